"""The ZeRO paper's memory table as an estimator: per-rank bytes by its formulas.

Per parameter, mixed-precision Adam holds 2 bytes of parameter, 2 of gradient and 12 of optimizer
state (fp32 master copy, m, v): the paper's 16Φ. In fp32 there is no separate master copy (the
parameter is the master): 4 + 4 + 8. Each stage keeps a part of each on a rank:

| stage       | parameters | gradients | optimizer state |
|-------------|------------|-----------|-----------------|
| 0 (DDP)     | all        | all       | all             |
| 1           | all        | all       | 1/N             |
| 2           | all        | 1/N       | 1/N             |
| 3           | 1/N        | 1/N       | 1/N             |

ZeroAdam adds buffers the table has no row for ("zerofast_extra"): in stages 2 and 3 the gradient
bucket buffers alive at once (bucket_buffers of them: [Note: buffers in flight] in
csrc/buckets.cpp), and padding (each bucket padded to a multiple of world x 4 elements). Stage 1's
gradients are its buckets, reduced in place ([Note: grads as bucket views]): padding only, unless
it reduces in another dtype (then it copies, as stage 2 does, and keeps a reduced shard).

Pure arithmetic: the options are checked and resolved by zerofast/config.py, the same code as
ZeroAdam's, so the estimator accepts exactly what ZeroAdam accepts; no compiled code is imported.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import (
    DEFAULT_BUCKET_MB,
    CommPolicy,
    check_stage,
    collective_names,
    comm_policy,
    precision_policy,
    resolve_plan,
    unit_policy,
)
from ..layout import ALIGN
from ..optim.agreement import AgreementLayout


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int  # 0 is DDP
    world: int
    params: int  # bytes per rank
    grads: int
    optimizer: int
    zerofast_extra: int  # bucket buffers, padding, stage 1's gradient shard (0 for DDP)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.zerofast_extra


# Where the estimator's keywords of before the policies live now.
_MOVED = {
    "precision": "mixed_precision= (None, 'bf16', 'fp16' or a MixedPrecisionPolicy, as ZeroAdam takes it)",
    "bucket_mb": "comm=CommPolicy(bucket_mb=...)",
    "bucket_buffers": "comm=CommPolicy(bucket_buffers=...)",
}


def estimate_memory(
    model_or_param_count, world: int, stage: int, mixed_precision=None, comm=None, units=None, shard_size=None, **moved
) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state for DDP (stage 0) or a ZeRO stage,
    by the paper's formulas, plus the buffers ZeroAdam adds. mixed_precision, comm and units as
    ZeroAdam takes them (stage 0 checks them alone). Stage 3's buckets are its units, whose size
    the estimate cannot know from a count: it takes stage 2's default bucket for each. A count is
    of trainable parameters; a module's frozen parameters are counted apart, as parameter bytes
    only (in the parameters' dtype; sharded in stage 3, whole in stages 0-2). shard_size=K (hybrid
    sharding, ZeroAdam's shard_size): the state is sharded over K ranks and replicated W/K times,
    so each sharded part is divided by K instead of W (None: K = world, flat ZeRO)."""
    for name in moved:
        if name in _MOVED:
            raise TypeError(f"estimate_memory: the keyword {name}= is now {_MOVED[name]}")
        raise TypeError(f"estimate_memory got an unexpected keyword argument {name!r}")
    frozen = 0  # frozen parameters: their bytes only, sharded in stage 3 ([Note: frozen parameters in stage 3])
    if isinstance(model_or_param_count, nn.Module):
        numel = sum(p.numel() for p in model_or_param_count.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model_or_param_count.parameters() if not p.requires_grad)
    elif (
        isinstance(model_or_param_count, int)
        and not isinstance(model_or_param_count, bool)
        and model_or_param_count >= 0
    ):
        numel = model_or_param_count
    else:
        raise ValueError(
            f"estimate_memory: model_or_param_count must be an nn.Module or a count >= 0; got {model_or_param_count!r}"
        )
    if not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise ValueError(f"estimate_memory: world must be an integer >= 1; got {world!r}")
    check_stage(stage, "estimate_memory", stages=(0, 1, 2, 3))
    shards = check_shard_size(shard_size, world, "estimate_memory", comm)
    if stage == 0:  # DDP: the options are checked all the same, so a typo is not silently ignored
        precision, comm_p = precision_policy(mixed_precision), comm_policy(comm)
        unit_policy(units)
        param_dtype, reduce_dtype = precision.param_dtype, precision.reduce_dtype or precision.param_dtype
        bucket_bytes, buffers, views = 0, comm_p.bucket_buffers, False
    else:
        plan = resolve_plan(stage, mixed_precision=mixed_precision, comm=comm, units=units)
        param_dtype, reduce_dtype = plan.param_dtype, plan.reduce_dtype
        bucket_bytes = plan.bucket_bytes or int(DEFAULT_BUCKET_MB[2] * 2**20)  # stage 3: a unit's stand-in
        buffers, views = plan.bucket_buffers, plan.grads_as_bucket_views
    p_bytes, r_bytes = _itemsize(param_dtype), _itemsize(reduce_dtype)
    g_bytes = p_bytes if stage < 2 else r_bytes  # full gradients in the parameters' dtype
    o_bytes = 8 + (4 if param_dtype != torch.float32 else 0)  # m, v and a separate fp32 master
    shard = -(-numel // shards)  # ceil: this rank's part
    params = p_bytes * (shard if stage == 3 else numel)
    params += p_bytes * (-(-frozen // shards) if stage == 3 else frozen)
    grads = g_bytes * (shard if stage >= 2 else numel)
    optimizer = o_bytes * (shard if stage >= 1 else numel)
    extra = 0
    if stage >= 1:
        all_grads = r_bytes * numel
        copied = stage >= 2 or not views  # gradients copied into pooled buffers (bucket_buffers=0: no bound)
        pooled = min(buffers * bucket_bytes, all_grads) if buffers else all_grads
        extra += pooled if copied else 0
        extra += r_bytes * shard if stage == 1 and not views else 0  # stage 1's reduced shard in reduce_dtype
        padding_elements = ALIGN * shards * max(1, -(-r_bytes * numel // bucket_bytes))
        extra += padding_elements * (p_bytes + r_bytes + o_bytes)
    return MemoryEstimate(stage, world, params, grads, optimizer, extra)


# --- traffic: the bytes comm_stats() reports, without running a step ---------------------------------


def check_shard_size(shard_size, world: int, who: str, comm=None) -> int:
    """shard_size (None: world, flat ZeRO), or the CommPolicy's as ZeroAdam takes it: an integer
    K >= 1 dividing world."""
    given = getattr(comm, "shard_size", None)
    if given is not None and shard_size is not None and given != shard_size:
        raise ValueError(f"{who}: shard_size={shard_size!r} and comm.shard_size={given!r} differ; pass one")
    shard_size = given if shard_size is None else shard_size
    if shard_size is None:
        return world
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"{who}: shard_size must be None or an integer >= 1; got {shard_size!r}")
    if shard_size > world or world % shard_size:
        raise ValueError(
            f"{who}: shard_size={shard_size} must divide world={world} (the ranks form world/shard_size "
            f"groups of shard_size consecutive ranks)"
        )
    return shard_size


# The int64 message of the step's agreement beyond a flag per trainable parameter tensor: each
# counter twice and the failure flag (zerofast/optim/agreement.py).
AGREEMENT_EXTRA = AgreementLayout(0).numel


@dataclass(frozen=True)
class Op:
    """The collectives of one kind a rank issues in one step, for the traffic and the time model."""

    group: str  # "shard" (the K ranks sharing the state) or "replicate" (the W/K holding the same shard)
    name: str  # the collective, as comm_stats() names it
    nbytes: int  # payload bytes per step, counted as comm_stats() counts them
    calls: int  # collective calls per step (each pays the latency term)
    phase: str  # the compute it can hide behind: "forward", "backward", or "step" (none)
    ranks: int  # ranks in the group

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
    second step on: zerofast/stage3/runtime.py's hooks played over the module tree ([Note: stage 3
    lifecycle], [Note: who gathers what]). Assumes each module that gathers runs once per forward,
    in registration order, inside its parent's call, and that every call's output reaches backward.
    The first step gathers more: with no previous order to go by, a merged unit is gathered again by
    each of its modules (nothing is carried)."""
    from ..stage3.units import hook_needs

    needs = hook_needs(model, layouts.unit_params, layouts.unit_plan)
    calls: list[tuple[int, ...]] = []  # the gathering calls, in forward order
    events: list[tuple[str, int]] = []  # ("pre" | "post", call), nested as the calls run
    seen: set[int] = set()

    def walk(module: nn.Module, held: frozenset) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        k = None
        units = needs.get(module)
        if units is not None and (module is model or not set(units) <= held):
            k = len(calls)
            calls.append(units)
            events.append(("pre", k))
            held = held | set(units)
        for child in module.children():
            walk(child, held)
        if k is not None:
            events.append(("post", k))

    walk(model, frozenset())

    def next_other(k: int, step: int) -> tuple[int, ...]:
        j = k + step
        while 0 <= j < len(calls):
            if calls[j] != calls[k]:
                return calls[j]
            j += step
        return ()

    n_units = len(layouts.unit_plan.groups)
    gathered = [False] * n_units
    refs, carried = [0] * n_units, [False] * n_units
    out: list[int] = []

    def gather(u):
        if not gathered[u]:
            gathered[u] = True
            out.append(u)

    def acquire(units):
        for u in units:
            refs[u] += 1
            carried[u] = False
            gather(u)

    def release(units):
        for u in units:
            refs[u] = max(0, refs[u] - 1)
            if refs[u] == 0 and not carried[u]:
                gathered[u] = False

    def release_all(keep=frozenset()):
        for u in range(n_units):
            refs[u], carried[u] = 0, u in keep
            gathered[u] = gathered[u] and u in keep

    def carry(k, following):
        for u in set(calls[k]) & set(calls[following]):
            carried[u] = True

    into_backward: set[int] = set()
    for kind, k in events:  # forward: pre-hook acquires and prefetches the next call's units
        if kind == "pre":
            acquire(calls[k])
            for u in next_other(k, +1):
                gather(u)
        else:
            if k == 0 or k + 1 == len(calls):  # the root and the last call: [Note: forward hands over to backward]
                for u in calls[k]:
                    carried[u] = True
                    into_backward.add(u)
            elif k + 1 < len(calls):
                carry(k, k + 1)
            release(calls[k])
            if k == 0:
                release_all(into_backward)
    forward, out = out, []
    for kind, k in reversed(events):  # backward: the forward's events reversed, pre and post swapped
        if kind == "post":
            acquire(calls[k])
            for u in next_other(k, -1):
                gather(u)
        elif k > 0:  # the root's inputs need no gradient: its post-backward never runs
            carry(k, k - 1)
            release(calls[k])
    release_all()
    return forward, out


def traffic_ops(
    model_or_param_count,
    world: int,
    stage: int,
    shard_size=None,
    mixed_precision=None,
    comm=None,
    units=None,
    backend: str = "nccl",
    rank: int = 0,
    micro_batches: int = 1,
    max_grad_norm=None,
) -> list[Op]:
    """The collectives behind estimate_traffic, with their call counts and the phase each can overlap."""
    who = "estimate_traffic"
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
    check_stage(stage, who, stages=(1, 2, 3))
    shards = check_shard_size(shard_size, world, who, comm)
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{who}: backend must be 'nccl' or 'gloo'; got {backend!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{who}: rank must be an integer in [0, {world}); got {rank!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"{who}: micro_batches must be an integer >= 1; got {micro_batches!r}")
    plan = resolve_plan(stage, max_grad_norm=max_grad_norm, mixed_precision=mixed_precision, comm=comm, units=units)
    replicas, shard_rank = world // shards, rank % shards
    r_bytes, p_bytes = _itemsize(plan.reduce_dtype), _itemsize(plan.param_dtype)
    reduces = 1 if plan.accumulates_locally else micro_batches  # [Note: accumulation] in zerofast/optim/grads.py
    flat = plan.partition == "flat"
    reduce_name, gather_name = collective_names(backend, flat)
    gather_step: list[tuple[int, int]] = []  # stages 1, 2: (bytes, calls) after the update
    gather_fwd: list[tuple[int, int]] = []  # stage 3: per micro-batch
    gather_bwd: list[tuple[int, int]] = []
    if is_module:
        from ..optim.layouts import plan_layouts

        model = model_or_param_count
        layouts = plan_layouts(model, plan, shards)
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
        for phase, parts, times in (
            ("step", gather_step, 1),
            ("forward", gather_fwd, micro_batches),
            ("backward", gather_bwd, micro_batches),
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
    if replicas > 1:
        # launched as each bucket's last reduce finishes: overlapped with backward ([Note: replicas
        # in backward] in csrc/buckets.cpp)
        ops.append(Op("replicate", "all_reduce", shard_numel * r_bytes, replicate_calls, "backward", replicas))
        ops.append(Op("replicate", "all_reduce_flags", flags, 1, "step", replicas))
    return ops


def _replicate_calls(owned: list[int], r_bytes: int, plan) -> int:
    """The replicas' all_reduces of a step, as the engine issues them ([Note: replicas in backward]
    in csrc/buckets.cpp): consecutive owned ranges together until they hold plan.replicate_bytes
    (stage 1's, in separate buckets, as one coalesced all_reduce)."""
    calls = pending = 0
    for i, n in enumerate(owned):
        pending += n
        if pending and (pending * r_bytes >= plan.replicate_bytes or i == len(owned) - 1):
            calls, pending = calls + 1, 0
    return calls


def estimate_traffic(
    model_or_param_count,
    world: int,
    stage: int,
    shard_size=None,
    mixed_precision=None,
    comm=None,
    units=None,
    backend: str = "nccl",
    rank: int = 0,
    micro_batches: int = 1,
    max_grad_norm=None,
) -> dict[str, int]:
    """The payload bytes per collective that `opt.comm_stats()` reports on rank `rank` after a step
    of ZeroAdam(model, stage, shard_size=..., mixed_precision=..., comm=..., units=...,
    max_grad_norm=...) on `world` ranks of `backend`, with `micro_batches` backwards per step
    (all but the last under no_sync()). Keys "shard/<collective>" (the K ranks sharing the state)
    and "replicate/<collective>" (the W/K copies of each shard, when shard_size < world).

    For an nn.Module it is exact: the same layouts ZeroAdam builds (zerofast.optim.layouts), the
    padding and the agreement message included. Stage 3's gathers are those of the second step on,
    with each gathering module run once per forward in registration order (see stage3_gathers); a
    step whose fp16 gradients overflowed skips its update and (stages 1, 2) its gather.
    For a parameter count it is an approximation: no padding, no per-tensor agreement flags (it
    knows no tensors), and stage 3's units taken as stage 2's default bucket size."""
    totals: dict[str, int] = {}
    for op in traffic_ops(
        model_or_param_count,
        world,
        stage,
        shard_size,
        mixed_precision,
        comm,
        units,
        backend,
        rank,
        micro_batches,
        max_grad_norm,
    ):
        totals[op.key] = totals.get(op.key, 0) + op.nbytes
    return totals


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(rows: list[MemoryEstimate]) -> str:
    head = f"{'':10s} {'params':>12s} {'grads':>12s} {'optimizer':>12s} {'zerofast+':>12s} {'total':>12s}"
    lines = [head]
    for r in rows:
        name = "DDP" if r.stage == 0 else f"stage {r.stage}"
        lines.append(
            f"{name:10s} {format_bytes(r.params):>12s} {format_bytes(r.grads):>12s} {format_bytes(r.optimizer):>12s} "
            f"{format_bytes(r.zerofast_extra):>12s} {format_bytes(r.total):>12s}"
        )
    return "\n".join(lines)


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """A parameter count as people write it: 7000000, 7_000_000, 7e9, 7.5B, 350M, 1.2T, 125K."""
    s = text.strip().replace("_", "").replace(",", "")
    scale = 1
    if s[-1:].upper() in _SUFFIXES:
        scale, s = _SUFFIXES[s[-1].upper()], s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7e9, 7.5B or 350M)") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}")
    if abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise argparse.ArgumentTypeError(f"not a whole number of parameters: {text!r} = {value}")
    return int(round(value))


