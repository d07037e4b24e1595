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
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import compat

__all__ = [
    "Replication",
    "ReplicaSource",
    "StaticReplication",
    "Topology",
    "resolve_topology",
    "check_process_group",
    "data_parallel_group",
    "broadcast_from_rank0",
    "group_timeout",
    "second_group",
]


@runtime_checkable
class Replication(Protocol):
    """The extension point of a step: how the replicas of the training state take each step together.
    The optimizer calls these, in this order, and names no implementation: StaticReplication (below)
    serves fixed replicas; a replicate dimension whose members change between steps plugs in its own
    (torchft's ReplicaGroups: [Note: replica groups on torchft] in zerofast/integrations/torchft/):

        attach(opt)               once, when the optimizer is built (its state: opt.checkpoint_view)
        begin_step()              opt.zero_grad(): the step begins (torchft: its quorum)
        check_step(step)          step() begins: raise if the step cannot run
        participants_now()        the replicas in this step (the average's divisor)
        agree(flags)              the step's agreement: a MAX over the replicas, in place
        commit() -> bool          after the reduces and the agreement, before the update: apply it?
        on_error(error)           the step raised before its commit: it still takes its one decision

    changes_membership: False for fixed replicas (the agreement runs over the replicate group, not
    agree()); True: the replicate group is one group per step taking one tensor per all_reduce, so
    gradients are not coalesced and agree() runs after the step's gradient all_reduces on it.
    """

    changes_membership: bool

    def attach(self, opt) -> None: ...
    def begin_step(self) -> None: ...
    def check_step(self, step: int) -> None: ...
    def participants_now(self) -> int: ...
    def agree(self, flags: torch.Tensor) -> None: ...
    def commit(self) -> bool: ...
    def on_error(self, error: BaseException) -> None: ...


@runtime_checkable
class ReplicaSource(Protocol):
    """A process_group argument that brings its own Replication (torchft's ReplicaGroups): `group`,
    the ranks of this replica, which shard the state; topology(group, plan): the Topology over them,
    checking the plan against what the replication supports."""

    group: dist.ProcessGroup

    def topology(self, group: dist.ProcessGroup, plan) -> Topology: ...


class StaticReplication:
    """Replicas fixed for the whole run (flat ZeRO: one; hybrid sharding: the replicate group's
    size): every step begins and commits, and the agreement is the replicate group's own."""

    changes_membership = False

    def __init__(self, replicas: int):
        self.replicas = replicas

    def attach(self, opt) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def check_step(self, step: int) -> None:
        pass

    def participants_now(self) -> int:
        return self.replicas

    def agree(self, flags: torch.Tensor) -> None:
        pass

    def commit(self) -> bool:
        return True

    def on_error(self, error: BaseException) -> None:
        pass

    def __repr__(self) -> str:
        return f"StaticReplication({self.replicas})"


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
    # How the replicas take each step together; None: fixed, StaticReplication(replicas).
    replication: Replication = None  # type: ignore[assignment]
    # Tensor parallelism: the ranks that hold the other parts of this rank's DTensor parameters, with
    # the same data ([Note: tensor parallelism] in zerofast/tensor_parallel.py); None: none.
    tp_group: dist.ProcessGroup | None = None
    tp_size: int = 1
    # Tensor parallelism: every rank of the mesh (data parallel x "tp"), which a checkpoint is saved
    # and loaded by (each holds other parts of the model); None: `group` is every rank of the model.
    model_group: dist.ProcessGroup | None = None
    # Pipeline parallelism: the ranks holding the other stages of the model, at this rank's place on
    # the other dims ([Note: pipeline accumulation] in zerofast/pipelining.py); None: no "pp" dim.
    pp_group: dist.ProcessGroup | None = None
    pp_size: int = 1

    def __post_init__(self):
        if self.replication is None:
            object.__setattr__(self, "replication", StaticReplication(self.replicas))

    @property
    def hybrid(self) -> bool:
        return self.replicas > 1

    def divisor(self) -> int:
        """What the step's gradient sum is divided by: every data-parallel rank, or under torchft the
        shard group's ranks times this step's participating replica groups."""
        return self.shard_size * self.replication.participants_now()


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


# The meshes ZeroAdam takes as process_group, by mesh_dim_names: hybrid sharding's (FSDP2's HSDP), and
# with tensor parallelism the data-parallel dims beside a "tp" dim ([Note: tensor parallelism] in
# zerofast/tensor_parallel.py). "dp" and "shard" name the same thing: the ranks that shard the state.
# A "pp" dim in front cuts the model into pipeline stages, each rank's ZeroAdam given its stage's part
# ([Note: pipeline accumulation] in zerofast/pipelining.py).
_DP_LAYOUTS = (
    ("replicate", "shard"),
    ("replicate", "dp"),
    ("dp", "tp"),
    ("shard", "tp"),
    ("replicate", "dp", "tp"),
    ("replicate", "shard", "tp"),
)
MESH_LAYOUTS = (
    *_DP_LAYOUTS,
    ("pp", "dp"),
    ("pp", "shard"),
    *(("pp", *names) for names in _DP_LAYOUTS),
)


@dataclass(frozen=True)
class MeshDims:
    """A DeviceMesh's dims as ZeroAdam reads them: which name replicates (None: none), which shards,
    which is tensor parallel (None: none)."""

    replicate: str | None
    shard: str
    tp: str | None
    pp: str | None = None


