"""plan_layouts(): where every managed parameter lives for K ranks sharing the state (the trainable
layout's buckets, owners and slices; stage 3's units and frozen layout). Pure Python, no process group,
so the optimizer and the estimator's traffic counts (zerofast/estimate/traffic.py) read one answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import Plan
from ..layout import Layout, build_layout
from ..partition import owners_for
from ..stage3.units import UnitPlan, find_units, split_units, unit_layout
from ..stage3.units import frozen_layout as frozen_layout_of


@dataclass(frozen=True)
class Layouts:
    names: list[str]  # the trainable parameters, in the optimizer's order
    params: list[nn.Parameter]
    layout: Layout  # theirs, over `world` ranks
    unit_plan: UnitPlan | None  # stage 3: which parameters gather together
    unit_params: list[nn.Parameter]  # stage 3: the unit plan's parameters, in model order
    unit_buckets: list[int | None] | None  # stage 3: each unit's trainable bucket (None: none)
    frozen_named: list[tuple[str, nn.Parameter]]  # stage 3: the frozen parameters it shards
    frozen_layout: Layout | None  # and their layout, one bucket per unit that has any
    frozen_bucket_of: list[int | None] | None


def plan_layouts(
    model: nn.Module,
    plan: Plan,
    world: int,
    costs: list[int] | None = None,
    named=None,
    core_of: Callable[[nn.Parameter], torch.Tensor] | None = None,
    unconverted: bool = False,
) -> Layouts:
    """The layouts an optimizer with `plan` builds when `world` ranks share the state.
    costs: per trainable parameter, greedy's step cost (ZeroMuon's Newton-Schulz FLOPs:
    zerofast.partition.greedy_by_cost); None: greedy by elements. named: the trainable (name,
    tensor) pairs as the core shards them (tensor parallelism: DTensors' stand-ins); None: the
    model's. core_of: the tensor the core shards for a model parameter (TensorParallel.standin_of;
    None: the parameter). Stage 3's units are planned over the model's parameters (its modules hold
    those) and laid out over what the core shards (for DTensors, the local tensors)."""
    if named is None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if core_of is None:
        core_of = _itself
    names, params = [n for n, _ in named], [p for _, p in named]
    numels = [p.numel() for p in params]
    reduce_size = torch.empty(0, dtype=plan.reduce_dtype).element_size()
    if not plan.params_sharded:
        bucket_numel = max(1, plan.bucket_bytes // reduce_size)
        order = list(reversed(range(len(numels))))  # backward order: see [Note: bucket order]
        first_bucket_numel = min(bucket_numel, plan.first_bucket_bytes // reduce_size)
        layout = build_layout(
            numels,
            order,
            world,
            bucket_numel,
            owners_for(plan.partition, numels, world, costs),
            first_bucket_numel,
            plan.layout_block,
        )
        return Layouts(names, params, layout, None, [], None, [], None, None)
    # Stage 3 shards the frozen parameters too: [Note: frozen parameters in stage 3] (those in the
    # parameters' dtype and on their device; any other is left to the model).
    device = params[0].device
    # unconverted: the model as given to the estimator, before mixed precision converts its frozen
    # floating parameters (model_setup.in_precision).
    converts = unconverted and plan.separate_master
    frozen_named = [
        (n, p)
        for n, p in model.named_parameters()
        if not p.requires_grad
        and (plan.param_dtype if converts and p.is_floating_point() else p.dtype) == plan.param_dtype
        and p.device == device
    ]
    trainable_index = {id(p): i for i, p in enumerate(params)}
    sharded = {id(p) for _, p in frozen_named}
    unit_params = [p for p in model.parameters() if id(p) in sharded or id(core_of(p)) in trainable_index]
    core = [core_of(p) for p in unit_params]
    unit_plan = find_units(
        model,
        unit_params,
        plan.unit_modules,
        plan.min_unit_bytes,
        torch.empty(0, dtype=plan.param_dtype).element_size(),
        numels=[c.numel() for c in core],
        who=plan.front,
    )
    # one bucket per unit with trainable parameters, in backward order
    parts, _ = split_units(unit_plan.groups, [id(c) in trainable_index for c in core])
    parts = [[trainable_index[id(core[i])] for i in part] for part in parts]
    layout, unit_buckets = unit_layout(parts, numels, world, plan.partition, costs, plan.layout_block)
    frozen_layout = frozen_bucket_of = None
    if frozen_named:
        frozen_layout, frozen_bucket_of = frozen_layout_of(
            unit_plan.groups, core, [core_of(p) for _, p in frozen_named], world, plan.partition
        )
    return Layouts(
        names, params, layout, unit_plan, unit_params, unit_buckets, frozen_named, frozen_layout, frozen_bucket_of
    )


def _itself(p: nn.Parameter) -> torch.Tensor:
    return p
