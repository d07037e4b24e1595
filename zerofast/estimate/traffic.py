"""Op, traffic_ops and estimate_traffic: the bytes a step moves, per collective and process group, as
report().comm counts them, without running a step: ZeroAdam's own layouts (zerofast/optim/placement.py)
and, for stage 3, the runtime's schedule (zerofast/stage3/schedule.py) run over the calls a forward is
expected to make. Pure arithmetic: no process group, no compiled code."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch.nn as nn

from ..collectives import collective_names
from ..config import DEFAULT_BUCKET_MB, check_stage, resolve_plan
from ..optim.agreement import AgreementLayout
from ..optim.placement import plan_layouts
from ..stage3.schedule import CallRef, Schedule, UnitOp
from ..stage3.units import hook_needs
from ..tensor_parallel import is_dtensor
from ..topology import check_shard_size

# The int64 message of the step's agreement beyond a flag per trainable parameter tensor: each
# counter twice and the failure flag (zerofast/optim/agreement.py).
AGREEMENT_EXTRA = AgreementLayout(0).numel


@dataclass(frozen=True)
class Op:
    """The collectives of one kind a rank issues in one step, for the traffic and the time model."""

    group: str  # "shard" (the K ranks sharing the state) or "replicate" (the W/K holding the same shard)
    name: str  # the collective, as report().comm names it
    nbytes: int  # payload bytes per step, counted as report().comm counts them
    calls: int  # collective calls per step (each pays the latency term)
    phase: str  # the compute it can hide behind: "forward", "backward", or "step" (none)
    ranks: int

    @property
    def key(self) -> str:
        return f"{self.group}/{self.name}"


def _gather_calls(backend: str, flat: bool, owners: int, ranks: int) -> int:
    """Collective calls of one bucket's gather: NCCL's flat all_gather is one call; gloo's flat
    gather is one broadcast per rank's slice; an owner layout broadcasts from each owner that has a part."""
    if flat:
        return 1 if backend != "gloo" else ranks
    return owners


def _owners(bucket) -> int:
    return sum(1 for r in range(len(bucket.bounds) - 1) if bucket.bounds[r + 1] > bucket.bounds[r])


def stage3_gathers(model: nn.Module, layouts) -> tuple[list[int], list[int]]:
    """The units stage 3 gathers in one micro-batch's forward and in its backward, in order, from the
    second step on: the runtime's schedule ([Note: stage 3 lifecycle] in zerofast/stage3/schedule.py)
    run over the calls of two steps. The calls are expected, not observed: each module that gathers
    runs once per forward, in registration order, inside its parent's call; every call's output
    reaches backward, which meets the calls in reverse (a call's outputs, then its inputs); the
    root's inputs need no gradient. The first step gathers more: with no previous order to go by,
    its forward prefetches nothing and regathers a merged unit for each of its modules."""
    needs = hook_needs(model, layouts.unit_params, layouts.unit_plan)
    schedule = Schedule(model, needs, len(layouts.unit_plan.groups))
    forward = _expected_forward(model, needs)
    _run_step(schedule, forward)  # the first step: the forward order the second goes by
    return _run_step(schedule, forward)


