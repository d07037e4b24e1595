"""GradReducer: phases 1 and 2 of a step (gradients into buckets, bucket reduces, the ranks' agreement).

Phase 1, during backward: the compiled gradient path ([Note: the gradient path] in csrc/grad_path.cpp)
takes each gradient as it is accumulated: checks it against its parameter, copies it into its bucket
slot (stages 2 and 3 then drop param.grad; stage 1's .grad is the slot), and once a bucket is complete
starts its reduce, asynchronously, buckets strictly in index order, which is backward order
([Note: bucket order] in zerofast/layout.py). "flat" reduces each bucket into this rank's gradient
shard; "round_robin" and "greedy" reduce each owner's segment to that owner.
Phase 2, at step() (or an earlier clip_grad_norm_()): buckets a rank never filled are launched with
zeros in the missing slots; the ranks agree which parameters got a gradient anywhere; all reduces
are waited for; with fp16 or clipping, one small all_reduce agrees on overflow and the global norm.

The step's phase is one variable, GradReducer.phase (a StepPhase), changed only by _enter, which also
sets how the compiled path takes gradients; every gradient's own state (which parameters got one,
which slots are filled, the next bucket to launch) is the compiled GradPath's alone.
Notes: [Note: the step's agreement] in agreement.py; here [Note: accumulation] at no_sync(),
[Note: unused parameters] at flush(), [Note: global gradient clipping] at clip().
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _ops
from ..comm import BucketComm
from ..config import Plan
from ..errors import OutOfStepError, StepNotAppliedError  # noqa: F401  (StepNotAppliedError: raised here, re-exported)
from ..layout import Layout
from ..tensor_parallel import TensorParallel
from . import host_reads
from .agreement import Agreed, AgreementLayout  # noqa: F401  ([Note: the step's agreement])
from .gather import ParamGather
from .precision import LossScaler
from .state import ShardState


class StepPhase(enum.Enum):
    """Where the step is, for its gradients (GradReducer.phase). Inside no_sync(): NO_SYNC and
    NO_SYNC_REDUCING; outside it, the others."""

    IDLE = "idle"
    """Outside no_sync(), no gradient of this step in a bucket yet: zero_grad() may clear .grad
    (gradients accumulated only locally under an earlier no_sync() are dropped with it)."""
    NO_SYNC = "no_sync"
    """Inside no_sync(), no gradient of this step in a bucket yet. With local accumulation (stage 1,
    or accumulate_locally) each backward leaves its gradients in .grad (stage 1: the bucket views)
    for the last micro-batch to hand over; otherwise the first gradient moves to NO_SYNC_REDUCING."""
    REDUCING = "reducing"
    """Outside no_sync(), gradients of this step are in buckets, each bucket's reduce started when it
    was complete. Reduces already launched cannot be taken back: zero_grad() is an error."""
    NO_SYNC_REDUCING = "no_sync_reducing"
    """Inside no_sync(), stages 2 and 3 reducing every micro-batch: a backward's end launches every
    bucket, and the next micro-batch's reduces add into the shard ([Note: accumulation])."""
    PREPARED = "prepared"
    """Phase 2 ran before step() (clip_grad_norm_): every reduce waited for, the ranks agreed; no
    gradient may arrive and no no_sync() begin until step()."""

    @property
    def in_no_sync(self) -> bool:
        return self in (StepPhase.NO_SYNC, StepPhase.NO_SYNC_REDUCING)


@dataclass
class Prepared:
    """What phase 2 agreed on, for the rest of the step."""

    used: list[bool]  # which parameters got a gradient on some rank
    found_inf: bool  # some rank's gradient shard holds an inf or nan (fp16 only)
    norm: torch.Tensor | None  # global norm of the averaged, unscaled gradient (when clipping)
    # The clip coefficients so far: 1.0 (none), or once clipped a float64 device tensor (0-dim),
    # kept on the device ([Note: host syncs] in zerofast/optim/host_reads.py).
    grad_factor: float | torch.Tensor

    def grad_scale(self, world_size: int, loss_scale: float) -> float | torch.Tensor:
        """The fused kernel's grad_scale: 1/N, unscaling and clipping together. A float, or (once
        clipped) a 1-element float32 device tensor holding the float64 quotient rounded once, the
        value the float path passes."""
        if isinstance(self.grad_factor, torch.Tensor):
            return (self.grad_factor / (world_size * loss_scale)).float().reshape(1)
        return self.grad_factor / (world_size * loss_scale)


