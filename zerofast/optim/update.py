"""An optimizer front's update rule: what it gives the builder besides the plan (its parameter
groups, greedy's costs, the state each parameter keeps) and the phase 3 it runs at step(). ZeroAdam
gives an AdamUpdate; ZeroMuon a MuonUpdate (zerofast/optim/muon.py). Everything else of a step (the
layout, phases 1, 2 and 4, stage 3's units, checkpoints) is the same for every rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..config import _is_number
from .state import ShardState

# Phase 3 over one shard: (used, param_groups, grad_scale) -> None. `used` is phase 2's agreement
# (which parameters got a gradient on some rank), grad_scale folds 1/N, unscaling and clipping.
Phase3 = Callable[[list[bool], list[dict], float | torch.Tensor], None]


def check_hyper(where: str, g: dict, who: str = "ZeroAdam") -> None:
    """Adam's lr, betas, eps and weight_decay (constructor or one group; ZeroMuon's AdamW part too)."""
    lr, betas, eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    if not (_is_number(lr) and lr >= 0):
        raise ValueError(f"{who}{where}: lr must be a number >= 0; got {lr!r}")
    if not (
        isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{who}{where}: betas must be two numbers in [0, 1); got {betas!r}")
    if not (_is_number(eps) and eps >= 0):
        raise ValueError(f"{who}{where}: eps must be a number >= 0; got {eps!r}")
    if not (_is_number(wd) and wd >= 0):
        raise ValueError(f"{who}{where}: weight_decay must be a number >= 0; got {wd!r}")


class UpdateRule(Protocol):
    """What the builder (zerofast/optim/builder.py) takes from an optimizer front."""

    groups: list[dict]  # torch.optim param groups over the trainable parameters, each exactly once
    defaults: dict  # torch.optim's `defaults`
    partition_costs: list[int] | None  # per trainable parameter, greedy's measure (None: its elements)
    step_costs: list[int] | None  # per trainable parameter, its Newton-Schulz FLOPs (reports; None: none)

    def state_kinds(self, index: int) -> tuple[str, ...]:
        """The optimizer state trainable parameter `index` holds, by ShardState's kind names."""
        ...

    def check_group(self, index: int, group: dict) -> None:
        """One parameter group's hyper-parameters, as they are at a step (a clear error if not)."""
        ...

    def phase3(self, shard: ShardState, names: list[str], params: list, group_of: list[int], adam) -> Phase3:
        """Phase 3 over this rank's shard, once it exists (group_of[i]: parameter i's group). adam: what
        runs the fused Adam step over it (apply_adam): the shard itself, or with the state offloaded
        zerofast/offload/update.py's OffloadedUpdate."""
        ...


class AdamUpdate:
    """ZeroAdam's rule: Adam's moments for every parameter, greedy balancing elements, and phase 3 the
    fused Adam kernel over every owned range of a used parameter."""

    partition_costs = None
    step_costs = None

    def __init__(self, groups: list[dict], defaults: dict, adamw: bool):
        self.groups, self.defaults, self.adamw = groups, defaults, adamw

    def state_kinds(self, index: int) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def check_group(self, index: int, group: dict) -> None:
        check_hyper(f".param_groups[{index}]", group)

    def phase3(self, shard: ShardState, names: list[str], params: list, group_of: list[int], adam) -> Phase3:
        adamw = self.adamw

        def update(used: list[bool], param_groups: list[dict], grad_scale: float | torch.Tensor) -> None:
            with torch.profiler.record_function("zerofast::adam"):
                adam.apply_adam(used, param_groups, group_of, adamw, grad_scale)

        return update
