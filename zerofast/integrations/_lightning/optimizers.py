"""configure_optimizers' optimizer as a ZeroAdam (zero_from), and what re-points the LR schedulers at it
(_schedulers, _track_step)."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
import torch.nn as nn

from ...config import comm_policy
from ...optim.base import ZeroOptimizer
from ...optim.zero_adam import ZeroAdam

# Keys of torch.optim.Adam(W)'s param groups that choose its implementation, not its mathematics.
_TORCH_ADAM_KEYS = {"foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay", "amsgrad", "maximize"}
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def _track_step(opt: torch.optim.Optimizer) -> None:
    """Mark opt.step as torch's LRScheduler marks its optimizer's (torch 2.14's lr_scheduler.py,
    patch_track_step_called; torch has no public way to re-point a scheduler), so the scheduler does not warn
    wrongly that lr_scheduler.step() came first. Were torch to change these private marks, that warning is the cost."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref, func = weakref.ref(opt), type(opt).step

    @functools.wraps(func)
    def step(*args, **kwargs):
        me = ref()
        me._opt_called = True
        return func(me, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    opt.step = step


def _schedulers(scheduler) -> list:
    """A scheduler and those it drives (SequentialLR, ChainedScheduler)."""
    found = [scheduler]
    for child in getattr(scheduler, "_schedulers", []):
        found += _schedulers(child)
    return found


def zero_from(optimizer, module: nn.Module, stage: int | None, options: dict) -> ZeroAdam:
    """The ZeroAdam that trains `module`: `optimizer` itself if it is one built on it, else one with
    torch.optim.AdamW's / Adam's parameter groups and hyper-parameters (frozen parameters left out,
    the groups' other keys, a scheduler's initial_lr, carried over)."""
    if isinstance(optimizer, ZeroOptimizer):
        if optimizer.model is not module:
            raise ValueError(
                f"ZeroStrategy: configure_optimizers returned a ZeroAdam built on "
                f"{type(optimizer.model).__name__}, not on the LightningModule; build it as "
                f"ZeroAdam(self, ...)"
            )
        given = [k for k, v in dict(options, stage=stage).items() if v is not None]
        if given:
            raise ValueError(
                f"ZeroStrategy: {', '.join(sorted(given))} given to ZeroStrategy and a ZeroAdam "
                f"returned by configure_optimizers; set them in one place (the ZeroAdam's)"
            )
        return optimizer
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        raise TypeError(
            f"ZeroStrategy: configure_optimizers returned {kind.__module__}.{kind.__qualname__}; "
            f"ZeroStrategy trains with ZeroAdam, converted from torch.optim.AdamW or torch.optim.Adam "
            f"(their parameter groups and hyper-parameters), or a ZeroAdam built on the "
            f"LightningModule (ZeroAdam(self, ...))"
        )
    for g, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"ZeroStrategy: {kind.__name__}.param_groups[{g}] has {flag}=True, which ZeroAdam "
                    f"does not implement"
                )
    adamw = kind is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay", False))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left_out = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
    if left_out:
        raise ValueError(
            f"ZeroStrategy: {left_out[0]} is trainable (requires_grad=True) but in no parameter group "
            f"of the {kind.__name__} ({len(left_out)} such); ZeroAdam trains every trainable parameter "
            f"of the module: set requires_grad=False on those it should not train"
        )

    def hyper(group: dict) -> dict:
        lr = group["lr"]
        return dict(
            lr=float(lr.item() if isinstance(lr, torch.Tensor) else lr),
            betas=tuple(float(b.item() if isinstance(b, torch.Tensor) else b) for b in group["betas"]),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
        )

    # Frozen parameters are in no ZeroAdam group (torch.optim skips them: they get no gradient); an
    # emptied group stays, so group i is still the scheduler's group i.
    groups = [
        dict(hyper(group), params=[p for p in group["params"] if p.requires_grad]) for group in optimizer.param_groups
    ]
    first = groups[0]
    given = {k: v for k, v in options.items() if v is not None}
    if "shard_size" in given:  # ZeroAdam takes it in its CommPolicy
        given["comm"] = dataclasses.replace(comm_policy(given.get("comm")), shard_size=given.pop("shard_size"))
    zero = ZeroAdam(
        module,
        stage=2 if stage is None else stage,
        adamw=adamw,
        param_groups=groups,
        **{k: first[k] for k in _HYPER_KEYS},
        **given,
    )
    for mine, theirs in zip(zero.param_groups, optimizer.param_groups):
        for key, value in theirs.items():  # a scheduler's keys (initial_lr, max_lr, ...), the user's own
            if key not in mine and key not in _TORCH_ADAM_KEYS:
                mine[key] = value
    return zero
