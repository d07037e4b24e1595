"""ZeroOptimizer: the torch.optim.Optimizer front ZeroAdam and ZeroMuon share, over a given update rule
(update.py). Each sibling is a constructor that checks its hyper-parameters and builds its rule; all
that follows (the step's order, the model side, reports, checkpoints) is here. parts_of: the tests'
seam. A step's phases and the parts that run them: zero_adam.py.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from ..checkpoint.binding import checkpoint_view
from ..checkpoint.view import CheckpointView
from ..config import Plan
from ..model_setup import ModelParts
from ..stage3.module import ShardedModule
from . import checks
from .builder import Parts, build
from .report import Report, build_report
from .step import Stepper
from .update import UpdateRule

__all__ = ["ZeroOptimizer", "parts_of", "optimizer_of"]

# Each model a front trains -> that front, held weakly: how a pipeline stage built over the model finds
# the optimizer its backwards feed (zerofast/pipelining.py), whichever of the two was built first.
_FRONTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def optimizer_of(module: torch.nn.Module) -> ZeroOptimizer | None:
    """The ZeroAdam or ZeroMuon training `module` (None: none, or it was garbage-collected)."""
    ref = _FRONTS.get(module)
    return ref() if ref is not None else None


class ZeroOptimizer(torch.optim.Optimizer):
    """A sharded optimizer over a model: ZeroAdam's and ZeroMuon's shared front. It is not built
    directly: a sibling's constructor resolves the plan and its update rule, then calls _wire()."""

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "ZeroOptimizer is the front ZeroAdam and ZeroMuon share, not an optimizer of its own: "
            "build a zerofast.ZeroAdam or zerofast.ZeroMuon"
        )

    def _wire(self, model: torch.nn.Module, plan: Plan, process_group, rule: UpdateRule) -> None:
        """Where every front's constructor ends: build() wires the parts, then torch.optim's fields."""
        self.model, self.plan = model, plan
        parts = self._parts = build(model, plan, process_group, rule)
        self._stepper = Stepper(parts, self._check_update)
        # The model side (zerofast/stage3/module.py), as shard_frozen's: at rest before whole tensors
        # are read, the step's gathers finished before a gathered block.
        parts.module = ShardedModule(
            model, parts.units, parts.hooks, settle=self._stepper.quiesce, before_block=parts.gather.wait
        )
        if parts.grads.window is not None:  # held weakly: the model's hooks reach the window
            parts.grads.window.prepare = weakref.WeakMethod(self._prepare_grads)
        super().__init__(rule.groups, rule.defaults)
        self._constructed = True  # add_param_group after this is an error
        self._held: contextlib.ExitStack | None = None  # a pipeline step's parts kept gathered
        self._split_passes = False  # a zero-bubble schedule's split backwards seen
        self._index_of: dict[int, int] | None = None  # a managed parameter's id -> its index
        self._view = checkpoint_view(parts, self._stepper, self.param_groups)
        parts.topology.replication.attach(self)  # the extension point: zerofast/topology.py
        for module in (model, *(model.parts if isinstance(model, ModelParts) else ())):
            _FRONTS[module] = weakref.ref(self)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise RuntimeError(
                f"{type(self).__name__}.add_param_group: parameter groups are fixed at construction (the flat "
                "buffers, shards and collectives are laid out over them); pass every group as "
                f"{type(self).__name__}(model, param_groups=[...])"
            )
        super().add_param_group(param_group)

    # --- the training loop's calls --------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss multiplied by the current loss scale under fp16 (as
        torch.amp.GradScaler.scale does); the same as loss.backward() otherwise."""
        self._parts.scaler.backward(loss, **kwargs)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self._parts.scaler.scale

    def no_sync(self):
        """The backwards inside only accumulate gradients; the step's last backward, outside, and
        step() then act on the sum. See [Note: accumulation] for what each stage communicates."""
        return self._parts.grads.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear .grad (stage 1 keeps full local gradients there). Between a backward and step() it is
        an error rather than a step that silently keeps them: gradients handed to the buckets are being
        reduced on every rank. Gradients accumulated only locally (stage 1, or accumulate_locally,
        inside no_sync) are dropped. It also begins the replication's step (zerofast/topology.py: on
        torchft's replica groups the step's quorum, where a recovering group receives the state)."""
        self._parts.grads.zero_grad(set_to_none)
        self._parts.topology.replication.begin_step()

    def step(self, closure=None):
        """One optimizer step (phases 2-4, in order: zerofast/optim/step.py). With a closure, as every
        torch optimizer: the closure (which runs forward and backward) is called under
        torch.enable_grad() first, and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._pipeline_release()  # a pipeline step whose stages never all finished their backwards
        with torch.no_grad():
            replication = self._parts.topology.replication
            replication.check_step(self._parts.comm.where.step)
            try:
                self._stepper.step(self.param_groups)
            except BaseException as e:  # one commit decision per step, even when it raises before it
                if not self._stepper.decided:
                    replication.on_error(e)
                raise
        return loss

    def _check_update(self) -> None:
        """The last checks before an update (hyper-parameters as a scheduler may have left them, which
        parameters are trainable), on every rank before the step's agreement, so that a failure applies
        nothing anywhere ([Note: the step's agreement] in zerofast/optim/agreement.py)."""
        parts = self._parts
        for g, group in enumerate(self.param_groups):
            parts.rule.check_group(g, group)
        checks.check_trainable_unchanged(parts.trainable_at_build, plan_front := self.plan.front)
        if not self.plan.params_sharded:
            who = f"{plan_front}(stage={self.plan.stage})"
            checks.check_params_in_place(parts.names, parts.params, parts.layout, parts.shard.param_buffers, who)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' global norm to max_norm, as torch.nn.utils.clip_grad_norm_ on the whole
        model would, and return the norm before clipping (a float32 tensor). Call it after a step's last
        backward, before step(); the fused kernel applies it through its grad_scale ([Note: global
        gradient clipping] in zerofast/optim/grads.py). max_norm=float("inf") only measures: the norm
        is returned, nothing clipped (what trainers call to log the norm)."""
        grads, world = self._parts.grads, self._parts.divisor()
        prep = grads.prepare_to_clip("clip_grad_norm_", "max_norm", max_norm, True, world, self._check_update)
        return grads.clip(prep, float(max_norm))

    def _prepare_grads(self):
        """Phase 2 for the gradient window (grad_view.py), as clip_grad_norm_() runs it."""
        grads, world = self._parts.grads, self._parts.divisor()
        return grads.prepare_to_clip("clip_grad_norm_", "max_norm", 1.0, False, world, self._check_update)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every element of the step's averaged, unscaled gradient to [-clip_value, clip_value],
        as torch.nn.utils.clip_grad_value_ on the whole model after DDP's average would. Call it after a
        step's last backward, before step(); each rank clamps its own reduced shard, so it costs no
        communication beyond the step's."""
        grads, world = self._parts.grads, self._parts.divisor()
        prep = grads.prepare_to_clip("clip_grad_value_", "clip_value", clip_value, False, world, self._check_update)
        grads.clamp(prep, float(clip_value), world)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() applied nothing: some rank's fp16 gradients held an inf or nan
        (torch.amp.GradScaler's skipped step; the same on every rank), or on torchft's replica groups
        the step was not committed (a replica group failed in it). False otherwise."""
        return self._stepper.skipped

    # --- a pipeline stage's calls ([Note: pipeline accumulation] in zerofast/pipelining.py) -------

    @contextlib.contextmanager
    def _pipeline_backward(self, stage: int, last: bool):
        """A backward of pipeline stage `stage` (its gradients local until its last), scaled as
        opt.backward(loss) scales under fp16."""
        scaler = self._parts.scaler
        with self._parts.grads.pipeline_backward(stage, last):
            scaler.in_scaled_backward = True
            try:
                yield scaler.scale if scaler.enabled else None
            finally:
                scaler.in_scaled_backward = False

    def _pipeline_weights(self, stage: int, last: bool, params) -> None:
        """A weight pass of stage `stage` assigned .grad of its `params` outside autograd's hooks:
        take them."""
        if self._parts.topology.tp_group is not None:
            raise NotImplementedError(
                f"{self.plan.front}: the zero-bubble schedules' weight passes with tensor parallelism are not "
                "supported yet (their gradients reach the DTensors, not the shards' stand-ins); use a schedule "
                "with full backwards (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)"
            )
        if self._index_of is None:  # built once: a weight pass runs per micro-batch
            self._index_of = {id(p): i for i, p in enumerate(self._parts.params)}
        indices = [self._index_of[id(p)] for p in params if id(p) in self._index_of and p.grad is not None]
        self._parts.grads.take_assigned(indices, stage, last)

    def _pipeline_group(self):
        """The "pp" dim's group of this rank (None: no "pp" dim)."""
        return self._parts.topology.pp_group

    def _pipeline_stage_done(self, stage: int, divisor: int) -> None:
        if self._parts.grads.pipeline_stage_done(stage, divisor):
            self._pipeline_release()

    def _pipeline_hold(self) -> None:
        """Stage 3, a schedule's step keeping the parts gathered across its micro-batches (torchtitan's
        default under pipelining): every unit gathered at the step's first forward, as gathered_params()
        gathers it, until every stage's backwards are done."""
        if self._held is None and self.plan.params_sharded and not self._split_passes:
            held = contextlib.ExitStack()
            held.enter_context(self.gathered_params())
            self._held = held

    def _pipeline_split(self) -> None:
        """A zero-bubble schedule's split backward: from now on its parts are gathered per pass, never
        held across the step (with units held gathered through them, torch failed an internal assert in
        autograd's tensor teardown on the last stage, seen on torch 2.14)."""
        self._split_passes = True
        self._pipeline_release()

    def _pipeline_release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()

    # --- the model, reports, checkpoints ----------------------------------------------------------

    @contextlib.contextmanager
    def gathered_params(self, gather_tp: bool = False):
        """Full, current parameters on every rank inside the block. Stages 1 and 2 always hold them
        (this only finishes gathers in flight); stage 3 gathers every unit on entry (every rank),
        keeps them through any number of forwards inside (generation: no collective per token, so
        ranks may run different numbers of forwards) and re-shards on exit, keeping what was written
        inside (the fp32 master takes it too): [Note: generation on stage 3] in
        zerofast/stage3/schedule.py. A tensor-parallel model's parameters stay DTensors on "tp", each
        rank's part whole (its forward runs as trained); gather_tp=True makes each whole across "tp"
        too (a Replicate DTensor: p.to_local() is the whole tensor), read-only, for reading the
        weights or a forward without gradients ([Note: tensor parallelism] in
        zerofast/tensor_parallel.py)."""
        with self._parts.module.gathered_params(gather_tp):
            yield self.model

    def full_state_dict(self, keep: bool = True, device="cpu") -> dict[str, torch.Tensor] | None:
        """model.state_dict() with every tensor whole, copied to `device` (default the CPU): what a
        consolidated save (Hugging Face's save_pretrained, safetensors) writes. Stage 3 gathers one unit
        at a time, so no rank holds more than the copies plus one gathered unit. Every rank must call it
        (the gathers are collectives); ranks passing keep=False take part, copy nothing and get None.
        Tied tensors keep one copy under each of their names, as state_dict() has them."""
        return self._parts.module.full_state_dict(keep, device)

    def report(self) -> Report:
        """This rank's partition (elements owned per rank, and ZeroMuon's Newton-Schulz FLOPs),
        stage 3's units, the bytes held now by kind, the bucket buffers, and the last step's payload
        bytes per collective: plain data, measured now (zerofast/optim/report.py)."""
        return build_report(self._parts, self._stepper.last_comm)

    @property
    def checkpoint_view(self) -> CheckpointView:
        """The training state as zerofast.checkpoint reads and writes it (zerofast/checkpoint/view.py):
        the parameters by name, what state each holds, live views of this rank's pieces, the step
        counts, the loss scale."""
        if self._parts.topology.tp_group is not None and self.plan.quantized_state:
            raise NotImplementedError(
                f"{type(self).__name__}: checkpoints of a tensor-parallel model with 8-bit optimizer state are "
                "not supported yet: its blocks are those of each rank's local tensor, not of the whole parameter "
                "([Note: tensor parallelism] in zerofast/tensor_parallel.py)"
            )
        return self._view

    def named_full_tensors(self, peft: str | None = None, gather_tp: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every entry of model.state_dict(), whole and in the model's dtype, one at a
        time (stage 3 gathering one unit at a time): for sending weights to an inference engine with no
        rank holding the whole model (zerofast/stage3/weights.py). Every rank must run it to its end
        (the gathers are collectives). For a PEFT model, peft="merged" gives merge_and_unload().state_dict()
        (what TRL's vLLM sync sends) and peft="adapter" get_peft_model_state_dict(), bitwise, the model
        left as it was ([Note: merged weights unit by unit] in zerofast/integrations/peft_weights.py).
        A tensor-parallel model's DTensors are gathered over "tp" too; gather_tp=False hands out each
        rank's local tensor instead (what an engine with the same tensor-parallel layout loads)."""
        return self._parts.module.named_full_tensors(peft, gather_tp)

    def state_dict(self) -> dict:
        """This rank's part of the training state as a torch.distributed.checkpoint state dict, for
        dcp.save: unlike a torch optimizer's it holds the parameters too (in stage 3 and mixed
        precision the fp32 master, the source of truth, lives here), each parameter and Adam moment
        by name in its own shape, this rank's pieces only (views of the live state). To restore, in
        any configuration: sd = opt.state_dict(); dcp.load(sd, ...); opt.load_state_dict(sd).
        zerofast.checkpoint.save/load do this with atomic folders and `extra`."""
        from ..checkpoint import dcp  # DCP is imported when first used (zerofast/checkpoint/__init__.py)

        return dcp.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Finish restoring after dcp.load filled a state_dict() of this optimizer (step counts,
        hyper-parameters, loss scale, low-precision parameters, the gather of stages 1 and 2)."""
        from ..checkpoint import dcp

        dcp.load_state_dict(self, state_dict)

    def flush(self) -> None:
        """With OffloadPolicy(delayed_update=True): wait for the last step's update still running and
        apply it, so the model and state are those after every step taken; otherwise nothing. step(),
        gathered_params(), full_state_dict() and checkpoints call it themselves; call it after the
        last step before reading the parameters directly. Every rank calls it (stages 1 and 2 then
        gather the updated parameters)."""
        self._stepper.flush()

    def remove_hooks(self) -> None:
        """Take every hook this optimizer put on the model off it (the model keeps its parameters,
        views of the optimizer's buffers)."""
        self._parts.remove_hooks()


def parts_of(opt: ZeroOptimizer) -> Parts:
    """The test seam: the parts behind a ZeroAdam or ZeroMuon front (builder.py), for tests that
    inject a fault into one part or check its internals. Library code uses the front instead."""
    return opt._parts
