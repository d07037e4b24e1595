"""estimate_memory: the ZeRO paper's memory table as an estimator, per-rank bytes by its formulas.

Per parameter, mixed-precision Adam holds 2 bytes of parameter, 2 of gradient and 12 of optimizer
state (fp32 master, m, v): the paper's 16Φ. fp32 has no separate master: 4 + 4 + 8. With 8-bit state
(MixedPrecisionPolicy(state_bits=8)) m and v are a byte each plus an fp32 scale per block of each:
2 + 8 / state_block instead of 8 (each parameter's block alignment, under state_block elements, is
not counted). ZeroMuon holds exactly ZeroAdam's state buffers (a matrix's momentum in exp_avg's slot,
its exp_avg_sq range unused: [Note: Muon's momentum in exp_avg's slot]), so the counts are its too.
Each stage keeps a part of each on a rank:

| stage       | parameters | gradients | optimizer state |
|-------------|------------|-----------|-----------------|
| 0 (DDP)     | all        | all       | all             |
| 1           | all        | all       | 1/N             |
| 2           | all        | 1/N       | 1/N             |
| 3           | 1/N        | 1/N       | 1/N             |

"zerofast_extra" is what the table has no row for: in stages 2 and 3 the gradient bucket buffers
alive at once (bucket_buffers: [Note: buffers in flight] in csrc/bucket_pool.cpp), and padding (each
bucket to a multiple of world x 4 elements). Stage 1's gradients are its buckets, reduced in place
([Note: grads as bucket views]): padding only, unless it reduces in another dtype (then it copies, as
stage 2 does, and keeps a reduced shard).

Offloaded (offload=: [Note: offload schedule] in zerofast/offload/__init__.py), the fp32 master, the
moments and 8-bit scales leave the device (`optimizer` and their padding in `zerofast_extra` are 0)
for pinned host memory ("host") or two generations of files streamed through a window of three
chunks ("disk"); the master is then a separate fp32 tensor. offloaded_state() counts them as
ShardState lays them out and the stores hold them (zerofast/offload/stores.py): exactly for a module
(its layout's shard, padding included), ceil(Φ/K) elements for a count. "host" on a CPU model moves
nothing: the state is in host memory already.

The options are checked and resolved by zerofast/config.py, ZeroAdam's own code, so the estimator
accepts exactly what ZeroAdam accepts; no compiled code is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import (
    DEFAULT_BUCKET_MB,
    OffloadPolicy,
    check_stage,
    comm_policy,
    offload_policy,
    precision_policy,
    resolve_plan,
    unit_policy,
)
from ..layout import ALIGN
from ..offload import file_bytes, is_offloaded, shard_specs, state_specs, window_layout
from ..optim.placement import plan_layouts
from ..quant import num_blocks
from ..stage3.units import inference_plan
from ..topology import check_shard_size


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int  # 0 is DDP
    world: int
    params: int  # bytes per rank
    grads: int
    optimizer: int
    zerofast_extra: int  # bucket buffers, padding, stage 1's gradient shard (0 for DDP)
    frozen_models: int = 0  # models sharded for inference only (shard_frozen): shards + units in flight
    # As report().offload.state: "device" (no offload), "host" or "disk". Offloaded, `optimizer` is 0
    # and the state is in the fields below, as report().offload gives them after a step.
    placement: str = "device"
    host_bytes: int = 0  # "host": the state in pinned host memory; "disk": the window
    disk_bytes: int = 0  # "disk": the state's files, two generations
    window_bytes: int = 0  # "disk": the window's three chunks of every kind of state
    # As report().offload.params: stage 3's parameter, gradient and frozen shards "device", "host" (a
    # CPU model's: nothing moves) or "disk" (then not in params, grads and zerofast_extra, but in
    # params_disk_bytes: report().offload.params_disk_bytes).
    params_placement: str = "device"
    params_disk_bytes: int = 0

    @property
    def disk_total(self) -> int:
        """Bytes on disk per rank: the state's files and stage 3's shards'."""
        return self.disk_bytes + self.params_disk_bytes

    @property
    def total(self) -> int:
        """Bytes on the device (the parameters' device: a GPU, or host memory for a CPU model)."""
        return self.params + self.grads + self.optimizer + self.zerofast_extra + self.frozen_models

    @property
    def device_bytes(self) -> int:
        """`total`, named beside host_bytes and disk_bytes."""
        return self.total