class GradReducer:
    """Phases 1 and 2 over one BucketComm: the step's phase, Python's part of the gradient path, the
    flush and the agreement (each gradient's own state is the compiled GradPath's)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        layout: Layout,
        comm: BucketComm,
        shard: ShardState,
        plan: Plan,
        *,
        scaler: LossScaler,
        gather: ParamGather,
        tp: TensorParallel | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ):
        self.params, self.names, self.layout, self.comm = params, names, layout, comm
        self.tp = tp  # [Note: tensor parallelism] in zerofast/tensor_parallel.py
        self.pp_group = pp_group  # [Note: pipeline accumulation] in zerofast/pipelining.py
        self.plan = plan
        self.shard = shard  # where the reduces leave this rank's owned gradients
        # Stage 1: each parameter's slot in the persistent buckets, which .grad is pointed at
        # ([Note: grads as bucket views] in csrc/buckets.cpp); None where gradients are copied.
        self.views = shard.grad_views(params)
        self.overlap = plan.overlap
        self.accumulates_locally = plan.accumulates_locally  # under no_sync: .grad accumulates
        self.scaler, self.gather = scaler, gather
        # What .grad reads as between the last backward and step() (zerofast/optim/grad_view.py);
        # None where parameters are not guarded (tensor parallelism's DTensors).
        self.window = None
        # Every gradient through Python: fp16 (each gradient checks its backward was scaled), the
        # overlapped gather (each checks its bucket's gather was waited for), check_collectives
        # (each launch is described first). See [Note: the gradient path] in csrc/grad_path.cpp.
        self.always_python = plan.overlap_param_gather or plan.scales_loss or plan.check_collectives
        # The compiled path calls back through weak references: it must not keep this reducer (and
        # with it the optimizer) alive, since the garbage collector cannot see references held in C++.
        me = weakref.ref(self)
        self.path = comm.grad_path(
            params,
            names,
            layout,
            self.views or [],
            plan.grads_sharded,
            plan.overlap,
            _Callback(me, "_on_grad"),
            _Callback(me, "_on_error"),
            _Callback(me, "_before_launch") if comm.check else None,
            plan.front,
        )
        if tp is not None:  # a DTensor's gradient reaches the path through its stand-in, in Python
            tp.install_grad_hooks(_Callback(me, "_on_grad"))
            owned = [g.numel() for g in shard.owned_grads()]
            self._norm_runs = tp.norm_runs(layout, shard.rank, owned)
        self.begin_step()

    # --- the step's phase -----------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step. Stage 1 with gradient views: the reduce has consumed .grad (its owned range
        now holds the sum over ranks, the rest is no gradient of this step), so .grad is dropped, as
        stages 2 and 3 drop it in backward; the buckets stay for the next backward."""
        if self.window is not None:
            self.window.close_window()
        if self.views is not None:
            for p in self.params:
                p.grad = None
        self.reduced_micro_batches = 0  # no_sync micro-batches already reduced into the shard
        self.micro_batches = 0  # backwards that gave gradients in this step
        # A pipeline schedule's step ([Note: pipeline accumulation] in zerofast/pipelining.py): each
        # stage seen, whether its last backward is done; the schedule's gradient divisor (torch's
        # scale_grads: its micro-batches, or 1); whether the backward running keeps .grad local.
        self.pipeline_stages: dict[int, bool] = {}
        self.step_divisor = 1
        self._pipeline_local = False
        self.comm.where.micro_batch = 0
        self._prepared: Prepared | None = None  # phase 2's result, in PREPARED
        self.path.begin_step()  # every slot empty, nothing used, no backward running
        self._enter(StepPhase.IDLE)
        self.comm.new_step()

    def _enter(self, phase: StepPhase) -> None:
        """The one place the phase changes; how the compiled path takes the next gradients follows
        ([Note: the gradient path] in csrc/grad_path.cpp): through Python when each has a check there
        or none may arrive (PREPARED); kept in .grad inside no_sync() with local accumulation; reduces
        adding into the shard after a micro-batch reduced under no_sync()."""
        self.phase = phase
        self.comm.set_last_micro_batch(not phase.in_no_sync)  # hybrid sharding: [Note: replicas in backward]
        self.path.python_decides = self.always_python or phase is StepPhase.PREPARED
        self.path.keep_local = (phase is StepPhase.NO_SYNC and self.accumulates_locally) or self._pipeline_local
        self.path.accumulate = self.reduced_micro_batches > 0

    def take_every_gradient_in_python(self) -> None:
        """From now on every gradient goes through Python's path, as fp16, the overlapped gather or
        check_collectives send them: the seam that tests the compiled path against Python's."""
        self.always_python = True
        self._enter(self.phase)

    # --- phase 1 --------------------------------------------------------------------------------

    def _on_grad(self, index: int) -> None:
        """Python's path for one gradient (the compiled hook calls it with the GIL): its checks,
        the start of a backward, then the gradient path's own work (GradPath.take)."""
        self._check_grad_allowed(index)
        if not self.path.in_backward:  # the first gradient of this backward
            self._backward_starts()
        bucket = self.layout.slots[index].bucket
        self.comm.run(
            lambda: f"the gradient path at bucket {bucket} (its copy, or a reduce it launched or waited for)",
            self.path.take,
            index,
        )

    def _backward_starts(self) -> None:
        """Queue the backward's end, and enter the phase its gradients put the step in."""
        self.path.in_backward = True
        if self.window is not None:
            self.window.close_window()
        self.comm.where.phase = "backward"
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.phase is StepPhase.IDLE:
            self._enter(StepPhase.REDUCING)
        elif self.phase is StepPhase.NO_SYNC and not self.accumulates_locally:
            self._enter(StepPhase.NO_SYNC_REDUCING)

    def _on_error(self, index: int, message: str) -> None:
        """A communication failure (CommError) in the compiled hook, raised as Python's path raises
        it. Only those come here; a GradientError the hook raises itself."""
        bucket = self.layout.slots[index].bucket
        raise self.comm.failed(
            f"the gradient path at bucket {bucket} (its copy, or a reduce it launched or waited for)",
            self.comm.error(message),
        )

    def _before_launch(self, bucket: int) -> None:
        """check_collectives: every rank describes the reduce it is about to launch."""
        self.comm.verify_reduce(bucket)

    def _check_grad_allowed(self, index: int) -> None:
        name = self.names[index]
        if self.scaler.enabled and not self.scaler.in_scaled_backward:
            raise RuntimeError(
                f"{self.plan.front}(mixed_precision='fp16'): {name} got a gradient from a backward that did not "
                f"scale the loss; call opt.backward(loss) instead of loss.backward() ([Note: loss scaling])"
            )
        if self.gather.pending[self.layout.slots[index].bucket]:
            raise RuntimeError(
                f"{self.plan.front}(overlap_param_gather=True): {name} was used while its gather was still in flight "
                f"(read outside the forward of a module that holds it); this step's result would be wrong. "
                f"Read it inside its module's forward, or pass overlap_param_gather=False. See "
                f"[Note: overlapped parameter gather]"
            )
        if self.phase is StepPhase.PREPARED:
            raise RuntimeError(
                f"{self.plan.front}: {name} got a gradient after clip_grad_norm_() and before step(); "
                f"clip after the last backward of the step"
            )

    def _end_backward(self) -> None:
        """End of a backward that gave this optimizer gradients: one more micro-batch (counted, so
        the ranks can check they ran the same number: [Note: the step's agreement])."""
        self.path.in_backward = False
        self.micro_batches += 1
        self.comm.where.micro_batch = self.micro_batches
        self.comm.where.phase = "after backward"
        if self.phase is StepPhase.NO_SYNC_REDUCING:
            self._end_micro_batch()
        elif self.phase is StepPhase.REDUCING and self.window is not None and not self.pipeline_stages:
            self.window.open_window()  # the step's gradients: .grad is the reduced one now

    def _end_micro_batch(self) -> None:
        """End of a backward inside no_sync() (stages 2 and 3, reducing every micro-batch): launch
        every bucket, then let the next micro-batch's reduces add into the shard."""
        self.flush()
        self.reduced_micro_batches += 1
        self.path.begin_micro_batch()
        self._enter(self.phase)

    # [Note: accumulation]
    # `with opt.no_sync():` around every micro-batch but the last; every rank runs the same number
    # of micro-batches (stages 2 and 3 communicate in each, as every rank runs the same number of
    # steps). Stage 1 (which holds full gradients anyway) lets .grad accumulate as autograd does and
    # reduces once, in the last backward: Φ of reduce per step however many micro-batches. Stages 2
    # and 3 by default reduce every micro-batch into the owned gradient shard, as DeepSpeed does: k
    # micro-batches cost k·Φ of reduce, but gradient memory stays at the shard ([Note: accumulation
    # into the shard] in csrc/buckets.cpp). With accumulate_locally=True they keep full local
    # gradients during no_sync (2Φ bytes more on each rank in mixed precision, 4Φ in fp32) and
    # reduce once, as stage 1. Reduces in reduce_dtype add in reduce_dtype too: accumulating many
    # bf16 micro-batches into a bf16 shard rounds each time; reduce_dtype=torch.float32 avoids that.
    @contextlib.contextmanager
    def no_sync(self):
        if self.phase.in_no_sync:
            raise RuntimeError(f"{self.plan.front}.no_sync() is already active: no_sync() blocks cannot be nested")
        if self.phase is StepPhase.PREPARED:
            raise RuntimeError(
                f"{self.plan.front}.no_sync() was entered after clip_grad_norm_() and before step(); "
                "clip after the last backward of the step, then call step()"
            )
        self._enter(StepPhase.NO_SYNC if self.phase is StepPhase.IDLE else StepPhase.NO_SYNC_REDUCING)
        try:
            yield
        finally:
            self.path.in_backward = False  # a backward that raised may have left it set, its end never run
            if self.phase is StepPhase.NO_SYNC:
                self._enter(StepPhase.IDLE)
            elif self.phase is StepPhase.NO_SYNC_REDUCING:
                self._enter(StepPhase.REDUCING)

    # --- a pipeline schedule's step ([Note: pipeline accumulation] in zerofast/pipelining.py) ----------

    @contextlib.contextmanager
    def pipeline_backward(self, stage: int, last: bool):
        """One backward (or weight pass) of pipeline stage `stage`'s part in a schedule's step: all but
        the stage's last leave their gradients in .grad; the last hands them to the buckets as they
        come, each bucket's reduce starting when it is complete."""
        if self.phase.in_no_sync:
            raise RuntimeError(
                f"{self.plan.front}: a pipeline schedule ran a backward inside `with opt.no_sync():`; the "
                "schedule accumulates its micro-batches itself: call schedule.step() outside no_sync()"
            )
        if self.phase is StepPhase.PREPARED:
            raise RuntimeError(
                f"{self.plan.front}: pipeline stage {stage} ran a backward after clip_grad_norm_() and before "
                "step(); clip after schedule.step()"
            )
        if self.pipeline_stages.get(stage):
            raise RuntimeError(
                f"{self.plan.front}: pipeline stage {stage} ran a backward after its last one of this step; call "
                "opt.step() (and opt.zero_grad()) after each schedule.step()"
            )
        self.pipeline_stages.setdefault(stage, False)
        self._pipeline_local = not last
        self._enter(self.phase)
        try:
            yield
        finally:
            self._pipeline_local = False
            self._enter(self.phase)

    def take_assigned(self, indices: list[int], stage: int, last: bool) -> None:
        """Gradients a weight pass assigned to .grad without autograd's accumulation, so no hook saw
        them (torch's stage_backward_weight, in the zero-bubble schedules): taken as the hook takes
        them, local until the stage's last pass."""
        with self.pipeline_backward(stage, last):
            if self.phase is StepPhase.IDLE:
                self._enter(StepPhase.REDUCING)
            for i in indices:
                if self.params[i].grad is not None:
                    self._check_grad_allowed(i)
                    bucket = self.layout.slots[i].bucket
                    self.comm.run(lambda: f"the gradient path at bucket {bucket}", self.path.take, i)

    def pipeline_stage_done(self, stage: int, divisor: int) -> bool:
        """Stage `stage`'s backwards of this step are done; the schedule divides its gradients by
        `divisor` (torch's scale_grads). Once every stage seen is done, .grad reads as the reduced
        gradient ([Note: the model stays a torch model]); returns whether they all are."""
        if stage not in self.pipeline_stages:
            return False  # no backward of this stage gave this optimizer gradients
        if any(self.pipeline_stages.values()) and divisor != self.step_divisor:
            raise ValueError(
                f"{self.plan.front}: pipeline stage {stage} scales its gradients by 1/{divisor}, another stage of "
                f"this rank by 1/{self.step_divisor}; every stage of one optimizer must run the same schedule"
            )
        self.step_divisor = divisor
        self.pipeline_stages[stage] = True
        done = all(self.pipeline_stages.values())
        if done and self.window is not None:
            self.window.open_window()
        return done

    def zero_grad(self, set_to_none: bool) -> None:
        if self.phase not in (StepPhase.IDLE, StepPhase.NO_SYNC):
            raise RuntimeError(
                f"{self.plan.front}.zero_grad() was called between backward and step(): this step's "
                "gradients are already being reduced across ranks and would still be "
                "applied; call step() first (or zero_grad() only at the start of an iteration)"
            )
        if self.window is not None:
            self.window.close_window()
        self.path.begin_step()  # locally accumulated gradients are dropped: no slot holds one now
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

    # [Note: unused parameters]
    # A parameter that gets a gradient on no rank in a step is left untouched, as torch.optim.AdamW
    # leaves a parameter whose grad is None: no update, no state change, its step count unchanged.
    # Where some ranks have a gradient and others none, the missing ones count as zero (their slot
    # is zeroed before the reduce: GradPath.flush). Which case holds is agreed by the step's one
    # small all_reduce(MAX) ([Note: the step's agreement]).
    def flush(self) -> None:
        """Launch what backward did not: each bucket not launched yet, with a locally accumulated
        gradient where one is waiting and zeros for a parameter without gradient here."""
        self.comm.run(
            "an earlier reduce, or the reduce of a bucket backward left incomplete (filled and launched "
            "at the end of the micro-batch)",
            self.path.flush,
        )

    def prepare_to_clip(self, method: str, arg: str, value, norm: bool, world_size: int, check) -> Prepared:
        """What both of the optimizer's clip methods do first: check their bound and where they are
        called, then prepare() (phase 2, with the global norm when norm=True)."""
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{self.plan.front}.{method}: {arg} must be a number > 0; got {value!r}")
        if self.phase.in_no_sync:
            raise RuntimeError(
                f"{self.plan.front}.{method}() was called inside `with opt.no_sync():`; clip after "
                f"the last backward of the step, outside it"
            )
        self.comm.where.phase = f"{method}() (the reduces and the agreement)"
        return self.prepare(norm, world_size, check=check)

    def prepare(self, need_norm: bool, world_size: int, check: Callable[[], None] | None = None) -> Prepared:
        """Phase 2, once per step (step() or an earlier clip_grad_norm_()): every bucket reduced, the
        ranks agreed ([Note: the step's agreement]) and, for loss scaling or clipping, on overflow and
        the global norm. check: this rank's last checks before the update; what it raises makes every
        rank raise, nothing applied."""
        if self.phase is StepPhase.PREPARED:  # clip_grad_norm_() or clip_grad_value_() ran it
            if need_norm and self._prepared.norm is None:  # clip_grad_value_(): the norm of the clamped gradient
                sumsq = torch.zeros(1, dtype=torch.float32, device=self.shard.grad_shard.device)
                sumsq[0] = self._sumsq(self.shard.owned_grads())
                self.comm.all_reduce_sum(sumsq)
                self._sum_over_model(sumsq, "the gradient norm's sum")
                self._prepared.norm = sumsq[0].sqrt() / (world_size * self.scaler.scale)
            return self._prepared
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
            local_used = self.path.used()
            message = AgreementLayout(len(local_used))
            reduce_hash, gather_hash = self.comm.order_hashes()
            counts = dict(steps=where.step, micro_batches=self.micro_batches, reduces=reduce_hash, gathers=gather_hash)
            flags = host_reads.to_device(
                message.pack(local_used, counts, None if failure is None else self.comm.dp_rank), torch.int64, device
            )
            # torchft's replica groups: each group's own collectives and failure ([Note: replica groups on torchft]).
            self.comm.all_reduce_max(flags, (message.counter("reduces"), message.counter("gathers"), message.failed))
            if self.tp is not None:
                self._agree_over_tp(flags, message)
            if self.pp_group is not None:
                self._agree_over_pp(flags, message)
            agreed = message.read(host_reads.to_list(flags, "agreement"))  # [Note: host syncs]
            if not (agreed.same("steps") and agreed.same("micro_batches")):
                steps, micro = agreed.ranges["steps"], agreed.ranges["micro_batches"]
                raise OutOfStepError(
                    f"{self.plan.front} (rank {self.comm.dp_rank}): the ranks are out of step at step() of step {where.step + 1}: "
                    f"they have taken {steps[0]} to {steps[1]} steps and run {micro[0]} to {micro[1]} micro-batches "
                    f"(this rank: {where.step} and {self.micro_batches}). Every rank must run the same "
                    f"micro-batches and call step() as often; nothing was applied"
                )
            if not (agreed.same("reduces") and agreed.same("gathers")):
                which = (
                    "gathers (stage 3: the modules ran in another order)" if not agreed.same("gathers") else "reduces"
                )
                raise OutOfStepError(
                    f"{self.plan.front} (rank {self.comm.dp_rank}): the ranks are out of step at step() of step {where.step + 1}: "
                    f"they issued different {which} in this step, so collectives paired up wrongly and this "
                    f"step's gradients are not to be trusted; nothing was applied. Every rank must run the same "
                    f"modules in the same order; ZEROFAST_DEBUG=1 names the first collective that differs"
                )
            self.comm.wait_reduces()
        if agreed.failed_rank is not None:
            self.begin_step()  # this step's gradients are dropped; nothing was applied
            note = (
                f"{self.plan.front}: step {where.step + 1} was not applied on any rank: rank {agreed.failed_rank} failed "
                f"before the update; parameters and optimizer state are those after step {where.step} on every "
                f"rank, and this step's gradients are dropped"
            )
            if failure is not None:
                failure.add_note(note)
                raise failure
            raise StepNotAppliedError(note + " (see that rank's error)")
        with torch.profiler.record_function("zerofast::replicate"):  # [Note: hybrid sharding] in zerofast/topology.py
            self.comm.all_reduce_replicas(self.shard.owned_grads())
        found_inf, sumsq = False, None
        if self.scaler.enabled or need_norm:
            stats = torch.zeros(2, dtype=torch.float32, device=device)
            owned = self.shard.owned_grads()
            if self.scaler.enabled:  # see [Note: loss scaling]
                for g in owned:
                    _ops.nonfinite_check_(g, stats[0:1])
            if need_norm:  # padding is zero, and each element sits in exactly one rank's shard
                stats[1] = self._sumsq(owned)
            self.comm.all_reduce_sum(stats)
            self._sum_over_model(stats, "the overflow flag's and norm's sum")
            sumsq = stats[1] if need_norm else None  # stays on the device: [Note: host syncs]
            if self.scaler.enabled:
                found_inf = host_reads.to_float(stats[0:1], "found_inf") > 0
        norm = None
        if sumsq is not None:  # the norm of the averaged, unscaled gradient
            norm = sumsq.sqrt() / (world_size * self.scaler.scale)
        self._prepared = Prepared(agreed.used, found_inf, norm, 1.0)
        self._enter(StepPhase.PREPARED)
        return self._prepared

    def _agree_over_tp(self, flags: torch.Tensor, message: AgreementLayout) -> None:
        """The data-parallel group's agreement joined over "tp" (used flags, step and micro-batch
        counts, a failure), so every rank of the model applies the step or none does. The collectives'
        hashes stay per data-parallel group: its layout follows its local shapes, which differ
        between "tp" ranks where a dim does not split evenly."""
        index = [*range(message.params), *range(message.counter("steps").start, message.counter("micro_batches").stop)]
        index = torch.tensor([*index, message.failed], device=flags.device)
        joined = flags[index]
        self.comm.all_reduce_tp(joined, dist.ReduceOp.MAX, self.tp.tp_group, "flags", "the step's agreement over tp")
        flags[index] = joined

    def _agree_over_pp(self, flags: torch.Tensor, message: AgreementLayout) -> None:
        """The agreement joined over "pp": the step counts and a failure, so every stage applies the
        step or none does. The used flags, micro-batch counts and hashes stay per stage: each
        stage's part holds other parameters, and a zero-bubble schedule's stages run their
        backwards in other splits."""
        index = [*range(message.counter("steps").start, message.counter("steps").stop), message.failed]
        index = torch.tensor(index, device=flags.device)
        joined = flags[index]
        self.comm.all_reduce_tp(joined, dist.ReduceOp.MAX, self.pp_group, "flags", "the step's agreement over pp", "pp")
        flags[index] = joined

    def _sum_over_model(self, stats: torch.Tensor, what: str) -> None:
        """The data-parallel group's sums (overflow flag, squared norm) over the model's other ranks: each
        rank of a "tp" group holds other elements (or counts none twice), each "pp" stage other
        parameters."""
        if self.tp is not None:
            self.comm.all_reduce_tp(stats, dist.ReduceOp.SUM, self.tp.tp_group, "stats", f"{what} over tp")
        if self.pp_group is not None:
            self.comm.all_reduce_tp(stats, dist.ReduceOp.SUM, self.pp_group, "stats", f"{what} over pp", "pp")

    def _sumsq(self, owned: list[torch.Tensor]) -> torch.Tensor:
        """The sum of squares of this rank's owned gradients, each element of the model counted on one
        rank only (with tensor parallelism, what is replicated across "tp" on its rank 0)."""
        if self.tp is None:
            return sum(torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in owned)
        parts = [owned[t].narrow(0, lo, n) for t, lo, n in self._norm_runs]
        zero = torch.zeros((), dtype=torch.float32, device=owned[0].device)
        return sum((torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in parts), zero)

    # [Note: global gradient clipping]
    # The global norm is that of the averaged, unscaled gradient: each rank computes the squared
    # norm of its reduced gradient shard (every element of the model sits in exactly one rank's
    # shard; a tied parameter is one parameter; padding is zero), one all_reduce sums them, and the
    # norm is sqrt(sum) / (N * scale) (prepare()). The coefficient min(1, max_norm / (norm + 1e-6)),
    # torch's, joins 1/N and 1/scale in the kernel's grad_scale, so clipping costs no pass over the
    # gradients; norm and coefficient stay on the device, and reach the kernel as its grad_scale
    # tensor ([Note: host syncs] in zerofast/optim/host_reads.py).
    @staticmethod
    def clip(prep: Prepared, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s coefficient, folded into grad_factor: applying it twice
        (clip_grad_norm_ and max_grad_norm) acts as clipping twice would."""
        factor = prep.grad_factor
        # A float32 norm times the factor rounded to float32, as a tensor times a Python float is.
        norm = prep.norm * (factor.float() if isinstance(factor, torch.Tensor) else factor)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        # On the device, in float64: the product of float32 coefficients is exact, as it was in a
        # Python float; nothing is read back ([Note: host syncs] in zerofast/optim/host_reads.py).
        prep.grad_factor = factor * coef.double()
        return norm

    def clamp(self, prep: Prepared, max_abs: float, world_size: int) -> None:
        """torch.nn.utils.clip_grad_value_ on the averaged, unscaled gradient (after any clip so far):
        elementwise, so each rank clamping its reduced shard clamps the whole gradient, with no
        communication. The shard is summed over the ranks and scaled, so the bound is carried into
        those units (padding is zero either way)."""
        bound = max_abs * world_size * self.scaler.scale / prep.grad_factor
        for g in self.shard.owned_grads():
            g.clamp_(-bound, bound)

    def remove(self) -> None:
        self.path.remove_hooks()
        if self.tp is not None:
            self.tp.remove_hooks()


class _Callback:
    """A method of the GradReducer, called by the compiled path through a weak reference."""

    def __init__(self, ref: weakref.ref[GradReducer], name: str):
        self.ref, self.name = ref, name

    def __call__(self, *args) -> None:
        reducer = self.ref()
        if reducer is not None:
            getattr(reducer, self.name)(*args)
