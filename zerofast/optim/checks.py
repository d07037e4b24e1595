"""An optimizer's checks that need the model (the options alone: zerofast/config.py): parameter groups,
the parameters' dtypes and device, and at every step that the trainable parameters are those it was
built over and still views of its buffers; each a clear error naming the argument and the value."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ModelConversionError
from .update import check_hyper

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def check_dtypes(names: list[str], params: list, param_dtype: torch.dtype, who: str = "ZeroAdam") -> None:
    """One device and one dtype for every trainable parameter; fp32 unless mixed precision converts it
    (to param_dtype, after this check)."""
    dtype, device = params[0].dtype, params[0].device
    for n, p in zip(names, params):
        if p.dtype != dtype or p.device != device:
            raise ValueError(
                f"{who} needs every trainable parameter on one device with one dtype: "
                f"{names[0]} is {dtype} on {device}, {n} is {p.dtype} on {p.device}"
            )
    if dtype != torch.float32 and param_dtype == torch.float32:
        raise ValueError(
            f"{who}: the model's parameters are {dtype}; without mixed_precision they must be "
            f"float32 (they are the master copy). Pass the fp32 model with "
            f"mixed_precision='bf16' or 'fp16' to train in low precision"
        )


def build_groups(param_groups, named, defaults, who: str = "ZeroAdam") -> list[dict]:
    """torch.optim-style groups over the model's trainable parameters, each exactly once."""
    params = [p for _, p in named]
    if param_groups is None:
        return [dict(defaults, params=params)]
    name_of = {id(p): n for n, p in named}
    seen: dict[int, int] = {}
    groups = []
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"{who}: param_groups[{g}] must be a dict with a 'params' list; got {group!r}")
        unknown = set(group) - {"params", *GROUP_KEYS}
        if unknown:
            raise ValueError(
                f"{who}: param_groups[{g}] has unknown keys {sorted(unknown)}; allowed: params, {', '.join(GROUP_KEYS)}"
            )
        members = list(group["params"])
        for p in members:
            if id(p) not in name_of:
                raise ValueError(
                    f"{who}: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is "
                    f"not one of the model's trainable parameters"
                )
            if id(p) in seen:
                raise ValueError(
                    f"{who}: {name_of[id(p)]} is in param_groups[{seen[id(p)]}] and "
                    f"param_groups[{g}]; each parameter belongs to one group"
                )
            seen[id(p)] = g
        full = dict(defaults, **{k: v for k, v in group.items() if k != "params"}, params=members)
        full["betas"] = tuple(full["betas"])
        check_hyper(f" param_groups[{g}]", full, who)
        groups.append(full)
    missing = [name_of[id(p)] for p in params if id(p) not in seen]
    if missing:
        raise ValueError(
            f"{who}: trainable parameter {missing[0]} is in no param group ({len(missing)} missing in all)"
        )
    return groups


def check_trainable_unchanged(trainable_at_build: list[tuple[str, nn.Parameter, bool]], who: str = "ZeroAdam") -> None:
    """Which parameters are trainable, as at construction: the buffers and optimizer state are laid
    out over the parameters trainable then."""
    for name, param, trainable in trainable_at_build:
        if param.requires_grad != trainable:
            effect = "its gradient would be ignored" if param.requires_grad else "it would silently stop training"
            raise RuntimeError(
                f"{who}: {name}.requires_grad changed from {trainable} to {param.requires_grad} after "
                f"{who} was built; its buffers and optimizer state are laid out over the parameters "
                f"trainable at construction, so {effect}. "
                f"Set requires_grad before building ZeroAdam (or build a new one)"
            )


def check_params_in_place(names: list[str], params: list, layout, buffers: list[torch.Tensor], who: str) -> None:
    """Stages 1 and 2: every trainable parameter still a view of its slot in the flat buffers; one
    given other storage since (p.data = t, set_(), swap_tensors) would be neither read nor updated
    ([Note: the model stays a torch model] in zerofast/guard/__init__.py). Run before the step's
    agreement, so every rank raises and nothing is applied."""
    for name, p, slot in zip(names, params, layout.slots):
        buf = buffers[slot.bucket]
        if p.data_ptr() != buf.data_ptr() + slot.offset * buf.element_size():
            raise ModelConversionError(
                f"{who}: {name} no longer views the optimizer's buffer: its storage was replaced after the "
                "optimizer was built (p.data = t, p.set_(...) or torch.utils.swap_tensors), so the step would "
                f"neither read its values nor update it. Write new values into it instead (with torch.no_grad(): "
                f"{name}.copy_(t)), or build the optimizer after the model is final"
            )
