"""build(): wires every part an optimizer front orders (the `Parts` record) from the resolved `Plan` and
the front's update rule (update.py). It only wires: a step's order is step.py's, the checkpoint's view
of the parts zerofast/checkpoint/binding.py's. Every data-parallel rank calls it, with the same options.
In order: the groups ([Note: hybrid sharding] in zerofast/topology.py), every rank holding rank 0's
model; mixed precision's conversion; the layouts (placement.py, greedy balancing the rule's costs); the
state (its store: zerofast/offload), collectives, loss scaler, parameter gather, stage 3's units,
gradient path and the rule's phase 3; the guard on the model's parameters
([Note: the model stays a torch model] in zerofast/guard/__init__.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .._hook_classes import own_classes, restore_classes
from ..comm import BucketComm
from ..config import Plan
from ..guard.modules import holders
from ..guard.params import ParamSlot, forget, manage
from ..layout import Layout
from ..model_setup import check_pipeline_parts, check_plain_parameters, in_precision, join_ranks, meta_device
from ..offload import OffloadedUpdate, ShardFiles, agreed, is_offloaded, open_store, state_specs
from ..stage3.frozen import FrozenShard, frozen_part
from ..stage3.module import ShardedModule
from ..stage3.runtime import UnitBuffers, UnitTracker
from ..stage3.units import UnitPlan, hook_needs
from ..tensor_parallel import TensorParallel, has_tp_dim
from ..topology import (
    ReplicaSource,
    Topology,
    check_process_group,
    data_parallel_group,
    group_timeout,
    resolve_topology,
    second_group,
)
from . import checks
from .gather import ParamGather
from .grad_view import GradWindow
from .grads import GradReducer
from .placement import plan_layouts
from .precision import LossScaler
from .state import ShardState
from .update import Phase3, UpdateRule

__all__ = ["Parts", "build", "trainable_params"]


@dataclass
class Parts:
    """Everything build() wired, for the front and its step (and, through zero_adam.parts_of, for
    tests that inject a fault into one part or read its internals)."""

    model: nn.Module
    plan: Plan
    rule: UpdateRule
    topology: Topology  # every data-parallel rank, and the shard and replicate groups
    names: list[str]  # the trainable parameters, in the optimizer's order (the layout's)
    params: list[nn.Parameter]
    group_of: list[int]  # per trainable parameter, the index of its param group
    trainable_at_build: list[tuple[str, nn.Parameter, bool]]  # every parameter, and whether it was trainable
    layout: Layout  # the trainable parameters' buckets, owners and slices, over the shard group
    store: object  # where the state lives (zerofast/offload/stores.py: device, host or disk)
    files: ShardFiles | None  # stage 3's shards in files (OffloadPolicy(params="disk"))
    shard: ShardState  # this rank's part of the training state
    offload: OffloadedUpdate | None  # the offloaded step (None: the state is on the device)
    comm: BucketComm  # the trainable parameters' collectives
    scaler: LossScaler
    gather: ParamGather  # phase 4 (stages 1 and 2)
    grads: GradReducer  # phases 1 and 2
    update: Phase3  # phase 3: the rule's, over the shard
    unit_plan: UnitPlan | None  # stage 3: which parameters gather together
    unit_params: list[nn.Parameter]  # stage 3: the unit plan's parameters, in model order
    units: UnitTracker | None  # stage 3: the hooks and unit buffers
    frozen_named: list[tuple[str, nn.Parameter]]  # stage 3: the frozen parameters it shards
    frozen: FrozenShard | None  # and their buffers and shard ([Note: frozen parameters in stage 3])
    frozen_comm: BucketComm | None  # and their gathers (no reduce)
    hooks: list  # handles on the model (mixed precision's input cast, the overlapped gather's waits)
    # every managed parameter's slot ([Note: the model stays a torch model])
    slots: list[ParamSlot] = field(default_factory=list)
    module_classes: dict = field(default_factory=dict)  # the modules moved to their guarded class, and their own
    module: ShardedModule = None  # type: ignore[assignment]  # the model side (the front makes it: its rest)

    def divisor(self) -> int:
        """What the step divides the summed gradient by: the data-parallel ranks (Topology.divisor), times
        a pipeline schedule's micro-batches where it scales its gradients (torch's scale_grads)."""
        return self.topology.divisor() * self.grads.step_divisor

    def remove_hooks(self) -> None:
        # Undone in the reverse order of build(): the guard's classes went on last, over the units'.
        restore_classes(self.module_classes)
        forget(self.slots)  # the parameters back in their own classes
        self.grads.remove()
        self.module.remove_hooks()


def trainable_params(model: nn.Module, who: str, process_group=None) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable (name, parameter) pairs, in model order (a tied parameter once). DTensor
    parameters only with a process_group mesh that has a "tp" dim ([Note: tensor parallelism])."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module; got {type(model).__name__}")
    check_plain_parameters(model, who, tensor_parallel=has_tp_dim(process_group))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{who}: the model has no trainable parameters")
    return named


def build(model: nn.Module, plan: Plan, process_group, rule: UpdateRule) -> Parts:
    """Wire the parts for `model` under `plan` across `process_group` (None: the world; or a 2-D
    DeviceMesh), with the front's update `rule`. Collective: every rank calls it."""
    check_process_group(process_group)
    source = process_group if isinstance(process_group, ReplicaSource) else None
    group, shard_size, mesh = data_parallel_group(source.group if source else process_group, plan.shard_size)
    named = trainable_params(model, plan.front, process_group)
    # A replica source's own Topology checks the plan against what its Replication supports.
    topology = (
        source.topology(group, plan) if source else resolve_topology(group, shard_size, group_timeout(group), mesh)
    )
    meta = meta_device([p for _, p in named], group, plan.stage, plan.front, has_tp_dim(process_group))
    join_ranks(model, group, plan.front, topology.tp_group, meta=meta is not None)
    if topology.pp_group is not None:
        check_pipeline_parts([n for n, _ in named], topology.pp_group, plan.front)
    tp = TensorParallel.of(model, named, topology.tp_group, topology.tp_size, plan.front)
    names = [n for n, _ in named]
    # The parameters as the core shards them: plain tensors ([Note: tensor parallelism]).
    params = tp.standins if tp is not None else [p for _, p in named]
    if plan.offload.delayed_update and topology.replication.changes_membership:
        raise ValueError(
            f"{plan.front}: OffloadPolicy(delayed_update=True) cannot run on replicas whose membership changes "
            f"({type(topology.replication).__name__}): a group that joins would receive the state with an "
            "update still in flight elsewhere; use the delayed update with fixed replicas"
        )
    group_index = {id(p): g for g, grp in enumerate(rule.groups) for p in grp["params"]}
    group_of = [group_index[id(p)] for _, p in named]
    # The layout is built over these, so a later change of requires_grad is an error at the next step.
    trainable_at_build = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
    checks.check_dtypes(names, params, plan.param_dtype, plan.front)
    hooks = []
    if plan.separate_master:  # see [Note: mixed precision]; before stage 3 lays out the frozen parameters
        hooks += in_precision(model, plan.param_dtype)
    layouts = plan_layouts(
        model, plan, topology.shard_size, rule.partition_costs, list(zip(names, params)), tp.standin_of if tp else None
    )
    store, shard, files = _state(layouts, topology, names, params, plan, tp is not None, meta)
    # Stage 3's shards in files take the offloaded step's path with the state in memory too: its
    # explicit I/O and all-or-none agreement (zerofast/offload/update.py).
    offload = (
        OffloadedUpdate(store, shard, layouts.layout.shard_numel(topology.shard_rank))
        if store.offloaded or files is not None
        else None
    )
    if tp is not None:
        tp.relink()
    comm = BucketComm(
        topology.shard_group,
        layouts.layout,
        topology.shard_rank,
        shard.grad_shard,
        second_group(topology.shard_group, topology.group)
        if plan.params_sharded
        else None,  # [Note: two process groups]
        shard.grad_buckets,
        plan.bucket_buffers,
        plan.check_collectives,
        replicate_group=topology.replicate_group,
        # A replicate group whose membership changes is one group per step: the agreement waits for
        # its gradient all_reduces instead of running on a second group (zerofast/topology.py).
        replicate_grads_group=topology.replicate_group
        if topology.replication.changes_membership
        else second_group(topology.replicate_group, topology.group),
        replication=topology.replication,
        replicate_min_bytes=plan.replicate_bytes,
        dp_rank=topology.rank,
        dp_world=topology.world,
    )
    scaler = LossScaler(plan.loss_scale)
    gather = ParamGather(comm, layouts.layout, shard.param_buffers)
    if plan.overlap_param_gather:
        hooks += gather.register_waits(model, params)
    frozen = frozen_comm = units = None
    if plan.params_sharded:
        frozen, frozen_comm = _frozen_part(layouts, topology, plan, comm, tp, files, meta)
        if tp is not None:
            tp.relink()  # the frozen DTensors too, before their storage is released
        units = _shard_params(model, layouts, topology, shard, comm, frozen, frozen_comm, offload, files)
    grads = GradReducer(
        params,
        names,
        layouts.layout,
        comm,
        shard,
        plan,
        scaler=scaler,
        gather=gather,
        tp=tp,
        pp_group=topology.pp_group,
    )
    parts = Parts(
        model=model,
        plan=plan,
        rule=rule,
        topology=topology,
        names=names,
        params=params,
        group_of=group_of,
        trainable_at_build=trainable_at_build,
        layout=layouts.layout,
        store=store,
        files=files,
        shard=shard,
        offload=offload,
        comm=comm,
        scaler=scaler,
        gather=gather,
        grads=grads,
        update=rule.phase3(shard, names, params, group_of, offload or shard),
        unit_plan=layouts.unit_plan,
        unit_params=layouts.unit_params,
        units=units,
        frozen_named=layouts.frozen_named,
        frozen=frozen,
        frozen_comm=frozen_comm,
        hooks=hooks,
    )
    if tp is None:  # DTensor parameters are not guarded
        _guard(parts)
    return parts