def _link_table(params: int, world: int, stages, shard_size, precision, backend: str, gpus_per_node: int) -> str:
    """Bytes per GPU per step of each collective, and the link it crosses (ranks numbered node by node)."""
    from .timemodel import Cluster, link_of

    cluster = Cluster(gpus_per_node=gpus_per_node)
    k = world if shard_size is None else shard_size
    lines = [f"{'':10s} {'collective':28s} {'bytes/GPU/step':>15s}  link"]
    for s in stages:
        if s == 0:
            continue
        totals: dict[str, list] = {}  # stage 3's forward and backward gathers: one row
        for op in traffic_ops(params, world, s, shard_size, precision, backend=backend):
            row = totals.setdefault(op.key, [0, link_of(op.group, world, k, cluster).name])
            row[0] += op.nbytes
        for key, (nbytes, link) in totals.items():
            lines.append(f"{'stage ' + str(s):10s} {key:28s} {format_bytes(nbytes):>15s}  {link}")
    return "\n".join(lines)


def _time_table(args, p) -> str:
    from .timemodel import Cluster, Link, format_seconds, step_time

    cluster = Cluster(
        gpus_per_node=args.gpus_per_node,
        intra=Link("intra-node", args.intra_bw, args.intra_latency),
        inter=Link("inter-node", args.inter_bw, args.inter_latency),
        flops=args.tflops * 1e12,
    )
    if args.global_tokens is not None:
        tokens = args.global_tokens // args.world
    else:
        tokens = args.tokens_per_rank
    sizes = [args.shard_size] if args.shard_size is not None else [None]
    g = args.gpus_per_node
    if args.shard_size is None and args.world > g and args.world % g == 0:
        sizes.append(g)  # flat against hybrid with a node per shard group
    stages = [args.stage] if args.stage is not None else [1, 2, 3]
    head = (
        f"{'':8s} {'K':>5s} {'intra B':>10s} {'inter B':>10s} {'intra t':>9s} {'inter t':>9s} "
        f"{'compute':>9s} {'exposed':>9s} {'step':>9s} {'mem/GPU':>10s}"
    )
    lines = [
        f"Φ = {args.params:,}, W = {args.world} GPUs ({g} per node), {tokens:,} tokens/GPU/step, "
        f"{args.tflops:g} TFLOP/s, intra {args.intra_bw / 1e9:g} GB/s {args.intra_latency * 1e6:g} us, "
        f"inter {args.inter_bw / 1e9:g} GB/s {args.inter_latency * 1e6:g} us, "
        f"{'overlapped' if args.overlap else 'no overlap'}",
        head,
    ]
    for s in stages:
        for k in sizes:
            kk = args.world if k is None else k
            try:
                t = step_time(
                    args.params,
                    args.world,
                    s,
                    tokens,
                    k,
                    cluster,
                    _PRECISIONS[args.precision],
                    args.backend,
                    args.micro_batches,
                    args.overlap,
                )
                mem = estimate_memory(args.params, args.world, s, _PRECISIONS[args.precision], shard_size=k)
            except ValueError as e:
                p.error(str(e))
            lines.append(
                f"{'stage ' + str(s):8s} {kk:>5d} {format_bytes(t.bytes.get('intra-node', 0)):>10s} "
                f"{format_bytes(t.bytes.get('inter-node', 0)):>10s} "
                f"{format_seconds(t.comm.get('intra-node', 0.0)):>9s} "
                f"{format_seconds(t.comm.get('inter-node', 0.0)):>9s} {format_seconds(t.compute):>9s} "
                f"{format_seconds(t.exposed):>9s} {format_seconds(t.step):>9s} {format_bytes(mem.total):>10s}"
            )
    return "\n".join(lines)


