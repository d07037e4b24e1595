"""What ZeroAdam and shard_frozen do to a model before sharding it, written once for both: every
rank holds the same model (checked: one all_gather_object, the first mismatch named on every rank)
with rank 0's values (broadcast), and in low precision the model converted and its inputs cast
([Note: mixed precision] in zerofast/optim/precision.py); a model built on the meta device trains on
the device its process group's backend implies ([Note: models built on the meta device])."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from .tensor_parallel import is_dtensor, set_local
from .topology import broadcast_from_rank0

__all__ = [
    "meta_device",
    "check_plain_parameters",
    "join_ranks",
    "check_same_across_ranks",
    "check_pipeline_parts",
    "ModelParts",
    "as_model",
    "in_precision",
    "cast_unmanaged",
    "InputCast",
]


def check_plain_parameters(model: nn.Module, who: str, tensor_parallel: bool = False) -> None:
    """Every parameter a plain tensor unless tensor_parallel (a mesh with a "tp" dim: [Note: tensor
    parallelism] in zerofast/tensor_parallel.py): a DTensor is a named error before any collective, on
    every rank alike, not a failure deep in the first broadcast. DTensor is looked up only where its
    module was imported (importing it costs about a second): no DTensor exists otherwise."""
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None or tensor_parallel:
        return
    for name, p in model.named_parameters():
        if isinstance(p, tensor.DTensor):
            mesh = p.device_mesh
            how = (
                "ZeroAdam takes it with process_group=a DeviceMesh whose mesh_dim_names are ('dp', 'tp') or "
                "('replicate', 'dp', 'tp'), the model parallelized over mesh['tp']"
                if who == "ZeroAdam"
                else f"{who} does not take tensor-parallel models (parallelize_module's DTensor parameters)"
                + (": Newton-Schulz runs on whole matrices" if who == "ZeroMuon" else "")
            )
            raise ValueError(
                f"{who}: parameter {name!r} is a DTensor (placements {tuple(p.placements)} on a "
                f"{mesh.ndim}-D DeviceMesh with mesh_dim_names={mesh.mesh_dim_names}); {how}"
            )


def meta_device(params: list[nn.Parameter], group, stage: int, who: str, tensor_parallel: bool = False):
    """None when the trainable parameters hold values; when they are all on the meta device, the device
    the model trains on: the backend's (nccl: this process's current CUDA device; otherwise the CPU).

    [Note: models built on the meta device]
    A model larger than memory cannot be built whole first (FSDP2's answer: build it under
    torch.device("meta"), shard, then materialize each shard). ZeroAdam at stage 3 takes such a model
    as it is: no rank broadcasts values, the flat buffers are allocated untouched and released at
    once (no page of the whole model is ever resident), each parameter is swapped into a view of its
    buffer (torch.utils.swap_tensors: the same Parameter object, now on the training device), and the
    shards, the fp32 master and the moments start at zero. The values come after, as for the plain
    model: model.apply(init_fn) / nn.init on each parameter (the guard writes each rank's pieces and
    the master: [Note: the model stays a torch model] in zerofast/guard/__init__.py), or a checkpoint
    loaded. The model's other meta tensors (buffers, frozen parameters of another dtype) are the
    user's to materialize (model.to_empty(device=...) passes the managed parameters by, as it finds
    them where it would move them), then to recompute (a rotary table). Stages 1 and 2 keep whole
    parameters on every rank: a meta model there is a named error, as is one mixing meta and real
    parameters."""
    meta = [p.is_meta for p in params]
    if not any(meta):
        return None
    if not all(meta):
        raise ValueError(
            f"{who}: some trainable parameters are on the meta device and some are not; build the whole model "
            "under torch.device('meta') (or none of it)"
        )
    if stage != 3 or tensor_parallel:
        why = "tensor parallelism's DTensors" if tensor_parallel else f"stage={stage} (whole parameters on every rank)"
        raise ValueError(
            f"{who}: a model on the meta device is built at stage 3, shard by shard; got it with {why}: "
            "materialize it first (model.to_empty(device=...) and its init) or use stage=3"
        )
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join_ranks(model: nn.Module, group: dist.ProcessGroup, who: str, tp_group=None, meta: bool = False) -> None:
    """The same model on every rank of `group`, with rank 0's values (with tensor parallelism: global
    rank 0's, broadcast_from_rank0); meta: the model has no values yet, only their shapes are checked.
    Collective."""
    check_same_across_ranks(model, group, who)
    if not meta:
        broadcast_from_rank0(model, group, tp_group)


class ModelParts(nn.Module):
    """Several pipeline stages' parts of one model on one rank (the schedules with more than one stage
    a rank: Interleaved1F1B, LoopedBFS, the zero-bubble ones), as the one model ZeroAdam trains: its
    modules and parameters are the parts', by the parts' own names (a pipeline cut keeps the original
    names, so they never collide: checked). The schedule calls each part; this is never called."""

    def __init__(self, parts: list[nn.Module], who: str = "ZeroAdam"):
        super().__init__()
        if not parts or not all(isinstance(m, nn.Module) for m in parts):
            raise TypeError(
                f"{who}: model must be an nn.Module or a non-empty list of them (pipeline parts); got {parts!r}"
            )
        self.parts = nn.ModuleList(parts)
        seen: dict[str, int] = {}
        for i, part in enumerate(parts):
            for name, _ in part.named_parameters():
                if name in seen:
                    raise ValueError(
                        f"{who}: parts {seen[name]} and {i} both hold a parameter named {name}; the parts of one rank "
                        "must be different stages of one model, cut with their original names"
                    )
                seen[name] = i

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        if memo is None:
            memo = set()
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        for part in self.parts:  # each part's root under this model's name: its parameters keep theirs
            yield from part.named_modules(memo, prefix, remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        if not target:
            return self
        for part in self.parts:
            try:
                return part.get_submodule(target)
            except AttributeError:
                continue
        raise AttributeError(f"no part of this ModelParts has a submodule {target!r}")

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelParts is not called: the pipeline schedule runs each part")


def as_model(model, who: str) -> nn.Module:
    """The model a front trains: a module, or a list of pipeline parts as one (ModelParts)."""
    if isinstance(model, (list, tuple)):
        return ModelParts(list(model), who)
    return model


def check_pipeline_parts(names: list[str], pp_group: dist.ProcessGroup, who: str) -> None:
    """Each "pp" rank's part holds parameters no other stage holds (a pipeline cut keeps the original
    names: [Note: pipeline accumulation] in zerofast/pipelining.py); the whole model, or the same part,
    on two stages is an error on every rank. Collective over "pp"."""
    everyone: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, names, group=pp_group)
    owner: dict[str, int] = {}
    for r, theirs in enumerate(everyone):
        for name in theirs:
            if name in owner:
                raise ValueError(
                    f'{who}: with a "pp" mesh dim each rank gives ZeroAdam its pipeline stage\'s part of the model; '
                    f"{name} is in the parts of pp ranks {owner[name]} and {r} (the whole model on every stage?). "
                    f"Cut the model into stages (a copy per stage with the other stages' layers removed) first"
                )
            owner[name] = r


def check_same_across_ranks(model: nn.Module, group, who: str = "ZeroAdam") -> None:
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
                raise ValueError(
                    f"{who}: ranks hold different models: rank 0 has {a[0]} {a[1]} "
                    f"{a[2]} {a[3]} (requires_grad={a[4]}), rank {rank} has {b[0]} {b[1]} "
                    f"{b[2]} {b[3]} (requires_grad={b[4]})"
                )
        raise ValueError(
            f"{who}: ranks hold different models: rank 0 has {len(reference)} parameters "
            f"and buffers, rank {rank} has {len(sig)}"
        )


def _signature(model: nn.Module) -> list[tuple]:
    return [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()] + [
        ("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()
    ]


def in_precision(model: nn.Module, param_dtype: torch.dtype | None) -> list:
    """The model converted as the policy converts it: floating parameters (ZeroAdam converts its
    trainable ones itself) and buffers in param_dtype, floating inputs cast (nothing for None or
    float32). Returns the hook handles."""
    if param_dtype is None or param_dtype == torch.float32:
        return []
    cast_unmanaged(model, param_dtype)
    return [model.register_forward_pre_hook(InputCast(param_dtype), prepend=True, with_kwargs=True)]


def cast_unmanaged(model: nn.Module, dtype: torch.dtype) -> None:
    """The rest of the model follows the managed parameters into `dtype`, as model.to(dtype) would:
    frozen floating parameters and floating buffers (see [Note: mixed precision])."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                set_local(p, (p._local_tensor if is_dtensor(p) else p.data).to(dtype))
        for mod in model.modules():
            for name, buf in mod.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(mod, name, buf.to(dtype))


class InputCast:
    """Forward pre-hook (with kwargs): floating-point inputs cast to the parameters' dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
                return x.to(self.dtype)
            return x

        return torch.utils._pytree.tree_map(cast, (args, kwargs))
