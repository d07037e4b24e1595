"""Phases 1 and 2 of a step: gradients into buckets, bucket reduces, and the ranks' agreement.

Phase 1, during backward: a hook per parameter (compiled: [Note: the gradient path]) copies its
gradient into its slot of a bucket (stages 2 and 3 then drop param.grad); when every parameter of a bucket is in,
the bucket's reduce starts at once, asynchronously, buckets strictly in index order (which is
backward order: [Note: bucket order] in zerofast/layout.py). "flat" reduces each bucket into this
rank's gradient shard; "round_robin" and "greedy" reduce each owner's segment to that owner.
Phase 2, at step() (or an earlier clip_grad_norm_()): buckets a rank never filled are launched with
zeros in the missing slots; the ranks agree which parameters got a gradient anywhere; all reduces
are waited for; with fp16 or clipping, one small all_reduce agrees on overflow and the global norm.

Where a step is lives in one StepPhase; GradReducer switches on it.

[Note: the gradient path]
Each gradient's work in phase 1 is the compiled GradPath's (csrc/grad_path.cpp): one autograd post
hook per parameter, on its AccumulateGrad node (where DDP's reducer hooks too; several post hooks
live on one node, so a user's hooks and ours never replace each other), copies the gradient into its
slot (stage 1: points .grad at it), drops .grad (stages 2 and 3), counts the bucket and launches
every complete bucket in order, with no Python frame. It also holds the state both paths share:
which parameters got a gradient, each bucket's missing count, the next bucket to launch.
Python keeps what Python must decide, through _on_grad (called with the GIL): the first gradient of
each backward (it queues the backward's end and sets the phase), every gradient under no_sync (local
accumulation or per-micro-batch reduces), fp16 (each checks its backward was scaled), the
overlapped gather (each checks its bucket was waited for), between clip_grad_norm_() and step(),
with check_collectives (each launch is described first), and a second gradient (an error).
_refresh() sets python_decides whenever one of those changes. A failure inside the compiled path
(a reduce that cannot complete) comes back through _on_error as the CollectiveError Python's path
would raise. Measured (benchmarks/bench_grad_path.py): see README, "Per-gradient cost".

[Note: the step's agreement]
Phase 2's one small all_reduce(MAX) carries, besides which parameters got a gradient, this rank's
step count, micro-batch count and running hashes of the buckets it reduced and gathered this step,
in order (each also negated, so the MAX yields both the largest and the smallest), and a failure
flag. Ranks whose counts differ raise OutOfStepError on every rank, before anything is applied: a
rank that ran an extra micro-batch or skipped one (stage 1, whose extra micro-batches communicate
nothing), or (stage 3) ran its modules in another order, so that gathers paired up with the wrong
buckets of the same size, a silent mix of data that only this check sees. Where the collectives
themselves no longer pair up (stages 2 and 3: an extra micro-batch issues extra reduces), the
mismatch may first surface as a CollectiveError or a hang up to the timeout; check_collectives
(ZEROFAST_DEBUG=1) catches it before the first differing collective is issued. The failure flag makes the update all-or-nothing: the last checks before it (the
hyper-parameters of every group, as an lr scheduler may have left them) run on every rank before
the agreement; if any rank's fail, every rank raises and applies nothing, the parameters and
optimizer state stay those of the previous step everywhere, and the step's gradients are dropped.
After the agreement, phase 3 is elementwise kernels over memory that already exists, and phase 4
(stages 1 and 2) only moves the updated owned ranges, which a checkpoint reads from their owners.

[Note: unused parameters]
A parameter that gets a gradient on no rank in a step is left untouched, as torch.optim.AdamW leaves
a parameter whose grad is None: no update, no state change, its step count unchanged. Where some
ranks have a gradient and others none, the missing ones count as zero (their slot is zeroed before
the reduce). Which case holds is agreed by one small all_reduce(MAX) per step.

[Note: global gradient clipping]
The global norm is that of the averaged, unscaled gradient: each rank computes the squared norm of
its reduced gradient shard (every element of the model sits in exactly one rank's shard; a tied
parameter is one parameter; padding is zero), one all_reduce sums them, and the norm is
sqrt(sum) / (N * scale). The coefficient min(1, max_norm / (norm + 1e-6)), torch's, joins 1/N and
1/scale in the kernel's grad_scale, so clipping costs no pass over the gradients.

[Note: accumulation]
`with opt.no_sync():` around every micro-batch but the last; every rank runs the same number of
micro-batches (stages 2 and 3 communicate in each, as every rank runs the same number of steps).
Stage 1 (which holds full gradients anyway) lets .grad accumulate as autograd does and reduces
once, in the last backward: Φ of reduce per step however many micro-batches. Stages 2 and 3 by
default reduce every micro-batch into the owned gradient shard, as DeepSpeed does: k micro-batches
cost k·Φ of reduce, but gradient memory stays at the shard ([Note: accumulation into the shard] in
csrc/buckets.cpp). With accumulate_locally=True they keep full local gradients during no_sync (2Φ
bytes more on each rank in mixed precision, 4Φ in fp32) and reduce once, as stage 1. Reduces in
reduce_dtype add in reduce_dtype too: accumulating many bf16 micro-batches into a bf16 shard
rounds each time; reduce_dtype=torch.float32 avoids that.
"""
from __future__ import annotations

