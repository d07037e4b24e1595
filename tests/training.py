"""What the multi-rank tests train on and how, shared with their oracles: the batch each rank sees
at each step (rank_batch, global_batch), the training loops (train_steps, train_same_batch), the
parameter groups and LR schedule of the Quirky cases, and ZeroAdam's keywords for a test matrix
(zero_options)."""

from __future__ import annotations

import torch
from models import model_loss

from zerofast.tools.models import random_batch

LOCAL_BATCH = 2


def rank_batch(model, step: int, rank: int):
    """Rank `rank`'s batch at `step`: the same on every run, different on every rank."""
    cfg = model.cfg
    return random_batch(cfg, LOCAL_BATCH, cfg.block_size, seed=1000 * step + rank)


def global_batch(model, step: int, world: int):
    parts = [rank_batch(model, step, r) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def train_steps(
    model, opt, rank: int, steps: int, *, start: int = 0, forward=None, backward=None, before_step=None, after_step=None
) -> list[float]:
    """The multi-rank tests' training loop, written once. For each step in range(start, start +
    steps): rank `rank`'s batch (rank_batch, moved to the model's device), its loss, backward,
    opt.step(), opt.zero_grad(). What a test does in between goes in the hooks:
    - forward(model, x, y, step) -> loss; default model_loss (our GPT-shaped models, a Hugging Face LM);
    - backward(loss); default loss.backward() (pass opt.backward for fp16's loss scaling);
    - before_step(step): after backward, before opt.step() (clip_grad_norm_, a snapshot);
    - after_step(step): after opt.step(), before opt.zero_grad() (memory while the step's state
      exists, an LR scheduler).
    Returns each step's loss."""
    device = next(model.parameters()).device
    losses = []
    for step in range(start, start + steps):
        x, y = (t.to(device) for t in rank_batch(model, step, rank))
        loss = forward(model, x, y, step) if forward is not None else model_loss(model, x, y)
        if backward is not None:
            backward(loss)
        else:
            loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        if after_step is not None:
            after_step(step)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_accumulated(model, opt, rank: int, start: int, steps: int, micro: int = 2) -> None:
    """Steps [start, start + steps), each `micro` micro-batches of rank_batch(model, 10 * step + m), the
    earlier backwards inside opt.no_sync(), through opt.backward (a model_loss model: Nested, GPT)."""
    from models import model_loss

    for step in range(start, start + steps):
        for m in range(micro):
            x, y = rank_batch(model, 10 * step + m, rank)
            if m < micro - 1:
                with opt.no_sync():
                    opt.backward(model_loss(model, x, y))
            else:
                opt.backward(model_loss(model, x, y))
        opt.step()
        opt.zero_grad()


def two_groups(model: torch.nn.Module) -> list[dict]:
    """Matrices in one group, vectors (biases, norms, rank0_only) in another with its own lr and wd."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "lr": 1e-3, "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() < 2], "lr": 2e-3, "weight_decay": 0.0},
    ]


def make_scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def train_same_batch(model, opt, start: int, steps: int) -> None:
    """Steps start .. start + steps - 1 with the same batch on every rank (rank 0's), so the averaged
    gradient is exact and runs at any world size can be compared bitwise."""
    for step in range(start, start + steps):
        x, y = rank_batch(model, step, 0)
        model_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def zero_options(
    stage: int,
    *,
    partition=None,
    bucket_mb=None,
    bucket_buffers=None,
    overlap=None,
    overlap_param_gather=None,
    accumulate_locally=None,
    check_collectives=None,
    shard_size=None,
    min_unit_mb=None,
    units=None,
    mixed_precision=None,
    reduce_dtype=None,
    init_scale=None,
    growth_interval=None,
) -> dict:
    """ZeroAdam's keywords for a test matrix written over flat option names: the stage, and the
    policies that hold the options given (None: the policy's default). A bucket size belongs to
    stages 1 and 2, so a matrix over stages passes bucket_mb to those only (stage 3 reduces one
    bucket per unit, and ZeroAdam rejects a bucket size there)."""
    from zerofast import CommPolicy, LossScalePolicy, MixedPrecisionPolicy, UnitPolicy

    comm = {
        k: v
        for k, v in dict(
            partition=partition,
            bucket_mb=bucket_mb if stage < 3 else None,
            bucket_buffers=bucket_buffers,
            overlap=overlap,
            overlap_param_gather=overlap_param_gather,
            accumulate_locally=accumulate_locally,
            check_collectives=check_collectives,
            shard_size=shard_size,
        ).items()
        if v is not None
    }
    out = dict(stage=stage, comm=CommPolicy(**comm))
    if stage == 3 and (units is not None or min_unit_mb is not None):
        out["units"] = UnitPolicy(modules=units, min_unit_mb=min_unit_mb if units is None else None)
    scaling = {k: v for k, v in dict(init_scale=init_scale, growth_interval=growth_interval).items() if v is not None}
    if mixed_precision is not None and (reduce_dtype is not None or scaling):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
        out["mixed_precision"] = MixedPrecisionPolicy(
            dtype, reduce_dtype, LossScalePolicy(**scaling) if scaling else None
        )
    elif mixed_precision is not None:
        out["mixed_precision"] = mixed_precision
    return out
