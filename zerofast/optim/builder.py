"""The builder: one function, build(), wires every part an optimizer front orders from the resolved
`Plan` and the front's update rule (zerofast/optim/update.py), and checkpoint_view() describes the
result for zerofast.checkpoint. A front (ZeroAdam, ZeroMuon) checks its own keywords, calls the
builder, and from then on only orders the parts' calls (zero_adam.py's docstring: a step, in phases).

What build() does, in order (every rank of the data-parallel group calls it, with the same options):
  1. the ranks: the data-parallel group and the shard and replicate groups
     ([Note: hybrid sharding] in zerofast/topology.py), every rank holding rank 0's model;
  2. mixed precision's conversion of the rest of the model and its input cast;
  3. the layouts (zerofast/optim/placement.py, greedy balancing the rule's costs);
  4. the state (ShardState; stage 3's FrozenShard), the collectives (BucketComm), the loss scaler,
     the parameter gather (stages 1 and 2), the units (stage 3), the gradient path (GradReducer) and
     the rule's phase 3 over the shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._hook_classes import own_classes, restore_classes
from ..checkpoint.view import CheckpointView, Facts, ScalerState, ShardedPart
from ..comm import BucketComm
from ..config import Plan
from ..guard.modules import holders
from ..guard.params import forget, manage
from ..layout import Layout
from ..model_setup import check_plain_parameters, in_precision, join_ranks
from ..offload import OffloadError
from ..stage3.frozen import FrozenShard, frozen_part
from ..stage3.module import ShardedModule
from ..stage3.runtime import UnitBuffers, UnitTracker
from ..stage3.units import UnitPlan, hook_needs
from ..tensor_parallel import TensorParallel
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
from .grads import GradReducer, StepNotAppliedError
from .placement import plan_layouts
from .precision import LossScaler
from .state import ShardState, storage_of
from .update import Phase3, UpdateRule

__all__ = ["Parts", "build", "checkpoint_view", "trainable_params"]


@dataclass
class Parts:
    """Everything build() wired, for the front that orders it (and, through zero_adam.parts_of, for
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
    shard: ShardState  # this rank's part of the training state
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
    slots: list = None  # type: ignore[assignment]  # every managed parameter's ([Note: the model stays a torch model])
    module_classes: dict = None  # type: ignore[assignment]  # the modules moved to their guarded class, and their own
    module: ShardedModule = None  # type: ignore[assignment]  # the model side: gathers, whole tensors, hooks
    decided: bool = False  # torchft: this step's commit decision was taken ([Note: replica groups on torchft])

    def quiesce(self, flush: bool = True) -> None:
        """Bring the state to rest: wait for parameter gathers still in flight (stages 1 and 2: the
        last step's, if some module never ran), release every gathered unit (stage 3) and apply the
        delayed update in flight (OffloadPolicy(delayed_update=True))."""
        self.gather.wait()
        if self.plan.params_sharded:
            self.units.release_all()
        if flush:  # step() flushes after its phase 2 instead: [Note: the delayed update]
            self.flush()  # once no unit is gathered

    def quiesce_state(self) -> None:
        """quiesce(), and the fp32 master taking what was written into the model since the last step
        (ShardState.follow_params): the state at rest as a checkpoint reads it."""
        self.quiesce()
        self.shard.follow_params()

    def apply(self, used: list[bool], param_groups: list[dict], grad_scale) -> None:
        """Phase 3: the rule's update over the shard. With the state on disk, every data-parallel rank
        then says whether it wrote its update, and all switch to it or none does ([Note: the
        all-or-none offloaded step] in zerofast/offload/__init__.py); with the delayed update it only
        starts, and the next quiesce() settles it."""
        shard = self.shard
        if shard.store is None:
            self.update(used, param_groups, grad_scale)
            return
        if self.plan.offload.delayed_update:
            self.update(used, param_groups, grad_scale)  # starts the thread
            return
        error = None
        try:
            self.update(used, param_groups, grad_scale)
        except OffloadError as e:
            error = e
        self._settle_offloaded(error, "this step's update")

    def _settle_offloaded(self, error: BaseException | None, what: str) -> bool:
        """After an offloaded update was written (or failed) on this rank: on disk, the ranks agree
        whether every one wrote it; then it is the state everywhere, or nowhere and this raises."""
        shard, where, tp = self.shard, self.comm.where, self.topology.tp_group
        # With tensor parallelism the ranks agree over "tp" too (a step applied on some of a layer's
        # parts only would leave the model split across two steps) and name a rank by its global rank.
        failed = -1 if error is None else (self.topology.rank if tp is None else dist.get_rank())
        if shard.placement == "disk":
            where.phase = "step() (phase 3: the agreement that every rank wrote its offloaded state)"
            flag = torch.tensor([failed + 1], dtype=torch.int64).to(self.comm.device)
            self.comm.all_reduce_max(flag)
            if tp is not None:
                self.comm.all_reduce_tp(flag, dist.ReduceOp.MAX, tp, "flags", "the offloaded write's agreement over tp")
            failed = int(flag.item()) - 1
        if failed < 0:
            shard.commit_offloaded()
            return True
        shard.abort_offloaded()
        self.grads.begin_step()  # this step's gradients are dropped; nothing was applied
        where.phase = "forward"
        note = (
            f"{self.plan.front}: {what} (step {where.step + 1}) was not applied on any rank: rank {failed} could not write "
            f"its offloaded state; parameters and optimizer state are those after step {where.step} on every "
            f"rank, and this step's gradients are dropped"
        )
        if error is not None:
            error.add_note(note)
            raise error
        raise StepNotAppliedError(note + " (see that rank's error)")

    def flush(self) -> None:
        """The delayed update in flight, if any, waited for, agreed on and applied: the parameters
        (stages 1 and 2: gathered from their owners) and the state become those after it ([Note:
        the delayed update] in zerofast/offload/__init__.py). Collective while one is in flight."""
        shard = self.shard
        if not shard.update_in_flight:
            return
        error = shard.wait_delayed()
        if error is not None and not isinstance(error, OffloadError):
            shard.drop_delayed()
            raise error
        try:
            self._settle_offloaded(error, "the delayed update of the last step")
        except BaseException:
            shard.drop_delayed()
            raise
        shard.apply_delayed()
        if not self.plan.params_sharded:
            self.gather.start()
            self.gather.wait()

    def sync_params_from_master(self) -> None:
        """After the fp32 master was written outside step(): the low-precision parameters become its
        rounding, and (stages 1 and 2) every rank's full parameters are gathered from their owners.
        Stage 3's next forward gathers."""
        self.shard.sync_params_from_master()
        if not self.plan.params_sharded:
            self.gather.start()
            self.gather.wait()

    def end_step(self) -> dict[str, int]:
        """The payload bytes of the step that ends now, per collective (the frozen parameters'
        gathers counted in: [Note: frozen parameters in stage 3]); the counts restart."""
        stats = dict(self.comm.stats)
        if self.frozen_comm is not None:
            for name, nbytes in self.frozen_comm.stats.items():
                stats[name] = stats.get(name, 0) + nbytes
            self.frozen_comm.new_step()
        return stats

    def remove_hooks(self) -> None:
        self.module.remove_hooks()
        self.grads.remove()
        forget(self.slots)  # the parameters, then the modules, back in their own classes
        restore_classes(self.module_classes)


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
    join_ranks(model, group, plan.front, topology.tp_group)
    tp = _tensor_parallel(model, named, topology, plan.front)
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
    # Which of the model's parameters were trainable: the layout is built over them, so a change of
    # requires_grad later is an error at the next step (checks.check_trainable_unchanged).
    trainable_at_build = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
    checks.check_dtypes(names, params, plan.param_dtype, plan.front)
    hooks = []
    if plan.separate_master:  # see [Note: mixed precision]; before stage 3 lays out the frozen parameters
        hooks += in_precision(model, plan.param_dtype)
    layouts = plan_layouts(
        model,
        plan,
        topology.shard_size,
        rule.partition_costs,
        list(zip(names, params)),
        tp.standin_of if tp is not None else None,
    )
    shard = _shard_state(layouts.layout, topology, names, params, plan)
    if tp is not None:
        tp.relink()
    comm = BucketComm(
        topology.shard_group,
        layouts.layout,
        topology.shard_rank,
        shard.grad_shard,
        _gather_group(topology) if plan.params_sharded else None,
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
    # [Note: the model stays a torch model] in zerofast/guard/__init__.py; DTensor parameters are not guarded.
    who = f"{plan.front}(stage={plan.stage})"
    slots = manage(list(zip(names, params)), who) if tp is None else []
    frozen_slots = manage(layouts.frozen_named, who, part=1) if tp is None and plan.params_sharded else []
    module_classes = own_classes(holders(model, [s.param for s in slots + frozen_slots])) if slots else {}
    if plan.overlap_param_gather:
        hooks += gather.register_waits(model, params)
        gather.guard_in_flight(slots)
    frozen = frozen_comm = units = None
    if plan.params_sharded:
        frozen, frozen_comm = _frozen_part(layouts, topology, plan, comm, tp)
        if tp is not None:
            tp.relink()  # the frozen DTensors too, before their storage is released
        units = _shard_params(model, layouts, topology, shard, comm, frozen, frozen_comm)
        units.buffers.guard([slots, frozen_slots])
    grads = GradReducer(params, names, layouts.layout, comm, shard, plan, scaler=scaler, gather=gather, tp=tp)
    if slots:
        grads.window = GradWindow(who, shard, comm, scaler, topology.divisor)
        grads.window.attach(slots)
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
        shard=shard,
        comm=comm,
        scaler=scaler,
        gather=gather,
        grads=grads,
        update=rule.phase3(shard, names, params, group_of),
        unit_plan=layouts.unit_plan,
        unit_params=layouts.unit_params,
        units=units,
        frozen_named=layouts.frozen_named,
        frozen=frozen,
        frozen_comm=frozen_comm,
        slots=slots + frozen_slots,
        module_classes=module_classes,
    )
    # The model side (zerofast/stage3/module.py), as shard_frozen's: at rest before whole tensors are
    # read, the step's gathers finished before a gathered block.
    parts.module = ShardedModule(model, units, hooks, settle=parts.quiesce, before_block=gather.wait)
    return parts


def has_tp_dim(process_group) -> bool:
    """Whether process_group is a DeviceMesh with a "tp" dim (tensor parallelism)."""
    return isinstance(process_group, DeviceMesh) and "tp" in (process_group.mesh_dim_names or ())


def _tensor_parallel(model: nn.Module, named, topology: Topology, who: str) -> TensorParallel | None:
    """The model's DTensor parameters and their stand-ins, where the mesh has a "tp" dim
    ([Note: tensor parallelism] in zerofast/tensor_parallel.py); a DTensor it cannot serve is named."""
    if topology.tp_group is None:
        return None
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    return TensorParallel(named, topology.tp_group, topology.tp_size, who, frozen)


def _shard_state(layout: Layout, topology: Topology, names, params, plan: Plan) -> ShardState:
    """This rank's ShardState. With the state on disk, every rank first learns whether every other
    could place its files (one small all_reduce), so that a rank's full or unwritable disk is named on
    every rank at construction rather than surfacing later as a dead peer."""
    if plan.offload.state != "disk":
        return ShardState(layout, topology.shard_rank, names, params, plan)
    shard, error = None, None
    try:
        shard = ShardState(layout, topology.shard_rank, names, params, plan)
    except OffloadError as e:
        error = e
    flag = torch.tensor([0 if error is None else topology.rank + 1], dtype=torch.int64, device=params[0].device)
    dist.all_reduce(flag, dist.ReduceOp.MAX, group=topology.group)
    failed = int(flag.item()) - 1
    if error is not None:
        raise error
    if failed >= 0:
        shard.store.close()  # its files go now, not when the traceback lets go of it
        raise OffloadError(
            f"{plan.front}: rank {failed} could not place its optimizer state under OffloadPolicy(path="
            f"{plan.offload.path!r}) (see that rank's error); no rank built its optimizer"
        )
    return shard


def _gather_group(topology: Topology) -> dist.ProcessGroup:
    """Stage 3 gathers on a second group: see [Note: two process groups] in csrc/buckets.cpp. Only a
    rank's own shard group gathers its parameters."""
    return second_group(topology.shard_group, topology.group)


def _frozen_part(layouts, topology: Topology, plan: Plan, comm: BucketComm, tp: TensorParallel | None):
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
    )
    frozen_comm.share_bookkeeping(comm)
    return frozen, frozen_comm


