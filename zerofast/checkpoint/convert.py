"""Plain torch, both ways (small models, migration): to_torch reads a checkpoint as a model state
dict and a torch.optim.AdamW state dict (a ZeroMuon checkpoint: {"muon": torch.optim.Muon's, "adamw":
torch.optim.AdamW's}), in one process without a process group; from_torch continues a plain-torch
run in ZeroAdam or ZeroMuon.

[Note: ZeroMuon's torch state dicts]
A ZeroMuon checkpoint is two torch optimizers' state: torch.optim.Muon over the matrices (state per
parameter: "momentum_buffer" only, as torch keeps it) and torch.optim.AdamW over the rest. Each state
dict indexes its own parameters from 0, in the order of its param_groups' lists, each in model order:
torch.optim.Muon(opt.muon_names' parameters) and torch.optim.AdamW(the other trainable parameters)
load them as they are. The checkpoint's groups say which they are (use_muon, as Keller Jordan's
MuonWithAuxAdam marks its groups), and so do a live optimizer's: its checkpoint view's param_groups
carry use_muon, and the view says per parameter which state it holds (a Muon matrix: momentum_buffer)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
import torch.nn as nn

from ..quant import code_of, dequantize, num_blocks, scale_kind
from . import safe
from .dcp import finish_load, groups_by_name
from .io import read_manifest, read_small
from .view import Checkpointable, ShardedPart

__all__ = ["to_torch", "from_torch"]


def _adamw_defaults() -> dict:
    """The keys torch.optim.AdamW's param groups carry, with its defaults (read from torch itself, so
    a state dict made here loads into the AdamW of any torch version)."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def _muon_defaults() -> dict:
    """The same for torch.optim.Muon."""
    probe = torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def _torch_state_dict(groups: list[dict], defaults: dict, state_of) -> dict[str, Any]:
    """A torch optimizer's state dict over the saved `groups` (parameters by name), indexed from 0 in
    group order; state_of(name) is a parameter's state (None: none yet)."""
    names = [n for g in groups for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    torch_groups = [
        {
            **defaults,
            **{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k in defaults},
            "params": [index[n] for n in g["params"]],
        }
        for g in groups
    ]
    state = {index[n]: s for n in names if (s := state_of(n)) is not None}
    return {"state": state, "param_groups": torch_groups}


def to_torch(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint at `path` as a plain model state dict (fp32 master values for trainable
    parameters) and a torch.optim.AdamW state dict, read in this process without a process group.
    The optimizer's parameter indices follow the saved param_groups, each listing its parameters
    in model order: AdamW(model.parameters()) for one group. A ZeroMuon checkpoint gives
    {"muon": torch.optim.Muon's state dict, "adamw": torch.optim.AdamW's} instead ([Note: ZeroMuon's
    torch state dicts])."""
    # every file checked, the metadata through the allowlist: [Note: safe checkpoints]
    block = read_manifest(path).get("state_block", 0)
    small = read_small(path)
    meta = safe.read_metadata(os.path.join(path, ".metadata")).state_dict_metadata
    model_sd = {
        k[len("model.") :]: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in meta.items()
        if k.startswith("model.") and hasattr(md, "size")
    }
    names = [n for g in small["param_groups"] for n in g["params"]]
    missing = [n for n in names if n not in model_sd]
    if missing:
        raise ValueError(
            f"zerofast.checkpoint.to_torch: {os.path.join(path, '.metadata')} has no entry for "
            f"{missing[0]!r}, which the small state names: the checkpoint is damaged"
        )
    muon = {n for g in small["param_groups"] if g.get("use_muon") for n in g["params"]}
    kinds = {n: MUON_KINDS if n in muon else ADAM_KINDS for n in names}
    moments = {n: _saved_moments(model_sd[n].shape, block, kinds[n]) for n in names}
    with warnings.catch_warnings():
        # DCP warns that it loads in one process when no process group is given: on purpose here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled.*", category=UserWarning)
        torch_dcp.load(
            {"model": model_sd, "optim": moments},
            storage_reader=safe.SafeReader(path),
            planner=safe.SafeLoadPlanner(),
            no_dist=True,
        )
    if block:
        moments = {n: _dequantized(m, block, kinds[n]) for n, m in moments.items()}
    if any("use_muon" in g for g in small["param_groups"]):  # ZeroMuon's
        steps = small["steps"]
        return model_sd, {
            "muon": _torch_state_dict(
                [g for g in small["param_groups"] if g["use_muon"]],
                _muon_defaults(),
                lambda n: moments[n] if steps[n] > 0 else None,
            ),
            "adamw": _torch_state_dict(
                [g for g in small["param_groups"] if not g["use_muon"]],
                _adamw_defaults(),
                lambda n: {"step": torch.tensor(float(steps[n])), **moments[n]} if steps[n] > 0 else None,
            ),
        }
    defaults = _adamw_defaults()
    index = {n: i for i, n in enumerate(names)}
    groups = [
        {
            **defaults,
            **{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"},
            "params": [index[n] for n in g["params"]],
        }
        for g in small["param_groups"]
    ]
    state = {
        index[n]: {"step": torch.tensor(float(small["steps"][n])), **moments[n]} for n in names if small["steps"][n] > 0
    }
    return model_sd, {"state": state, "param_groups": groups}


ADAM_KINDS = ("exp_avg", "exp_avg_sq")
MUON_KINDS = ("momentum_buffer",)  # a ZeroMuon matrix's


def _saved_moments(shape: torch.Size, block: int, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Empty tensors for a parameter's optimizer state as a checkpoint stores it: fp32 in its shape, or
    8-bit (block > 0) uint8 codes and fp32 scales per block ([Note: 8-bit checkpoints] in dcp.py)."""
    if not block:
        return {kind: torch.empty(shape) for kind in kinds}
    blocks = num_blocks(shape.numel(), block)
    return {
        k: v
        for kind in kinds
        for k, v in ((kind, torch.empty(shape, dtype=torch.uint8)), (scale_kind(kind), torch.empty(blocks)))
    }


def _dequantized(saved: dict[str, torch.Tensor], block: int, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A parameter's 8-bit state as torch.optim.AdamW / Muon keep it: fp32 in its shape."""
    return {
        kind: dequantize(saved[kind].reshape(-1), saved[scale_kind(kind)], code_of(kind), block).view(saved[kind].shape)
        for kind in kinds
    }


def from_torch(
    model_state_dict: dict[str, torch.Tensor],
    optim_state_dict: dict | None,
    model: nn.Module,
    opt: Checkpointable,
    param_order: list[torch.Tensor] | None = None,
) -> None:
    """Continue a plain-torch run in ZeroAdam: `model_state_dict` (model.state_dict() of the same
    architecture) and, optionally, the state dict of torch.optim.AdamW, in full on every rank; each
    rank keeps what it owns. param_order: the model's parameters in the order of that state dict's
    indices (its param_groups' lists, one after another: [p for g in adamw.param_groups for p in
    g["params"]] of an AdamW built the same way); default model.parameters(), or the trainable ones."""
    missing = [k for k in model.state_dict(keep_vars=True) if k not in model_state_dict]
    if missing:
        raise ValueError(
            f"zerofast.checkpoint.from_torch: model_state_dict has no {missing[0]} ({len(missing)} keys missing)"
        )
    for key, value in model.state_dict(keep_vars=True).items():
        given = model_state_dict[key]
        if tuple(given.shape) != tuple(value.shape):
            raise ValueError(
                f"zerofast.checkpoint.from_torch: {key} has shape {tuple(given.shape)}, the model {tuple(value.shape)}"
            )
    view = opt.checkpoint_view
    part = view.trainable
    names = part.names
    moments, groups = {}, groups_by_name(view)  # without an AdamW state dict: zero moments, our hyper-parameters
    if optim_state_dict is not None and any("use_muon" in g for g in view.param_groups):  # ZeroMuon's groups
        moments, groups = _from_muon_and_adamw(optim_state_dict, part, param_order)
    elif optim_state_dict is not None:
        order = _adamw_param_order(optim_state_dict, model, part, param_order)
        moments = {order[k]: v for k, v in optim_state_dict["state"].items() if order[k] is not None}
        keys = ("lr", "betas", "eps", "weight_decay")
        groups = [
            {
                **{k: g[k] for k in keys if k in g},
                "params": [names[order[k]] for k in g["params"] if order[k] is not None],
            }
            for g in optim_state_dict["param_groups"]
        ]
    view.quiesce()  # nothing in flight writes the state while it is replaced
    full = {}
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            i = part.index(value)
            j = view.frozen.index(value) if i is None and view.frozen is not None else None
            if j is not None:  # stage 3's frozen parameters: this rank's shard ([Note: frozen parameters in stage 3])
                view.frozen.load_pieces("master", {j: model_state_dict[key]})
            elif i is None:
                value.copy_(model_state_dict[key])
            else:
                full.setdefault(i, model_state_dict[key])
    part.load_pieces("master", full)
    for kind in sorted({kind for kinds in part.kinds for kind in kinds}):
        part.load_pieces(kind, {i: m[kind] for i, m in moments.items() if kind in m and kind in part.kinds[i]})
    # torch.optim.Muon keeps no step count: a matrix with a momentum buffer takes the run's (AdamW's largest)
    run_steps = max([int(m["step"]) for m in moments.values() if "step" in m], default=1)
    finish_load(
        view,
        {
            "steps": {
                n: (int(moments[i]["step"]) if "step" in moments[i] else run_steps) if i in moments else 0
                for i, n in enumerate(names)
            },
            "param_groups": groups,
            "loss_scaler": None,
        },
    )


def _from_muon_and_adamw(optim_state_dict, part: ShardedPart, param_order):
    """from_torch for ZeroMuon: {"muon": torch.optim.Muon's state dict, "adamw": torch.optim.AdamW's};
    param_order None (each indexes its own parameters in model order: [Note: ZeroMuon's torch state
    dicts]) or {"muon": [...], "adamw": [...]}. Returns (state by parameter index, groups by name)."""
    if not (isinstance(optim_state_dict, dict) and set(optim_state_dict) == {"muon", "adamw"}):
        raise ValueError(
            f"zerofast.checkpoint.from_torch: a ZeroMuon takes {{'muon': torch.optim.Muon's state dict, "
            f"'adamw': torch.optim.AdamW's}}; got a dict with keys {sorted(optim_state_dict)}"
        )
    names = part.names
    muon = ["momentum_buffer" in kinds for kinds in part.kinds]  # a Muon matrix's state
    moments, groups = {}, []
    for kind, use_muon, keys in (
        (
            "muon",
            True,
            ("lr", "momentum", "nesterov", "weight_decay", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn"),
        ),
        ("adamw", False, ("lr", "betas", "eps", "weight_decay")),
    ):
        sd = optim_state_dict[kind]
        if param_order is not None:
            order = [part.index(p) for p in param_order[kind]]
        else:
            order = [i for i in range(len(names)) if muon[i] == use_muon]
        count = sum(len(g["params"]) for g in sd["param_groups"])
        if count != len(order):
            raise ValueError(
                f"zerofast.checkpoint.from_torch: optim_state_dict[{kind!r}] holds {count} parameters; "
                f"this ZeroMuon has {len(order)} {kind} parameters"
            )
        moments.update({order[k]: v for k, v in sd["state"].items() if order[k] is not None})
        groups += [
            {
                **{k: g[k] for k in keys if k in g},
                "use_muon": use_muon,
                "params": [names[order[k]] for k in g["params"] if order[k] is not None],
            }
            for g in sd["param_groups"]
        ]
    return moments, groups


def _adamw_param_order(
    optim_state_dict: dict, model: nn.Module, part: ShardedPart, param_order: list[torch.Tensor] | None
) -> list[int | None]:
    """Index k of the AdamW state dict -> ZeroAdam's parameter index (None: not managed)."""
    count = sum(len(g["params"]) for g in optim_state_dict["param_groups"])
    if param_order is not None:
        if len(param_order) != count:
            raise ValueError(
                f"zerofast.checkpoint.from_torch: the optimizer state dict holds {count} parameters; "
                f"param_order has {len(param_order)}"
            )
        return [part.index(p) for p in param_order]
    everything = list(model.parameters())
    trainable = [p for p in everything if p.requires_grad]
    params = everything if count == len(everything) else trainable if count == len(trainable) else None
    if params is None:
        raise ValueError(
            f"zerofast.checkpoint.from_torch: the optimizer state dict holds {count} parameters; the "
            f"model has {len(everything)} ({len(trainable)} trainable)"
        )
    return [part.index(p) for p in params]