# Where the estimator's keywords of before the policies live now.
_MOVED = {
    "precision": "mixed_precision= (None, 'bf16', 'fp16' or a MixedPrecisionPolicy, as ZeroAdam takes it)",
    "shard_size": "comm=CommPolicy(shard_size=...), as ZeroAdam takes it",
    "bucket_mb": "comm=CommPolicy(bucket_mb=...)",
    "bucket_buffers": "comm=CommPolicy(bucket_buffers=...)",
}


def _local_numel(p: torch.Tensor) -> int:
    """A parameter's elements on this rank: a DTensor's local tensor's, another's own."""
    return getattr(p, "_local_tensor", p).numel()


def estimate_memory(
    model_or_param_count,
    world: int,
    stage: int,
    *,
    mixed_precision=None,
    comm=None,
    units=None,
    offload=None,
    tp: int = 1,
    rank: int | None = None,
    frozen_models=(),
    device="cuda",
    pp: int = 1,
    **moved,
) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state for DDP (stage 0) or a ZeRO stage, by
    the paper's formulas, plus the buffers ZeroAdam adds. Keywords as estimate_traffic's, in the same
    order (mixed_precision, comm, units, offload, tp, rank); mixed_precision, comm, units and offload as
    ZeroAdam takes them (stage 0 checks them alone). A count is of trainable parameters; a module's
    frozen parameters count as parameter bytes only (in the parameters' dtype; sharded in stage 3,
    whole in stages 0-2). Stage 3's buckets are its units, whose size a count does not give: each is
    taken as stage 2's default bucket. comm=CommPolicy(shard_size=K) (hybrid sharding): the state is
    sharded over K ranks and replicated W/K times, so each sharded part is divided by K instead of W
    (None: K = world).
    frozen_models: models sharded for inference only with zerofast.shard_frozen over the world's ranks
    in the policy's precision (a reference model, reward models), each a module or a parameter count,
    counted in `frozen_models` by frozen_model_bytes.
    offload: None, "host", "disk:PATH" (the path is never touched here) or an OffloadPolicy. Offloaded
    (stages 1-3; DDP has no offload), `optimizer` is 0 and `placement`, host_bytes, disk_bytes and
    window_bytes say where the state is, as report().offload does after a step. device: the type of
    device the model trains on ("cuda" by default, "cpu", a torch.device, ...); "host" moves nothing
    off a CPU model. OffloadPolicy(params="disk") (stage 3, a CPU model, as ZeroAdam takes it): the
    parameter, gradient and frozen shards (padding included) leave `params`, `grads` and
    `zerofast_extra` for params_disk_bytes. rank: whose shard a module's estimate counts (shards differ by their padding;
    None: the largest); a count's shards are all ceil(Φ/K).
    tp: the tensor-parallel degree ([Note: tensor parallelism] in zerofast/tensor_parallel.py): each
    rank holds 1/tp of every split parameter, which ZeRO shards over the world/tp data-parallel ranks
    (shard_size counts those). A module parallelized over "tp" is counted exactly by its DTensors'
    local tensors; a count is divided by tp (weights replicated across "tp", such as norms under
    SequenceParallel, counted as split: a count cannot tell them apart).
    pp: the pipeline degree ([Note: pipeline accumulation] in zerofast/pipelining.py): the module (or
    count) is one stage's part, `world` every rank ("pp" outermost), ZeRO over the world/pp ranks of
    the stage. At rest, as report() after a step; during a step a stage also holds its part's full
    local gradients between micro-batches (stages 2 and 3: `grads` of stage 1's)."""
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
    if not (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 and world % pp == 0):
        raise ValueError(f"estimate_memory: pp must be an integer >= 1 that divides world ({world}); got {pp!r}")
    if rank is not None and not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world):
        raise ValueError(f"estimate_memory: rank must be None or an integer in [0, {world}); got {rank!r}")
    world, rank = world // pp, None if rank is None else rank % (world // pp)
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and world % tp == 0):
        raise ValueError(f"estimate_memory: tp must be an integer >= 1 that divides world ({world}); got {tp!r}")
    if tp > 1:
        if isinstance(model_or_param_count, nn.Module):
            numel = sum(_local_numel(p) for p in model_or_param_count.parameters() if p.requires_grad)
            frozen = sum(_local_numel(p) for p in model_or_param_count.parameters() if not p.requires_grad)
            model_or_param_count = numel  # the layouts below are the local tensors'
        else:
            numel = -(-numel // tp)
        world //= tp
        if rank is not None:
            rank //= tp
    check_stage(stage, "estimate_memory", stages=(0, 1, 2, 3))
    shards = check_shard_size(None, world, "estimate_memory", comm)
    device_type = _device_type(device)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world):
        raise ValueError(f"estimate_memory: rank must be None or an integer in [0, {world}); got {rank!r}")
    if stage == 0:  # DDP: the options are checked all the same, so a typo is not silently ignored
        precision, comm_p = precision_policy(mixed_precision), comm_policy(comm)
        unit_policy(units)
        if offload_policy(offload).active:
            raise ValueError(
                f"estimate_memory: offload applies to ZeroAdam's stages 1-3; stage 0 is DDP, whose optimizer "
                f"state stays with the parameters; got offload={offload!r} with stage=0"
            )
        param_dtype, reduce_dtype = precision.param_dtype, precision.reduce_dtype or precision.param_dtype
        bucket_bytes, buffers, views = 0, comm_p.bucket_buffers, False
        state_bits, state_block = precision.state_bits, precision.state_block
    else:
        plan = resolve_plan(stage, mixed_precision=mixed_precision, comm=comm, units=units, offload=offload)
        param_dtype, reduce_dtype = plan.param_dtype, plan.reduce_dtype
        bucket_bytes = plan.bucket_bytes or int(DEFAULT_BUCKET_MB[2] * 2**20)  # stage 3: a unit's stand-in
        buffers, views = plan.bucket_buffers, plan.grads_as_bucket_views
        state_bits, state_block = plan.state_bits, plan.state_block
    p_bytes, r_bytes = param_dtype.itemsize, reduce_dtype.itemsize
    g_bytes = p_bytes if stage < 2 else r_bytes  # full gradients in the parameters' dtype
    # m and v (fp32, or one byte each: [Note: quantized state]) and a separate fp32 master (in fp32
    # too with stage 3's shards in files: the values a failed step goes back to)
    shards_in_files = stage == 3 and plan.offload.params == "disk"
    o_bytes = (8 if state_bits == 32 else 2) + (4 if param_dtype != torch.float32 or shards_in_files else 0)

    def state_bytes(elements: int) -> int:  # 8-bit state adds one fp32 scale per block per moment
        return o_bytes * elements + (2 * 4 * num_blocks(elements, state_block) if state_bits == 8 else 0)

    shard = -(-numel // shards)  # ceil: this rank's part
    params = p_bytes * (shard if stage == 3 else numel)
    params += p_bytes * (-(-frozen // shards) if stage == 3 else frozen)
    grads = g_bytes * (shard if stage >= 2 else numel)
    optimizer = state_bytes(shard if stage >= 1 else numel)
    extra = 0
    if stage >= 1:
        all_grads = r_bytes * numel
        copied = stage >= 2 or not views  # gradients copied into pooled buffers (bucket_buffers=0: no bound)
        pooled = min(buffers * bucket_bytes, all_grads) if buffers else all_grads
        extra += pooled if copied else 0
        extra += r_bytes * shard if stage == 1 and not views else 0  # stage 1's reduced shard in reduce_dtype
        padding_elements = ALIGN * shards * max(1, -(-r_bytes * numel // bucket_bytes))
        extra += padding_elements * (p_bytes + r_bytes + o_bytes)
    placement, host, disk, window = "device", 0, 0, 0
    params_placement, params_disk = "device", 0
    exact_shard, frozen_shard = shard, -(-frozen // shards)  # a count's: ceil(Φ/K); a module's, exact:
    if stage >= 1 and isinstance(model_or_param_count, nn.Module) and (plan.offload.active or plan.offload.params):
        shard_rank = None if rank is None else rank % shards
        exact_shard, frozen_shard = _module_shard(model_or_param_count, plan, shards, shard_rank)
    if stage >= 1 and plan.offload.active:
        placement = plan.offload.state
        if offloaded(plan.offload, device_type):  # the state, its padding included, leaves the device
            host, disk, window = offloaded_state(exact_shard, plan)
            optimizer = 0
            extra -= padding_elements * o_bytes
    if stage == 3 and plan.offload.params is not None:
        params_placement = plan.offload.params
        if device_type != "cpu":
            raise NotImplementedError(
                f"estimate_memory: OffloadPolicy(params={params_placement!r}) is built for models on the CPU "
                f"(ZeroAdam refuses it on {device_type!r}: its GPU schedule is not built yet); got device={device!r}"
            )
        if params_placement == "disk":
            params_disk = file_bytes(shard_specs(plan, exact_shard, frozen_shard))
            params, grads = 0, 0
            extra -= padding_elements * (p_bytes + r_bytes)
    if isinstance(frozen_models, (nn.Module, int)) or not isinstance(frozen_models, (list, tuple)):
        raise ValueError(
            f"estimate_memory: frozen_models must be a list of modules or parameter counts; got {frozen_models!r}"
        )
    inference = sum(frozen_model_bytes(m, world, param_dtype, units) for m in frozen_models)
    return MemoryEstimate(
        stage,
        world,
        params,
        grads,
        optimizer,
        extra,
        inference,
        placement,
        host,
        disk,
        window,
        params_placement,
        params_disk,
    )


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(
            f"estimate_memory: device must be the device the model trains on ('cuda', 'cpu', a torch.device); "
            f"got {device!r}"
        ) from None


def offloaded(policy: OffloadPolicy, device_type: str) -> bool:
    """Whether ZeroAdam moves the state off a model on `device_type` (offload's is_offloaded, as ShardState)."""
    return is_offloaded(policy.state, policy.delayed_update, device_type)


def _module_shard(model: nn.Module, plan, shards: int, shard_rank: int | None) -> tuple[int, int]:
    """Elements of the shard ZeroAdam builds for `shard_rank` (None: the largest), padding included,
    and of stage 3's frozen parameters' shard (0: none)."""
    layouts = plan_layouts(model, plan, shards, unconverted=True)
    ranks = range(shards) if shard_rank is None else [shard_rank]
    frozen = layouts.frozen_layout
    return (
        max(layouts.layout.shard_numel(r) for r in ranks),
        max(frozen.shard_numel(r) for r in ranks) if frozen is not None else 0,
    )


def offloaded_state(shard: int, plan) -> tuple[int, int, int]:
    """(host_bytes, disk_bytes, window_bytes) of a shard of `shard` elements offloaded as plan.offload
    places it: HostState holds the state; DiskState two generations of files, and its window in host
    memory (by offload's state_specs and window_layout, which ShardState and DiskState use)."""
    specs = state_specs(shard, True, plan.state_bits, plan.state_block)
    state = sum(s.nbytes for s in specs)
    if plan.offload.state == "host":
        return state, 0, 0
    block = plan.state_block if plan.quantized_state else 1
    _, window = window_layout(specs, shard, int(plan.offload.window_mb * 2**20), block)
    return window, 2 * file_bytes(specs), window


def frozen_model_bytes(model_or_param_count, world: int, param_dtype: torch.dtype, units=None) -> int:
    """Peak per-rank parameter bytes of a model sharded for inference only (zerofast.shard_frozen) over
    `world` ranks in param_dtype: this rank's shard (Φ/N plus alignment padding), the units a forward
    holds at once (the root's and two others: [Note: models sharded for inference only] in
    zerofast/stage3/inference.py), and any parameter left whole (another dtype). A module is planned
    exactly as shard_frozen plans it; a count has no units, so two of stage 2's default buckets stand
    in for them."""
    size = param_dtype.itemsize
    if isinstance(model_or_param_count, nn.Module):
        model = model_or_param_count
        named, plan, layout, bucket_of = inference_plan(model, None, unit_policy(units), world, "estimate_memory", size)
        sharded = {id(p) for _, p in named}
        whole = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in sharded)
        shard = max(layout.shard_numel(r) for r in range(world))
        unit_numel = [layout.buckets[b].numel if b is not None else 0 for b in bucket_of]
        root = unit_numel[0] if plan.has_root_unit else 0
        others = sorted(unit_numel[1:] if plan.has_root_unit else unit_numel, reverse=True)
        return size * (shard + root + sum(others[:2])) + whole
    count = model_or_param_count
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
        raise ValueError(f"estimate_memory: frozen_models must hold modules or counts >= 0; got {count!r}")
    stand_in = int(DEFAULT_BUCKET_MB[2] * 2**20) // size
    return size * (-(-count // world) + min(count, 2 * stand_in))