import contextlib
import enum
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import _C, _ops
from ..comm import BucketComm, OutOfStepError, is_comm_failure
from .gather import ParamGather
from ..config import Plan
from ..layout import Layout
from .precision import LossScaler
from .state import ShardState


class StepNotAppliedError(RuntimeError):
    """step() applied nothing on any rank, because some rank failed before the update."""


class StepPhase(enum.Enum):
    IDLE = "idle"
    """No gradient has reached a bucket since the last step(); zero_grad() may clear .grad (gradients
    accumulated only locally, stage 1 inside no_sync, are dropped with it)."""
    BACKWARD = "backward"
    """This micro-batch's gradients are going into buckets; each bucket's reduce starts when it is
    complete. Reduces already launched cannot be taken back: zero_grad() is an error."""
    ACCUMULATED = "accumulated"
    """Stages 2 and 3 inside no_sync(): a micro-batch's backward ended with every bucket launched; the
    next micro-batch's reduces add into the shard ([Note: accumulation])."""
    PREPARED = "prepared"
    """Phase 2 ran before step() (clip_grad_norm_): every reduce waited for, the ranks agreed; no
    gradient may arrive until step()."""


@dataclass
class Prepared:
    """What phase 2 agreed on, for the rest of the step."""
    used: list[bool]            # which parameters got a gradient on some rank
    found_inf: bool             # some rank's gradient shard holds an inf or nan (fp16 only)
    norm: Optional[torch.Tensor]  # global norm of the averaged, unscaled gradient (when clipping)
    grad_factor: float          # the clip coefficients so far (1.0: none)


