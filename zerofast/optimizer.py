"""ZeroAdam: Adam/AdamW with ZeRO stage 1, 2 or 3 sharding, under the plain training loop.

    opt = ZeroAdam(model, stage=2, lr=1e-3, partition="flat")
    loss.backward(); opt.step(); opt.zero_grad()

Goals: exactly single-process torch.optim.AdamW on the global batch; communication overlapped with
backward; one contiguous buffer per bucket, so collectives and the optimizer step run over long
flat ranges rather than per tensor.

A step, in phases (see also the named notes in layout.py and csrc/buckets.cpp):
  Phase 1, during backward: a post-accumulate-grad hook per parameter copies its gradient into its
    slot of a bucket (stage 2 then drops param.grad); when every parameter of a bucket is in, the
    bucket's reduce starts at once, asynchronously, buckets strictly in index order (which is
    backward order: [Note: bucket order]). "flat" reduce_scatters each bucket into this rank's
    gradient shard; "round_robin" and "greedy" reduce each owner's segment to that owner.
  Phase 2, step() (or an earlier clip_grad_norm_()): buckets a rank never filled (parameters
    without a gradient there) are launched with zeros in the missing slots; the ranks agree which
    parameters got a gradient anywhere; all reduces are waited for; with fp16 or clipping, one
    small all_reduce agrees on overflow and the global norm ([Note: loss scaling], [Note: global
    gradient clipping]); an overflow skips phases 3 and 4 on every rank.
  Phase 3, step(): the fused Adam kernel runs over this rank's fp32 master (in fp32, the owned
    ranges of the parameter buffers; in mixed precision, a master shard of its own whose update it
    writes, rounded, into the parameters: [Note: mixed precision]), reading the gradient shard and
    averaging, unscaling and clipping it through its grad_scale, in runs that share a parameter
    group and a step count.
  Phase 4, step(): each bucket's updated parameters are gathered (all_gather for "flat", broadcast
    from each owner otherwise) straight into the flat parameter buffers the model's parameters are
    views of, buckets in forward order. By default step() returns when every gather is done; with
    overlap_param_gather=True it returns at once and each bucket's gather is awaited by the first
    module whose forward needs it ([Note: overlapped parameter gather]).

[Note: overlapped parameter gather]
As Megatron-LM's overlap_param_gather: step() starts the gathers (the last bucket first, since it
holds the first layers) and returns; a forward pre-hook on every module that holds managed
parameters directly waits for their buckets, so the gather of later layers runs while earlier
layers compute. The contract: a parameter is read only inside the forward of a module that holds it
(module.parameters(recurse=False)). A parameter read elsewhere (in a loss function, say) may be read
while its gather is still in flight; that is caught when its gradient arrives, as an error naming
it, when the parameter's bucket has not been waited for by then. The check is best-effort: if
another module of the same bucket ran its pre-hook in between, the flag is cleared and the early
read goes unnoticed. opt.gathered_params() (and the next step()) wait for everything.

Stage 3 changes phases 3 and 4: the parameters themselves are sharded. Each unit (by default each
block: zerofast/stage3.py) is one bucket; its flat buffer exists only while gathered, module by
module with prefetch ([Note: stage 3 lifecycle]); the fp32 master is this rank's parameter shard,
which the fused kernel updates, and there is no gather after step(): the next forward gathers.

[Note: mixed precision]
mixed_precision="bf16" or "fp16" converts the model as model.to(dtype) would (trainable and frozen
parameters, floating buffers) and casts floating-point inputs of its forward, so forward and backward
run in that dtype. The optimizer keeps what the seed's 16Φ table keeps, each part sharded as the
stage says: 2Φ parameters (the flat buffers the model's parameters are views of; stage 3: a
low-precision shard plus the units gathered now), 2Φ gradients (buckets and the reduced shard, in
reduce_dtype, default the parameter dtype) and 12Φ of optimizer state (an fp32 master shard,
initialised from the user's exact fp32 values, and m and v). The fused kernel reads the
low-precision gradient shard, updates the fp32 master, m and v, and writes the rounded parameter
through its param_copy in the same pass; the gather then moves 2-byte parameters.

[Note: loss scaling]
fp16: opt.backward(loss) multiplies the loss by the scale, as torch.amp.GradScaler.scale does. At
step(), after the reduces, every rank runs the fused kernel's non-finite check
(zerofast::nonfinite_check_) over its gradient shard, and one small all_reduce (with the squared
norm, when clipping) tells every rank whether any shard overflowed, before any rank updates: then
every rank skips the update together (parameters, master, m, v and step counts untouched) and the
scale is multiplied by backoff_factor; after growth_interval clean steps in a row it is multiplied
by growth_factor. Rule and float32 rounding are GradScaler's. Unscaling costs nothing: 1/scale is
part of the kernel's grad_scale. A reduce in fp16 can itself overflow (two finite gradients whose
sum is not); that is caught the same way, one reason to pass reduce_dtype=torch.float32.

[Note: global gradient clipping]
The global norm is that of the averaged, unscaled gradient: each rank computes the squared norm of
its reduced gradient shard (every element of the model sits in exactly one rank's shard; a tied
parameter is one parameter; padding is zero), one all_reduce sums them, and the norm is
sqrt(sum) / (N * scale). The coefficient min(1, max_norm / (norm + 1e-6)), torch's, joins 1/N and
1/scale in the kernel's grad_scale, so clipping costs no pass over the gradients.

[Note: accumulation]
`with opt.no_sync():` around every micro-batch but the last; every rank runs the same number of
micro-batches (stages 2 and 3 communicate in each, as every rank runs the same number of steps). Stage 1 (which holds full gradients
anyway) lets .grad accumulate as autograd does and reduces once, in the last backward: Φ of reduce
per step however many micro-batches. Stages 2 and 3 by default reduce every micro-batch into the
owned gradient shard, as DeepSpeed does: k micro-batches cost k·Φ of reduce, but gradient memory
stays at the shard ([Note: accumulation into the shard] in csrc/buckets.cpp). With
accumulate_locally=True they keep full local gradients during no_sync (2Φ bytes more on each rank
in mixed precision, 4Φ in fp32) and reduce once, as stage 1. Reduces in reduce_dtype add in
reduce_dtype too: accumulating many bf16 micro-batches into a bf16 shard rounds each time;
reduce_dtype=torch.float32 avoids that.

[Note: unused parameters]
A parameter that gets a gradient on no rank in a step is left untouched, as torch.optim.AdamW leaves
a parameter whose grad is None: no update, no state change, its step count unchanged. Where some
ranks have a gradient and others none, the missing ones count as zero (their slot is zeroed before
the reduce). Which case holds is agreed by one small all_reduce(MAX) per step.

[Note: determinism]
Two runs with the same inputs give bitwise-identical results: the layout is a pure function of the
parameter list and the arguments, buckets are launched in a fixed order, the collectives reduce in
a fixed order for a fixed world size, and the fused kernel is elementwise.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _ops
from .comm import BucketComm
from .layout import Layout, Piece, build_layout, layout_from_groups
from .partition import PARTITIONS, imbalance, owners_for
from .stage3 import UnitBuffers, UnitPlan, UnitTracker, find_units, hook_needs

__all__ = ["ZeroAdam"]

_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
# The first bucket (in backward order) holds at most this, so its reduce starts early in backward;
# DDP uses the same 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
_FIRST_BUCKET_BYTES = 1 << 20


_LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Prepared:
    """What phase 2 agreed on, for the rest of the step."""
    used: list[bool]            # which parameters got a gradient on some rank
    found_inf: bool             # some rank's gradient shard holds an inf or nan (fp16 only)
    norm: Optional[torch.Tensor]  # global norm of the averaged, unscaled gradient (when clipping)
    grad_factor: float          # the clip coefficients so far (1.0: none)


class _LossScaler:
    """fp16's dynamic loss scale, with torch.amp.GradScaler's rule and rounding: halve (backoff) on
    a step with an inf or nan, grow after growth_interval clean steps in a row; the scale is kept
    in float32, as GradScaler's tensor is."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, enabled: bool):
        self.enabled = enabled
        self.scale = _to_f32(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = _to_f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _to_f32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0


def _to_f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class _Run:
    """A contiguous range of this rank's shard that one fused_adam_ call updates."""
    bucket: int        # which parameter buffer
    bucket_lo: int     # first element inside that buffer
    state_lo: int      # first element inside the shard buffers (grads, exp_avg, exp_avg_sq)
    numel: int
    group: int         # parameter group index
    params: tuple[int, ...]  # the parameters it touches (their step counts advance together)


class ZeroAdam(torch.optim.Optimizer):
    """Adam/AdamW whose state (stage 1), gradients (stage 2) and parameters (stage 3) are sharded
    across the ranks of `process_group` (default: the whole world).

    model: the nn.Module whose trainable parameters it manages (frozen ones are left alone; a tied
      parameter is one parameter). Its parameters become views into zerofast's flat buffers.
    partition: "flat" (default; equal slices of every bucket), "round_robin" (the seed's parameter
      i to rank i % N) or "greedy" (whole tensors, largest first, to the least-loaded rank).
    param_groups: torch.optim-style dicts over the model's trainable parameters ("lr", "betas",
      "eps", "weight_decay"; missing keys take the constructor's values).
    bucket_mb: stages 1 and 2 bucket size (stage 3 uses one bucket per unit).
    overlap: reduce each bucket during backward as soon as it is complete (else at step()).
    overlap_param_gather: stages 1 and 2: gather after step() overlapped with the next forward.
    units: stage 3: which modules' parameters are gathered together: None (the model's blocks:
      its `_no_split_modules` classes, else the children of every nn.ModuleList, else the root's
      children), a list of submodules, a module class or set of classes, or a callable
      module -> bool; the parameters no unit holds form one more unit, the root's.
      opt.units_report() shows the choice ([Note: choosing units] in zerofast/stage3.py).
    mixed_precision: None (fp32 parameters), "bf16" or "fp16": the model is converted as
      model.to(dtype) would (parameters, frozen ones too, and floating buffers), floating-point
      inputs of its forward are cast to that dtype, and the optimizer keeps the fp32 master shard
      and Adam state ([Note: mixed precision]).
    reduce_dtype: the dtype gradients are reduced (and, in stages 2 and 3, kept sharded) in;
      default the parameters' dtype, torch.float32 on request.
    max_grad_norm: clip the global gradient norm to this at every step (None: no clipping);
      opt.clip_grad_norm_(max_norm) clips on request ([Note: global gradient clipping]).
    init_scale, growth_factor, backoff_factor, growth_interval: fp16's dynamic loss scaling, named
      and behaving as torch.amp.GradScaler's; use opt.backward(loss) ([Note: loss scaling]).
    accumulate_locally: stages 2 and 3 under no_sync(): keep full local gradients and reduce once
      (like stage 1) instead of reducing every micro-batch into the shard ([Note: accumulation]).
    """

    def __init__(self, model: nn.Module, stage: int = 2, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True,
                 param_groups: Optional[list[dict]] = None, partition: str = "flat",
                 bucket_mb: float = 25.0, overlap: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None, overlap_param_gather: bool = False,
                 units=None, mixed_precision: Optional[str] = None,
                 reduce_dtype: Optional[torch.dtype] = None, max_grad_norm: Optional[float] = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, accumulate_locally: bool = False):
        _check_args(model, stage, lr, betas, eps, weight_decay, partition, bucket_mb)
        _check_units(model, stage, units)
        _check_precision(mixed_precision, reduce_dtype, max_grad_norm, init_scale, growth_factor,
                         backoff_factor, growth_interval)
        for name, value in (("adamw", adamw), ("overlap", overlap), ("overlap_param_gather", overlap_param_gather),
                            ("accumulate_locally", accumulate_locally)):
            if not isinstance(value, bool):
                raise TypeError(f"ZeroAdam: {name} must be True or False; got {value!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"ZeroAdam: process_group must be a torch.distributed ProcessGroup or None; "
                            f"got {type(process_group).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroAdam needs torch.distributed initialized (dist.init_process_group); "
                               "world size 1 works too")
        self.model = model
        self.stage = stage
        self.adamw = bool(adamw)
        self.partition = partition
        self.overlap = bool(overlap)
        self.overlap_param_gather = bool(overlap_param_gather)
        self.mixed_precision = mixed_precision
        self.param_dtype = _LOW_DTYPES[mixed_precision] if mixed_precision else torch.float32
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else self.param_dtype
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulate_locally = bool(accumulate_locally)
        self._scaler = _LossScaler(init_scale, growth_factor, backoff_factor, growth_interval,
                                   enabled=(mixed_precision == "fp16"))
        self._in_no_sync = False
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ZeroAdam: the model has no trainable parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        _check_same_across_ranks(model, self.group)
        _broadcast_from_rank0(model, self.group)
        groups = _build_groups(param_groups, named, dict(lr=lr, betas=tuple(betas), eps=eps,
                                                         weight_decay=weight_decay))
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = [0] * len(self._params)
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_of[index_of[id(p)]] = g
        self._build_buffers(bucket_mb, units)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                       for i, p in enumerate(self._params)]
        if self.param_dtype != torch.float32:
            self._hooks.append(model.register_forward_pre_hook(self._cast_inputs, prepend=True, with_kwargs=True))
        self._pending_gather = [False] * len(self.layout.buckets)
        if self.overlap_param_gather and stage < 3:
            self._hooks += self._register_gather_waits()
        self.units: Optional[UnitTracker] = self._shard_params() if stage == 3 else None
        self.last_step_skipped = False  # fp16: the last step() found an inf or nan and skipped
        self._begin_step()

    # --- construction ---------------------------------------------------------------------------

    def _build_buffers(self, bucket_mb: float, unit_modules) -> None:
        first = self._params[0]
        dtype, device = first.dtype, first.device
        for n, p in zip(self._names, self._params):
            if p.dtype != dtype or p.device != device:
                raise ValueError(f"ZeroAdam needs every trainable parameter on one device with one dtype: "
                                 f"{self._names[0]} is {dtype} on {device}, {n} is {p.dtype} on {p.device}")
        if dtype != torch.float32 and self.mixed_precision is None:
            raise ValueError(f"ZeroAdam: the model's parameters are {dtype}; without mixed_precision they must be "
                             f"float32 (they are the master copy). Pass the fp32 model with "
                             f"mixed_precision='bf16' or 'fp16' to train in low precision")
        dtype = self.param_dtype
        mixed = dtype != torch.float32
        reduce_size = torch.empty(0, dtype=self.reduce_dtype).element_size()
        numels = [p.numel() for p in self._params]
        bucket_numel = max(1, int(bucket_mb * 2**20) // reduce_size)
        owners = owners_for(self.partition, numels, self.world_size)
        if self.stage == 3:  # one bucket per unit, in backward order: see [Note: bucket order]
            self.unit_plan: Optional[UnitPlan] = find_units(self.model, self._params, unit_modules)
            self.layout: Layout = layout_from_groups(numels, self.unit_plan.groups[::-1], self.world_size, owners)
        else:
            self.unit_plan = None
            order = list(reversed(range(len(numels))))  # backward order: see [Note: bucket order]
            first_bucket_numel = min(bucket_numel, _FIRST_BUCKET_BYTES // reduce_size)
            self.layout = build_layout(numels, order, self.world_size, bucket_numel, owners, first_bucket_numel)
        # The model's parameters become views into one flat buffer per bucket, so the gather
        # writes straight into the model; the owned range of each buffer is the fp32 master copy.
        self._param_buffers = [torch.zeros(b.numel, dtype=dtype, device=device) for b in self.layout.buckets]
        originals = [p.detach() for p in self._params]  # the user's values: the master starts from them
        with torch.no_grad():
            for i, p in enumerate(self._params):
                s = self.layout.slots[i]
                view = self._param_buffers[s.bucket].narrow(0, s.offset, s.numel).view_as(p)
                view.copy_(p)
                p.data = view
            if mixed:  # the rest of the model follows, as model.to(dtype) would: see [Note: mixed precision]
                for p in self.model.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(dtype)
                for mod in self.model.modules():
                    for name, buf in mod.named_buffers(recurse=False):
                        if buf.is_floating_point():
                            setattr(mod, name, buf.to(dtype))
        shard = self.layout.shard_numel(self.rank)
        self._grad_shard = torch.zeros(shard, dtype=self.reduce_dtype, device=device)
        # Stage 3's parameter shard, in the parameters' dtype, which the next forward gathers
        # (stages 1 and 2 update the owned range of the parameter buffers in place instead).
        self._param_shard = torch.zeros(shard if self.stage == 3 else 0, dtype=dtype, device=device)
        self._exp_avg = torch.zeros(shard, dtype=torch.float32, device=device)
        self._exp_avg_sq = torch.zeros(shard, dtype=torch.float32, device=device)
        self._pieces: list[Piece] = self.layout.pieces(self.rank)
        # The fp32 master copy: in fp32 the parameters are their own master (the owned range of the
        # parameter buffers, or stage 3's shard); in mixed precision a shard of its own, from the
        # user's exact values, which the fused kernel updates and casts into the parameters.
        self._master = torch.zeros(shard if mixed else 0, dtype=torch.float32, device=device)
        with torch.no_grad():
            for pc in (self._pieces if mixed else []):
                src = originals[pc.param].reshape(-1)[pc.param_offset:pc.param_offset + pc.numel]
                self._master[pc.state_offset:pc.state_offset + pc.numel].copy_(src)
        del originals
        self._steps = [0] * len(self._params)  # per parameter, as torch.optim keeps it
        # Stage 3 gathers on a second group: see [Note: two process groups] in csrc/buckets.cpp.
        gather_group = None
        if self.stage == 3:
            ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
            gather_group = dist.new_group(ranks, use_local_synchronization=True)
        self.comm = BucketComm(self.group, self.layout, self.rank, self._grad_shard, gather_group)

    # --- phase 1: backward hooks ----------------------------------------------------------------

    def _begin_step(self) -> None:
        n = len(self._params)
        self._used = [False] * n       # got a gradient on this rank in any micro-batch of this step
        self._local = [False] * n      # holds a locally accumulated .grad not yet in a bucket
        self._accumulate = False       # later reduces add into the shard: [Note: accumulation]
        self._callback_queued = False
        self._prepared: Optional[_Prepared] = None
        self._begin_micro_batch()
        self.comm.new_step()

    def _begin_micro_batch(self) -> None:
        self._got_grad = [False] * len(self._params)  # copied into its bucket in this micro-batch
        self._missing = [len(b.params) for b in self.layout.buckets]
        self._next_launch = 0

    def _hook_for(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)
        return hook

    _in_scaled_backward = False

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        slot = self.layout.slots[index]
        if self._scaler.enabled and not self._in_scaled_backward:
            raise RuntimeError(
                f"ZeroAdam(mixed_precision='fp16'): {self._names[index]} got a gradient from a backward "
                f"that did not scale the loss; call opt.backward(loss) instead of loss.backward() "
                f"([Note: loss scaling])")
        if self._pending_gather[slot.bucket]:
            raise RuntimeError(
                f"ZeroAdam(overlap_param_gather=True): {self._names[index]} was used while its gather was "
                f"still in flight (read outside the forward of a module that holds it); this step's "
                f"result would be wrong. Read it inside its module's forward, or pass "
                f"overlap_param_gather=False. See [Note: overlapped parameter gather]")
        if self._prepared is not None:
            raise RuntimeError(
                f"ZeroAdam: {self._names[index]} got a gradient after clip_grad_norm_() and before step(); "
                f"clip after the last backward of the step")
        self._used[index] = True
        if self._in_no_sync and self._accumulates_locally:
            self._local[index] = True  # .grad accumulates; the last micro-batch copies it
            return
        if self._got_grad[index]:
            raise RuntimeError(
                f"ZeroAdam: {self._names[index]} got a second gradient before step(); call opt.step() "
                f"after each backward, or run the earlier backwards of an accumulated step inside "
                f"`with opt.no_sync():`")
        if self._in_no_sync and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_batch)
        self.comm.add_grad(slot.bucket, slot.offset, param.grad)
        self._got_grad[index] = True
        self._local[index] = False
        if self.stage >= 2:
            param.grad = None  # stage 2: the bucket holds it now; see [Note: grads as views]
        self._missing[slot.bucket] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start every complete bucket whose predecessors have all started: see [Note: bucket order]."""
        buckets = self.layout.buckets
        while self._next_launch < len(buckets) and self._missing[self._next_launch] == 0:
            self.comm.reduce(self._next_launch, self._accumulate)
            self._next_launch += 1

    @property
    def _accumulates_locally(self) -> bool:
        return self.stage == 1 or self.accumulate_locally

    def _end_micro_batch(self) -> None:
        """End of a backward inside no_sync() (stages 2 and 3, reducing every micro-batch): launch
        every bucket, then let the next micro-batch's reduces add into the shard."""
        self._callback_queued = False
        self._flush()
        self._accumulate = True
        self._begin_micro_batch()

    # --- step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroAdam.step does not take a closure; got one")
        if self._in_no_sync:
            raise RuntimeError("ZeroAdam.step() was called inside `with opt.no_sync():`; no_sync() wraps "
                               "the micro-batches whose gradients are only accumulated, and step() follows "
                               "the last backward, outside it")
        self._wait_gathers()                    # last step's, if some module never ran
        if self.units is not None:              # stage 3: nothing may stay gathered across the update
            self.units.release_all()
        prep = self._prepare(need_norm=self.max_grad_norm is not None)  # phase 2
        if self.max_grad_norm is not None:
            self._clip(prep, self.max_grad_norm)
        anything = any(prep.used)  # agreed: the same on every rank
        if anything and not prep.found_inf:
            self._update(prep.used, prep.grad_factor / (self.world_size * self._scaler.scale))  # phase 3
            if self.stage < 3:                  # phase 4 (stage 3: the next forward gathers)
                self._start_gathers()
                if not self.overlap_param_gather:
                    self._wait_gathers()
        if anything:  # a step without gradients anywhere is no evidence for or against the scale
            self._scaler.update(prep.found_inf)
        self.last_step_skipped = prep.found_inf
        self._last_comm = dict(self.comm.stats)
        self._begin_step()
        return None

    def _flush(self) -> None:
        """Launch what backward did not: a locally accumulated gradient where one is waiting, zeros
        for a parameter without gradient here ([Note: unused parameters])."""
        for b in range(self._next_launch, len(self.layout.buckets)):
            for i in self.layout.buckets[b].params:
                if self._got_grad[i]:
                    continue
                s = self.layout.slots[i]
                p = self._params[i]
                if self._local[i] and p.grad is not None:
                    self.comm.add_grad(s.bucket, s.offset, p.grad)
                    if self.stage >= 2:
                        p.grad = None
                else:
                    self.comm.zero_slot(s.bucket, s.offset, s.numel)
                self._got_grad[i] = True
            self._missing[b] = 0
        self._launch_ready()

    def _prepare(self, need_norm: bool) -> "_Prepared":
        """Phase 2, once per step (step() or an earlier clip_grad_norm_()): every bucket reduced, the
        ranks agreed on which parameters got a gradient, and, where loss scaling or clipping needs
        them, on whether any gradient overflowed and on the global gradient norm."""
        if self._prepared is not None:  # clip_grad_norm_() ran it; it computed the norm
            return self._prepared
        self._flush()
        got = torch.tensor(self._used, dtype=torch.uint8, device=self._grad_shard.device)
        self.comm.all_reduce_max(got)
        used = [bool(x) for x in got.tolist()]
        self.comm.wait_reduces()
        found_inf, sumsq = False, None
        if self._scaler.enabled or need_norm:
            stats = torch.zeros(2, dtype=torch.float32, device=self._grad_shard.device)
            if self._scaler.enabled:  # see [Note: loss scaling]
                _ops.nonfinite_check_(self._grad_shard, stats[0:1])
            if need_norm:  # padding is zero, and each element sits in exactly one rank's shard
                stats[1] = torch.linalg.vector_norm(self._grad_shard, dtype=torch.float32).square()
            self.comm.all_reduce_sum(stats)
            found_inf, sumsq = bool(stats[0].item() > 0), stats[1]
        norm = None
        if sumsq is not None:  # the norm of the averaged, unscaled gradient
            norm = sumsq.sqrt() / (self.world_size * self._scaler.scale)
        self._prepared = _Prepared(used, found_inf, norm, 1.0)
        return self._prepared

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' global norm to max_norm, as torch.nn.utils.clip_grad_norm_ on the
        whole model would, and return the norm before clipping (a float32 tensor). Call it after
        the last backward of a step and before step(); the clipping is applied inside the fused
        kernel, through its grad_scale ([Note: global gradient clipping])."""
        if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0):
            raise ValueError(f"ZeroAdam.clip_grad_norm_: max_norm must be a number > 0; got {max_norm!r}")
        if self._in_no_sync:
            raise RuntimeError("ZeroAdam.clip_grad_norm_() was called inside `with opt.no_sync():`; clip after "
                               "the last backward of the step, outside it")
        return self._clip(self._prepare(need_norm=True), float(max_norm))

    @staticmethod
    def _clip(prep: "_Prepared", max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s coefficient, folded into grad_factor: applying it twice
        (clip_grad_norm_ and max_grad_norm) acts as clipping twice would."""
        norm = prep.norm * prep.grad_factor
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        prep.grad_factor *= float(coef)
        return norm

    def _update(self, used: list[bool], grad_scale: float) -> None:
        for run in self._runs(used):
            group = self.param_groups[run.group]
            beta1, beta2 = group["betas"]
            state = slice(run.state_lo, run.state_lo + run.numel)
            master, copy = self._master_and_copy(run.bucket, run.bucket_lo, state)
            _ops.fused_adam_(
                master,
                self._grad_shard[state], self._exp_avg[state], self._exp_avg_sq[state],
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=self._steps[run.params[0]] + 1,
                adamw=self.adamw, grad_scale=grad_scale, param_copy=copy)
        for i, u in enumerate(used):
            if u:
                self._steps[i] += 1

    def _master_and_copy(self, bucket: int, bucket_lo: int, state: slice):
        """The fp32 master of an owned range (bucket `bucket` from `bucket_lo`; `state` in the shard
        buffers), and the low-precision parameters its update is written to (None in fp32, where
        the master is the parameter)."""
        # Stage 3 keeps its parameters in the shard (the unit buffers are released by now).
        params = (self._param_shard[state] if self.stage == 3
                  else self._param_buffers[bucket].narrow(0, bucket_lo, state.stop - state.start))
        if self._master.numel():  # mixed precision
            return self._master[state], params
        return params, None

    def _runs(self, used: list[bool]) -> list[_Run]:
        """This rank's owned pieces of used parameters, merged where contiguous with equal
        (bucket, group, step count), so one kernel call covers many small tensors."""
        runs: list[_Run] = []
        for pc in self._pieces:
            if not used[pc.param]:
                continue
            key = (pc.bucket, self._group_of[pc.param], self._steps[pc.param])
            last = runs[-1] if runs else None
            if (last is not None and (last.bucket, last.group, self._steps[last.params[0]]) == key
                    and last.bucket_lo + last.numel == pc.bucket_offset
                    and last.state_lo + last.numel == pc.state_offset):
                runs[-1] = _Run(last.bucket, last.bucket_lo, last.state_lo, last.numel + pc.numel,
                                last.group, last.params + (pc.param,))
            else:
                runs.append(_Run(pc.bucket, pc.bucket_offset, pc.state_offset, pc.numel, key[1], (pc.param,)))
        return runs

    # --- stage 3 ----------------------------------------------------------------------------------

    def _shard_params(self) -> UnitTracker:
        """Copy this rank's shards out, release every unit, and install the hooks."""
        buffers = UnitBuffers(self._param_buffers, self._param_shard, self.layout, self.rank, self.comm)
        buffers.shard_out()
        return UnitTracker(self.model, hook_needs(self.model, self._params, self.unit_plan), buffers)

    def units_report(self) -> list[dict]:
        """Stage 3: what each unit gathers together, in unit order (unit 0 is the root's remaining
        parameters, when there are any): its module's name ("" for the root), how many parameter
        tensors and elements it holds, and their bytes in the parameters' dtype. See
        [Note: choosing units] in zerofast/stage3.py. Empty for stages 1 and 2, which gather by bucket."""
        if self.stage != 3:
            return []
        size = self._param_buffers[0].element_size()
        report = []
        for u, (group, name) in enumerate(zip(self.unit_plan.groups, self.unit_plan.names)):
            numel = sum(self._params[i].numel() for i in group)
            report.append({"unit": u, "module": name, "class": type(self.unit_plan.modules[u]).__name__,
                           "tensors": len(group), "numel": numel, "bytes": numel * size})
        return report

    def materialized_param_bytes(self) -> int:
        """Bytes of parameter storage that exist now: gathered unit buffers (stage 3: only those
        gathered at this moment; stages 1 and 2: always all) plus stage 3's own shard."""
        return (sum(b.untyped_storage().nbytes() for b in self._param_buffers)
                + self._param_shard.numel() * self._param_shard.element_size())

    # --- stages 1 and 2: the gather after step --------------------------------------------------

    def _start_gathers(self) -> None:
        for b in reversed(range(len(self.layout.buckets))):  # forward order: first layers first
            self.comm.gather_start(b, self._param_buffers[b])
            self._pending_gather[b] = True

    def _wait_gathers(self, buckets: Iterable[int] | None = None) -> None:
        for b in (range(len(self._pending_gather)) if buckets is None else buckets):
            if self._pending_gather[b]:
                self.comm.gather_wait(b)
                self._pending_gather[b] = False

    def _register_gather_waits(self) -> list:
        """A forward pre-hook per module holding managed parameters: see [Note: overlapped parameter gather]."""
        index_of = {id(p): i for i, p in enumerate(self._params)}
        handles = []
        for module in self.model.modules():
            buckets = sorted({self.layout.slots[index_of[id(p)]].bucket
                              for p in module.parameters(recurse=False) if id(p) in index_of})
            if buckets:
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args, buckets=tuple(buckets): self._wait_gathers(buckets)))
        return handles

    # --- mixed precision, loss scaling, accumulation ---------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss multiplied by the current loss scale under fp16 (as
        torch.amp.GradScaler.scale does); the same as loss.backward() otherwise."""
        if self._scaler.enabled:
            loss = loss.float() * self._scaler.scale
        self._in_scaled_backward = True
        try:
            loss.backward(**kwargs)
        finally:
            self._in_scaled_backward = False

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self._scaler.scale

    @contextlib.contextmanager
    def no_sync(self):
        """The backwards inside only accumulate gradients; the step's last backward, outside, and
        step() then act on the sum. See [Note: accumulation] for what each stage communicates."""
        if self._in_no_sync:
            raise RuntimeError("ZeroAdam.no_sync() is already active: no_sync() blocks cannot be nested")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False
            self._callback_queued = False  # a backward that raised may have left it queued, never run

    def _cast_inputs(self, module, args, kwargs):
        """Floating-point tensors passed to the model's forward, cast to the parameters' dtype."""
        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
                return x.to(self.param_dtype)
            return x
        return torch.utils._pytree.tree_map(cast, (args, kwargs))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear .grad (stage 1 keeps full local gradients there). Between a backward and step(),
        gradients already handed to the buckets cannot be taken back (their reduces are in flight
        on every rank): that is an error rather than a step that silently keeps them. Gradients
        accumulated only locally (stage 1, or accumulate_locally, inside no_sync) are dropped."""
        if any(self._got_grad) or self._accumulate or self._prepared is not None:
            raise RuntimeError("ZeroAdam.zero_grad() was called between backward and step(): this step's "
                               "gradients are already being reduced across ranks and would still be "
                               "applied; call step() first (or zero_grad() only at the start of an iteration)")
        self._used = [False] * len(self._params)
        self._local = [False] * len(self._params)
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # --- the rest of the public surface ---------------------------------------------------------

    @contextlib.contextmanager
    def gathered_params(self):
        """Full, current parameters on every rank inside the block. Stages 1 and 2 always hold
        them, so this costs nothing there (beyond finishing gathers still in flight); stage 3
        gathers every unit and re-shards on exit (changes made inside the block are not kept)."""
        self._wait_gathers()
        if self.units is None:
            yield self.model
            return
        self.units.gather_all()
        try:
            yield self.model
        finally:
            self.units.release_all()

    def partition_report(self) -> dict:
        """Elements each rank owns (real parameters, not padding) and the imbalance max/mean."""
        owned = [self.layout.owned_numel(r) for r in range(self.world_size)]
        return {"owned_numel": owned, "imbalance": imbalance(owned)}

    def memory_report(self) -> dict:
        """Bytes this rank holds now, by kind, counted from the tensors."""
        def nbytes(t): return t.numel() * t.element_size()
        return {
            "params": self.materialized_param_bytes(),
            "param_padding": sum(b.numel - self.layout.used_numel(b.index) for b in self.layout.buckets)
            * self._param_buffers[0].element_size(),
            "grads": sum(nbytes(p.grad) for p in self._params if p.grad is not None),
            "grad_shard": nbytes(self._grad_shard),
            "optimizer": nbytes(self._exp_avg) + nbytes(self._exp_avg_sq),
            "master_copy": nbytes(self._master),  # 0 in fp32: the parameters are their own master
            "bucket_buffers": self.comm.buffer_bytes,
            "bucket_buffers_peak": self.comm.peak_buffer_bytes,
            "bucket_pool": self.comm.pooled_bytes,  # released buffers kept for reuse (<= the peak)
        }

    def master_shard(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's part of the fp32 master copy, as (parameter name, offset into the flattened
        parameter, fp32 values) pieces; the ranks' pieces together cover every parameter once."""
        out = []
        for pc in self._pieces:
            master, _ = self._master_and_copy(pc.bucket, pc.bucket_offset,
                                              slice(pc.state_offset, pc.state_offset + pc.numel))
            out.append((self._names[pc.param], pc.param_offset, master.detach().float().clone()))
        return out

    def step_counts(self) -> dict[str, int]:
        """Adam steps taken by each trainable parameter (a parameter with no gradient on any rank
        in a step does not advance: see [Note: unused parameters])."""
        return dict(zip(self._names, self._steps))

    def comm_stats(self) -> dict:
        """Payload bytes of each collective in the last step (see zerofast/comm.py)."""
        return dict(getattr(self, "_last_comm", {}))

    def state_dict(self):
        raise NotImplementedError("ZeroAdam.state_dict: sharded checkpoints are not implemented yet")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("ZeroAdam.load_state_dict: sharded checkpoints are not implemented yet")

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.units is not None:
            self.units.remove()


