"""Which ranks share the state and which replicate it: flat ZeRO over every rank, or hybrid sharding.

[Note: hybrid sharding]
Flat ZeRO shards over all W data-parallel ranks, so each step's reduces and gathers cross the
slowest links. With CommPolicy(shard_size=K) the ranks form W/K shard groups of K consecutive ranks (one
machine under torchrun, whose ranks are numbered node by node); optimizer state, gradients and
(stage 3) parameters are sharded within a shard group, exactly as flat ZeRO over K ranks, and the
groups are replicas of each other. The replicate group of a rank is the ranks holding the same shard
in every shard group (rank r, r + K, r + 2K, ...). A step then adds one collective across machines:
after the shard group's reduce, each rank all_reduces its owned gradient shard (1/K of the
gradients) over its replicate group, once per step (under no_sync, never per micro-batch), so every
replica applies the same update to the same state. The step's agreement (which parameters got a
gradient, the counters, a failure) is a MAX over the shard group, then over the replicate group; the
overflow flag and the squared gradient norm are summed over the shard group only, where each element
sits in exactly one rank's shard (summing over every rank would count each element W/K times). The
average divides by W. Only a rank's own shard group gathers its parameters: stage 3's gathers never
leave the machine. K = W (the default) builds no group: today's flat run, bitwise. K = 1 is plain
replication (DDP's traffic, with the fused step). FSDP2's HSDP is the same arrangement (a 2-D mesh,
"replicate" outer, "shard" inner); a DeviceMesh with those dims is accepted as ZeroAdam's
process_group (a mesh is the data-parallel ranks, with their groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import compat

__all__ = ["LiveReplicas", "Topology", "resolve_topology"]


@runtime_checkable
class LiveReplicas(Protocol):
    """A replicate dimension whose members change between steps, given as ZeroAdam's process_group
    (zerofast.integrations.torchft.ReplicaGroups; [Note: replica groups on torchft] there). The
    optimizer calls these; the replica group's own ranks (`group`) shard the state."""

    group: dist.ProcessGroup

    def topology(self, group: dist.ProcessGroup) -> Topology: ...
    def attach(self, opt) -> None: ...  # the optimizer is built: its state heals; the first quorum
    def begin_step(self) -> None: ...  # this step's quorum (opt.zero_grad())
    def check_quorum(self, step: int) -> None: ...  # step() raises without one
    def participants_now(self) -> int: ...
    def all_reduce_max(self, flags: torch.Tensor) -> None: ...  # the agreement over the participants
    def commit(self) -> bool: ...  # the step's one decision
    def fail(self, error: BaseException) -> None: ...  # the step raised before its decision


@dataclass(frozen=True)
class Topology:
    group: dist.ProcessGroup  # every data-parallel rank (the average divides by its size)
    rank: int  # in `group`
    world: int
    shard_group: dist.ProcessGroup  # the ranks sharing one copy of the state (== group when flat)
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None  # the ranks holding this rank's shard (None: no replica)
    replicas: int
    live: LiveReplicas | None = None  # replicas whose membership changes between steps (torchft)

    @property
    def hybrid(self) -> bool:
        return self.replicas > 1

    def divisor(self) -> int:
        """What the step's gradient sum is divided by: every data-parallel rank, or under torchft the
        shard group's ranks times this step's participating replica groups."""
        return self.world if self.live is None else self.shard_size * self.live.participants_now()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_shard_size(shard_size, world: int, who: str = "ZeroAdam", comm=None) -> int:
    """shard_size (None: world), or the CommPolicy's as ZeroAdam takes it (comm.shard_size), checked
    against the number of ranks; the two given and different is an error naming both."""
    given = getattr(comm, "shard_size", None)
    if given is not None and shard_size is not None and given != shard_size:
        raise ValueError(f"{who}: shard_size={shard_size!r} and comm.shard_size={given!r} differ; pass one")
    shard_size = given if shard_size is None else shard_size
    if shard_size is None:
        return world
    if not (_is_int(shard_size) and shard_size >= 1):
        raise ValueError(f"{who}: shard_size must be None or an integer >= 1; got {shard_size!r}")
    if shard_size > world or world % shard_size:
        raise ValueError(
            f"{who}: shard_size={shard_size} must divide the number of ranks, {world} (the ranks form "
            f"{world}/shard_size groups of shard_size consecutive ranks)"
        )
    return shard_size


def _global(group: dist.ProcessGroup, r: int) -> int:
    return r if group is dist.group.WORLD else dist.get_global_rank(group, r)


def mesh_groups(mesh, who: str = "ZeroAdam") -> tuple[int, int]:
    """A DeviceMesh as ZeroAdam takes it: 2-D, dims named ("replicate", "shard"). Returns its (replicas, shard size)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{who}: the mesh must be a torch.distributed.device_mesh.DeviceMesh; got {type(mesh).__name__}"
        )
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("replicate", "shard"):
        raise ValueError(
            f"{who}: a DeviceMesh as process_group must be 2-D with mesh_dim_names=('replicate', 'shard') (replicate across the "
            f"outer dim, shard within the inner one, as FSDP2's HSDP); got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} with mesh_dim_names={mesh.mesh_dim_names}"
        )
    return mesh.size(0), mesh.size(1)


def resolve_topology(group: dist.ProcessGroup, shard_size: int, timeout: timedelta | None, mesh=None) -> Topology:
    """The groups of `group`'s ranks for shard_size (already checked: check_shard_size), or those of
    `mesh`. Every rank of `group` calls it (new_group is collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if mesh is not None:
        replicas, k = mesh_groups(mesh)
        shard_group, replicate_group = mesh.get_group("shard"), mesh.get_group("replicate")
        return Topology(
            group,
            rank,
            world,
            shard_group,
            dist.get_rank(shard_group),
            k,
            replicate_group if replicas > 1 else None,
            replicas,
        )
    if shard_size == world:
        return Topology(group, rank, world, group, rank, world, None, 1)
    replicas = world // shard_size
    # Each rank makes only its own two groups (local synchronization): `group` may be a subgroup of
    # the world (tensor x data parallel), whose other ranks never call here; every rank makes its
    # shard group, then its replicate group, so the members of each agree on its name.
    g, i = divmod(rank, shard_size)
    shard_group = compat.new_group([_global(group, g * shard_size + j) for j in range(shard_size)], timeout=timeout)
    replicate_group = compat.new_group([_global(group, h * shard_size + i) for h in range(replicas)], timeout=timeout)
    return Topology(group, rank, world, shard_group, i, shard_size, replicate_group, replicas)