class GradReducer:
    """Phases 1 and 2 over one BucketComm: the gradient path, the launches, the flush and the
    agreement. The per-gradient state (which parameters got a gradient, each bucket's missing
    count, the next bucket to launch) lives in the compiled GradPath, which both paths update."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], layout: Layout, comm: BucketComm,
                 shard: ShardState, plan: Plan, *, scaler: LossScaler, gather: ParamGather):
        self.params, self.names, self.layout, self.comm = params, names, layout, comm
        self.plan = plan
        self.shard = shard                    # where the reduces leave this rank's owned gradients
        # Stage 1: each parameter's slot in the persistent buckets, which .grad is pointed at
        # ([Note: grads as bucket views] in csrc/buckets.cpp); None where gradients are copied.
        self.views = shard.grad_views(params)
        self.overlap = plan.overlap
        self.accumulates_locally = plan.accumulates_locally  # under no_sync: .grad accumulates
        self.scaler, self.gather = scaler, gather
        # Every gradient through Python: fp16 (each gradient checks its backward was scaled), the
        # overlapped gather (each checks its bucket's gather was waited for), check_collectives
        # (each launch is described first). See [Note: the gradient path].
        self.always_python = plan.overlap_param_gather or plan.scales_loss or plan.check_collectives
        self.in_no_sync = False
        slots = layout.slots
        # The compiled path calls back through weak references: it must not keep this reducer (and
        # with it the optimizer) alive, since the garbage collector cannot see references held in C++.
        me = weakref.ref(self)
        self.path = _C.GradPath(comm._impl, params, [s.bucket for s in slots], [s.offset for s in slots],
                                [len(b.params) for b in layout.buckets], self.views or [], plan.grads_sharded,
                                plan.overlap,
                                _Callback(me, "_on_grad"), _Callback(me, "_on_error"))
        self.begin_step()

    # --- the step's bookkeeping -----------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step. Stage 1 with gradient views: the reduce has consumed .grad (its owned range
        now holds the sum over ranks, the rest is no gradient of this step), so .grad is dropped, as
        stages 2 and 3 drop it in backward; the buckets stay for the next backward."""
        n = len(self.params)
        if self.views is not None:
            for p in self.params:
                p.grad = None
        self.phase = StepPhase.IDLE
        self.local = [False] * n       # holds a locally accumulated .grad not yet in a bucket
        self.reduced_micro_batches = 0  # no_sync micro-batches already reduced into the shard
        self.micro_batches = 0          # backwards that gave gradients in this step
        self.comm.where.micro_batch = 0
        self.prepared: Optional[Prepared] = None  # phase 2's result, in PREPARED
        self.path.begin_step()          # used, got_grad, missing, next_launch; no backward running
        self._refresh()
        self.comm.new_step()

    def _begin_micro_batch(self) -> None:
        self.path.begin_micro_batch()

    def _refresh(self) -> None:
        """Whether the compiled path may take gradients without Python: [Note: the gradient path]."""
        self.path.python_decides = (self.always_python or self.in_no_sync or self.phase is StepPhase.PREPARED)
        self.path.accumulate = self.reduced_micro_batches > 0

    # --- phase 1 --------------------------------------------------------------------------------

    def _on_grad(self, index: int) -> None:
        """Python's path for one gradient (the compiled hook calls it with the GIL)."""
        param = self.params[index]
        self._check_grad_allowed(index)
        if not self.path.in_backward:  # the first gradient of this backward
            self.path.in_backward = True
            self.comm.where.phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.path.set_used(index)
        if self.in_no_sync and self.accumulates_locally:
            if self.views is not None:
                self._point_at_view(index, param)
            self.local[index] = True  # .grad accumulates; the last micro-batch copies it
            return
        if self.path.got_grad(index):
            raise RuntimeError(
                f"ZeroAdam: {self.names[index]} got a second gradient before step(); call opt.step() "
                f"after each backward, or run the earlier backwards of an accumulated step inside "
                f"`with opt.no_sync():`")
        self.phase = StepPhase.BACKWARD
        self.local[index] = False
        bucket = self.layout.slots[index].bucket
        # Into the slot, .grad dropped in stages 2 and 3 ([Note: grads as views]), counted, and
        # launched (in C++ unless Python decides the launches too).
        self.comm.run(lambda: f"an earlier reduce (waited for before bucket {bucket} takes a gradient)",
                      self.path.accept, index)
        if self.overlap:
            self.launch_ready()

    def _on_error(self, index: int, message: str) -> None:
        """A failure in the compiled path's copy or launch, raised as Python's path would raise it."""
        if not is_comm_failure(RuntimeError(message)):  # not the backend's: named, and raised as it is
            raise RuntimeError(f"ZeroAdam: {self.names[index]}: {message}")
        bucket = self.layout.slots[index].bucket
        raise self.comm.failed(f"the gradient path at bucket {bucket} (its copy, or a reduce it launched or "
                               f"waited for)", RuntimeError(message))

    def _point_at_view(self, index: int, param: torch.Tensor) -> None:
        """Make .grad the parameter's bucket slot: autograd accumulated into it in place, unless
        .grad was None (autograd then hands over a fresh tensor) or user code replaced it; then its
        values are copied into the slot once, and the slot becomes .grad."""
        view, grad = self.views[index], param.grad
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    def _check_grad_allowed(self, index: int) -> None:
        name = self.names[index]
        if self.scaler.enabled and not self.scaler.in_scaled_backward:
            raise RuntimeError(
                f"ZeroAdam(mixed_precision='fp16'): {name} got a gradient from a backward that did not "
                f"scale the loss; call opt.backward(loss) instead of loss.backward() ([Note: loss scaling])")
        if self.gather.pending[self.layout.slots[index].bucket]:
            raise RuntimeError(
                f"ZeroAdam(overlap_param_gather=True): {name} was used while its gather was still in flight "
                f"(read outside the forward of a module that holds it); this step's result would be wrong. "
                f"Read it inside its module's forward, or pass overlap_param_gather=False. See "
                f"[Note: overlapped parameter gather]")
        if self.phase is StepPhase.PREPARED:
            raise RuntimeError(f"ZeroAdam: {name} got a gradient after clip_grad_norm_() and before step(); "
                               f"clip after the last backward of the step")

    def launch_ready(self) -> None:
        """Start every complete bucket whose predecessors have all started: see [Note: bucket order].
        With check_collectives each launch goes through Python, which describes it first."""
        if not self.comm.check:
            self.comm.run("the reduce of a complete bucket", self.path.launch_ready)
            return
        buckets = self.layout.buckets
        while self.path.next_launch < len(buckets) and self.path.missing(self.path.next_launch) == 0:
            with torch.profiler.record_function("zerofast::reduce"):
                self.comm.reduce(self.path.next_launch, self.reduced_micro_batches > 0)
            self.path.next_launch += 1

    def _end_backward(self) -> None:
        """End of a backward that gave this optimizer gradients: one more micro-batch (counted, so
        the ranks can check they ran the same number: [Note: the step's agreement])."""
        self.path.in_backward = False
        self.micro_batches += 1
        self.comm.where.micro_batch = self.micro_batches
        self.comm.where.phase = "after backward"
        if self.in_no_sync and not self.accumulates_locally:
            self._end_micro_batch()

    def _end_micro_batch(self) -> None:
        """End of a backward inside no_sync() (stages 2 and 3, reducing every micro-batch): launch
        every bucket, then let the next micro-batch's reduces add into the shard."""
        self.flush()
        self.reduced_micro_batches += 1
        self.phase = StepPhase.ACCUMULATED
        self._begin_micro_batch()
        self._refresh()

    @contextlib.contextmanager
    def no_sync(self):
        if self.in_no_sync:
            raise RuntimeError("ZeroAdam.no_sync() is already active: no_sync() blocks cannot be nested")
        self.in_no_sync = True
        self._refresh()
        try:
            yield
        finally:
            self.in_no_sync = False
            self.path.in_backward = False  # a backward that raised may have left it set, its end never run
            self._refresh()

    def zero_grad(self, set_to_none: bool) -> None:
        if self.phase is not StepPhase.IDLE:
            raise RuntimeError("ZeroAdam.zero_grad() was called between backward and step(): this step's "
                               "gradients are already being reduced across ranks and would still be "
                               "applied; call step() first (or zero_grad() only at the start of an iteration)")
        self.path.begin_step()
        self.local = [False] * len(self.params)
        self.micro_batches = 0  # micro-batches accumulated only locally are dropped with their gradients
        self.comm.where.micro_batch = 0
        if self.views is not None and not set_to_none:  # zeroed slots: autograd accumulates in place
            for g in self.shard.grad_buckets:
                g.zero_()
            for p, view in zip(self.params, self.views):
                p.grad = view
            return
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # --- phase 2 --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Launch what backward did not: a locally accumulated gradient where one is waiting, zeros
        for a parameter without gradient here ([Note: unused parameters])."""
        path = self.path
        for b in range(path.next_launch, len(self.layout.buckets)):
            for i in self.layout.buckets[b].params:
                if path.got_grad(i):
                    continue
                s = self.layout.slots[i]
                p = self.params[i]
                if self.local[i] and p.grad is not None:
                    if self.views is not None:
                        self._point_at_view(i, p)
                    else:
                        self.comm.add_grad(s.bucket, s.offset, p.grad)
                    if self.plan.grads_sharded:
                        p.grad = None
                else:
                    self.comm.zero_slot(s.bucket, s.offset, s.numel)
                path.set_got_grad(i)
            path.clear_missing(b)
        self.launch_ready()

    def prepare(self, need_norm: bool, world_size: int, check: Optional[Callable[[], None]] = None) -> Prepared:
        """Phase 2, once per step (step() or an earlier clip_grad_norm_()): every bucket reduced, the
        ranks agreed on which parameters got a gradient, that they are in step, and that none failed
        before the update ([Note: the step's agreement]), and, where loss scaling or clipping needs
        them, on whether any gradient overflowed and on the global gradient norm. check: this rank's
        last checks before the update; what it raises makes every rank raise, nothing applied."""
        if self.prepared is not None:  # clip_grad_norm_() ran it; it computed the norm
            return self.prepared
        failure = None
        try:
            if check is not None:
                check()
        except Exception as e:  # noqa: BLE001  (any error: the ranks must agree to apply nothing)
            failure = e
        self.flush()
        where = self.comm.where
        with torch.profiler.record_function("zerofast::reduce"):
            device = self.shard.grad_shard.device
            local_used = self.path.used_list()
            n = len(local_used)
            counts = [where.step, self.micro_batches, *self.comm.order_hashes()]
            flags = torch.tensor(local_used + [v for c in counts for v in (c, -c)]
                                 + [0 if failure is None else self.comm.rank + 1], dtype=torch.int64, device=device)
            self.comm.all_reduce_max(flags)
            agreed = flags.tolist()
            used = [bool(x) for x in agreed[:n]]
            (steps, micro, reduces, gathers) = [(agreed[n + 2 * i], -agreed[n + 2 * i + 1]) for i in range(4)]
            failed = agreed[n + 8]
            if steps[0] != steps[1] or micro[0] != micro[1]:
                raise OutOfStepError(
                    f"ZeroAdam (rank {self.comm.rank}): the ranks are out of step at step() of step {where.step + 1}: "
                    f"they have taken {steps[1]} to {steps[0]} steps and run {micro[1]} to {micro[0]} micro-batches "
                    f"(this rank: {where.step} and {self.micro_batches}). Every rank must run the same "
                    f"micro-batches and call step() as often; nothing was applied")
            if reduces[0] != reduces[1] or gathers[0] != gathers[1]:
                which = "gathers (stage 3: the modules ran in another order)" if gathers[0] != gathers[1] else "reduces"
                raise OutOfStepError(
                    f"ZeroAdam (rank {self.comm.rank}): the ranks are out of step at step() of step {where.step + 1}: "
                    f"they issued different {which} in this step, so collectives paired up wrongly and this "
                    f"step's gradients are not to be trusted; nothing was applied. Every rank must run the same "
                    f"modules in the same order; ZEROFAST_DEBUG=1 names the first collective that differs")
            self.comm.wait_reduces()
        if failed:
            self.begin_step()  # this step's gradients are dropped; nothing was applied
            note = (f"ZeroAdam: step {where.step + 1} was not applied on any rank: rank {failed - 1} failed before "
                    f"the update; parameters and optimizer state are those after step {where.step} on every rank, "
                    f"and this step's gradients are dropped")
            if failure is not None:
                failure.add_note(note)
                raise failure
            raise StepNotAppliedError(note + " (see that rank's error)")
        found_inf, sumsq = False, None
        if self.scaler.enabled or need_norm:
            stats = torch.zeros(2, dtype=torch.float32, device=device)
            owned = self.shard.owned_grads()
            if self.scaler.enabled:  # see [Note: loss scaling]
                for g in owned:
                    _ops.nonfinite_check_(g, stats[0:1])
            if need_norm:  # padding is zero, and each element sits in exactly one rank's shard
                stats[1] = sum(torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in owned)
            self.comm.all_reduce_sum(stats)
            found_inf, sumsq = bool(stats[0].item() > 0), stats[1]
        norm = None
        if sumsq is not None:  # the norm of the averaged, unscaled gradient
            norm = sumsq.sqrt() / (world_size * self.scaler.scale)
        self.prepared = Prepared(used, found_inf, norm, 1.0)
        self.phase = StepPhase.PREPARED
        self._refresh()
        return self.prepared

    @staticmethod
    def clip(prep: Prepared, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s coefficient, folded into grad_factor: applying it twice
        (clip_grad_norm_ and max_grad_norm) acts as clipping twice would. See
        [Note: global gradient clipping]."""
        norm = prep.norm * prep.grad_factor
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        prep.grad_factor *= float(coef)
        return norm

    def remove(self) -> None:
        self.path.remove_hooks()


class _Callback:
    """A method of the GradReducer, called by the compiled path through a weak reference."""

    def __init__(self, ref: "weakref.ref[GradReducer]", name: str):
        self.ref, self.name = ref, name

    def __call__(self, *args) -> None:
        reducer = self.ref()
        if reducer is not None:
            getattr(reducer, self.name)(*args)
