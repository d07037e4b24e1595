"""ZeroAdam's checks that need the model or the process group (the options alone are checked in
zerofast/config.py): the parameter groups, the parameters' dtypes and device, the cross-rank
agreement on the model (one all_gather_object, then rank 0's values broadcast), and at every step
that the trainable parameters are still those it was built over; each raising a clear error naming
the argument and the value it got, or the first mismatch across ranks, never a hang later."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import compat
from ..config import check_hyper
from ..topology import LiveReplicas, check_shard_size, mesh_groups

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def check_process_group(process_group) -> None:
    if process_group is not None and not isinstance(process_group, (dist.ProcessGroup, DeviceMesh, LiveReplicas)):
        raise TypeError(
            f"ZeroAdam: process_group must be a torch.distributed ProcessGroup, a 2-D DeviceMesh "
            f'("replicate", "shard"), torchft\'s replica groups (zerofast.integrations.torchft.ReplicaGroups) '
            f"or None; got {type(process_group).__name__}"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeroAdam needs torch.distributed initialized (dist.init_process_group); world size 1 works too"
        )


def check_dtypes(names: list[str], params: list, param_dtype: torch.dtype) -> None:
    """One device and one dtype for every trainable parameter; fp32 unless mixed precision converts it
    (to param_dtype, after this check)."""
    dtype, device = params[0].dtype, params[0].device
    for n, p in zip(names, params):
        if p.dtype != dtype or p.device != device:
            raise ValueError(
                f"ZeroAdam needs every trainable parameter on one device with one dtype: "
                f"{names[0]} is {dtype} on {device}, {n} is {p.dtype} on {p.device}"
            )
    if dtype != torch.float32 and param_dtype == torch.float32:
        raise ValueError(
            f"ZeroAdam: the model's parameters are {dtype}; without mixed_precision they must be "
            f"float32 (they are the master copy). Pass the fp32 model with "
            f"mixed_precision='bf16' or 'fp16' to train in low precision"
        )


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
            raise ValueError(
                f"ZeroAdam: param_groups[{g}] has unknown keys {sorted(unknown)}; "
                f"allowed: params, {', '.join(GROUP_KEYS)}"
            )
        members = list(group["params"])
        for p in members:
            if id(p) not in name_of:
                raise ValueError(
                    f"ZeroAdam: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is "
                    f"not one of the model's trainable parameters"
                )
            if id(p) in seen:
                raise ValueError(
                    f"ZeroAdam: {name_of[id(p)]} is in param_groups[{seen[id(p)]}] and "
                    f"param_groups[{g}]; each parameter belongs to one group"
                )
            seen[id(p)] = g
        full = dict(defaults, **{k: v for k, v in group.items() if k != "params"}, params=members)
        full["betas"] = tuple(full["betas"])
        check_hyper(f" param_groups[{g}]", full)
        groups.append(full)
    missing = [name_of[id(p)] for p in params if id(p) not in seen]
    if missing:
        raise ValueError(
            f"ZeroAdam: trainable parameter {missing[0]} is in no param group ({len(missing)} missing in all)"
        )
    return groups


def _signature(model: nn.Module) -> list[tuple]:
    return [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()] + [
        ("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()
    ]


def check_live_replicas(live, plan) -> None:
    """torchft's replica groups ([Note: replica groups on torchft] in zerofast/integrations/torchft.py):
    the replica group's own ranks shard the state, so it takes no shard_size of its own, and the
    collective checks, which gather over the replicate group, do not run on torchft's managed group."""
    if plan.shard_size is not None:
        raise ValueError(
            f"ZeroAdam: with torchft's replica groups as process_group, each replica group's ranks shard "
            f"the state; pass no CommPolicy.shard_size (got shard_size={plan.shard_size!r})"
        )
    if plan.check_collectives:
        raise ValueError(
            "ZeroAdam: CommPolicy(check_collectives=True) is not supported with torchft's replica groups "
            "(the checks gather over the replicate group, which torchft's managed group does not carry)"
        )


def data_parallel_group(process_group, shard_size):
    """The group of every data-parallel rank, the shard size and the mesh, if one was given
    ([Note: hybrid sharding] in zerofast/topology.py): from process_group (None: the world) and
    CommPolicy.shard_size, or from a 2-D DeviceMesh given as process_group."""
    if not isinstance(process_group, DeviceMesh):
        group = process_group if process_group is not None else dist.group.WORLD
        # The raw value first, on every rank: a value bad on some ranks only must fail on all of
        # them, not leave the others waiting in the next collective.
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, repr(shard_size), group=group)
        for r, value in enumerate(everyone):
            if value != everyone[0]:
                raise ValueError(
                    f"ZeroAdam: ranks were given different options: rank 0 has shard_size={everyone[0]}, "
                    f"rank {r} has shard_size={value}"
                )
        return group, check_shard_size(shard_size, dist.get_world_size(group)), None
    mesh = process_group
    if shard_size is not None:
        raise ValueError(
            f'ZeroAdam: a DeviceMesh as process_group gives the shard groups itself (its "shard" '
            f"dim); pass it without CommPolicy.shard_size (got shard_size={shard_size!r})"
        )
    _replicas, k = mesh_groups(mesh)
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if sorted(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD, k, mesh
    return compat.new_group(ranks), k, mesh


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


def broadcast_from_rank0(model: nn.Module, group) -> None:
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def check_trainable_unchanged(trainable_at_build: list[tuple[str, nn.Parameter, bool]]) -> None:
    """Which parameters are trainable, as at construction: the buffers and optimizer state are laid
    out over the parameters trainable then."""
    for name, param, trainable in trainable_at_build:
        if param.requires_grad != trainable:
            effect = "its gradient would be ignored" if param.requires_grad else "it would silently stop training"
            raise RuntimeError(
                f"ZeroAdam: {name}.requires_grad changed from {trainable} to {param.requires_grad} after "
                f"ZeroAdam was built; its buffers and optimizer state are laid out over the parameters "
                f"trainable at construction, so {effect}. "
                f"Set requires_grad before building ZeroAdam (or build a new one)"
            )