_PRECISIONS = {"mixed": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": None}


def main(argv=None) -> int:
    from .timemodel import parse_rate, parse_seconds

    def typed(parse, what):
        def f(text):
            try:
                return parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        f.__name__ = what
        return f

    p = argparse.ArgumentParser(
        prog="python -m zerofast.estimate",
        description="Per-rank memory of DDP and ZeRO stages 1-3 by the ZeRO paper's formulas, "
        "the bytes each step moves on each link, and (--time) a step-time model.",
    )
    p.add_argument(
        "--params",
        type=parse_count,
        required=True,
        help="trainable parameters (Φ): 7000000, 7e9, 7.5B, 350M, 1.2T, 125K",
    )
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks (N)")
    p.add_argument("--stage", type=int, default=None, help="one stage (0 = DDP, 1, 2, 3); default: all")
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="hybrid sharding: the state is sharded over K consecutive ranks and replicated world/K "
        "times (ZeroAdam's shard_size; default: world, flat ZeRO)",
    )
    p.add_argument(
        "--precision",
        default="mixed",
        help="mixed or bf16 (2+2+12 bytes), fp16 (the same), or fp32 (4+4+8); default mixed",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="ZeroAdam's CommPolicy.bucket_mb, stages 1 and 2 (default 25 for stage 1, 8 for stage 2)",
    )
    p.add_argument(
        "--bucket-buffers",
        type=int,
        default=CommPolicy.bucket_buffers,
        help=f"ZeroAdam's CommPolicy.bucket_buffers (default {CommPolicy.bucket_buffers}; 0: no bound)",
    )
    p.add_argument("--backend", default="nccl", help="nccl (default) or gloo: which collectives each layout uses")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: which groups stay on one node (8)")
    t = p.add_argument_group("step time (--time): see [Note: the time model] in zerofast/tools/timemodel.py")
    t.add_argument("--time", action="store_true", help="predict communication and step time, flat against hybrid")
    t.add_argument("--tokens-per-rank", type=int, default=16384, help="tokens per GPU per step (default 16384)")
    t.add_argument(
        "--global-tokens",
        type=parse_count,
        default=None,
        help="tokens per step over all GPUs instead (a fixed global batch: 4M, 2e6)",
    )
    t.add_argument("--micro-batches", type=int, default=1, help="backwards per step (default 1)")
    t.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU (default 400)")
    t.add_argument(
        "--intra-bw",
        type=typed(parse_rate, "bandwidth"),
        default=parse_rate("300GB/s"),
        help="intra-node bus bandwidth per GPU (default 300GB/s, NVLink)",
    )
    t.add_argument(
        "--intra-latency",
        type=typed(parse_seconds, "latency"),
        default=parse_seconds("5us"),
        help="intra-node latency per hop (default 5us)",
    )
    t.add_argument(
        "--inter-bw",
        type=typed(parse_rate, "bandwidth"),
        default=parse_rate("400Gb/s"),
        help="inter-node bandwidth per GPU (default 400Gb/s = 50 GB/s)",
    )
    t.add_argument(
        "--inter-latency",
        type=typed(parse_seconds, "latency"),
        default=parse_seconds("10us"),
        help="inter-node latency per hop (default 10us)",
    )
    t.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="every collective exposed (communication and compute share the same cores)",
    )
    args = p.parse_args(argv)
    if args.params < 0:
        p.error(f"--params must be 0 or more; got {args.params}")
    if args.world < 1:
        p.error(f"--world must be at least 1; got {args.world}")
    if args.stage is not None and args.stage not in (0, 1, 2, 3):
        p.error(f"--stage must be 0 (DDP), 1, 2 or 3; got {args.stage}")
    if args.shard_size is not None:
        try:
            check_shard_size(args.shard_size, args.world, "--shard-size")
        except ValueError as e:
            p.error(str(e).replace("--shard-size: shard_size=", "--shard-size ").replace("world=", "--world "))
    if args.precision not in _PRECISIONS:
        p.error(f"--precision must be mixed, bf16, fp16 or fp32; got {args.precision!r}")
    if args.backend not in ("nccl", "gloo"):
        p.error(f"--backend must be nccl or gloo; got {args.backend!r}")
    if args.gpus_per_node < 1:
        p.error(f"--gpus-per-node must be at least 1; got {args.gpus_per_node}")
    if args.micro_batches < 1:
        p.error(f"--micro-batches must be at least 1; got {args.micro_batches}")
    if not args.tflops > 0:
        p.error(f"--tflops must be > 0; got {args.tflops}")
    if args.global_tokens is not None and args.global_tokens < args.world:
        p.error(f"--global-tokens must be at least --world ({args.world}); got {args.global_tokens}")
    if args.tokens_per_rank < 1:
        p.error(f"--tokens-per-rank must be at least 1; got {args.tokens_per_rank}")
    try:
        comm = CommPolicy(bucket_mb=args.bucket_mb, bucket_buffers=args.bucket_buffers)
    except ValueError as e:
        p.error(
            str(e)
            .replace("CommPolicy: bucket_mb", "--bucket-mb")
            .replace("CommPolicy: bucket_buffers", "--bucket-buffers")
        )
    if args.time:
        if args.stage == 0:
            p.error("--time models ZeRO stages 1-3; got --stage 0")
        if args.params < 1:
            p.error("--time needs --params of 1 or more")
        print(_time_table(args, p))
        return 0
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    rows = []
    for s in stages:
        # Stage 3 takes no bucket size (its buckets are its units): in the table of every stage the
        # option applies to the others; asked for stage 3 alone, it is ZeroAdam's error.
        stage_comm = CommPolicy(bucket_buffers=comm.bucket_buffers) if s == 3 and args.stage is None else comm
        try:
            rows.append(
                estimate_memory(
                    args.params, args.world, s, _PRECISIONS[args.precision], stage_comm, shard_size=args.shard_size
                )
            )
        except ValueError as e:
            p.error(str(e))
    k = f", sharded over K = {args.shard_size} (x{args.world // args.shard_size} replicas)" if args.shard_size else ""
    print(f"Φ = {args.params:,} parameters, N = {args.world} ranks{k}, {args.precision} Adam; bytes per rank")
    print(format_table(rows))
    if args.params > 0 and any(s > 0 for s in stages):
        print(f"\nCommunication per step ({args.backend}, {args.gpus_per_node} GPUs per node; a count: no padding)")
        print(
            _link_table(
                args.params,
                args.world,
                stages,
                args.shard_size,
                _PRECISIONS[args.precision],
                args.backend,
                args.gpus_per_node,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
