"""ZeroAdam: Adam/AdamW with ZeRO stage 1, 2 or 3 sharding, under the plain training loop.

    opt = ZeroAdam(model, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Goals: exactly single-process torch.optim.AdamW on the global batch; communication overlapped with
backward; one contiguous buffer per bucket, so collectives and the step run over long flat ranges.

A step's phases, each owned by one object (its module holds the details and the named notes):
  Phase 1, in backward (GradReducer, grads.py): each gradient is copied into its bucket slot; a
    complete bucket's reduce starts at once, asynchronously, in bucket order.
  Phase 2, step() or an earlier clip_grad_norm_() (GradReducer): buckets this rank left unfilled are
    launched with zeros; the ranks agree which parameters got a gradient anywhere; every reduce is
    waited for; with fp16 or clipping, one small all_reduce agrees on overflow and the global norm;
    an overflow skips phases 3 and 4 on every rank (LossScaler, precision.py).
  Phase 3, step() (ShardState, state.py): the fused Adam kernel over this rank's fp32 master ranges,
    averaging, unscaling and clipping the gradient shard through its grad_scale.
  Phase 4, step() (ParamGather, gather.py): stages 1 and 2 gather each bucket's updated parameters
    into the flat buffers the model's parameters view; step() returns once every gather is done
    (with CommPolicy(overlap_param_gather=True), at once).
Stage 3 (UnitTracker over UnitBuffers, zerofast/stage3/runtime.py) shards the parameters themselves: each
unit (by default each block) is one bucket whose flat buffer exists only while gathered, module by
module with prefetch; the fp32 master is this rank's parameter shard; no phase 4: the next forward
gathers. Communication: BucketComm (zerofast/comm.py over csrc/). The builder (builder.py) wires the
parts from the plan and the front's update rule (update.py); the front (base.py) orders their calls,
reports (report.py) and hands checkpoints one view (checkpoint_view).

[Note: determinism]
Two runs with the same inputs give bitwise-identical results: the layout is a pure function of the
parameter list and the plan, buckets are launched in a fixed order, the collectives reduce in
a fixed order for a fixed world size, and the fused kernel is elementwise.
"""

from __future__ import annotations

import torch.nn as nn

from ..config import reject_moved, resolve_plan
from ..model_setup import as_model
from . import checks
from .base import (
    ZeroOptimizer,
    parts_of,  # noqa: F401  (the tests' seam, importable here as before; not public)
)
from .builder import trainable_params
from .update import AdamUpdate, check_hyper

__all__ = ["ZeroAdam"]


class ZeroAdam(ZeroOptimizer):
    """Adam/AdamW whose state (stage 1), gradients (stage 2) and parameters (stage 3) are sharded
    across the ranks of `process_group` (default: the whole world).

    model: the nn.Module whose trainable parameters it manages (a tied parameter is one parameter);
      they become views into zerofast's flat buffers. Frozen ones get no gradient or optimizer
      state; stage 3 shards them too, gathered with their unit ([Note: frozen parameters in stage 3]
      in zerofast/stage3/frozen.py), stages 1 and 2 leave them alone.
    stage: 1 shards the Adam state, 2 also the gradients, 3 also the parameters.
    lr, betas, eps, weight_decay: as torch.optim.AdamW's.
    adamw: decoupled weight decay (torch.optim.AdamW); False: torch.optim.Adam's L2 term.
    param_groups: torch.optim-style dicts over the model's trainable parameters ("lr", "betas",
      "eps", "weight_decay"; missing keys take the constructor's values).
    max_grad_norm: clip the global gradient norm to this at every step (None: no clipping);
      opt.clip_grad_norm_(max_norm) clips on request ([Note: global gradient clipping]).
    mixed_precision: None (fp32 parameters), "bf16", "fp16" or a MixedPrecisionPolicy (its reduce
      dtype and fp16's loss scaling): the model is converted as model.to(dtype) would (frozen
      parameters and floating buffers too), its forward's floating-point inputs are cast, and the
      optimizer keeps the fp32 master shard and Adam state ([Note: mixed precision]).
    units: stage 3: a UnitPolicy, or what its `modules` takes (a list of submodules, a module class
      or set of classes, a callable module -> bool); None: the model's blocks, small ones merged.
    comm: a CommPolicy: partition, hybrid sharding's shard_size, bucket size, buffers in flight,
      overlap, accumulation, and the collectives' debug check (None: CommPolicy()'s defaults).
    process_group: the data-parallel ranks (None: the whole world), or a 2-D DeviceMesh with
      mesh_dim_names ("replicate", "shard") as FSDP2's HSDP takes it: hybrid sharding by its groups;
      or, for a model parallelized over mesh["tp"] (DTensor parameters), a mesh ("dp", "tp") or
      ("replicate", "dp", "tp"): ZeRO over the data-parallel dims, stages 1-3 ([Note: tensor
      parallelism] in zerofast/tensor_parallel.py); any of these with "pp" in front (also ("pp",
      "dp")) for a pipeline stage's part, trained through zerofast.pipelining.ZeroPipelineStage
      ([Note: pipeline accumulation]). model may then be a list of this rank's parts (several
      stages a rank), trained as one.
    offload: where the optimizer state lives: None (with the parameters), an OffloadPolicy, or its
      shortcuts "host" (pinned host memory, stepped by the fused CPU kernel) and "disk:PATH" (files
      under PATH streamed through a bounded window): [Note: offload schedule] in zerofast/offload.
    Every option is checked and resolved once into `opt.plan` (zerofast/config.py), which every part
    reads. Every wait is bounded by the process group's timeout (stage 3's gather group's too): a
    dead, stuck or out-of-step rank makes the others raise CollectiveError naming the step, phase
    and collective ([Note: faults] in zerofast/comm.py).
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
        offload=None,
        **moved,
    ):
        reject_moved("ZeroAdam", moved)
        model = as_model(model, "ZeroAdam")
        named = trainable_params(model, "ZeroAdam", process_group)
        plan = resolve_plan(
            stage,
            adamw=adamw,
            max_grad_norm=max_grad_norm,
            mixed_precision=mixed_precision,
            comm=comm,
            units=units,
            offload=offload,
            who="ZeroAdam",
        )
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps, weight_decay=weight_decay
        )
        check_hyper("", defaults)
        rule = AdamUpdate(checks.build_groups(param_groups, named, defaults), defaults, plan.adamw)
        self._wire(model, plan, process_group, rule)