def _guard(parts: Parts) -> None:
    """[Note: the model stays a torch model] in zerofast/guard/__init__.py: a slot for every managed
    parameter, its module moved to its guarded class, stage 3's released parameters guarded, the
    gradient window, and a gather in flight waited for."""
    plan = parts.plan
    who = f"{plan.front}(stage={plan.stage})"
    slots = manage(list(zip(parts.names, parts.params)), who)
    frozen_slots = manage(parts.frozen_named, who, part=1) if plan.params_sharded else []
    parts.slots = slots + frozen_slots
    parts.module_classes = own_classes(holders(parts.model, [s.param for s in parts.slots]))
    if plan.overlap_param_gather:
        parts.gather.guard_in_flight(slots)
    if plan.params_sharded:
        parts.units.buffers.guard([slots, frozen_slots])
    # The window is reached from the model (its parameters' slots); its divisor holds the topology and
    # the reducer weakly, never the parts, whose stepper holds the optimizer.
    topology, grads = parts.topology, weakref.ref(parts.grads)
    window = parts.grads.window = GradWindow(
        who, parts.shard, parts.comm, parts.scaler, lambda: topology.divisor() * grads().step_divisor
    )
    window.attach(slots)


def _state(layouts, topology: Topology, names, params, plan: Plan, tp: bool, meta) -> tuple:
    """Where the state lives (zerofast/offload), stage 3's shards' files (if any) and this rank's
    ShardState over them: (store, shard, files); on disk agreed first."""
    rank, frozen = topology.shard_rank, layouts.frozen_layout
    shard_numel, frozen_numel = layouts.layout.shard_numel(rank), frozen.shard_numel(rank) if frozen else 0
    # Offloaded, the master is a tensor of its own even in fp32 (ShardState.master_apart says why).
    device = meta or params[0].device  # meta: the device a model built on the meta device trains on
    offloaded = is_offloaded(plan.offload.state, plan.offload.delayed_update, device.type)
    master_apart = plan.separate_master or offloaded or plan.offload.params == "disk"  # as ShardState's
    specs = state_specs(shard_numel, master_apart, plan.state_bits, plan.state_block)

    def build():
        store, files = open_store(specs, shard_numel, plan, device, frozen_numel, topology.rank, tp)
        return store, ShardState(layouts.layout, rank, names, params, plan, store, files, meta), files

    def agree(failed: int) -> int:
        flag = torch.tensor([failed + 1], dtype=torch.int64, device=device)
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=topology.group)
        return int(flag.item()) - 1

    return agreed(build, plan, topology.rank, agree)