def _shard_params(model, layouts, topology: Topology, shard: ShardState, comm, frozen, frozen_comm) -> UnitTracker:
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
        before_write=shard.check_writable,
    )
    buffers.shard_out()
    return UnitTracker(model, hook_needs(model, layouts.unit_params, layouts.unit_plan), buffers)


# --- the checkpoint's view ----------------------------------------------------------------------------


def checkpoint_view(parts: Parts, param_groups: list[dict]) -> CheckpointView:
    """The parts as zerofast.checkpoint reads and writes them (zerofast/checkpoint/view.py);
    param_groups: the front's own list (torch.optim's), which a load updates in place."""
    plan, topo, shard, rule = parts.plan, parts.topology, parts.shard, parts.rule
    tp = parts.grads.tp  # the checkpoint names a DTensor parameter, whole ([Note: tensor parallelism])
    load_pieces = shard.load_pieces
    if tp is not None:

        def load_pieces(kind, full, load=shard.load_pieces):
            load(kind, {i: tp.local_part(i, t) for i, t in full.items()})

    trainable = ShardedPart(
        params=tuple(zip(parts.names, tp.params if tp is not None else parts.params)),
        kinds=tuple(rule.state_kinds(i) for i in range(len(parts.params))),
        layout=parts.layout,
        pieces=tuple(shard.pieces),
        dtype=torch.float32,
        device=shard.device,
        piece_view=shard.piece_view,
        write_piece=shard.write_piece,
        load_pieces=load_pieces,
        buffer_of=storage_of,
        state_block=plan.state_block if plan.quantized_state else 0,
        local_geometry=tp.local_geometry() if tp is not None else None,
    )
    return CheckpointView(
        model=parts.model,
        facts=Facts(  # with tensor parallelism every rank of the mesh saves and loads together
            *(
                (topo.rank, topo.world, topo.group)
                if topo.model_group is None
                else (
                    dist.get_rank(topo.model_group),
                    dist.get_world_size(topo.model_group),
                    topo.model_group,
                )
            ),
            plan.stage,
            plan.partition,
            plan.mixed_precision or "fp32",
            topo.shard_rank,
            topo.shard_size,
            topo.shard_group,
        ),
        trainable=trainable,
        frozen=_frozen_view(parts),
        param_groups=param_groups,
        step_counts=shard.step_counts,
        set_step_counts=shard.set_step_counts,
        loss_scaler_state=lambda: _scaler_state(parts.scaler),
        load_loss_scaler_state=lambda state: _load_scaler_state(parts.scaler, state),
        quiesce=parts.quiesce_state,
        sync_params_from_master=parts.sync_params_from_master,
        flat_state=lambda: _flat_state(parts),
        steps_taken=lambda: parts.comm.where.step,
        set_steps_taken=lambda step: setattr(parts.comm.where, "step", int(step)),
    )