def mesh_dims(mesh, who: str = "ZeroAdam") -> MeshDims:
    """A DeviceMesh as ZeroAdam takes it (MESH_LAYOUTS), or an error naming the mesh it got."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{who}: the mesh must be a torch.distributed.device_mesh.DeviceMesh; got {type(mesh).__name__}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if names not in MESH_LAYOUTS:
        raise ValueError(
            f"{who}: a DeviceMesh as process_group must have mesh_dim_names ('replicate', 'shard') (hybrid "
            f"sharding, as FSDP2's HSDP), ('dp', 'tp') or ('replicate', 'dp', 'tp') (tensor parallelism), "
            f"'shard' and 'dp' naming the same dim, each with 'pp' in front (pipeline parallelism; also ('pp', 'dp')); "
            f"got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} with mesh_dim_names={mesh.mesh_dim_names}"
        )
    return MeshDims(
        "replicate" if "replicate" in names else None,
        "shard" if "shard" in names else "dp",
        "tp" if "tp" in names else None,
        "pp" if "pp" in names else None,
    )


def mesh_groups(mesh, who: str = "ZeroAdam") -> tuple[int, int]:
    """(replicas, shard size) of a DeviceMesh's data-parallel ranks (a "tp" dim is not data parallel)."""
    dims = mesh_dims(mesh, who)
    return (mesh.size(mesh.mesh_dim_names.index(dims.replicate)) if dims.replicate else 1), mesh.size(
        mesh.mesh_dim_names.index(dims.shard)
    )


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A group of every rank of `mesh` (the world where it covers it). Every rank of it calls it."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if sorted(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return compat.new_group(sorted(ranks))


def resolve_topology(group: dist.ProcessGroup, shard_size: int, timeout: timedelta | None, mesh=None) -> Topology:
    """The groups of `group`'s ranks for shard_size (already checked: check_shard_size), or those of
    `mesh`. Every rank of `group` calls it (new_group is collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if mesh is not None:
        replicas, k = mesh_groups(mesh)
        dims = mesh_dims(mesh)
        shard_group = mesh.get_group(dims.shard)
        replicate_group = mesh.get_group(dims.replicate) if dims.replicate else None
        tp_group = mesh.get_group(dims.tp) if dims.tp else None
        model_group = _mesh_group(mesh) if dims.tp or dims.pp else None
        return Topology(
            group,
            rank,
            world,
            shard_group,
            dist.get_rank(shard_group),
            k,
            replicate_group if replicas > 1 else None,
            replicas,
            tp_group=tp_group,
            tp_size=mesh.size(mesh.mesh_dim_names.index(dims.tp)) if dims.tp else 1,
            model_group=model_group,
            pp_group=mesh.get_group(dims.pp) if dims.pp else None,
            pp_size=mesh.size(0) if dims.pp else 1,
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


# --- the process groups ---------------------------------------------------------------------------


def check_process_group(process_group) -> None:
    """process_group as ZeroAdam and shard_frozen take it, with torch.distributed initialized."""
    if process_group is not None and not isinstance(process_group, (dist.ProcessGroup, DeviceMesh, ReplicaSource)):
        raise TypeError(
            f"ZeroAdam: process_group must be a torch.distributed ProcessGroup, a 2-D DeviceMesh "
            f'("replicate", "shard"), replica groups that bring their own Replication (a ReplicaSource, '
            f"e.g. zerofast.integrations.torchft.ReplicaGroups) or None; got {type(process_group).__name__}"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeroAdam needs torch.distributed initialized (dist.init_process_group); world size 1 works too"
        )


def data_parallel_group(process_group, shard_size):
    """(group of every data-parallel rank, shard size, mesh or None): from process_group (None: the
    world) and CommPolicy.shard_size, or from a DeviceMesh as process_group ([Note: hybrid sharding])."""
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
    dims = mesh_dims(mesh)
    ranks = mesh.mesh
    if dims.tp:  # the data-parallel ranks are those at this rank's coordinate on "tp" (and "pp")
        ranks = ranks.select(mesh.ndim - 1, mesh.get_local_rank(dims.tp))
    if dims.pp:
        ranks = ranks.select(0, mesh.get_local_rank(dims.pp))
    if ranks.ndim == 1:
        return mesh.get_group(dims.shard), k, mesh
    ranks = [int(r) for r in ranks.flatten().tolist()]
    if sorted(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD, k, mesh
    return compat.new_group(ranks), k, mesh


def broadcast_from_rank0(model: nn.Module, group, tp_group=None) -> None:
    """Every parameter and buffer of `model` (a DTensor's local tensor) as `group`'s first rank holds
    it, on every rank of it; with tp_group, then whatever is replicated across "tp" from the tp
    group's first rank, so every rank holds global rank 0's ([Note: tensor parallelism])."""
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    tensors = list(model.parameters()) + list(model.buffers())
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(_local(t), src=src, group=group)
        if tp_group is None:
            return
        tp_src = dist.get_global_rank(tp_group, 0)
        for t in tensors:
            if _replicated_across_tp(t):
                dist.broadcast(_local(t), src=tp_src, group=tp_group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a collective over some ranks takes of a tensor: a DTensor's local tensor, another's .data."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.data


def _replicated_across_tp(t: torch.Tensor) -> bool:
    placements = getattr(t, "placements", None)
    return placements is None or all(p.is_replicate() for p in placements)


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout a process group's collectives wait for (None where the backend does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None


def second_group(group: dist.ProcessGroup | None, timeout_of: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """A second group of the same ranks (None for None): collectives whose order is set by timing
    (stage 3's gathers, the replicas' gradient all_reduces during backward) get a group of their
    own, so they never pair up with another kind of collective. Every rank of `group` calls it."""
    if group is None:
        return None
    ranks = dist.get_process_group_ranks(group)
    # With the same timeout as the group given: new_group's default is 30 minutes ([Note: faults]).
    return compat.new_group(ranks, timeout=group_timeout(timeout_of))