def _expected_forward(model: nn.Module, needs) -> list[nn.Module | None]:
    """A forward as the hooks would meet it: each module of `needs` as it begins (the module) and
    ends (None), depth first in registration order, each module once."""
    events: list[nn.Module | None] = []
    seen: set[int] = set()

    def walk(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        hooked = module in needs
        if hooked:
            events.append(module)
        for child in module.children():
            walk(child)
        if hooked:
            events.append(None)

    walk(model)
    return events


def _run_step(schedule: Schedule, forward: list[nn.Module | None]) -> tuple[list[int], list[int]]:
    """One forward and backward of the schedule, called as the runtime's hooks call it: the units each gathers."""
    gathered_forward: list[int] = []
    hooked: list[tuple[bool, CallRef]] = []  # (begins, call) of each call the schedule keeps, in order
    for module in forward:
        if module is not None:
            call = schedule.enter(module)
            if call is not None:
                gathered_forward += _gathers(schedule.pre_forward(call))
                hooked.append((True, call))
        else:
            call = schedule.exit_call()
            if call is not None:
                gathered_forward += _gathers(schedule.post_forward(call, backward_follows=True))
                hooked.append((False, call))
    gathered_backward: list[int] = []
    for begins, call in reversed(hooked):
        if not begins:  # backward reaches the call's outputs
            gathered_backward += _gathers(schedule.pre_backward(call))
        elif call.module is not schedule.root:  # and passes its inputs (the root's need no gradient)
            gathered_backward += _gathers(schedule.post_backward(call))
    gathered_backward += _gathers(schedule.end_backward())
    return gathered_forward, gathered_backward


def _gathers(actions) -> list[int]:
    return [a.unit for a in actions if a.op is UnitOp.GATHER]


def traffic_ops(
    model_or_param_count,
    world: int,
    stage: int,
    *,
    mixed_precision=None,
    comm=None,
    units=None,
    offload=None,
    tp: int = 1,
    rank: int = 0,
    max_grad_norm=None,
    micro_batches: int = 1,
    backend: str = "nccl",
    pp: int = 1,
    **moved,
) -> list[Op]:
    """The collectives behind estimate_traffic (its keywords, as estimate_memory's in the same order:
    mixed_precision, comm, units, offload, tp, rank), with their call counts and the phase each can
    overlap."""
    who = "estimate_traffic"
    for name in moved:
        if name == "shard_size":
            raise TypeError(
                f"{who}: the keyword shard_size= is now comm=CommPolicy(shard_size=...), as ZeroAdam takes it"
            )
        raise TypeError(f"{who} got an unexpected keyword argument {name!r}")
    is_module = isinstance(model_or_param_count, nn.Module)
    if not is_module and not (
        isinstance(model_or_param_count, int)
        and not isinstance(model_or_param_count, bool)
        and model_or_param_count >= 1
    ):
        raise ValueError(
            f"{who}: model_or_param_count must be an nn.Module or a count >= 1; got {model_or_param_count!r}"
        )
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{who}: world must be an integer >= 1; got {world!r}")
    if not (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 and world % pp == 0):
        raise ValueError(f"{who}: pp must be an integer >= 1 that divides world ({world}); got {pp!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{who}: rank must be an integer in [0, {world}); got {rank!r}")
    # A pipeline stage's part ([Note: pipeline accumulation] in zerofast/pipelining.py): the ranks of
    # this rank's stage, "pp" outermost in the mesh.
    world, rank = world // pp, rank % (world // pp)
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and world % tp == 0):
        raise ValueError(f"{who}: tp must be an integer >= 1 that divides world ({world}); got {tp!r}")
    world, rank = world // tp, rank // tp  # ZeRO over the data-parallel ranks of this rank's "tp" coordinate
    if tp > 1 and not is_module:
        model_or_param_count = -(-model_or_param_count // tp)
    check_stage(stage, who, stages=(1, 2, 3))
    shards = check_shard_size(None, world, who, comm)
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{who}: backend must be 'nccl' or 'gloo'; got {backend!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"{who}: micro_batches must be an integer >= 1; got {micro_batches!r}")
    plan = resolve_plan(
        stage, max_grad_norm=max_grad_norm, mixed_precision=mixed_precision, comm=comm, units=units, offload=offload
    )
    # The state on disk: after the update, one int64 MAX over every rank, whether each wrote its
    # files ([Note: the all-or-none offloaded step] in zerofast/offload/__init__.py).
    disk_agreement = plan.offload.state == "disk"
    replicas, shard_rank = world // shards, rank % shards
    r_bytes, p_bytes = plan.reduce_dtype.itemsize, plan.param_dtype.itemsize
    # [Note: accumulation] in zerofast/optim/grads.py; a pipeline stage reduces once a step whatever
    # the CommPolicy says ([Note: pipeline accumulation]).
    reduces = 1 if plan.accumulates_locally or pp > 1 else micro_batches
    flat = plan.partition == "flat"
    reduce_name, gather_name = collective_names(backend, flat)
    gather_step: list[tuple[int, int]] = []  # stages 1, 2: (bytes, calls) after the update
    gather_fwd: list[tuple[int, int]] = []  # stage 3: per micro-batch
    gather_bwd: list[tuple[int, int]] = []
    if is_module:
        model = model_or_param_count
        # With tensor parallelism the core shards each DTensor's local tensor ([Note: tensor parallelism]).
        named = [(n, _local(p)) for n, p in model.named_parameters() if p.requires_grad] if tp > 1 else None
        layouts = plan_layouts(model, plan, shards, named=named, core_of=_local if tp > 1 else None)
        layout = layouts.layout
        tensors = len(layouts.params)
        reduce_numel = sum(b.numel for b in layout.buckets)
        reduce_calls = sum(1 if flat else _owners(b) for b in layout.buckets)
        shard_numel = layout.shard_numel(shard_rank)
        replicate_calls = _replicate_calls(
            [b.bounds[shard_rank + 1] - b.bounds[shard_rank] for b in layout.buckets], r_bytes, plan
        )
        if stage < 3:
            gather_step = [
                (b.numel * p_bytes, _gather_calls(backend, flat, _owners(b), shards)) for b in layout.buckets
            ]
        else:

            def unit_cost(u: int) -> tuple[int, int]:
                nbytes = calls = 0
                for lay, bucket_of in (
                    (layout, layouts.unit_buckets),
                    (layouts.frozen_layout, layouts.frozen_bucket_of),
                ):
                    if lay is not None and bucket_of[u] is not None:
                        b = lay.buckets[bucket_of[u]]
                        nbytes += b.numel * p_bytes
                        calls += _gather_calls(backend, flat, _owners(b), shards)
                return nbytes, calls

            fwd, bwd = stage3_gathers(model, layouts)
            gather_fwd, gather_bwd = [unit_cost(u) for u in fwd], [unit_cost(u) for u in bwd]
    else:  # a count: no tensors, no padding; buckets of the plan's size (stage 3: estimate_memory's stand-in)
        numel = model_or_param_count
        tensors = 0
        bucket_bytes = plan.bucket_bytes or int(DEFAULT_BUCKET_MB[2] * 2**20)
        buckets = max(1, -(-numel * r_bytes // bucket_bytes))
        reduce_numel, shard_numel = numel, -(-numel // shards)
        reduce_calls = buckets * (1 if flat else shards)
        replicate_calls = max(1, -(-shard_numel * r_bytes // plan.replicate_bytes))
        every_bucket = [(numel * p_bytes, buckets * _gather_calls(backend, flat, shards, shards))]
        if stage < 3:
            gather_step = every_bucket
        else:
            gather_fwd = gather_bwd = every_bucket
    flags = 8 * AgreementLayout(tensors).numel
    ops: list[Op] = []
    if shards > 1:  # a group of one moves nothing
        ops.append(
            Op("shard", reduce_name, reduces * reduce_numel * r_bytes, reduces * reduce_calls, "backward", shards)
        )
        # Under a pipeline, stage 3's parts stay gathered for the step ([Note: pipeline accumulation]):
        # each unit once, in forward.
        for phase, parts, times in (
            ("step", gather_step, 1),
            ("forward", gather_fwd, 1 if pp > 1 else micro_batches),
            ("backward", [] if pp > 1 else gather_bwd, micro_batches),
        ):
            if parts:
                ops.append(
                    Op(
                        "shard",
                        gather_name,
                        times * sum(b for b, _ in parts),
                        times * sum(c for _, c in parts),
                        phase,
                        shards,
                    )
                )
        ops.append(Op("shard", "all_reduce_flags", flags, 1, "step", shards))
        if plan.scales_loss or plan.max_grad_norm is not None:  # overflow flag and squared norm: 2 x fp32
            ops.append(Op("shard", "all_reduce_stats", 8, 1, "step", shards))
        if disk_agreement:
            ops.append(Op("shard", "all_reduce_flags", 8, 1, "step", shards))
    if replicas > 1:
        # launched as each bucket's last reduce finishes: overlapped with backward ([Note: replicas
        # in backward] in csrc/buckets.cpp)
        ops.append(Op("replicate", "all_reduce", shard_numel * r_bytes, replicate_calls, "backward", replicas))
        ops.append(Op("replicate", "all_reduce_flags", flags, 1, "step", replicas))
        if disk_agreement:
            ops.append(Op("replicate", "all_reduce_flags", 8, 1, "step", replicas))
    if tp > 1:  # the optimizer's own all_reduces over "tp" (GradReducer._agree_over_tp, prepare's stats)
        message = AgreementLayout(tensors)
        joined = message.params + message.counter("micro_batches").stop - message.counter("steps").start + 1
        ops.append(Op("tp", "all_reduce_flags", 8 * joined + (8 if disk_agreement else 0), 1, "step", tp))
        if plan.scales_loss or plan.max_grad_norm is not None:
            ops.append(Op("tp", "all_reduce_stats", 8, 1, "step", tp))
    if pp > 1:  # the step joined over "pp": the step counts and a failure (GradReducer._agree_over_pp), the stats
        ops.append(Op("pp", "all_reduce_flags", 8 * 3 + (8 if disk_agreement else 0), 1, "step", pp))
        if plan.scales_loss or plan.max_grad_norm is not None:
            ops.append(Op("pp", "all_reduce_stats", 8, 1, "step", pp))
    return ops


def _local(p):
    """What the core shards of a parameter: a DTensor's local tensor, another the parameter itself."""
    return p._local_tensor if is_dtensor(p) else p


def _replicate_calls(owned: list[int], r_bytes: int, plan) -> int:
    """The replicas' all_reduces of a step, as the engine issues them ([Note: replicas in backward]
    in csrc/replica_reducer.cpp): consecutive owned ranges together until they hold plan.replicate_bytes
    (stage 1's, in separate buckets, as one coalesced all_reduce)."""
    calls = pending = 0
    for i, n in enumerate(owned):
        pending += n
        if pending and (pending * r_bytes >= plan.replicate_bytes or i == len(owned) - 1):
            calls, pending = calls + 1, 0
    return calls


def estimate_traffic(model_or_param_count, world: int, stage: int, **options) -> dict[str, int]:
    """The payload bytes per collective that `opt.report().comm` reports on rank `rank` after a step of
    ZeroAdam(model, stage, mixed_precision=..., comm=CommPolicy(shard_size=K, ...), units=...,
    offload=..., max_grad_norm=...) on `world` ranks of `backend`, with `micro_batches` backwards per
    step (all but the last under no_sync()). Keywords as estimate_memory's, in the same order:
    mixed_precision, comm, units, offload, tp, rank. offload as ZeroAdam takes it: with the state on
    disk, each step that applies its update agrees over every rank that every rank wrote its files (8
    more bytes of all_reduce_flags in each group of more than one rank); "host" moves nothing more. tp:
    the tensor-parallel degree, as estimate_memory takes it (a module by its DTensors' local tensors,
    exactly; ZeRO over the world/tp data-parallel ranks, rank counted among all); tp > 1 adds the
    optimizer's own all_reduces over "tp" (the step's agreement joined, and the overflow flag's and
    norm's sum when loss scaling or clipping). Keys: "shard/<collective>" (the K ranks sharing the
    state), "replicate/<collective>" (the W/K copies of each shard, when K < world), "tp/<collective>"
    and "pp/<collective>". pp: the pipeline degree ("pp" outermost in the mesh; the module is this
    rank's stage's part, `world` every rank): a stage reduces once a step whatever micro_batches, and
    adds the step's all_reduces over "pp" (the agreement's step counts and failure; the overflow flag
    and norm when loss scaling or clipping); stage 3 gathers each unit once a step, in the first
    micro-batch's forward (ZeroPipelineStage's default, the parts kept gathered for the step; with
    gather_per_micro_batch=True, or a zero-bubble schedule's split passes, it gathers more).

    Exact for an nn.Module: ZeroAdam's own layouts (zerofast.optim.placement), padding and agreement
    message included. Stage 3's gathers are those of the second step on, each gathering module run
    once per forward in registration order (stage3_gathers); a step whose fp16 gradients overflowed
    skips its update and (stages 1, 2) its gather. Approximate for a parameter count: no padding, no
    per-tensor agreement flags (it knows no tensors), and stage 3's units taken as stage 2's default
    bucket size."""
    totals: dict[str, int] = {}
    for op in traffic_ops(model_or_param_count, world, stage, **options):
        totals[op.key] = totals.get(op.key, 0) + op.nbytes
    return totals


# Its keywords are traffic_ops's, written once there; help() and inspect show them here too.
estimate_traffic.__signature__ = inspect.signature(traffic_ops).replace(return_annotation=dict[str, int])