def _flat_state(parts: Parts) -> dict[str, torch.Tensor]:
    """Every flat tensor of this rank's state, by name (CheckpointView.flat_state)."""
    shard = parts.shard
    # Stages 1-2: every parameter, whole; stage 3: the parameters' shard below (its gathered buffers
    # hold no storage at rest).
    out = {} if parts.plan.params_sharded else {f"param_buffers.{i}": b for i, b in enumerate(shard.param_buffers)}
    for name in ("param_shard", "master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        out[name] = getattr(shard, name)
    if parts.frozen is not None:
        out["frozen_shard"] = parts.frozen.shard
    return {k: v for k, v in out.items() if v.numel()}


def _frozen_view(parts: Parts) -> ShardedPart | None:
    fz, tp = parts.frozen, parts.grads.tp
    if fz is None:
        return None
    named = parts.frozen_named  # the model's (DTensors named whole, as the trainable part's)
    load_pieces = fz.load_pieces
    if tp is not None:

        def load_pieces(full, load=fz.load_pieces):
            load({i: tp.narrow(named[i][1], t) for i, t in full.items()})

    return ShardedPart(
        params=tuple(named),
        kinds=((),) * len(named),
        layout=fz.layout,
        pieces=tuple(fz.pieces),
        dtype=fz.dtype,
        device=fz.device,
        piece_view=lambda pc, kind: fz.piece_view(pc),  # its values, whatever the kind: it has no state
        write_piece=lambda pc, kind, values: fz.piece_view(pc).copy_(values.reshape(-1)),
        load_pieces=lambda kind, full: load_pieces(full),
        buffer_of=lambda kind: "master",
        local_geometry=tuple(tp.geometry(p) for _, p in named) if tp is not None else None,
    )


def _scaler_state(scaler: LossScaler) -> ScalerState:
    return ScalerState(scale=scaler.scale, growth_tracker=scaler.growth_tracker, enabled=scaler.enabled)


def _load_scaler_state(scaler: LossScaler, state: ScalerState) -> None:
    if scaler.enabled and state["enabled"]:
        scaler.scale, scaler.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
