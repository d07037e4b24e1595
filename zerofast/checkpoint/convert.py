"""Plain torch, both ways (small models, migration): to_torch reads a checkpoint as a model state
dict and a torch.optim.AdamW state dict, in one process without a process group; from_torch
continues a plain-torch run in ZeroAdam."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed.checkpoint as torch_dcp
import torch.nn as nn

from . import safe
from .dcp import finish_load, groups_by_name, sharded_tensors
from .io import read_manifest, read_small

if TYPE_CHECKING:
    from ..optim.zero_adam import ZeroAdam

__all__ = ["to_torch", "from_torch"]


def _adamw_defaults() -> dict:
    """The keys torch.optim.AdamW's param groups carry, with its defaults (read from torch itself, so
    a state dict made here loads into the AdamW of any torch version)."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def to_torch(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint at `path` as a plain model state dict (fp32 master values for trainable
    parameters) and a torch.optim.AdamW state dict, read in this process without a process group.
    The optimizer's parameter indices follow the saved param_groups, each listing its parameters
    in model order: AdamW(model.parameters()) for one group."""
    read_manifest(path)  # every file checked, the metadata through the allowlist: [Note: safe checkpoints]
    small = read_small(path)
    meta = safe.read_metadata(os.path.join(path, ".metadata")).state_dict_metadata
    model_sd = {k[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                for k, md in meta.items() if k.startswith("model.") and hasattr(md, "size")}
    names = [n for g in small["param_groups"] for n in g["params"]]
    missing = [n for n in names if n not in model_sd]
    if missing:
        raise ValueError(f"zerofast.checkpoint.to_torch: {os.path.join(path, '.metadata')} has no entry for "
                         f"{missing[0]!r}, which the small state names: the checkpoint is damaged")
    moments = {n: {"exp_avg": torch.empty(model_sd[n].shape), "exp_avg_sq": torch.empty(model_sd[n].shape)}
               for n in names}
    with sharded_tensors():
        torch_dcp.load({"model": model_sd, "optim": moments}, storage_reader=safe.SafeReader(path),
                       planner=safe.SafeLoadPlanner(), no_dist=True)
    defaults = _adamw_defaults()
    index = {n: i for i, n in enumerate(names)}
    groups = [{**defaults, **{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"},
               "params": [index[n] for n in g["params"]]} for g in small["param_groups"]]
    state = {index[n]: {"step": torch.tensor(float(small["steps"][n])), **moments[n]}
             for n in names if small["steps"][n] > 0}
    return model_sd, {"state": state, "param_groups": groups}


def from_torch(model_state_dict: dict[str, torch.Tensor], optim_state_dict: Optional[dict], model: nn.Module,
               opt: ZeroAdam, param_order: Optional[list[torch.Tensor]] = None) -> None:
    """Continue a plain-torch run in ZeroAdam: `model_state_dict` (model.state_dict() of the same
    architecture) and, optionally, the state dict of torch.optim.AdamW, in full on every rank; each
    rank keeps what it owns. param_order: the model's parameters in the order of that state dict's
    indices (its param_groups' lists, one after another: [p for g in adamw.param_groups for p in
    g["params"]] of an AdamW built the same way); default model.parameters(), or the trainable ones."""
    missing = [k for k in model.state_dict(keep_vars=True) if k not in model_state_dict]
    if missing:
        raise ValueError(f"zerofast.checkpoint.from_torch: model_state_dict has no {missing[0]} "
                         f"({len(missing)} keys missing)")
    for key, value in model.state_dict(keep_vars=True).items():
        given = model_state_dict[key]
        if tuple(given.shape) != tuple(value.shape):
            raise ValueError(f"zerofast.checkpoint.from_torch: {key} has shape {tuple(given.shape)}, the model "
                             f"{tuple(value.shape)}")
    names = [n for n, _ in opt.named_params]
    moments, groups = {}, groups_by_name(opt)  # without an AdamW state dict: zero moments, our hyper-parameters
    if optim_state_dict is not None:
        order = _adamw_param_order(optim_state_dict, model, opt, param_order)
        moments = {order[k]: v for k, v in optim_state_dict["state"].items() if order[k] is not None}
        keys = ("lr", "betas", "eps", "weight_decay")
        groups = [{**{k: g[k] for k in keys if k in g}, "params": [names[order[k]] for k in g["params"]
                                                                 if order[k] is not None]}
                  for g in optim_state_dict["param_groups"]]
    opt.quiesce()  # nothing in flight writes the state while it is replaced
    full = {}
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            i = opt.param_index(value)
            j = opt.frozen_index(value) if i is None else None
            if j is not None:  # stage 3's frozen parameters: this rank's shard ([Note: frozen parameters in stage 3])
                opt.frozen.load_pieces({j: model_state_dict[key]})
            elif i is None:
                value.copy_(model_state_dict[key])
            else:
                full.setdefault(i, model_state_dict[key])
    opt.shard.load_pieces("master", full)
    for kind in ("exp_avg", "exp_avg_sq"):
        opt.shard.load_pieces(kind, {i: m[kind] for i, m in moments.items()})
    finish_load(opt, {"steps": {n: int(moments[i]["step"]) if i in moments else 0 for i, n in enumerate(names)},
                      "param_groups": groups, "loss_scaler": None})


def _adamw_param_order(optim_state_dict: dict, model: nn.Module, opt: ZeroAdam,
                       param_order: Optional[list[torch.Tensor]]) -> list[Optional[int]]:
    """Index k of the AdamW state dict -> ZeroAdam's parameter index (None: not managed)."""
    count = sum(len(g["params"]) for g in optim_state_dict["param_groups"])
    if param_order is not None:
        if len(param_order) != count:
            raise ValueError(f"zerofast.checkpoint.from_torch: the optimizer state dict holds {count} parameters; "
                             f"param_order has {len(param_order)}")
        return [opt.param_index(p) for p in param_order]
    everything = list(model.parameters())
    trainable = [p for p in everything if p.requires_grad]
    params = everything if count == len(everything) else trainable if count == len(trainable) else None
    if params is None:
        raise ValueError(f"zerofast.checkpoint.from_torch: the optimizer state dict holds {count} parameters; the "
                         f"model has {len(everything)} ({len(trainable)} trainable)")
    return [opt.param_index(p) for p in params]
