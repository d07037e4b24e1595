"""Stage 3's one planner, pure functions of the module tree (no process group, no storage: the estimator
plans with them): find_units (which parameters form a unit: [Note: choosing units],
[Note: merging small units]), hook_needs (the units each module holds while it runs), unit_layout and
frozen_layout (the trainable and frozen buckets: [Note: frozen parameters in stage 3] in frozen.py),
inference_plan (shard_frozen's plan).

[Note: choosing units]
A unit is a group of parameters gathered and released together, one bucket (one collective) each
way. `units=` on ZeroAdam takes
  - None (default): the model's repeated blocks, found as (1) the modules whose class is named in
    the model's `_no_split_modules` (the Hugging Face convention Accelerate's FSDP auto-wrap reads),
    else (2) the children of every nn.ModuleList anywhere in the model (not looking inside a child
    already taken), else (3) the root's children (through ModuleDict containers);
  - a list of submodules, as given (a parameter in two of them belongs to the first);
  - a module class or a set of classes (FSDP's transformer auto-wrap policy), or a callable
    module -> bool: every matching module, outermost only (a match inside a match joins it).
The units are planned over every parameter stage 3 shards, trainable and frozen alike ([Note:
frozen parameters in stage 3] in zerofast/stage3/frozen.py), so a unit's size is what it gathers.
Every such parameter that no unit module holds joins one more unit, the root's: embeddings, the
final norm, an output head. It is unit 0, the last in backward order, because a tied embedding's
gradient is complete only at the very end of backward ([Note: bucket order]).
`opt.report().units` lists what each unit holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import DEFAULT_MIN_UNIT_MB, CommPolicy, UnitPolicy
from ..layout import Layout, layout_from_groups
from ..partition import owners_for


@dataclass(frozen=True)
class UnitPlan:
    """The units of a model, in order: unit 0 is the root's (if any parameter is left for it)."""

    groups: list[list[int]]  # groups[u]: indices (into the managed parameters) of unit u's parameters
    modules: list[nn.Module]  # modules[u]: the (first) module defining unit u (the root for the root's unit)
    names: list[str]  # names[u]: the qualified names of its modules, ", "-joined ("" for the root)
    has_root_unit: bool  # unit 0 is the root's remaining parameters
    members: list[tuple[nn.Module, ...]] = ()  # members[u]: every module of unit u (several when merged)


def unit_modules(model: nn.Module, units, who: str = "ZeroAdam") -> list[nn.Module]:
    """The modules that define units, from `units=` (see [Note: choosing units]); a clear error,
    naming `who` (the optimizer, or shard_frozen), for anything else."""
    if units is None:
        return default_unit_modules(model)
    if isinstance(units, nn.Module):
        raise TypeError(
            f"{who}: units must be a list of submodules, a module class, a set of classes or a "
            f"callable module -> bool; got the module {type(units).__name__} itself "
            f"(wrap it in a list: units=[module])"
        )
    if isinstance(units, type):
        return _outermost(model, _class_policy(model, [units], who))
    if callable(units):
        return _outermost(model, units)
    if isinstance(units, (str, bytes)) or not isinstance(units, Iterable):
        raise TypeError(
            f"{who}: units must be a list of submodules, a module class, a set of classes or a "
            f"callable module -> bool; got {units!r}"
        )
    items = list(units)
    if items and all(isinstance(u, type) for u in items):
        return _outermost(model, _class_policy(model, items, who))
    mine = {id(m) for m in model.modules()}
    for k, u in enumerate(items):
        if not isinstance(u, nn.Module) or id(u) not in mine:
            raise ValueError(
                f"{who}: units[{k}] must be a submodule of the model (or every item a module "
                f"class); got {type(u).__name__}"
            )
    return items


def _class_policy(model: nn.Module, classes: list, who: str) -> Callable[[nn.Module], bool]:
    for c in classes:
        if not issubclass(c, nn.Module):
            raise ValueError(f"{who}: units names the class {c.__name__}, which is not an nn.Module class")
    present = {type(m) for m in model.modules()}
    if not any(issubclass(t, tuple(classes)) for t in present):
        raise ValueError(
            f"{who}: units names the classes {sorted(c.__name__ for c in classes)}, but the model "
            f"holds no module of them"
        )
    return lambda m: isinstance(m, tuple(classes))


