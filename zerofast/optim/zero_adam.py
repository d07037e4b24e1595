"""ZeroAdam: Adam/AdamW with ZeRO stage 1, 2 or 3 sharding, under the plain training loop.

    opt = ZeroAdam(model, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Goals: exactly single-process torch.optim.AdamW on the global batch; communication overlapped with
backward; one contiguous buffer per bucket, so collectives and the optimizer step run over long
flat ranges rather than per tensor.

A step, in phases, each owned by one object (its module holds the details and the named notes):
  Phase 1, during backward (GradReducer, zerofast/optim/grads.py): each gradient is copied into its slot
    of a bucket; a complete bucket's reduce starts at once, asynchronously, in bucket order.
  Phase 2, step() or an earlier clip_grad_norm_() (GradReducer): buckets not filled on this rank
    are launched with zeros; the ranks agree which parameters got a gradient anywhere; every reduce
    is waited for; with fp16 or clipping, one small all_reduce agrees on overflow and the global
    norm; an overflow skips phases 3 and 4 on every rank (LossScaler, zerofast/optim/precision.py).
  Phase 3, step() (ShardState, zerofast/optim/state.py): the fused Adam kernel over this rank's fp32
    master ranges, averaging, unscaling and clipping the gradient shard through its grad_scale.
  Phase 4, step() (ParamGather, zerofast/optim/gather.py): stages 1 and 2 gather each bucket's updated
    parameters straight into the flat buffers the model's parameters are views of; by default
    step() returns when every gather is done, with CommPolicy(overlap_param_gather=True) at once.
Stage 3 (UnitTracker over UnitBuffers, zerofast/stage3/runtime.py) shards the parameters themselves: each
unit (by default each block) is one bucket whose flat buffer exists only while gathered, module by
module with prefetch; the fp32 master is this rank's parameter shard, and there is no phase 4: the
next forward gathers. The communication itself is BucketComm (zerofast/comm.py over csrc/).

[Note: determinism]
Two runs with the same inputs give bitwise-identical results: the layout is a pure function of the
parameter list and the plan, buckets are launched in a fixed order, the collectives reduce in
a fixed order for a fixed world size, and the fused kernel is elementwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TypedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import BucketComm, group_timeout
from ..config import Plan, check_hyper, reject_moved, resolve_plan
from ..layout import Layout
from ..partition import imbalance
from ..stage3.frozen import FrozenShard, placeholder_grad_shard
from ..stage3.runtime import UnitBuffers, UnitPart, UnitTracker
from ..stage3.units import UnitPlan, hook_needs
from ..stage3.weights import named_full_tensors
from ..topology import Topology, resolve_topology
from . import checks as _checks
from .gather import ParamGather
from .grads import GradReducer
from .layouts import plan_layouts
from .precision import InputCast, LossScaler, cast_unmanaged
from .state import ShardState

__all__ = ["ZeroAdam"]


class ZeroAdam(torch.optim.Optimizer):
    """Adam/AdamW whose state (stage 1), gradients (stage 2) and parameters (stage 3) are sharded
    across the ranks of `process_group` (default: the whole world).

    model: the nn.Module whose trainable parameters it manages (a tied parameter is one parameter).
      Its parameters become views into zerofast's flat buffers. Frozen ones get no gradient or
      optimizer state; stage 3 shards them too, gathered with their unit ([Note: frozen
      parameters in stage 3] in zerofast/stage3/frozen.py), stages 1 and 2 leave them alone.
    stage: 1 shards the Adam state, 2 also the gradients, 3 also the parameters.
    lr, betas, eps, weight_decay: as torch.optim.AdamW's.
    adamw: decoupled weight decay (torch.optim.AdamW); False: torch.optim.Adam's L2 term.
    param_groups: torch.optim-style dicts over the model's trainable parameters ("lr", "betas",
      "eps", "weight_decay"; missing keys take the constructor's values).
    max_grad_norm: clip the global gradient norm to this at every step (None: no clipping);
      opt.clip_grad_norm_(max_norm) clips on request ([Note: global gradient clipping]).
    mixed_precision: None (fp32 parameters), "bf16", "fp16" or a MixedPrecisionPolicy (its reduce
      dtype and fp16's loss scaling): the model is converted as model.to(dtype) would (parameters,
      frozen ones too, and floating buffers), floating-point inputs of its forward are cast to that
      dtype, and the optimizer keeps the fp32 master shard and Adam state ([Note: mixed precision]).
    units: stage 3: a UnitPolicy, or what its `modules` takes (a list of submodules, a module class
      or set of classes, a callable module -> bool); None: the model's blocks, small ones merged.
    comm: a CommPolicy: partition, bucket size, buffers in flight, overlap, accumulation, and the
      collectives' debug check (None: CommPolicy()'s defaults).
    process_group: the data-parallel ranks (None: the whole world), or a 2-D DeviceMesh with
      mesh_dim_names ("replicate", "shard") as FSDP2's HSDP takes it: hybrid sharding by its groups.
    shard_size: hybrid sharding: the ranks form groups of shard_size consecutive ranks (a machine
      under torchrun), each group shards the state as above and the groups replicate it; the
      owned gradient shard is all_reduced across the replicas once per step (None: every rank
      shares one copy, flat ZeRO; 1: plain replication). [Note: hybrid sharding] in zerofast/topology.py.
    Every option is checked and resolved once into `opt.plan` (zerofast/config.py), which every part
    reads. Every wait is bounded by the process group's timeout (stage 3's gather group gets the
    same): a dead, stuck or out-of-step rank makes the others raise CollectiveError naming the step,
    the phase and the collective ([Note: faults] in zerofast/comm.py).
    """

    def __init__(
        self,
        model: nn.Module,
        stage: int = 2,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        param_groups: list[dict] | None = None,
        *,
        max_grad_norm: float | None = None,
        mixed_precision=None,
        units=None,
        comm=None,
        process_group=None,
        shard_size: int | None = None,
        **moved,
    ):
        reject_moved("ZeroAdam", moved)
        if not isinstance(model, nn.Module):
            raise TypeError(f"ZeroAdam: model must be an nn.Module; got {type(model).__name__}")
        plan = resolve_plan(
            stage, adamw=adamw, max_grad_norm=max_grad_norm, mixed_precision=mixed_precision, comm=comm, units=units
        )
        check_hyper("", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        _checks.check_process_group(process_group)
        self.plan: Plan = plan
        self.model = model
        group, shard_size, mesh = _checks.data_parallel_group(process_group, shard_size)
        self.group = group  # every data-parallel rank: [Note: hybrid sharding] in zerofast/topology.py
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ZeroAdam: the model has no trainable parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        _checks.check_same_across_ranks(model, self.group)
        _checks.broadcast_from_rank0(model, self.group)
        self.topology: Topology = resolve_topology(self.group, shard_size, group_timeout(self.group), mesh)
        # The layout's ranks: this rank's place in its shard group (the whole group when flat).
        self.shard_rank, self.shard_size = self.topology.shard_rank, self.topology.shard_size
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(self._build_param_groups(param_groups, named, defaults), defaults)
        index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = [0] * len(self._params)
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_of[index_of[id(p)]] = g
        self._constructed = True  # add_param_group after this is an error
        # Which of the model's parameters were trainable: the layout is built over them, so a change
        # of requires_grad later is an error at the next step (see _check_update).
        self._trainable_at_build = [(n, p, p.requires_grad) for n, p in model.named_parameters()]

        _checks.check_dtypes(self._names, self._params, plan.param_dtype)
        self._hooks = []
        if plan.separate_master:  # see [Note: mixed precision]; before stage 3 lays out the frozen parameters
            cast_unmanaged(model, plan.param_dtype)
            self._hooks.append(
                model.register_forward_pre_hook(InputCast(plan.param_dtype), prepend=True, with_kwargs=True)
            )
        layouts = plan_layouts(model, plan, self.shard_size, self._partition_costs())
        # Stage 3 shards the frozen parameters too: [Note: frozen parameters in stage 3].
        self._frozen_named = layouts.frozen_named
        self._unit_params: list[nn.Parameter] = layouts.unit_params  # the unit plan's parameters, in model order
        self.unit_plan: UnitPlan | None = layouts.unit_plan
        self._unit_buckets = layouts.unit_buckets  # stage 3: each unit's trainable bucket
        self.layout: Layout = layouts.layout
        self.shard = ShardState(self.layout, self.shard_rank, self._names, self._params, plan)
        self.frozen: FrozenShard | None = None
        if layouts.frozen_layout is not None:
            self.frozen = FrozenShard(
                layouts.frozen_layout,
                self.shard_rank,
                [n for n, _ in self._frozen_named],
                [p for _, p in self._frozen_named],
                layouts.frozen_bucket_of,
            )
        self._frozen_comm: BucketComm | None = None  # the frozen part's gathers (_shard_params)
        topo = self.topology
        self.comm = BucketComm(
            topo.shard_group,
            self.layout,
            self.shard_rank,
            self.shard.grad_shard,
            self._gather_group() if plan.params_sharded else None,
            self.shard.grad_buckets,
            plan.bucket_buffers,
            plan.check_collectives,
            replicate_group=topo.replicate_group,
            replicate_grads_group=self._second_group(topo.replicate_group),
            replicate_min_bytes=plan.replicate_bytes,
            dp_rank=self.rank,
            dp_world=self.world_size,
        )
        self._scaler = LossScaler(plan.loss_scale)
        self._gather = ParamGather(self.comm, self.layout, self.shard.param_buffers)
        if plan.overlap_param_gather:
            self._hooks += self._gather.register_waits(model, self._params)
        self.units: UnitTracker | None = self._shard_params() if plan.params_sharded else None
        self._grads = GradReducer(
            self._params,
            self._names,
            self.layout,
            self.comm,
            self.shard,
            plan,
            scaler=self._scaler,
            gather=self._gather,
        )
        self._step_skipped = False  # fp16: the last step() found an inf or nan and skipped
        self._last_comm: dict = {}

    @property
    def stage(self) -> int:
        return self.plan.stage

    @property
    def partition(self) -> str:
        return self.plan.partition

    @property
    def mixed_precision(self) -> str | None:
        """ "bf16", "fp16" or None, as the mixed_precision= shortcut names the parameters' dtype."""
        return self.plan.mixed_precision

    # --- construction ---------------------------------------------------------------------------

    def _second_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """A second group of the same ranks (None for None): collectives whose order is set by
        timing (stage 3's gathers, the replicas' gradient all_reduces during backward) get a group
        of their own, so they never pair up with another kind of collective."""
        if group is None:
            return None
        ranks = dist.get_process_group_ranks(group)
        # With the same timeout as the group given: new_group's default is 30 minutes ([Note: faults]).
        return dist.new_group(ranks, timeout=group_timeout(self.group), use_local_synchronization=True)

    def _gather_group(self) -> dist.ProcessGroup:
        """Stage 3 gathers on a second group: see [Note: two process groups] in csrc/buckets.cpp."""
        return self._second_group(self.topology.shard_group)  # only a rank's own shard group gathers its parameters

    def _shard_params(self) -> UnitTracker:
        """Copy this rank's shards out, release every unit, and install the hooks."""
        frozen = None
        if self.frozen is not None:  # gathers only, on the same gather group: no reduce, no gradient shard
            fz = self.frozen
            self._frozen_comm = BucketComm(
                self.topology.shard_group,
                fz.layout,
                self.shard_rank,
                placeholder_grad_shard(fz.layout.shard_numel(self.shard_rank), self.plan.reduce_dtype, fz.device),
                self.comm.gather_group,
                None,
                0,
                self.plan.check_collectives,
                dp_rank=self.rank,
                dp_world=self.world_size,
            )
            self._frozen_comm.share_bookkeeping(self.comm)
            frozen = UnitPart(fz.buffers, fz.shard, fz.layout, self._frozen_comm, fz.bucket_of)
        buffers = UnitBuffers(
            self.shard.param_buffers,
            self.shard.param_shard,
            self.layout,
            self.shard_rank,
            self.comm,
            self._unit_buckets,
            frozen,
        )
        buffers.shard_out()
        return UnitTracker(self.model, hook_needs(self.model, self._unit_params, self.unit_plan), buffers)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise RuntimeError(
                "ZeroAdam.add_param_group: parameter groups are fixed at construction (the flat "
                "buffers, shards and collectives are laid out over them); pass every group as "
                "ZeroAdam(model, param_groups=[...])"
            )
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
        if self._grads.phase.in_no_sync:
            raise RuntimeError(
                "ZeroAdam.step() was called inside `with opt.no_sync():`; no_sync() wraps "
                "the micro-batches whose gradients are only accumulated, and step() follows "
                "the last backward, outside it"
            )
        where = self.comm.where
        where.phase = "step() (phase 2: the reduces and the agreement)"
        self.quiesce()  # last step's gathers, if some module never ran; stage 3: none stays gathered across the update
        prep = self._grads.prepare(
            self.plan.max_grad_norm is not None,
            self.world_size,  # phase 2
            check=self._check_update,
        )
        if self.plan.max_grad_norm is not None:
            self._grads.clip(prep, self.plan.max_grad_norm)
        anything = any(prep.used)  # agreed: the same on every rank
        if anything and not prep.found_inf:
            self._update(prep.used, prep.grad_scale(self.world_size, self._scaler.scale))  # phase 3
            if self.plan.gather_after_step:  # phase 4 (stage 3: the next forward gathers)
                where.phase = "step() (phase 4: the parameter gather)"
                with torch.profiler.record_function("zerofast::gather"):
                    self._gather.start()
                    if not self.plan.overlap_param_gather:
                        self._gather.wait()
        if anything:  # a step without gradients anywhere is no evidence for or against the scale
            self._scaler.update(prep.found_inf)
        self._step_skipped = prep.found_inf
        self._last_comm = dict(self.comm.stats)
        if self._frozen_comm is not None:  # the frozen parameters' gathers: [Note: frozen parameters in stage 3]
            for name, nbytes in self._frozen_comm.stats.items():
                self._last_comm[name] = self._last_comm.get(name, 0) + nbytes
            self._frozen_comm.new_step()
        where.step += 1
        where.phase = "forward"
        self._grads.begin_step()

    # --- what a subclass with another update (ZeroMuon, zerofast/optim/muon.py) replaces ------------
    # The layout, phases 1, 2 and 4, stage 3's units and the checkpoints are this class's; a subclass
    # changes the parameter groups, greedy's costs and phase 3, through these four methods only.

    def _build_param_groups(self, param_groups, named, defaults) -> list[dict]:
        """The torch.optim param_groups over the trainable (name, parameter) pairs `named`."""
        return _checks.build_groups(param_groups, named, defaults)

    def _partition_costs(self) -> list[int] | None:
        """Per trainable parameter, its step cost for partition "greedy" (None: balance elements)."""
        return None

    def _check_group(self, index: int, group: dict) -> None:
        """One parameter group's hyper-parameters, as they are at a step."""
        check_hyper(f".param_groups[{index}]", group)

    def _update(self, used: list[bool], grad_scale: float | torch.Tensor) -> None:
        """Phase 3: update every owned range of a used parameter; the gradient shard holds the sum
        over ranks, and grad_scale (1/N, unscaling and clipping together; a 1-element device tensor
        once clipped) makes it the average."""
        with torch.profiler.record_function("zerofast::adam"):
            self.shard.apply_adam(used, self.param_groups, self._group_of, self.plan.adamw, grad_scale)

    def _check_update(self) -> None:
        """The last checks before an update, on every rank before the step's agreement, so that a
        failure here applies nothing anywhere ([Note: the step's agreement] in zerofast/optim/grads.py):
        the hyper-parameters as a scheduler or user code may have left them, and which parameters
        are trainable."""
        for g, group in enumerate(self.param_groups):
            self._check_group(g, group)
        for name, param, trainable in self._trainable_at_build:
            if param.requires_grad != trainable:
                raise RuntimeError(
                    f"ZeroAdam: {name}.requires_grad changed from {trainable} to {param.requires_grad} after "
                    f"ZeroAdam was built; its buffers and optimizer state are laid out over the parameters "
                    f"trainable at construction, so {'its gradient would be ignored' if param.requires_grad else 'it would silently stop training'}. "
                    f"Set requires_grad before building ZeroAdam (or build a new one)"
                )

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' global norm to max_norm, as torch.nn.utils.clip_grad_norm_ on the
        whole model would, and return the norm before clipping (a float32 tensor). Call it after
        the last backward of a step and before step(); the clipping is applied inside the fused
        kernel, through its grad_scale ([Note: global gradient clipping] in zerofast/optim/grads.py).
        max_norm=float("inf") only measures: the norm is returned and nothing is clipped (what
        trainers call to log the norm)."""
        prep = self._prepare_to_clip("clip_grad_norm_", "max_norm", max_norm, norm=True)
        return self._grads.clip(prep, float(max_norm))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every element of the step's gradient to [-clip_value, clip_value], as
        torch.nn.utils.clip_grad_value_ on the whole model after DDP's average would (the averaged,
        unscaled gradient). Call it after the last backward of a step and before step(); each rank
        clamps its own reduced shard, elementwise, so it costs no communication beyond the step's."""
        prep = self._prepare_to_clip("clip_grad_value_", "clip_value", clip_value, norm=False)
        self._grads.clamp(prep, float(clip_value), self.world_size)

    def _prepare_to_clip(self, method: str, arg: str, value, norm: bool):
        """What both clip methods do first: check their bound and where they are called, then finish
        the step's reduces (and the norm, with norm=True)."""
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"ZeroAdam.{method}: {arg} must be a number > 0; got {value!r}")
        if self._grads.phase.in_no_sync:
            raise RuntimeError(
                f"ZeroAdam.{method}() was called inside `with opt.no_sync():`; clip after "
                f"the last backward of the step, outside it"
            )
        self.comm.where.phase = f"{method}() (the reduces and the agreement)"
        return self._grads.prepare(norm, self.world_size, check=self._check_update)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() applied nothing because some rank's fp16 gradients held an inf
        or nan (torch.amp.GradScaler's skipped step; the same on every rank). False without fp16."""
        return self._step_skipped

    def train(self) -> None:
        """A no-op: trainers (transformers.Trainer, Accelerate) call optimizer.train() / eval() where
        the optimizer has them, for schedule-free optimizers that swap their parameters; ZeroAdam's
        parameters are the same in both modes."""

    def eval(self) -> None:
        """A no-op: see train()."""

    # --- the rest of the public surface ---------------------------------------------------------

    @contextlib.contextmanager
    def gathered_params(self):
        """Full, current parameters on every rank inside the block. Stages 1 and 2 always hold
        them, so this costs nothing there (beyond finishing gathers still in flight); stage 3
        gathers every unit on entry (every rank), keeps them gathered through any number of
        forwards inside (generation: no collective per token, so ranks may run different numbers
        of forwards) and re-shards on exit (changes made inside the block are not kept). See
        [Note: generation on stage 3] in zerofast/stage3/schedule.py."""
        self._gather.wait()
        if not self.plan.params_sharded:
            yield self.model
            return
        self.units.pin()
        try:
            yield self.model
        finally:
            self.units.unpin()

    def full_state_dict(self, keep: bool = True, device="cpu") -> dict[str, torch.Tensor] | None:
        """model.state_dict() with every tensor whole, copied to `device` (default the CPU): what a
        consolidated save (Hugging Face's save_pretrained, safetensors) writes. Stage 3 gathers one
        unit at a time, so no rank holds more than the copies plus one gathered unit. Every rank must
        call it (the gathers are collectives); ranks passing keep=False take part, copy nothing and
        get None. Tied tensors keep one copy under each of their names, as state_dict() has them."""
        self.quiesce()
        entries = self.model.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # a tied tensor is copied once

        def take_present() -> None:
            """Copy every entry whose storage exists now (stage 3: the unit gathered at the moment)."""
            for key, t in entries.items():
                if key not in out and (t.numel() == 0 or t.untyped_storage().nbytes() > 0):
                    if keep and id(t) not in copies:
                        copies[id(t)] = t.detach().to(device, copy=True)
                    out[key] = copies.get(id(t))

        if self.plan.params_sharded:
            for u in range(len(self.units.state)):
                self.units.acquire((u,))
                try:
                    take_present()
                finally:
                    self.units.release((u,))
        take_present()
        return out if keep else None

    def partition_report(self) -> dict:
        """Elements each rank owns (real parameters, not padding) and the imbalance max/mean."""
        owned = [self.layout.owned_numel(r) for r in range(self.shard_size)]
        return {"owned_numel": owned, "imbalance": imbalance(owned)}

    def units_report(self) -> list[dict]:
        """Stage 3: what each unit gathers together, in unit order (unit 0 is the root's remaining
        parameters, when there are any): its module's name ("" for the root), class, how many
        parameter tensors and elements it holds, and their bytes in the parameters' dtype, frozen
        ones included (stage 3 shards them too), and how many of the tensors and elements are frozen
        ("frozen_tensors", "frozen_numel": [Note: frozen parameters in stage 3]). See
        [Note: choosing units] in zerofast/stage3/units.py. Empty for stages 1 and 2, which gather by bucket."""
        if not self.plan.params_sharded:
            return []
        size = torch.empty(0, dtype=self.plan.param_dtype).element_size()
        report = []
        for u, (group, name) in enumerate(zip(self.unit_plan.groups, self.unit_plan.names)):
            params = [self._unit_params[i] for i in group]
            numel = sum(p.numel() for p in params)
            frozen = [p for p in params if not p.requires_grad]
            report.append(
                {
                    "unit": u,
                    "module": name,
                    "class": type(self.unit_plan.modules[u]).__name__,
                    "modules": len(self.unit_plan.members[u]),
                    "tensors": len(group),
                    "numel": numel,
                    "bytes": numel * size,
                    "frozen_tensors": len(frozen),
                    "frozen_numel": sum(p.numel() for p in frozen),
                }
            )
        return report

    def memory_report(self) -> dict:
        """Bytes this rank holds now, by kind, counted from the tensors: "grads" is the full local
        gradients (stage 1: its gradient buckets, which .grad are views of; otherwise whatever
        .grad holds), "grad_shard" the reduced owned gradients of stages 2 and 3 (and of stage 1
        when it reduces in another dtype), "bucket_buffers" the pooled buffers in use now,
        "frozen_params" stage 3's frozen parameters (their shard and gathered buffers; 0 in stages 1
        and 2, whose frozen parameters are the model's own tensors)."""
        nbytes = self.shard.nbytes()
        grad_buckets = nbytes.pop("grad_buckets")
        local = sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        return {
            **nbytes,
            "grads": grad_buckets if self.plan.grads_as_bucket_views else local,
            "bucket_buffers": self.comm.buffer_bytes,
            "bucket_buffers_peak": self.comm.peak_buffer_bytes,
            "bucket_pool": self.comm.pooled_bytes,  # released buffers kept for reuse (<= the peak)
            "frozen_params": self.units.buffers.materialized_bytes(first=1) if self.frozen is not None else 0,
        }

    def buffer_counts(self) -> dict[str, int]:
        """The pooled gradient bucket buffers, as the C++ side counts them: "live" (alive now),
        "peak_live" / "peak_alive" (the most in use, and in use + kept, at once), "max" (the budget,
        CommPolicy.bucket_buffers; 0: no bound) and "over_budget" (how often backward found no reduce
        in flight to wait for)."""
        return self.comm.buffer_counts()

    def materialized_param_bytes(self) -> int:
        """Bytes of parameter storage that exist now: gathered unit buffers (stage 3: only those
        gathered at this moment; stages 1 and 2: always all) plus stage 3's own shard; stage 3's
        frozen parameters alike (their gathered buffers and shard). Stages 1 and 2 count the
        trainable parameters only (their frozen parameters are the model's own tensors)."""
        frozen = self.units.buffers.materialized_bytes(first=1) if self.frozen is not None else 0
        return self.shard.materialized_param_bytes() + frozen

    def master_shard(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's part of the fp32 master copy, as (parameter name, offset into the flattened
        parameter, fp32 values) pieces; the ranks' pieces together cover every parameter once."""
        return self.shard.master_pieces()

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every entry of model.state_dict(), whole and in the model's dtype, one
        at a time, stage 3 gathering one unit at a time: for sending weights to an inference engine
        with no rank holding the whole model (zerofast/stage3/weights.py). Every rank must run it
        to its end (the gathers are collectives)."""
        self.quiesce()
        return named_full_tensors(self.model, self.units)

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
        # The dependency runs optim -> checkpoint, which reads this optimizer through the typed
        # accessors at the end of the class; imported here, not at the top, because importing
        # torch.distributed.checkpoint costs ~0.8 s and only checkpointing needs it.
        from ..checkpoint import dcp

        return dcp.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Finish restoring after dcp.load filled a state_dict() of this optimizer (step counts,
        hyper-parameters, loss scale, low-precision parameters, the gather of stages 1 and 2)."""
        from ..checkpoint import dcp  # lazy: see state_dict()

        dcp.load_state_dict(self, state_dict)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._grads.remove()
        if self.plan.params_sharded:
            self.units.remove()

    # --- typed access to the state, for checkpoints and tools ------------------------------------
    # zerofast.checkpoint reads and writes the optimizer only through these (and the ShardState
    # accessors of opt.shard, the layout and param_groups), never through underscored attributes.

    @property
    def named_params(self) -> tuple[tuple[str, nn.Parameter], ...]:
        """The managed (trainable) parameters and their names, in the optimizer's order: index i
        is parameter i of the layout, of the step counts and of a checkpoint."""
        return tuple(zip(self._names, self._params))

    def param_index(self, param: torch.Tensor) -> int | None:
        """The index of a managed parameter in named_params (by identity), or None for any
        other tensor (a frozen parameter, a buffer)."""
        return self._index_of.get(id(param))

    @functools.cached_property
    def _index_of(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self._params)}

    def state_kinds(self, index: int) -> tuple[str, ...]:
        """The optimizer state parameter `index` of named_params holds, by ShardState's kind names
        (what a checkpoint saves under its name): Adam's moments."""
        return ("exp_avg", "exp_avg_sq")

    @property
    def frozen_named_params(self) -> tuple[tuple[str, nn.Parameter], ...]:
        """Stage 3's sharded frozen parameters and their names (index j is parameter j of
        self.frozen.layout); empty in stages 1 and 2 ([Note: frozen parameters in stage 3])."""
        return tuple(self._frozen_named)

    def frozen_index(self, param: torch.Tensor) -> int | None:
        """The index of a sharded frozen parameter in frozen_named_params (by identity), or None."""
        return self._frozen_index_of.get(id(param))

    @functools.cached_property
    def _frozen_index_of(self) -> dict[int, int]:
        return {id(p): j for j, (_, p) in enumerate(self._frozen_named)}

    def quiesce(self) -> None:
        """Bring the state to rest, so that the shard alone is the state and nothing writes it:
        wait for parameter gathers still in flight (stages 1 and 2) and release every gathered unit
        (stage 3). Before reading or writing the state outside step()."""
        self._gather.wait()  # last step's, if some module never ran
        if self.plan.params_sharded:  # stage 3: nothing stays gathered
            self.units.release_all()

    def sync_params_from_master(self) -> None:
        """After the fp32 master was written outside step() (a load, with the state at rest):
        the low-precision parameters become its rounding, and (stages 1 and 2) every rank's full
        parameters are gathered from their owners. Stage 3's next forward gathers."""
        self.shard.sync_params_from_master()
        if not self.plan.params_sharded:
            self._gather.start()
            self._gather.wait()

    def loss_scaler_state(self) -> ScalerState:
        """fp16's dynamic loss scale as plain data (enabled False without fp16 loss scaling)."""
        s = self._scaler
        return ScalerState(scale=s.scale, growth_tracker=s.growth_tracker, enabled=s.enabled)

    def load_loss_scaler_state(self, state: ScalerState) -> None:
        """Restore loss_scaler_state(): the scale and growth tracker, when loss scaling is on here
        and was on where the state came from; otherwise this optimizer's own scale stays."""
        if self._scaler.enabled and state["enabled"]:
            self._scaler.scale, self._scaler.growth_tracker = float(state["scale"]), int(state["growth_tracker"])


class ScalerState(TypedDict):
    """ZeroAdam.loss_scaler_state(): fp16's loss scale, as torch.amp.GradScaler keeps it."""

    scale: float
    growth_tracker: int  # clean steps in a row since the scale last changed
    enabled: bool
