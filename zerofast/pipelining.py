"""ZeroAdam under torch.distributed.pipelining: ZeroPipelineStage, the one changed line of a pipelined
training loop ([Note: pipeline accumulation]).

    mesh = init_device_mesh("cuda", (pp, dp), mesh_dim_names=("pp", "dp"))
    part = cut(model, mesh["pp"].get_local_rank(), pp)     # this rank's stage, original names kept
    opt = ZeroAdam(part, stage=3, process_group=mesh)
    stage = ZeroPipelineStage(part, stage_index, pp, device, group=mesh["pp"].get_group())   # was PipelineStage
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    schedule.step(x, target=y, losses=losses)   # on the first and last stages' ranks as torch documents
    opt.step(); opt.zero_grad()

[Note: pipeline accumulation]
A schedule runs each stage's backward once per micro-batch, interleaved with other micro-batches'
forwards, and tells the stage which backward is its last of the step (torch's `last_backward`). torch's
PipelineStage turns that into DDP's no_sync or FSDP2's set_requires_gradient_sync by isinstance; this
subclass turns it into ZeroAdam's: every backward but the stage's last keeps its gradients in .grad,
accumulated by autograd as no_sync with accumulate_locally=True keeps them (full local gradients of the
part: 2 bytes per parameter of the part in bf16, 4 in fp32; stage 1's are its bucket views anyway);
the last backward hands each gradient, the sum over the micro-batches, to its bucket as autograd
finishes it, and each bucket's reduce across "dp" starts when it is complete, overlapping the rest
of that backward. So gradients cross "dp" once per step, Φ of reduce-scatter whatever the number of
micro-batches, as the same part trained without pipelining; report().comm counts the same bytes.
Several stages on one rank (Interleaved1F1B, LoopedBFS, the zero-bubble ones) are several backwards
of one optimizer, each stage's last its own: a bucket whose parameters span two stages is reduced
once both have handed theirs over.
The zero-bubble schedules split a backward into an input pass (autograd.grad over the activations:
no parameter gradient) and a weight pass that assigns each weight's .grad itself (torch's
stage_backward_weight), which no autograd hook sees; the stage hands those gradients over after each
weight pass (local before the last, to the buckets at the last), so they are reduced once too. A
gradient left behind any other way is still taken at step(): flush hands over every local one.
torch's scale_grads (after a stage's last backward, by the micro-batch count when scale_grads=True,
the default, matching a loss_fn that averages over its micro-batch) would divide .grad, which here
is a bucket being reduced (stage 1) or gone (stages 2 and 3); the stage instead gives the divisor to
the optimizer, which folds it into the fused kernel's grad_scale with 1/N: the step uses the mean
over every micro-batch of every data-parallel rank, what AdamW on the whole model over the global
batch uses. With scale_grads=False (a loss_fn that sums) the divisor is 1. Once every stage of the
optimizer is done, .grad reads as the reduced gradient, so torch's clip_grad_norm_ works as after a
plain backward. The step is one step of the whole model: its agreement (steps, a failure) is joined
over "pp" and the overflow flag and the squared norm are summed over "pp" (each stage holds other
parameters), so clipping sees the global norm, an fp16 overflow on any rank skips the step on every
rank of every stage, and every stage's loss scale moves together. Under fp16 the last stage's loss
is multiplied by the loss scale before its backward, as opt.backward(loss) multiplies it.
Stage 3 by default keeps the rank's parts gathered from the step's first forward to its stages' last
backward (torchtitan's default under pipelining, FSDP2's reshard_after_forward=False): each unit is
gathered once a step, at the cost of holding the whole part (as gathered_params() holds it; released
before step()). ZeroPipelineStage(gather_per_micro_batch=True) gathers each unit for each
micro-batch's forward and again for its backward, as without pipelining, holding only the units in
use. A zero-bubble schedule's split passes gather the parts for each pass instead (torch finds each
weight's gradient accumulator through a view of it, which a released parameter refuses), and once
one is seen the optimizer's parts are no longer held across the step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from .optim.base import ZeroOptimizer, optimizer_of

__all__ = ["ZeroPipelineStage"]


class ZeroPipelineStage(PipelineStage):
    """torch.distributed.pipelining.PipelineStage over a part a ZeroAdam (or ZeroMuon) trains: the
    same arguments; its backwards accumulate and reduce as [Note: pipeline accumulation] says. Build it
    before or after the optimizer; the optimizer must exist before the schedule's first step."""

    def __init__(self, *args, gather_per_micro_batch: bool = False, **kwargs):
        """gather_per_micro_batch (stage 3): gather each unit for each micro-batch's forward and
        backward, as without pipelining (least memory); False, the default (torchtitan's under
        pipelining): the parts stay gathered from the step's first forward to its last backward, each
        unit gathered once a step."""
        if not isinstance(gather_per_micro_batch, bool):
            raise TypeError(
                f"ZeroPipelineStage: gather_per_micro_batch must be True or False; got {gather_per_micro_batch!r}"
            )
        super().__init__(*args, **kwargs)
        self.gather_per_micro_batch = gather_per_micro_batch
        self._checked = None  # the optimizer whose "pp" group was checked against this stage's
        if optimizer_of(self.submod) is not None:
            self._optimizer()  # group= first: another group than the mesh's "pp" says so
        _check_place(self)

    def _optimizer(self) -> ZeroOptimizer:
        opt = optimizer_of(self.submod)
        if opt is None:
            raise RuntimeError(
                f"ZeroPipelineStage (stage {self.stage_index}): no ZeroAdam trains its module "
                f"({type(self.submod).__name__}); build ZeroAdam(part, process_group=mesh) over the same module "
                "before the schedule's first step, or use torch's PipelineStage for a part no ZeroAdam trains"
            )
        if self._checked is not opt:
            _check_groups(opt, self)
            self._checked = opt
        return opt

    def forward_one_chunk(self, *args, **kwargs):
        if not self.gather_per_micro_batch and self.has_backward:  # [Note: pipeline accumulation]
            self._optimizer()._pipeline_hold()
        return super().forward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        opt = self._optimizer()
        # Stage 3, a split backward (zero-bubble): torch finds each weight's gradient accumulator
        # through a view of it, which a released parameter refuses; the parts are gathered for the
        # pass (every rank of the stage runs it at the same point of the schedule).
        split = backward_type in ("input", "weight") and opt.plan.params_sharded
        if split:  # the parts kept gathered do not survive torch's split passes: gathered per pass
            opt._pipeline_split()
        gathered = opt.gathered_params() if split else contextlib.nullcontext()
        if backward_type == "weight":
            with gathered, opt._pipeline_backward(self.stage_index, last_backward):
                result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            opt._pipeline_weights(self.stage_index, last_backward, list(self.submod.parameters()))
            return result
        with gathered, opt._pipeline_backward(self.stage_index, last_backward) as loss_scale:
            if loss_scale is not None and self.is_last:  # fp16: the loss, scaled as opt.backward(loss) does
                bwd_kwargs = {**bwd_kwargs, "stage_output": _scaled(bwd_kwargs["stage_output"], loss_scale)}
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def scale_grads(self, grad_scale_factor: int) -> None:
        self._optimizer()._pipeline_stage_done(self.stage_index, grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # torch's: FSDP2's post-backward, then scale_grads; the reduce is the optimizer's already.
        self.scale_grads(grad_scale_factor)


def _check_place(stage: PipelineStage) -> None:
    """A stage index this rank holds under torch's schedules: s % pp == its place in group= (the
    looped ones), or 2 * pp - 1 - its place (the V-shaped ZBV, two stages a rank). Another would have
    its schedule exchange activations with the wrong ranks and wait on them."""
    s, n, rank, pp = stage.stage_index, stage.num_stages, stage.group_rank, stage.group_size
    if s % pp != rank and not (n == 2 * pp and s == 2 * pp - 1 - rank):
        looped = ", ".join(str(i) for i in range(rank, n, pp))
        raise ValueError(
            f"ZeroPipelineStage: stage_index={s} (of num_stages={n}) is not this rank's: it is rank {rank} of the "
            f"{pp} in group=, whose stages are {looped} (torch's looped schedules)"
            + (f" or {rank} and {2 * pp - 1 - rank} (ZBV)" if n == 2 * pp else "")
            + '; give each rank the part of its own stage (mesh["pp"].get_local_rank())'
        )


def _scaled(loss, scale: float):
    """The last stage's loss (a tensor, or a tuple of them: torch's input pass) times the loss scale."""
    if isinstance(loss, torch.Tensor):
        return loss.float() * scale
    return tuple(t.float() * scale for t in loss)


def _check_groups(opt: ZeroOptimizer, stage: ZeroPipelineStage) -> None:
    """The stage's point-to-point group is the "pp" dim ZeroAdam's step spans (the agreement, the
    norm), so every stage of the model takes one step."""
    pp = opt._pipeline_group()
    if pp is None:
        raise ValueError(
            f'ZeroPipelineStage (stage {stage.stage_index}): its {opt.plan.front} was built without a "pp" mesh '
            "dim, so its step would not span the pipeline (global norm, overflow, agreement); build it with "
            'process_group=mesh, a DeviceMesh with dims ("pp", "dp") (or ("pp", "dp", "tp"))'
        )
    ours = dist.get_process_group_ranks(pp)
    theirs = (
        dist.get_process_group_ranks(stage.group) if stage.group is not None else list(range(dist.get_world_size()))
    )
    if sorted(ours) != sorted(theirs):
        raise ValueError(
            f"ZeroPipelineStage (stage {stage.stage_index}): group= holds ranks {sorted(theirs)}, but the mesh's "
            f'"pp" dim given to {opt.plan.front} holds {sorted(ours)} on this rank; pass group=mesh["pp"].get_group()'
        )
