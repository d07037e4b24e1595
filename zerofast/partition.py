"""Owner assignment, pure Python: which rank owns (updates, keeps Adam state for) which parameter.
- "round_robin": parameter i to rank i % world (the reference stages' rule: zerofast/reference.py);
- "greedy": whole tensors, largest first, each to the rank owning the fewest elements so far; with
  per-tensor step costs (ZeroMuon's newton_schulz_flops), greedy_by_cost balances the cost first;
- "flat": intra-tensor, as FSDP and DeepSpeed: no owner per tensor, each bucket cut into world equal
  slices (layout.py).
"""

from __future__ import annotations

import heapq

PARTITIONS = ("flat", "round_robin", "greedy")


def round_robin(numels: list[int], world: int) -> list[int]:
    """Owner of each parameter: i % world."""
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


def newton_schulz_flops(shape: tuple[int, ...], ns_steps: int) -> int:
    """FLOPs of Muon's Newton-Schulz on an m x n matrix: with p = min(m, n), q = max(m, n) (the
    iteration runs on the p x q orientation), each step computes A = X X^T (2 p^2 q), B = bA + cA^2
    (2 p^3, the addmm) and X' = aX + BX (2 p^2 q): ns_steps * (4 p^2 q + 2 p^3)."""
    m, n = shape
    p, q = min(m, n), max(m, n)
    return ns_steps * (4 * p * p * q + 2 * p**3)


def greedy_by_cost(numels: list[int], costs: list[int], world: int) -> list[int]:
    """Owner of each parameter when some carry a step cost (costs[i] > 0: ZeroMuon's matrices, in
    Newton-Schulz FLOPs): those first, costliest first, each to the rank with the least cost so far
    (LPT scheduling: within 4/3 of the optimal makespan, usually exact on a transformer's repeated
    shapes); then the cost-free tensors (AdamW's memory-bound step, ~10 FLOPs per element against
    thousands: noise), largest first, to the rank owning the fewest elements, which balances their
    state's memory. Ties: fewer elements, then the lower rank."""
    owners = [0] * len(numels)
    cost = [0] * world
    owned = [0] * world
    costly = sorted((i for i in range(len(numels)) if costs[i] > 0), key=lambda i: (-costs[i], -numels[i], i))
    for i in costly:
        rank = min(range(world), key=lambda r: (cost[r], owned[r], r))
        owners[i] = rank
        cost[rank] += costs[i]
        owned[rank] += numels[i]
    rest = sorted((i for i in range(len(numels)) if costs[i] <= 0), key=lambda i: (-numels[i], i))
    for i in rest:
        rank = min(range(world), key=lambda r: (owned[r], cost[r], r))
        owners[i] = rank
        owned[rank] += numels[i]
    return owners


def owners_for(partition: str, numels: list[int], world: int, costs: list[int] | None = None) -> list[int] | None:
    """Owner per parameter for "round_robin" and "greedy" (by `costs` when given: greedy_by_cost);
    None for "flat" (owners per slice)."""
    if partition == "round_robin":
        return round_robin(numels, world)
    if partition == "greedy":
        return greedy(numels, world) if costs is None else greedy_by_cost(numels, costs, world)
    if partition == "flat":
        return None
    raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}; got {partition!r}")


def imbalance(owned: list[int]) -> float:
    """max / mean of the elements each rank owns (1.0 is perfect balance)."""
    mean = sum(owned) / len(owned)
    return max(owned) / mean if mean else 1.0