# --- construction checks ----------------------------------------------------------------------------

def _check_args(model, stage, lr, betas, eps, weight_decay, partition, bucket_mb) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"ZeroAdam: model must be an nn.Module; got {type(model).__name__}")
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroAdam: stage must be 1, 2 or 3; got {stage!r}")
    if partition not in PARTITIONS:
        raise ValueError(f"ZeroAdam: partition must be one of {', '.join(PARTITIONS)}; got {partition!r}")
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"ZeroAdam: bucket_mb must be a positive number; got {bucket_mb!r}")
    _check_hyper("", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))


def _check_precision(mixed_precision, reduce_dtype, max_grad_norm, init_scale, growth_factor, backoff_factor,
                     growth_interval) -> None:
    if mixed_precision is not None and mixed_precision not in _LOW_DTYPES:
        raise ValueError(f"ZeroAdam: mixed_precision must be None, 'bf16' or 'fp16'; got {mixed_precision!r}")
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ZeroAdam: reduce_dtype must be None, torch.float32, torch.bfloat16 or torch.float16; "
                         f"got {reduce_dtype!r}")
    if mixed_precision is None and reduce_dtype not in (None, torch.float32):
        raise ValueError(f"ZeroAdam: reduce_dtype={reduce_dtype} needs mixed_precision; fp32 parameters reduce "
                         f"in float32")
    if reduce_dtype == torch.float16 and mixed_precision != "fp16":
        raise ValueError(f"ZeroAdam: reduce_dtype=torch.float16 needs mixed_precision='fp16' (whose loss scaling "
                         f"catches overflow); got mixed_precision={mixed_precision!r}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                          and not isinstance(max_grad_norm, bool) and max_grad_norm > 0):
        raise ValueError(f"ZeroAdam: max_grad_norm must be None or a number > 0; got {max_grad_norm!r}")
    for name, value, ok in (("init_scale", init_scale, lambda v: v > 0),
                            ("growth_factor", growth_factor, lambda v: v > 1),
                            ("backoff_factor", backoff_factor, lambda v: 0 < v < 1)):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and ok(value)):
            bound = {"init_scale": "> 0", "growth_factor": "> 1", "backoff_factor": "in (0, 1)"}[name]
            raise ValueError(f"ZeroAdam: {name} must be a number {bound}; got {value!r}")
    if not (isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval >= 1):
        raise ValueError(f"ZeroAdam: growth_interval must be an integer >= 1; got {growth_interval!r}")


