"""ZeroAdam's configuration: the policies a user passes, and the frozen plan they resolve into.

The policies group options that travel together, as FSDP2's do; each is a frozen dataclass that
checks its own fields:
  MixedPrecisionPolicy  parameter dtype, reduce dtype, and fp16's LossScalePolicy
  CommPolicy            who owns what (partition), how many ranks share one copy (shard_size), buckets,
                        buffers in flight, overlap, accumulation, the collectives' debug check
  UnitPolicy            stage 3: which modules form a unit, and merging small ones
  OffloadPolicy         where the optimizer state lives: the device, pinned host memory or files on disk
`resolve_plan` checks the combinations and fills every default once, into a `Plan` of explicit facts
(gradients as bucket views, parameters sharded, ...) that every part of the optimizer reads instead of
re-deriving the stage. Every default and check of ZeroAdam's options lives here; no compiled code is
imported (the estimator, `python -m zerofast.estimate`, runs where the extension was never built).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from os import PathLike, fspath
from typing import Any

import torch

from .collectives import debug_from_env
from .partition import PARTITIONS
from .quant import DEFAULT_STATE_BLOCK, MIN_STATE_BLOCK, STATE_BITS

STAGES = (1, 2, 3)

# Bucket sizes of stages 1 and 2 (stage 3's buckets are its units). Stage 1's buckets are its gradients,
# so their size only cuts the reduce into collectives: DDP's 25 MB. Stage 2's are transient,
# DEFAULT_BUCKET_BUFFERS of them beside the gradient shard: 8 MB, measured (docs/benchmarks.md,
# "Buffers in flight": the step time of 25 MB buckets at a third of the memory).
DEFAULT_BUCKET_MB = {1: 25.0, 2: 8.0}

# Gradient bucket buffers alive at once (stages 2 and 3, and stage 1 when gradients are copied): one
# filled while the previous one is reduced. Measured: docs/benchmarks.md, "Buffers in flight"
# ([Note: buffers in flight] in csrc/bucket_pool.cpp).
DEFAULT_BUCKET_BUFFERS = 2

# Stage 3's default units smaller than this are merged with their neighbours ([Note: merging small
# units] in zerofast/stage3/units.py). Measured: docs/benchmarks.md, "Stage 3 unit size".
DEFAULT_MIN_UNIT_MB = 2.0

# The first bucket (in backward order) holds at most this, so its reduce starts early in backward;
# DDP uses the same 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
FIRST_BUCKET_BYTES = 1 << 20

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False; got {value!r}")


# --- the policies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16's dynamic loss scaling, named and behaving as torch.amp.GradScaler's: the loss is
    multiplied by the scale (opt.backward(loss)); a step whose gradients hold an inf or nan is
    skipped and the scale multiplied by backoff_factor; after growth_interval clean steps in a row it
    is multiplied by growth_factor ([Note: loss scaling] in zerofast/optim/precision.py)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        for name, ok, bound in (
            ("init_scale", lambda v: v > 0, "> 0"),
            ("growth_factor", lambda v: v > 1, "> 1"),
            ("backoff_factor", lambda v: 0 < v < 1, "in (0, 1)"),
        ):
            value = getattr(self, name)
            if not (_is_number(value) and ok(value)):
                raise ValueError(f"LossScalePolicy: {name} must be a number {bound}; got {value!r}")
        gi = self.growth_interval
        if not (isinstance(gi, int) and not isinstance(gi, bool) and gi >= 1):
            raise ValueError(f"LossScalePolicy: growth_interval must be an integer >= 1; got {gi!r}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes of training ([Note: mixed precision] in zerofast/optim/precision.py).

    param_dtype: the model's parameters (and floating buffers, and floating inputs of its forward)
      in this dtype; the optimizer keeps the fp32 master shard and Adam state either way.
    reduce_dtype: the dtype gradients are reduced in (and, in stages 2 and 3, kept sharded in);
      None: param_dtype. torch.float16 needs param_dtype float16 (whose loss scaling catches overflow).
    loss_scale: fp16's dynamic loss scaling (None: LossScalePolicy()'s defaults); float16 only.
    state_bits: Adam's exp_avg and exp_avg_sq in 32 bits (fp32) or 8 (one byte per element and one
      fp32 scale per block, [Note: quantized state] in zerofast/quant.py); the fp32 master is kept.
      ZeroMuon: its matrices' momentum buffers too ([Note: Muon's 8-bit momentum]).
    state_block: elements per scale of 8-bit state, a power of two >= 32 (default 256).
    `mixed_precision="bf16"` is MixedPrecisionPolicy(torch.bfloat16), "fp16" MixedPrecisionPolicy(torch.float16),
    and "no" (Accelerate's spelling: `mixed_precision=accelerator.mixed_precision`) the same as None.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    loss_scale: LossScalePolicy | None = None
    state_bits: int = 32
    state_block: int = DEFAULT_STATE_BLOCK

    def __post_init__(self):
        self._check_state_format()
        if self.param_dtype not in _PARAM_DTYPES:
            raise ValueError(
                f"MixedPrecisionPolicy: param_dtype must be torch.float32, torch.bfloat16 or "
                f"torch.float16; got {self.param_dtype!r}"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in _PARAM_DTYPES:
            raise ValueError(
                f"MixedPrecisionPolicy: reduce_dtype must be None, torch.float32, torch.bfloat16 or "
                f"torch.float16; got {self.reduce_dtype!r}"
            )
        if self.param_dtype == torch.float32 and self.reduce_dtype not in (None, torch.float32):
            raise ValueError(
                f"MixedPrecisionPolicy: reduce_dtype={self.reduce_dtype} needs a low-precision "
                f"param_dtype; fp32 parameters reduce in float32"
            )
        if self.reduce_dtype == torch.float16 and self.param_dtype != torch.float16:
            raise ValueError(
                f"MixedPrecisionPolicy: reduce_dtype=torch.float16 needs param_dtype=torch.float16 "
                f"(whose loss scaling catches overflow); got param_dtype={self.param_dtype}"
            )
        if self.loss_scale is not None:
            if not isinstance(self.loss_scale, LossScalePolicy):
                raise TypeError(
                    f"MixedPrecisionPolicy: loss_scale must be a LossScalePolicy or None; "
                    f"got {type(self.loss_scale).__name__}"
                )
            if self.param_dtype != torch.float16:
                raise ValueError(
                    f"MixedPrecisionPolicy: loss_scale applies to float16 parameters only; got "
                    f"param_dtype={self.param_dtype} (bf16 and fp32 need no loss scaling)"
                )

    def _check_state_format(self) -> None:
        bits, block = self.state_bits, self.state_block
        if isinstance(bits, bool) or bits not in STATE_BITS:
            raise ValueError(f"MixedPrecisionPolicy: state_bits must be 32 or 8; got {bits!r}")
        if not (
            isinstance(block, int)
            and not isinstance(block, bool)
            and block >= MIN_STATE_BLOCK
            and block & (block - 1) == 0
        ):
            raise ValueError(
                f"MixedPrecisionPolicy: state_block must be a power of two >= {MIN_STATE_BLOCK}; got {block!r}"
            )


@dataclass(frozen=True)
class CommPolicy:
    """How the ranks split the state and move it.

    partition: "flat" (intra-tensor: each bucket one buffer cut into N equal padded slices;
      reduce_scatter / all_gather), "round_robin" (parameter i to rank i % N; reduce to the owner,
      broadcast from it) or "greedy" (whole tensors, largest first, to the least-loaded rank).
    bucket_mb: stages 1 and 2's bucket size in MiB of gradients (None: 25 for stage 1, whose buckets
      are its gradients, 8 for stage 2; stage 3 has one bucket per unit, so it takes none).
    bucket_buffers: at most this many gradient bucket buffers alive at once, filled, reduced or kept
      (0: no bound); backward waits for the oldest reduce when all are in use ([Note: buffers in
      flight] in csrc/bucket_pool.cpp).
    overlap: reduce each bucket during backward as soon as it is complete (else at step()).
    overlap_param_gather: stages 1 and 2: step() returns before the parameter gather finishes and
      each module's forward waits for its own bucket ([Note: overlapped parameter gather]).
    accumulate_locally: stages 2 and 3 under no_sync(): keep full local gradients and reduce once
      (as stage 1 always does) instead of reducing every micro-batch into the shard.
    check_collectives: before every collective, check that every rank is about to issue the same
      one (None: on when ZEROFAST_DEBUG=1); one small blocking all_gather per collective.
    shard_size: hybrid sharding: the ranks form groups of shard_size consecutive ranks (a machine
      under torchrun), each group shards the state as `partition` says and the groups replicate it;
      the owned gradient shard is all_reduced across the replicas once per step (None: every rank
      shares one copy, flat ZeRO; 1: plain replication; it must divide the number of ranks). A 2-D
      DeviceMesh as process_group says the same with its "shard" dim ([Note: hybrid sharding] in
      zerofast/topology.py).
    """

    partition: str = "flat"
    bucket_mb: float | None = None
    bucket_buffers: int = DEFAULT_BUCKET_BUFFERS
    overlap: bool = True
    overlap_param_gather: bool = False
    accumulate_locally: bool = False
    check_collectives: bool | None = None
    shard_size: int | None = None

    def __post_init__(self):
        if self.partition not in PARTITIONS:
            raise ValueError(f"CommPolicy: partition must be one of {', '.join(PARTITIONS)}; got {self.partition!r}")
        k = self.shard_size
        if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(f"CommPolicy: shard_size must be None or an integer >= 1; got {k!r}")
        if self.bucket_mb is not None and not (_is_number(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"CommPolicy: bucket_mb must be None or a number > 0; got {self.bucket_mb!r}")
        bb = self.bucket_buffers
        if not (isinstance(bb, int) and not isinstance(bb, bool) and bb >= 0):
            raise ValueError(f"CommPolicy: bucket_buffers must be an integer >= 0 (0: no bound); got {bb!r}")
        for name in ("overlap", "overlap_param_gather", "accumulate_locally"):
            _check_bool("CommPolicy", name, getattr(self, name))
        if self.check_collectives is not None:
            _check_bool("CommPolicy", "check_collectives", self.check_collectives)


UnitSpec = None | list | tuple | type | set | frozenset | Callable[[Any], bool]


@dataclass(frozen=True)
class UnitPolicy:
    """Stage 3: which modules' parameters are gathered and released together ([Note: choosing units]
    in zerofast/stage3/units.py; opt.report().units shows the choice).

    modules: None (the model's blocks: its `_no_split_modules` classes, else the children of every
      nn.ModuleList, else the root's children), a list of submodules, a module class or set of
      classes, or a callable module -> bool. The parameters no unit holds form one more unit, the root's.
    min_unit_mb: the default units smaller than this (in the parameters' dtype) are merged with their
      neighbours, so a deep narrow model gathers in few collectives (None: 2 MiB; 0: never merge).
      Units given as `modules` are kept as given, so the two are not combined.
    `units=X` on ZeroAdam is UnitPolicy(modules=X).
    """

    modules: UnitSpec = None
    min_unit_mb: float | None = None

    def __post_init__(self):
        m = self.min_unit_mb
        if m is not None and not (_is_number(m) and m >= 0):
            raise ValueError(f"UnitPolicy: min_unit_mb must be None or a number >= 0; got {m!r}")
        if m is not None and self.modules is not None:
            raise ValueError(
                f"UnitPolicy: min_unit_mb={m!r} merges the default units, and units given as modules "
                f"are kept as given; pass one or the other"
            )


OFFLOAD_STATES = (None, "host", "disk")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where this rank's optimizer state (the fp32 master, Adam's moments and 8-bit state's scales)
    lives: [Note: offload schedule] in zerofast/offload/__init__.py.

    state: None (default: with the parameters, no offload), "host" (pinned host memory, stepped by
      the fused CPU kernel; a CPU model's state is there already) or "disk" (files under `path`, streamed
      through a bounded window, stepped by the CPU kernel; any device, the CPU included).
    path: "disk": the folder that holds the files (created if missing; one subfolder per rank and
      optimizer, removed when the optimizer is; twice the state's bytes, for the all-or-none step).
    window_mb: "disk": MiB of state in memory at once per rank (the read-ahead, the step and the
      write-behind; at least 3 chunks of one element of every state kind each).
    io_threads: "disk": threads reading and writing the files.
    pin_memory: "host" on a GPU: the state in page-locked memory (so its copies run asynchronously).
    direct_io: "disk": the moments and the master read and written with O_DIRECT where the filesystem
      allows (True), or through the page cache (False, the default: faster in every case measured,
      cold reads of a large state included: docs/benchmarks.md#offload).
    delayed_update: ZeRO-Offload's one-step-delayed update (DPU), a different algorithm, never the
      default: step t's update runs on a thread during step t+1's forward and backward, so each
      gradient is computed with parameters one update behind ([Note: the delayed update] in
      zerofast/offload/__init__.py). The next step(), gathered_params(), a checkpoint or opt.flush()
      applies the update in flight. Needs "host" or "disk" (on a CPU model "host" then keeps the
      state apart from the parameters, for the thread to update).
    params: stage 3's parameter shard and gradient shard (ZeRO-Infinity), independent of `state`:
      None (default: on the device), "host" (host memory: a CPU model's are there already, so nothing
      moves) or "disk" (files under `path`, mapped: a unit's shard is read as its gather starts, a
      gradient's as the step reads it, and each leaves resident memory then: [Note: parameters on
      disk] in zerofast/offload/__init__.py). Stage 3 only: stages 1 and 2 hold whole parameters.
    keep_files: "disk": leave the files when the optimizer is closed or the process exits (flushed to
      the disk, with kept.json naming each file's tensor, dtype and element count: [Note: files kept
      on purpose] in zerofast/offload/__init__.py), for reading the run's last state after it ended;
      no later optimizer removes them. False (default): removed. A run continues from a checkpoint
      (zerofast.checkpoint), never from these.
    `offload="host"` / `offload="disk:PATH"` on ZeroAdam are shortcuts for the state's policy;
    `offload="infinity:PATH"` for OffloadPolicy("disk", PATH, params="disk"): the state and stage 3's
    parameters and gradients on disk.
    """

    state: str | None = None
    path: str | None = None
    window_mb: float = 64.0
    io_threads: int = 2
    pin_memory: bool = True
    direct_io: bool = False
    delayed_update: bool = False
    params: str | None = None
    keep_files: bool = False

    def __post_init__(self):
        if self.state not in OFFLOAD_STATES:
            raise ValueError(f"OffloadPolicy: state must be None, 'host' or 'disk'; got {self.state!r}")
        if self.params not in OFFLOAD_STATES:
            raise ValueError(f"OffloadPolicy: params must be None, 'host' or 'disk'; got {self.params!r}")
        if self.path is not None:
            if not isinstance(self.path, (str, PathLike)) or not fspath(self.path):
                raise ValueError(f"OffloadPolicy: path must be a folder's path (str or os.PathLike); got {self.path!r}")
            object.__setattr__(self, "path", fspath(self.path))
        on_disk = [f"{k}='disk'" for k in ("state", "params") if getattr(self, k) == "disk"]
        if on_disk and self.path is None:
            raise ValueError(
                f"OffloadPolicy: {' and '.join(on_disk)} needs path=, the folder for the files (a local disk, "
                "not a RAM-backed /tmp); got path=None"
            )
        if not on_disk and self.path is not None:
            raise ValueError(
                f"OffloadPolicy: path applies to state='disk' or params='disk'; got path={self.path!r} with "
                f"state={self.state!r}, params={self.params!r}"
            )
        if not (_is_number(self.window_mb) and self.window_mb > 0):
            raise ValueError(f"OffloadPolicy: window_mb must be a number > 0; got {self.window_mb!r}")
        t = self.io_threads
        if not (isinstance(t, int) and not isinstance(t, bool) and t >= 1):
            raise ValueError(f"OffloadPolicy: io_threads must be an integer >= 1; got {t!r}")
        _check_bool("OffloadPolicy", "pin_memory", self.pin_memory)
        _check_bool("OffloadPolicy", "direct_io", self.direct_io)
        _check_bool("OffloadPolicy", "delayed_update", self.delayed_update)
        _check_bool("OffloadPolicy", "keep_files", self.keep_files)
        if self.keep_files and not on_disk:
            raise ValueError(
                f"OffloadPolicy: keep_files applies to state='disk' or params='disk' (the files); got keep_files=True "
                f"with state={self.state!r}, params={self.params!r}"
            )
        if self.delayed_update and self.state is None:
            raise ValueError("OffloadPolicy: delayed_update=True needs state='host' or 'disk'; got state=None")

    @property
    def active(self) -> bool:
        """The optimizer state leaves the parameters."""
        return self.state is not None

    @property
    def params_on_disk(self) -> bool:
        return self.params == "disk"


def offload_policy(offload, who: str = "ZeroAdam") -> OffloadPolicy:
    """offload= as ZeroAdam takes it: None, an OffloadPolicy, "host", "disk:PATH"."""
    if offload is None:
        return OffloadPolicy()
    if isinstance(offload, OffloadPolicy):
        return offload
    if offload == "host":
        return OffloadPolicy("host")
    for prefix, params in (("disk:", None), ("infinity:", "disk")):
        if isinstance(offload, str) and offload.startswith(prefix) and len(offload) > len(prefix):
            return OffloadPolicy("disk", offload[len(prefix) :], params=params)
    raise ValueError(
        f"{who}: offload must be None, 'host', 'disk:PATH', 'infinity:PATH' or an OffloadPolicy; got {offload!r}"
    )


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Every option of a ZeroAdam (or ZeroMuon), resolved once by resolve_plan, and the facts each part acts on."""

    stage: int
    partition: str
    shard_size: int | None  # hybrid sharding: ranks per shard group (None: every rank, flat ZeRO)
    adamw: bool  # decoupled weight decay (AdamW); False: Adam's L2 term
    max_grad_norm: float | None  # clip the global gradient norm at every step
    param_dtype: torch.dtype  # the model's parameters
    reduce_dtype: torch.dtype  # gradients in buckets, reduces and (stages 2, 3) the shard
    loss_scale: LossScalePolicy | None  # fp16 only: dynamic loss scaling
    bucket_bytes: int  # stages 1 and 2: gradient bytes per bucket (0 in stage 3)
    replicate_bytes: int  # hybrid sharding: the replicas' all_reduces hold at least this
    first_bucket_bytes: int  # the first bucket in backward order holds at most this
    bucket_buffers: int  # pooled gradient buffers alive at once (0: no bound)
    overlap: bool  # reduce each bucket in backward as soon as it is complete
    overlap_param_gather: bool  # stages 1 and 2: the gather overlaps the next forward
    check_collectives: bool  # every collective first checked across ranks (ZEROFAST_DEBUG=1)
    unit_modules: UnitSpec  # stage 3: the unit modules as given (None: the default rule)
    min_unit_bytes: int  # stage 3, default units: merge units smaller than this
    # The facts, one per behaviour that differs between stages and precisions:
    params_sharded: bool  # stage 3: parameters live in a shard, gathered unit by unit
    grads_sharded: bool  # stages 2, 3: after its reduce a rank keeps only its gradient shard
    grads_as_bucket_views: bool  # stage 1 reducing in its own dtype: .grad are views of persistent
    # buckets reduced in place ([Note: grads as bucket views])
    gather_after_step: bool  # stages 1, 2: step() gathers the updated parameters (stage 3:
    # the next forward does)
    accumulates_locally: bool  # under no_sync(), .grad accumulates and one reduce follows
    separate_master: bool  # low-precision parameters: an fp32 master shard of its own
    state_bits: int = 32  # Adam's moments: fp32, or 8-bit codes with per-block scales
    state_block: int = DEFAULT_STATE_BLOCK  # 8-bit state: elements per scale
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)  # where the state lives
    front: str = "ZeroAdam"  # the optimizer built (ZeroAdam, ZeroMuon): what its errors name

    @property
    def quantized_state(self) -> bool:
        """8-bit moments ([Note: quantized state] in zerofast/quant.py)."""
        return self.state_bits == 8

    @property
    def layout_block(self) -> int:
        """Every parameter slot, rank slice and owner segment starts at a multiple of this (1: no
        constraint beyond [Note: padding]); 8-bit state's block, so blocks never straddle them."""
        return self.state_block if self.quantized_state else 1

    @property
    def mixed_precision(self) -> str | None:
        """ "bf16", "fp16" or None: the shortcut name of param_dtype."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.param_dtype)

    @property
    def scales_loss(self) -> bool:
        return self.loss_scale is not None


def precision_policy(mixed_precision, who: str = "ZeroAdam") -> MixedPrecisionPolicy:
    """mixed_precision= as ZeroAdam takes it: None (or "no"), "bf16", "fp16" or a MixedPrecisionPolicy."""
    if mixed_precision is None or (isinstance(mixed_precision, str) and mixed_precision == "no"):
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if isinstance(mixed_precision, str) and mixed_precision in LOW_DTYPES:
        return MixedPrecisionPolicy(LOW_DTYPES[mixed_precision])
    raise ValueError(
        f"{who}: mixed_precision must be None, 'no', 'bf16', 'fp16' or a MixedPrecisionPolicy; got {mixed_precision!r}"
    )


def unit_policy(units) -> UnitPolicy:
    """units= as ZeroAdam takes it: a UnitPolicy, or what UnitPolicy(modules=...) takes."""
    return units if isinstance(units, UnitPolicy) else UnitPolicy(modules=units)


def comm_policy(comm, who: str = "ZeroAdam") -> CommPolicy:
    if comm is None:
        return CommPolicy()
    if not isinstance(comm, CommPolicy):
        raise TypeError(f"{who}: comm must be a CommPolicy or None; got {type(comm).__name__}")
    return comm


def check_stage(stage, who: str = "ZeroAdam", stages=STAGES) -> None:
    if isinstance(stage, bool) or stage not in stages:
        words = " or ".join(", ".join(str(s) for s in stages).rsplit(", ", 1))
        raise ValueError(f"{who}: stage must be {words}; got {stage!r}")


def resolve_plan(
    stage: int,
    *,
    adamw: bool = True,
    max_grad_norm: float | None = None,
    mixed_precision=None,
    comm=None,
    units=None,
    offload=None,
    who: str = "ZeroAdam",
) -> Plan:
    """The one place an optimizer's options are checked together and their defaults filled in
    (`who`: the front being built, ZeroAdam or ZeroMuon, which every error names). mixed_precision,
    comm and units as ZeroAdam takes them (shortcuts included)."""
    check_stage(stage, who)
    _check_bool(who, "adamw", adamw)
    if max_grad_norm is not None and not (_is_number(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"{who}: max_grad_norm must be None or a number > 0; got {max_grad_norm!r}")
    precision, comm_p, unit_p = precision_policy(mixed_precision, who), comm_policy(comm, who), unit_policy(units)
    if stage < 3 and unit_p != UnitPolicy():
        raise ValueError(
            f"{who}: units apply to stage 3 only (stages 1 and 2 gather by bucket); got "
            f"units={unit_p} with stage={stage}"
        )
    if stage == 3 and comm_p.bucket_mb is not None:
        raise ValueError(
            f"{who}: CommPolicy.bucket_mb sets stages 1 and 2's buckets; stage 3 reduces and "
            f"gathers one bucket per unit (see UnitPolicy); got bucket_mb={comm_p.bucket_mb!r} "
            f"with stage=3"
        )
    if stage == 3 and comm_p.overlap_param_gather:
        raise ValueError(
            f"{who}: CommPolicy.overlap_param_gather applies to stages 1 and 2 (stage 3 gathers "
            "each unit in the next forward anyway); got it with stage=3"
        )
    offload_p = offload_policy(offload, who)
    if stage < 3 and offload_p.params is not None:
        raise ValueError(
            f"{who}: OffloadPolicy(params=...) applies to stage 3, whose parameters are sharded; stages 1 and 2 "
            f"hold every parameter whole on every rank; got params={offload_p.params!r} with stage={stage}"
        )
    param_dtype = precision.param_dtype
    reduce_dtype = precision.reduce_dtype or param_dtype
    reduce_size = reduce_dtype.itemsize
    loss_scale = (precision.loss_scale or LossScalePolicy()) if param_dtype == torch.float16 else None
    bucket_mb = comm_p.bucket_mb if comm_p.bucket_mb is not None else DEFAULT_BUCKET_MB.get(stage, 0.0)
    min_unit_mb = DEFAULT_MIN_UNIT_MB if unit_p.min_unit_mb is None else float(unit_p.min_unit_mb)
    return Plan(
        front=who,
        stage=stage,
        partition=comm_p.partition,
        shard_size=comm_p.shard_size,
        adamw=adamw,
        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        loss_scale=loss_scale,
        bucket_bytes=max(reduce_size, int(bucket_mb * 2**20)) if stage < 3 else 0,
        # the shard group's bucket size (stage 3, whose buckets are its units: stage 2's)
        replicate_bytes=max(reduce_size, int((bucket_mb or DEFAULT_BUCKET_MB[2]) * 2**20)),
        first_bucket_bytes=FIRST_BUCKET_BYTES,
        bucket_buffers=comm_p.bucket_buffers,
        overlap=comm_p.overlap,
        overlap_param_gather=comm_p.overlap_param_gather,
        check_collectives=debug_from_env() if comm_p.check_collectives is None else comm_p.check_collectives,
        unit_modules=unit_p.modules if stage == 3 else None,
        min_unit_bytes=int(min_unit_mb * 2**20) if stage == 3 and unit_p.modules is None else 0,
        params_sharded=stage == 3,
        grads_sharded=stage >= 2,
        grads_as_bucket_views=stage == 1 and reduce_dtype == param_dtype,
        gather_after_step=stage < 3,
        accumulates_locally=stage == 1 or comm_p.accumulate_locally,
        separate_master=param_dtype != torch.float32,
        state_bits=precision.state_bits,
        state_block=precision.state_block,
        offload=offload_p,
    )


# Where each keyword ZeroAdam took before the policies lives now, for the error that names it.
MOVED_KEYWORDS = {
    "partition": "comm=CommPolicy(partition=...)",
    "shard_size": "comm=CommPolicy(shard_size=...)",
    "bucket_mb": "comm=CommPolicy(bucket_mb=...)",
    "bucket_buffers": "comm=CommPolicy(bucket_buffers=...)",
    "overlap": "comm=CommPolicy(overlap=...)",
    "overlap_param_gather": "comm=CommPolicy(overlap_param_gather=...)",
    "accumulate_locally": "comm=CommPolicy(accumulate_locally=...)",
    "check_collectives": "comm=CommPolicy(check_collectives=...)",
    "min_unit_mb": "units=UnitPolicy(min_unit_mb=...)",
    "reduce_dtype": "mixed_precision=MixedPrecisionPolicy(param_dtype, reduce_dtype=...)",
    "init_scale": "mixed_precision=MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(init_scale=...))",
    "growth_factor": "mixed_precision=MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(growth_factor=...))",
    "backoff_factor": "mixed_precision=MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(backoff_factor=...))",
    "growth_interval": "mixed_precision=MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(growth_interval=...))",
}


def reject_moved(who: str, given: dict) -> None:
    """A clear error for keywords that moved into a policy (or never existed)."""
    for name in given:
        if name in MOVED_KEYWORDS:
            raise TypeError(
                f"{who}: the keyword {name}= moved into a policy: pass {MOVED_KEYWORDS[name]} (see docs/configuration.md)"
            )
        raise TypeError(f"{who} got an unexpected keyword argument {name!r}")