def default_unit_modules(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: see [Note: choosing units]."""
    names = getattr(model, "_no_split_modules", None)
    if names:
        wanted = set(names)
        found = _outermost(model, lambda m: type(m).__name__ in wanted)
        if found:
            return found
    in_lists = _children_of_module_lists(model)
    if in_lists:
        return in_lists
    return list(_root_children(model))


def _outermost(model: nn.Module, policy: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules below the root matching `policy`, in module order, not looking inside a match."""
    found = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if policy(child):
                found.append(child)
            else:
                walk(child)

    walk(model)
    return _with_params(found)


def _children_of_module_lists(model: nn.Module) -> list[nn.Module]:
    found = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                found.extend(child.children())
            else:
                walk(child)

    walk(model)
    return _with_params(found)


def _root_children(module: nn.Module):
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _root_children(child)
        elif any(True for _ in child.parameters()):
            yield child


def _with_params(modules: list[nn.Module]) -> list[nn.Module]:
    seen, out = set(), []
    for m in modules:
        if id(m) not in seen and any(True for _ in m.parameters()):
            seen.add(id(m))
            out.append(m)
    return out


def find_units(
    model: nn.Module,
    params: list[nn.Parameter],
    units=None,
    min_unit_bytes: int = 0,
    element_size: int = 4,
    numels: list[int] | None = None,
    who: str = "ZeroAdam",
) -> UnitPlan:
    """Group the managed parameters (indices into `params`) into units: the root's rest first, then
    one per unit module in the order given (module order for the policies). With the default
    units (units=None), units of fewer than min_unit_bytes are merged with their neighbours in
    module order ([Note: merging small units]). numels: each parameter's elements as this rank
    holds them (tensor parallelism: its local tensor's); None: p.numel()."""
    index_of = {id(p): i for i, p in enumerate(params)}
    name_of = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    singles, claimed = [], set()
    for module in unit_modules(model, units, who):
        mine = [index_of[id(p)] for p in module.parameters() if id(p) in index_of and id(p) not in claimed]
        if mine:
            claimed.update(id(params[i]) for i in mine)
            singles.append(([module], [name_of[id(module)]], mine))
    if units is None and min_unit_bytes > 0:
        numels = numels if numels is not None else [p.numel() for p in params]
        singles = _merge_small(singles, min_unit_bytes, [n * element_size for n in numels])
    groups = [idx for _, _, idx in singles]
    members = [tuple(mods) for mods, _, _ in singles]
    names = [", ".join(ns) for _, ns, _ in singles]
    rest = [i for i, p in enumerate(params) if id(p) not in claimed]
    if rest:
        return UnitPlan([rest] + groups, [model] + [m[0] for m in members], [""] + names, True, [(model,)] + members)
    return UnitPlan(groups, [m[0] for m in members], names, False, members)


# [Note: merging small units]
# A deep narrow model has many small blocks, and a gather of each is a latency-bound collective:
# units below min_unit_mb are merged with their neighbours in module order (as FSDP's size-based
# auto-wrap policy groups modules), so a handful of collectives move the model each way. A unit at
# or above the threshold stays alone; consecutive small ones join until the group reaches it. The
# merged unit is handed from one of its modules to the next (carried: [Note: stage 3 lifecycle] in
# schedule.py), not released and gathered again between them; so is a unit whose module runs twice
# in a row: consecutive calls of one unit cost one gather.


def _merge_small(singles, min_bytes: int, nbytes: list[int]):
    merged, current = [], None

    def size(group):
        return sum(nbytes[i] for i in group[2])

    for item in singles:
        if size(item) >= min_bytes:
            if current is not None:
                merged.append(current)
                current = None
            merged.append(item)
            continue
        current = item if current is None else (current[0] + item[0], current[1] + item[1], current[2] + item[2])
        if size(current) >= min_bytes:
            merged.append(current)
            current = None
    if current is not None:
        merged.append(current)
    return merged


def hook_needs(model: nn.Module, params: list[nn.Parameter], plan: UnitPlan) -> dict[nn.Module, tuple[int, ...]]:
    """The units each module must hold while it runs: see [Note: who gathers what] in schedule.py."""
    unit_of_param = {id(params[i]): u for u, group in enumerate(plan.groups) for i in group}
    unit_of_module = {id(m): u for u, members in enumerate(plan.members) for m in members if m is not model}
    needs = {}
    for module in model.modules():
        units = {unit_of_param[id(p)] for p in module.parameters(recurse=False) if id(p) in unit_of_param}
        if module is model and plan.has_root_unit:
            units.add(0)
        if id(module) in unit_of_module:
            units.add(unit_of_module[id(module)])
        if units or module is model:
            needs[module] = tuple(sorted(units))
    return needs


# --- laying the units out: the buckets of their trainable and frozen parts ---------------------------


def split_units(groups: list[list[int]], trainable: list[bool]) -> tuple[list[list[int]], list[list[int]]]:
    """Each unit's group split into its trainable and its frozen members, in the group's order."""
    return ([[i for i in g if trainable[i]] for g in groups], [[i for i in g if not trainable[i]] for g in groups])


def unit_layout(
    parts: list[list[int]],
    numels: list[int],
    world: int,
    partition: str,
    costs: list[int] | None = None,
    block: int = 1,
) -> tuple[Layout, list[int | None]]:
    """A Layout with one bucket per non-empty part, in backward order (the last unit first: [Note:
    bucket order]); parts[u] indexes into `numels` (and `costs`, greedy's step costs, when given).
    block: as build_layout takes it. Returns it and each unit's bucket (None: empty)."""
    order = [u for u in reversed(range(len(parts))) if parts[u]]
    bucket_of: list[int | None] = [None] * len(parts)
    for b, u in enumerate(order):
        bucket_of[u] = b
    owners = owners_for(partition, numels, world, costs)
    layout = layout_from_groups(numels, [parts[u] for u in order], world, owners, block)
    return layout, bucket_of


def frozen_layout(
    groups: list[list[int]],
    unit_params: list[torch.nn.Parameter],
    frozen_params: list[torch.nn.Parameter],
    world: int,
    partition: str,
) -> tuple[Layout, list[int | None]]:
    """The frozen parameters' layout: one bucket per unit that holds any (groups: the unit plan's,
    indices into unit_params), and each unit's bucket (None: it holds none)."""
    index = {id(p): j for j, p in enumerate(frozen_params)}
    parts = [[index[id(unit_params[i])] for i in g if id(unit_params[i]) in index] for g in groups]
    return unit_layout(parts, [p.numel() for p in frozen_params], world, partition)


def inference_plan(
    model: torch.nn.Module,
    param_dtype: torch.dtype | None,
    unit_p: UnitPolicy,
    world: int,
    who: str,
    element_size: int | None = None,
) -> tuple[list[tuple[str, torch.nn.Parameter]], UnitPlan, Layout, list[int | None]]:
    """shard_frozen's plan, also the estimator's: the parameters it shards, its units, their layout
    over `world` ranks and each unit's bucket. element_size: the sharded dtype's where the model is
    not converted yet (the estimator); None: the parameters'."""
    named = sharded_params(model, param_dtype, who)
    params = [p for _, p in named]
    min_unit_mb = unit_p.min_unit_mb if unit_p.min_unit_mb is not None else DEFAULT_MIN_UNIT_MB
    element_size = element_size or params[0].element_size()
    plan = find_units(
        model, params, unit_p.modules, int(min_unit_mb * 2**20) if unit_p.modules is None else 0, element_size, who=who
    )
    layout, bucket_of = frozen_layout(plan.groups, params, params, world, CommPolicy().partition)
    return named, plan, layout, bucket_of


def sharded_params(
    model: torch.nn.Module, param_dtype: torch.dtype | None, who: str
) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters shard_frozen shards: the floating ones in the model's dtype (param_dtype, or
    the first floating parameter's) on its device; any other (an int8 table, a buffer-like
    parameter on another device) stays whole on every rank, as stage 3 leaves it."""
    floating = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    if not floating:
        raise ValueError(f"{who}: the model has no floating-point parameters to shard")
    dtype = param_dtype or floating[0][1].dtype
    device = floating[0][1].device
    return [(n, p) for n, p in floating if p.dtype == dtype and p.device == device]