def _check_units(model: nn.Module, stage: int, units) -> None:
    """The stage; the value itself is checked where it is read (zerofast.stage3.unit_modules)."""
    if units is not None and stage != 3:
        raise ValueError(f"ZeroAdam: units apply to stage 3 only; got units with stage={stage}")


def _check_hyper(where: str, g: dict) -> None:
    lr, betas, eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"ZeroAdam{where}: lr must be a number >= 0; got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"ZeroAdam{where}: betas must be two numbers in [0, 1); got {betas!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"ZeroAdam{where}: eps must be a number >= 0; got {eps!r}")
    if not (isinstance(wd, (int, float)) and wd >= 0):
        raise ValueError(f"ZeroAdam{where}: weight_decay must be a number >= 0; got {wd!r}")


def _build_groups(param_groups, named, defaults) -> list[dict]:
    """torch.optim-style groups over the model's trainable parameters, each exactly once."""
    params = [p for _, p in named]
    if param_groups is None:
        return [dict(defaults, params=params)]
    name_of = {id(p): n for n, p in named}
    seen: dict[int, int] = {}
    groups = []
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"ZeroAdam: param_groups[{g}] must be a dict with a 'params' list; got {group!r}")
        unknown = set(group) - {"params", *_GROUP_KEYS}
        if unknown:
            raise ValueError(f"ZeroAdam: param_groups[{g}] has unknown keys {sorted(unknown)}; "
                             f"allowed: params, {', '.join(_GROUP_KEYS)}")
        members = list(group["params"])
        for p in members:
            if id(p) not in name_of:
                raise ValueError(f"ZeroAdam: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is "
                                 f"not one of the model's trainable parameters")
            if id(p) in seen:
                raise ValueError(f"ZeroAdam: {name_of[id(p)]} is in param_groups[{seen[id(p)]}] and "
                                 f"param_groups[{g}]; each parameter belongs to one group")
            seen[id(p)] = g
        full = dict(defaults, **{k: v for k, v in group.items() if k != "params"}, params=members)
        full["betas"] = tuple(full["betas"])
        _check_hyper(f" param_groups[{g}]", full)
        groups.append(full)
    missing = [name_of[id(p)] for p in params if id(p) not in seen]
    if missing:
        raise ValueError(f"ZeroAdam: trainable parameter {missing[0]} is in no param group "
                         f"({len(missing)} missing in all)")
    return groups


def _signature(model: nn.Module) -> list[tuple]:
    return ([("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
            + [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()])


def _check_same_across_ranks(model: nn.Module, group) -> None:
    """Every rank raises the same error (naming the first mismatch) instead of hanging later."""
    mine = _signature(model)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, sig in enumerate(everyone[1:], start=1):
        if sig == reference:
            continue
        for a, b in zip(reference, sig):
            if a != b:
                raise ValueError(f"ZeroAdam: ranks hold different models: rank 0 has {a[0]} {a[1]} "
                                 f"{a[2]} {a[3]} (requires_grad={a[4]}), rank {rank} has {b[0]} {b[1]} "
                                 f"{b[2]} {b[3]} (requires_grad={b[4]})")
        raise ValueError(f"ZeroAdam: ranks hold different models: rank 0 has {len(reference)} parameters "
                         f"and buffers, rank {rank} has {len(sig)}")


def _broadcast_from_rank0(model: nn.Module, group) -> None:
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)
