"""ZeroAdam: Adam/AdamW with ZeRO stage 1, 2 or 3 sharding, under the plain training loop.

    opt = ZeroAdam(model, stage=2, lr=1e-3, partition="flat")
    loss.backward(); opt.step(); opt.zero_grad()

Goals: exactly single-process torch.optim.AdamW on the global batch; communication overlapped with
backward; one contiguous buffer per bucket, so collectives and the optimizer step run over long
flat ranges rather than per tensor.

A step, in phases, each owned by one object (its module holds the details and the named notes):
  Phase 1, during backward (GradReducer, zerofast/grads.py): each gradient is copied into its slot
    of a bucket; a complete bucket's reduce starts at once, asynchronously, in bucket order.
  Phase 2, step() or an earlier clip_grad_norm_() (GradReducer): buckets not filled on this rank
    are launched with zeros; the ranks agree which parameters got a gradient anywhere; every reduce
    is waited for; with fp16 or clipping, one small all_reduce agrees on overflow and the global
    norm; an overflow skips phases 3 and 4 on every rank (LossScaler, zerofast/precision.py).
  Phase 3, step() (ShardState, zerofast/state.py): the fused Adam kernel over this rank's fp32
    master ranges, averaging, unscaling and clipping the gradient shard through its grad_scale.
  Phase 4, step() (ParamGather, zerofast/gather.py): stages 1 and 2 gather each bucket's updated
    parameters straight into the flat buffers the model's parameters are views of; by default
    step() returns when every gather is done, with overlap_param_gather=True at once.
Stage 3 (UnitTracker over UnitBuffers, zerofast/stage3.py) shards the parameters themselves: each
unit (by default each block) is one bucket whose flat buffer exists only while gathered, module by
module with prefetch; the fp32 master is this rank's parameter shard, and there is no phase 4: the
next forward gathers. The communication itself is BucketComm (zerofast/comm.py over csrc/).

[Note: determinism]
Two runs with the same inputs give bitwise-identical results: the layout is a pure function of the
parameter list and the arguments, buckets are launched in a fixed order, the collectives reduce in
a fixed order for a fixed world size, and the fused kernel is elementwise.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import checks as _checks
from ..comm import BucketComm, debug_from_env, group_timeout
from .gather import ParamGather
from .grads import GradReducer
from ..layout import Layout, build_layout, layout_from_groups
from ..partition import imbalance, owners_for
from .precision import LOW_DTYPES, InputCast, LossScaler, cast_unmanaged
from ..stage3.runtime import UnitBuffers, UnitTracker
from ..stage3.units import UnitPlan, find_units, hook_needs
from .state import ShardState

__all__ = ["ZeroAdam"]

# Stage 3's default units smaller than this are merged with their neighbours ([Note: merging small
# units] in zerofast/stage3.py). Chosen by measurement: see DEFAULT_MIN_UNIT_MB's row in README.
DEFAULT_MIN_UNIT_MB = 2.0

# Bucket sizes of stages 1 and 2 (stage 3's buckets are its units). Stage 1's buckets are its
# gradients, so their size sets only how the reduce is cut into collectives: DDP's 25 MB. Stage 2's
# are transient, DEFAULT_BUCKET_BUFFERS of them beside the gradient shard: 8 MB, chosen by
# measurement (README, "Buffers in flight": the step time of 25 MB buckets at a third of the memory).
DEFAULT_BUCKET_MB = {1: 25.0, 2: 8.0}

# Gradient bucket buffers alive at once (stages 2 and 3, and stage 1 when gradients are copied):
# one being filled while the previous one is reduced. Chosen by measurement: see README's
# "Buffers in flight" ([Note: buffers in flight] in csrc/buckets.cpp).
DEFAULT_BUCKET_BUFFERS = 2

# The first bucket (in backward order) holds at most this, so its reduce starts early in backward;
# DDP uses the same 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
_FIRST_BUCKET_BYTES = 1 << 20


class ZeroAdam(torch.optim.Optimizer):
    """Adam/AdamW whose state (stage 1), gradients (stage 2) and parameters (stage 3) are sharded
    across the ranks of `process_group` (default: the whole world).

    model: the nn.Module whose trainable parameters it manages (frozen ones are left alone; a tied
      parameter is one parameter). Its parameters become views into zerofast's flat buffers.
    partition: "flat" (default; equal slices of every bucket), "round_robin" (the seed's parameter
      i to rank i % N) or "greedy" (whole tensors, largest first, to the least-loaded rank).
    param_groups: torch.optim-style dicts over the model's trainable parameters ("lr", "betas",
      "eps", "weight_decay"; missing keys take the constructor's values).
    bucket_mb: stages 1 and 2 bucket size in MiB of gradients (None: DEFAULT_BUCKET_MB, 25 for stage 1,
      8 for stage 2; stage 3 uses one bucket per unit).
    overlap: reduce each bucket during backward as soon as it is complete (else at step()).
    overlap_param_gather: stages 1 and 2: gather after step() overlapped with the next forward.
    units: stage 3: which modules' parameters are gathered together: None (the model's blocks:
      its `_no_split_modules` classes, else the children of every nn.ModuleList, else the root's
      children), a list of submodules, a module class or set of classes, or a callable
      module -> bool; the parameters no unit holds form one more unit, the root's.
      opt.units_report() shows the choice ([Note: choosing units] in zerofast/stage3.py).
    min_unit_mb: stage 3 with the default units: units smaller than this (in the parameters'
      dtype) are merged with their neighbours, so a deep narrow model gathers in a few collectives
      (None: DEFAULT_MIN_UNIT_MB; 0: never merge). Units given explicitly are kept as given.
    mixed_precision: None (fp32 parameters), "bf16" or "fp16": the model is converted as
      model.to(dtype) would (parameters, frozen ones too, and floating buffers), floating-point
      inputs of its forward are cast to that dtype, and the optimizer keeps the fp32 master shard
      and Adam state ([Note: mixed precision] in zerofast/precision.py).
    reduce_dtype: the dtype gradients are reduced (and, in stages 2 and 3, kept sharded) in;
      default the parameters' dtype, torch.float32 on request.
    max_grad_norm: clip the global gradient norm to this at every step (None: no clipping);
      opt.clip_grad_norm_(max_norm) clips on request ([Note: global gradient clipping]).
    init_scale, growth_factor, backoff_factor, growth_interval: fp16's dynamic loss scaling, named
      and behaving as torch.amp.GradScaler's; use opt.backward(loss) ([Note: loss scaling]).
    accumulate_locally: stages 2 and 3 under no_sync(): keep full local gradients and reduce once
      (like stage 1) instead of reducing every micro-batch into the shard ([Note: accumulation]).
    bucket_buffers: at most this many gradient bucket buffers alive at once, being filled, being
      reduced or kept for reuse (0: no bound); backward waits for the oldest reduce when they are
      all in use ([Note: buffers in flight] in csrc/buckets.cpp). Stage 1 needs none when the
      gradients are reduced in their own dtype: its .grad are views of persistent buckets that are
      reduced in place, so a rank holds one copy of the gradients ([Note: grads as bucket views]);
      after step() its .grad is None, as in stages 2 and 3.
    check_collectives: before every collective, check that every rank is about to issue the same
      one (the same bucket, size, step and micro-batch), raising OutOfStepError on every rank
      otherwise; one small blocking all_gather per collective (None: on when ZEROFAST_DEBUG=1).
      Without it, a cheap check rides on the step's agreement ([Note: the step's agreement]).
    Every wait is bounded by the process group's timeout (stage 3's gather group gets the same): a
    dead, stuck or out-of-step rank makes the others raise CollectiveError naming the step, the phase
    and the collective ([Note: faults] in zerofast/comm.py).
    """

    def __init__(self, model: nn.Module, stage: int = 2, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True,
                 param_groups: Optional[list[dict]] = None, partition: str = "flat",
                 bucket_mb: Optional[float] = None, overlap: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None, overlap_param_gather: bool = False,
                 units=None, mixed_precision: Optional[str] = None,
                 reduce_dtype: Optional[torch.dtype] = None, max_grad_norm: Optional[float] = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, accumulate_locally: bool = False,
                 min_unit_mb: Optional[float] = None, bucket_buffers: int = DEFAULT_BUCKET_BUFFERS,
                 check_collectives: Optional[bool] = None):
        _checks.check_args(model, stage, lr, betas, eps, weight_decay, partition, bucket_mb)
        if bucket_mb is None:
            bucket_mb = DEFAULT_BUCKET_MB.get(stage, DEFAULT_BUCKET_MB[2])
        _checks.check_units(model, stage, units)
        _checks.check_min_unit_mb(min_unit_mb)
        _checks.check_bucket_buffers(bucket_buffers)
        _checks.check_precision(mixed_precision, reduce_dtype, max_grad_norm, init_scale, growth_factor,
                                backoff_factor, growth_interval)
        _checks.check_flags(adamw=adamw, overlap=overlap, overlap_param_gather=overlap_param_gather,
                            accumulate_locally=accumulate_locally)
        if check_collectives is not None:
            _checks.check_flags(check_collectives=check_collectives)
        _checks.check_process_group(process_group)
        self.model, self.stage, self.adamw, self.partition = model, stage, adamw, partition
        self.overlap, self.overlap_param_gather = overlap, overlap_param_gather
        self.mixed_precision = mixed_precision
        self.param_dtype = LOW_DTYPES[mixed_precision] if mixed_precision else torch.float32
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else self.param_dtype
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulate_locally = accumulate_locally
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ZeroAdam: the model has no trainable parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        _checks.check_same_across_ranks(model, self.group)
        _checks.broadcast_from_rank0(model, self.group)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(_checks.build_groups(param_groups, named, defaults), defaults)
        index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = [0] * len(self._params)
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_of[index_of[id(p)]] = g
        self._constructed = True  # add_param_group after this is an error

        _checks.check_dtypes(self._names, self._params, mixed_precision)
        self.min_unit_mb = DEFAULT_MIN_UNIT_MB if min_unit_mb is None else float(min_unit_mb)
        self.unit_plan: Optional[UnitPlan] = (find_units(model, self._params, units, int(self.min_unit_mb * 2**20),
                                                         torch.empty(0, dtype=self.param_dtype).element_size())
                                              if stage == 3 else None)
        self.layout: Layout = self._build_layout(bucket_mb)
        self.shard = ShardState(self.layout, self.rank, self._names, self._params, self.param_dtype,
                                self.reduce_dtype, sharded_params=stage == 3,
                                grad_views=stage == 1 and self.reduce_dtype == self.param_dtype)
        self._hooks = []
        if self.param_dtype != torch.float32:  # see [Note: mixed precision]
            cast_unmanaged(model, self.param_dtype)
            self._hooks.append(model.register_forward_pre_hook(InputCast(self.param_dtype), prepend=True,
                                                               with_kwargs=True))
        self.comm = BucketComm(self.group, self.layout, self.rank, self.shard.grad_shard,
                               self._gather_group() if stage == 3 else None, self.shard.grad_buckets,
                               bucket_buffers,
                               debug_from_env() if check_collectives is None else check_collectives)
        self._scaler = LossScaler(init_scale, growth_factor, backoff_factor, growth_interval,
                                  enabled=mixed_precision == "fp16")
        self._gather = ParamGather(self.comm, self.layout, self.shard.param_buffers)
        if overlap_param_gather and stage < 3:
            self._hooks += self._gather.register_waits(model, self._params)
        self.units: Optional[UnitTracker] = self._shard_params() if stage == 3 else None
        self._grads = GradReducer(self._params, self._names, self.layout, self.comm, self.shard,
                                  stage, overlap=overlap, accumulate_locally=accumulate_locally,
                                  scaler=self._scaler, gather=self._gather,
                                  always_python=overlap_param_gather and stage < 3)
        self.last_step_skipped = False  # fp16: the last step() found an inf or nan and skipped
        self._last_comm: dict = {}

    # --- construction ---------------------------------------------------------------------------

    def _build_layout(self, bucket_mb: float) -> Layout:
        reduce_size = torch.empty(0, dtype=self.reduce_dtype).element_size()
        numels = [p.numel() for p in self._params]
        owners = owners_for(self.partition, numels, self.world_size)
        if self.stage == 3:  # one bucket per unit, in backward order: see [Note: bucket order]
            return layout_from_groups(numels, self.unit_plan.groups[::-1], self.world_size, owners)
        bucket_numel = max(1, int(bucket_mb * 2**20) // reduce_size)
        order = list(reversed(range(len(numels))))  # backward order: see [Note: bucket order]
        first_bucket_numel = min(bucket_numel, _FIRST_BUCKET_BYTES // reduce_size)
        return build_layout(numels, order, self.world_size, bucket_numel, owners, first_bucket_numel)

    def _gather_group(self) -> dist.ProcessGroup:
        """Stage 3 gathers on a second group: see [Note: two process groups] in csrc/buckets.cpp."""
        ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        # With the same timeout as the group given: new_group's default is 30 minutes ([Note: faults]).
        return dist.new_group(ranks, timeout=group_timeout(self.group), use_local_synchronization=True)

    def _shard_params(self) -> UnitTracker:
        """Copy this rank's shards out, release every unit, and install the hooks."""
        buffers = UnitBuffers(self.shard.param_buffers, self.shard.param_shard, self.layout, self.rank, self.comm)
        buffers.shard_out()
        return UnitTracker(self.model, hook_needs(self.model, self._params, self.unit_plan), buffers)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise RuntimeError("ZeroAdam.add_param_group: parameter groups are fixed at construction (the flat "
                               "buffers, shards and collectives are laid out over them); pass every group as "
                               "ZeroAdam(model, param_groups=[...])")
        super().add_param_group(param_group)

    # --- the training loop's calls --------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss multiplied by the current loss scale under fp16 (as
        torch.amp.GradScaler.scale does); the same as loss.backward() otherwise."""
        self._scaler.backward(loss, **kwargs)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self._scaler.scale

    def no_sync(self):
        """The backwards inside only accumulate gradients; the step's last backward, outside, and
        step() then act on the sum. See [Note: accumulation] for what each stage communicates."""
        return self._grads.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear .grad (stage 1 keeps full local gradients there). Between a backward and step(),
        gradients already handed to the buckets cannot be taken back (their reduces are in flight
        on every rank): that is an error rather than a step that silently keeps them. Gradients
        accumulated only locally (stage 1, or accumulate_locally, inside no_sync) are dropped."""
        self._grads.zero_grad(set_to_none)

    def step(self, closure=None):
        """One optimizer step (phases 2-4). With a closure, as every torch optimizer: the closure
        (which runs forward and backward) is called under torch.enable_grad() first, and its loss
        is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step()
        return loss

    def _step(self) -> None:
        if self._grads.in_no_sync:
            raise RuntimeError("ZeroAdam.step() was called inside `with opt.no_sync():`; no_sync() wraps "
                               "the micro-batches whose gradients are only accumulated, and step() follows "
                               "the last backward, outside it")
        where = self.comm.where
        where.phase = "step() (phase 2: the reduces and the agreement)"
        self._gather.wait()                     # last step's, if some module never ran
        if self.units is not None:              # stage 3: nothing may stay gathered across the update
            self.units.release_all()
        prep = self._grads.prepare(self.max_grad_norm is not None, self.world_size,  # phase 2
                                   check=self._check_update)
        if self.max_grad_norm is not None:
            self._grads.clip(prep, self.max_grad_norm)
        anything = any(prep.used)  # agreed: the same on every rank
        if anything and not prep.found_inf:
            with torch.profiler.record_function("zerofast::adam"):  # phase 3
                self.shard.apply_adam(prep.used, self.param_groups, self._group_of, self.adamw,
                                      prep.grad_factor / (self.world_size * self._scaler.scale))
            if self.stage < 3:                  # phase 4 (stage 3: the next forward gathers)
                where.phase = "step() (phase 4: the parameter gather)"
                with torch.profiler.record_function("zerofast::gather"):
                    self._gather.start()
                    if not self.overlap_param_gather:
                        self._gather.wait()
        if anything:  # a step without gradients anywhere is no evidence for or against the scale
            self._scaler.update(prep.found_inf)
        self.last_step_skipped = prep.found_inf
        self._last_comm = dict(self.comm.stats)
        where.step += 1
        where.phase = "forward"
        self._grads.begin_step()

    def _check_update(self) -> None:
        """The last checks before an update, on every rank before the step's agreement, so that a
        failure here applies nothing anywhere ([Note: the step's agreement] in zerofast/grads.py):
        the hyper-parameters as a scheduler or user code may have left them."""
        for g, group in enumerate(self.param_groups):
            _checks.check_hyper(f".param_groups[{g}]", group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' global norm to max_norm, as torch.nn.utils.clip_grad_norm_ on the
        whole model would, and return the norm before clipping (a float32 tensor). Call it after
        the last backward of a step and before step(); the clipping is applied inside the fused
        kernel, through its grad_scale ([Note: global gradient clipping] in zerofast/grads.py)."""
        if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0):
            raise ValueError(f"ZeroAdam.clip_grad_norm_: max_norm must be a number > 0; got {max_norm!r}")
        if self._grads.in_no_sync:
            raise RuntimeError("ZeroAdam.clip_grad_norm_() was called inside `with opt.no_sync():`; clip after "
                               "the last backward of the step, outside it")
        self.comm.where.phase = "clip_grad_norm_() (the reduces and the agreement)"
        return self._grads.clip(self._grads.prepare(True, self.world_size, check=self._check_update),
                                float(max_norm))

    # --- the rest of the public surface ---------------------------------------------------------

    @contextlib.contextmanager
    def gathered_params(self):
        """Full, current parameters on every rank inside the block. Stages 1 and 2 always hold
        them, so this costs nothing there (beyond finishing gathers still in flight); stage 3
        gathers every unit and re-shards on exit (changes made inside the block are not kept)."""
        self._gather.wait()
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

    def units_report(self) -> list[dict]:
        """Stage 3: what each unit gathers together, in unit order (unit 0 is the root's remaining
        parameters, when there are any): its module's name ("" for the root), class, how many
        parameter tensors and elements it holds, and their bytes in the parameters' dtype. See
        [Note: choosing units] in zerofast/stage3.py. Empty for stages 1 and 2, which gather by bucket."""
        if self.unit_plan is None:
            return []
        size = torch.empty(0, dtype=self.param_dtype).element_size()
        report = []
        for u, (group, name) in enumerate(zip(self.unit_plan.groups, self.unit_plan.names)):
            numel = sum(self._params[i].numel() for i in group)
            report.append({"unit": u, "module": name, "class": type(self.unit_plan.modules[u]).__name__,
                           "modules": len(self.unit_plan.members[u]), "tensors": len(group), "numel": numel,
                           "bytes": numel * size})
        return report

    def memory_report(self) -> dict:
        """Bytes this rank holds now, by kind, counted from the tensors: "grads" is the full local
        gradients (stage 1: its gradient buckets, which .grad are views of; otherwise whatever
        .grad holds), "grad_shard" the reduced owned gradients of stages 2 and 3 (and of stage 1
        when it reduces in another dtype), "bucket_buffers" the pooled buffers in use now."""
        nbytes = self.shard.nbytes()
        grad_buckets = nbytes.pop("grad_buckets")
        local = sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        return {
            **nbytes,
            "grads": grad_buckets if self.shard.grad_buckets else local,
            "bucket_buffers": self.comm.buffer_bytes,
            "bucket_buffers_peak": self.comm.peak_buffer_bytes,
            "bucket_pool": self.comm.pooled_bytes,  # released buffers kept for reuse (<= the peak)
        }

    def materialized_param_bytes(self) -> int:
        """Bytes of parameter storage that exist now: gathered unit buffers (stage 3: only those
        gathered at this moment; stages 1 and 2: always all) plus stage 3's own shard."""
        return self.shard.materialized_param_bytes()

    def master_shard(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's part of the fp32 master copy, as (parameter name, offset into the flattened
        parameter, fp32 values) pieces; the ranks' pieces together cover every parameter once."""
        return self.shard.master_pieces()

    def step_counts(self) -> dict[str, int]:
        """Adam steps taken by each trainable parameter (a parameter with no gradient on any rank
        in a step does not advance: see [Note: unused parameters])."""
        return self.shard.step_counts()

    def comm_stats(self) -> dict:
        """Payload bytes of each collective in the last step (see zerofast/comm.py)."""
        return dict(self._last_comm)

    def state_dict(self) -> dict:
        """This rank's part of the training state as a torch.distributed.checkpoint state dict, for
        dcp.save: unlike a torch optimizer's, it holds the model's parameters too (in stage 3 and in
        mixed precision the fp32 master, which is the source of truth, lives here), each parameter
        and Adam moment by name in its own shape, this rank's pieces only (views of the live state).
        To restore: sd = opt.state_dict(); dcp.load(sd, ...); opt.load_state_dict(sd), in any
        configuration. zerofast.checkpoint.save/load do this with atomic folders and `extra`."""
        from .. import checkpoint
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Finish restoring after dcp.load filled a state_dict() of this optimizer (step counts,
        hyper-parameters, loss scale, low-precision parameters, the gather of stages 1 and 2)."""
        from .. import checkpoint
        checkpoint.load_state_dict(self, state_dict)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._grads.remove()
        if self.units is not None:
            self.units.remove()