def _frozen_part(layouts, topology: Topology, plan: Plan, comm: BucketComm, tp: TensorParallel | None, files, meta):
    """Stage 3's frozen parameters ([Note: frozen parameters in stage 3]): their FrozenShard and the
    BucketComm that gathers them, on the trainable part's gather group (no reduce, no gradient
    shard); (None, None) when there are none. A frozen DTensor is sharded through its stand-in."""
    if layouts.frozen_layout is None:
        return None, None
    frozen, frozen_comm = frozen_part(
        [(n, tp.standin_of(p) if tp is not None else p) for n, p in layouts.frozen_named],
        layouts.frozen_layout,
        layouts.frozen_bucket_of,
        topology.shard_rank,
        topology.shard_group,
        comm.gather_group,
        plan.reduce_dtype,
        plan.check_collectives,
        dp_rank=topology.rank,
        dp_world=topology.world,
        shard=files.tensors["frozen_shard"] if files is not None else None,
        meta_device=meta,
    )
    frozen_comm.share_bookkeeping(comm)
    return frozen, frozen_comm


def _shard_params(
    model, layouts, topology: Topology, shard: ShardState, comm, frozen, frozen_comm, offload, files
) -> UnitTracker:
    """Stage 3: copy this rank's shards out, release every unit, and install the hooks."""
    buffers = UnitBuffers(
        shard.param_buffers,
        shard.param_shard,
        layouts.layout,
        topology.shard_rank,
        comm,
        layouts.unit_buckets,
        frozen.unit_part(frozen_comm) if frozen is not None else None,
        follow=shard.follow_shard,
        before_write=offload.check_writable if offload is not None else None,
        let_go=files.let_go_all if files is not None else None,
        empty=shard.meta,
    )
    for part, name in zip(buffers.parts, ("param_shard", "frozen_shard")) if files is not None else ():
        part.read_from(files.reader(name))
    buffers.shard_out()
    return UnitTracker(model, hook_needs(model, layouts.unit_params, layouts.unit_plan), buffers)
