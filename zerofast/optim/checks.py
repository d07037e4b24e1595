"""ZeroAdam's argument checks and the cross-rank checks at construction: pure functions that raise
a clear error naming the argument and the value it got (or, across ranks, the first mismatch),
never a hang later."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..partition import PARTITIONS
from .precision import LOW_DTYPES

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"ZeroAdam: {name} must be True or False; got {value!r}")


def check_process_group(process_group) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"ZeroAdam: process_group must be a torch.distributed ProcessGroup or None; "
                        f"got {type(process_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("ZeroAdam needs torch.distributed initialized (dist.init_process_group); "
                           "world size 1 works too")


def check_args(model, stage, lr, betas, eps, weight_decay, partition, bucket_mb) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"ZeroAdam: model must be an nn.Module; got {type(model).__name__}")
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroAdam: stage must be 1, 2 or 3; got {stage!r}")
    if partition not in PARTITIONS:
        raise ValueError(f"ZeroAdam: partition must be one of {', '.join(PARTITIONS)}; got {partition!r}")
    if bucket_mb is not None and not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"ZeroAdam: bucket_mb must be None or a positive number; got {bucket_mb!r}")
    check_hyper("", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))


def check_precision(mixed_precision, reduce_dtype, max_grad_norm, init_scale, growth_factor, backoff_factor,
                     growth_interval) -> None:
    if mixed_precision is not None and mixed_precision not in LOW_DTYPES:
        raise ValueError(f"ZeroAdam: mixed_precision must be None, 'bf16' or 'fp16'; got {mixed_precision!r}")
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ZeroAdam: reduce_dtype must be None, torch.float32, torch.bfloat16 or torch.float16; "
                         f"got {reduce_dtype!r}")
    if mixed_precision is None and reduce_dtype not in (None, torch.float32):
        raise ValueError(f"ZeroAdam: reduce_dtype={reduce_dtype} needs mixed_precision; fp32 parameters reduce "
                         f"in float32")
    if reduce_dtype == torch.float16 and mixed_precision != "fp16":
        raise ValueError(f"ZeroAdam: reduce_dtype=torch.float16 needs mixed_precision='fp16' (whose loss scaling "
                         f"catches overflow); got mixed_precision={mixed_precision!r}")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                          and not isinstance(max_grad_norm, bool) and max_grad_norm > 0):
        raise ValueError(f"ZeroAdam: max_grad_norm must be None or a number > 0; got {max_grad_norm!r}")
    for name, value, ok in (("init_scale", init_scale, lambda v: v > 0),
                            ("growth_factor", growth_factor, lambda v: v > 1),
                            ("backoff_factor", backoff_factor, lambda v: 0 < v < 1)):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and ok(value)):
            bound = {"init_scale": "> 0", "growth_factor": "> 1", "backoff_factor": "in (0, 1)"}[name]
            raise ValueError(f"ZeroAdam: {name} must be a number {bound}; got {value!r}")
    if not (isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval >= 1):
        raise ValueError(f"ZeroAdam: growth_interval must be an integer >= 1; got {growth_interval!r}")


def check_dtypes(names: list[str], params: list, mixed_precision) -> None:
    """One device and one dtype for every trainable parameter; fp32 unless mixed precision converts it."""
    dtype, device = params[0].dtype, params[0].device
    for n, p in zip(names, params):
        if p.dtype != dtype or p.device != device:
            raise ValueError(f"ZeroAdam needs every trainable parameter on one device with one dtype: "
                             f"{names[0]} is {dtype} on {device}, {n} is {p.dtype} on {p.device}")
    if dtype != torch.float32 and mixed_precision is None:
        raise ValueError(f"ZeroAdam: the model's parameters are {dtype}; without mixed_precision they must be "
                         f"float32 (they are the master copy). Pass the fp32 model with "
                         f"mixed_precision='bf16' or 'fp16' to train in low precision")


def check_units(model: nn.Module, stage: int, units) -> None:
    """The stage; the value itself is checked where it is read (zerofast.stage3.unit_modules)."""
    if units is not None and stage != 3:
        raise ValueError(f"ZeroAdam: units apply to stage 3 only; got units with stage={stage}")


def check_min_unit_mb(min_unit_mb) -> None:
    if min_unit_mb is not None and not (isinstance(min_unit_mb, (int, float)) and not isinstance(min_unit_mb, bool)
                                        and min_unit_mb >= 0):
        raise ValueError(f"ZeroAdam: min_unit_mb must be None or a number >= 0; got {min_unit_mb!r}")


def check_bucket_buffers(bucket_buffers) -> None:
    if not (isinstance(bucket_buffers, int) and not isinstance(bucket_buffers, bool) and bucket_buffers >= 0):
        raise ValueError(f"ZeroAdam: bucket_buffers must be an integer >= 0 (0: no bound); got {bucket_buffers!r}")


def check_hyper(where: str, g: dict) -> None:
    lr, betas, eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"ZeroAdam{where}: lr must be a number >= 0; got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"ZeroAdam{where}: betas must be two numbers in [0, 1); got {betas!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"ZeroAdam{where}: eps must be a number >= 0; got {eps!r}")
    if not (isinstance(wd, (int, float)) and wd >= 0):
        raise ValueError(f"ZeroAdam{where}: weight_decay must be a number >= 0; got {wd!r}")


def build_groups(param_groups, named, defaults) -> list[dict]:
    """torch.optim-style groups over the model's trainable parameters, each exactly once."""
    params = [p for _, p in named]
    if param_groups is None:
        return [dict(defaults, params=params)]
    name_of = {id(p): n for n, p in named}
    seen: dict[int, int] = {}
    groups = []
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"ZeroAdam: param_groups[{g}] must be a dict with a 'params' list; got {group!r}")
        unknown = set(group) - {"params", *GROUP_KEYS}
        if unknown:
            raise ValueError(f"ZeroAdam: param_groups[{g}] has unknown keys {sorted(unknown)}; "
                             f"allowed: params, {', '.join(GROUP_KEYS)}")
        members = list(group["params"])
        for p in members:
            if id(p) not in name_of:
                raise ValueError(f"ZeroAdam: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is "
                                 f"not one of the model's trainable parameters")
            if id(p) in seen:
                raise ValueError(f"ZeroAdam: {name_of[id(p)]} is in param_groups[{seen[id(p)]}] and "
                                 f"param_groups[{g}]; each parameter belongs to one group")
            seen[id(p)] = g
        full = dict(defaults, **{k: v for k, v in group.items() if k != "params"}, params=members)
        full["betas"] = tuple(full["betas"])
        check_hyper(f" param_groups[{g}]", full)
        groups.append(full)
    missing = [name_of[id(p)] for p in params if id(p) not in seen]
    if missing:
        raise ValueError(f"ZeroAdam: trainable parameter {missing[0]} is in no param group "
                         f"({len(missing)} missing in all)")
    return groups


def _signature(model: nn.Module) -> list[tuple]:
    return ([("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
            + [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()])


def check_same_across_ranks(model: nn.Module, group) -> None:
    """Every rank raises the same error (naming the first mismatch) instead of hanging later."""
    mine = _signature(model)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, sig in enumerate(everyone[1:], start=1):
        if sig == reference:
            continue
        for a, b in zip(reference, sig):
            if a != b:
                raise ValueError(f"ZeroAdam: ranks hold different models: rank 0 has {a[0]} {a[1]} "
                                 f"{a[2]} {a[3]} (requires_grad={a[4]}), rank {rank} has {b[0]} {b[1]} "
                                 f"{b[2]} {b[3]} (requires_grad={b[4]})")
        raise ValueError(f"ZeroAdam: ranks hold different models: rank 0 has {len(reference)} parameters "
                         f"and buffers, rank {rank} has {len(sig)}")


def broadcast_from_rank0(model: nn.Module, group) -> None:
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)
