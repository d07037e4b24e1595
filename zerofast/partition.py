"""Owner assignment: which rank owns (updates, keeps Adam state for) which parameter.

Pure Python, no process group. Three partitions:
- "round_robin": round-robin owners (the ZeRO textbook chapter's inter-tensor rule), parameter i
  to rank i % world;
- "greedy": whole tensors, largest first, each to the rank that owns the fewest elements so far;
- "flat": intra-tensor, as FSDP and DeepSpeed do: no owner per tensor; each bucket is one buffer cut
  into world equal slices (see layout.py), so every rank owns the same number of elements.
"""
from __future__ import annotations

import heapq

PARTITIONS = ("flat", "round_robin", "greedy")


def round_robin(numels: list[int], world: int) -> list[int]:
    """Owner of each parameter: i % world (round-robin owners)."""
    return [i % world for i in range(len(numels))]


def greedy(numels: list[int], world: int) -> list[int]:
    """Owner of each parameter: largest first, to the least-loaded rank (ties: lower rank)."""
    owners = [0] * len(numels)
    loads = [(0, r) for r in range(world)]  # (elements owned, rank): a min-heap
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + numels[i], rank))
    return owners


def owners_for(partition: str, numels: list[int], world: int) -> list[int] | None:
    """Owner per parameter for "round_robin" and "greedy"; None for "flat" (owners per slice)."""
    if partition == "round_robin":
        return round_robin(numels, world)
    if partition == "greedy":
        return greedy(numels, world)
    if partition == "flat":
        return None
    raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}; got {partition!r}")


def imbalance(owned: list[int]) -> float:
    """max / mean of the elements each rank owns (1.0 is perfect balance)."""
    mean = sum(owned) / len(owned)
    return max(owned) / mean if mean else 1.0
