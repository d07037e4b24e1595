"""Tensor parallelism: a model whose parameters are DTensors on a "tp" mesh dimension
(torch.distributed.tensor.parallel.parallelize_module), sharded by ZeRO across the data-parallel
dimension of the same mesh.

[Note: tensor parallelism]
ZeroAdam(model, process_group=mesh), mesh_dim_names ("dp", "tp") or ("replicate", "dp", "tp")
("shard" may stand for "dp"). The ranks at one coordinate of "tp" are a data-parallel group of their
own (zerofast/topology.py): they hold the same part of every DTensor and see different data; the
ranks of one "tp" group hold the parts of one layer and see the same data.
- The core shards plain tensors only. Each DTensor parameter is represented to it by a stand-in: a
  plain leaf tensor, the shape of the parameter's local tensor, sharing its storage. Layouts,
  buckets, the fp32 master, the fused step and the gathers all run on the stand-ins, exactly as on a
  plain model, over the data-parallel group. A plain parameter (replicated across "tp") is its own
  stand-in.
- Binding a parameter to its slot in the flat buffers is `p.data = view` for a plain tensor; on a
  DTensor that assignment is a silent no-op (forward keeps reading the old local tensor), so after
  the core binds the stand-ins, relink() points each DTensor's local tensor at its stand-in's
  storage (FSDP2's reset_sharded_param does the same), or, where mixed precision changed the dtype,
  swaps in a DTensor of the new dtype over it (torch.utils.swap_tensors keeps the Parameter object,
  which the model, the optimizer's param_groups and the user hold).
- Gradients: autograd accumulates a DTensor gradient into the DTensor parameter, not always in the
  parameter's placements: a SequenceParallel norm weight (Replicate) gets a Partial gradient (each
  "tp" rank holds a partial sum), a RowwiseParallel embedding (Shard(0)) a Replicate one. A
  post-accumulate hook on each DTensor parameter redistributes its gradient to the parameter's
  placements (the Partial sum over "tp", once), hands the local tensor to the stand-in's .grad and
  drops the DTensor's; the gradient path then takes it as any other (through Python:
  GradReducer._on_grad). Averaging is over the data-parallel ranks only: the "tp" ranks of a group
  saw the same data.
- The global gradient norm counts each element once: after the data-parallel reduce every "tp"
  rank holds disjoint parts of the DTensors placed Shard and the same values of whatever is
  replicated across "tp", so each rank sums the squares of its shard, the replicated parameters
  only on "tp" rank 0 (norm_runs), and one more all_reduce sums over "tp". The overflow flag is
  summed over "tp" too, so every rank of the model skips a step together.
- Broadcast at construction: local tensors over the data-parallel group, then everything replicated
  across "tp" from "tp" rank 0 (zerofast/topology.py broadcast_from_rank0): every rank holds global
  rank 0's replicated weights, which SequenceParallel assumes (it builds DTensors with
  from_local(run_check=False)).
- Checkpoints name each DTensor parameter by its whole shape: each rank's pieces of its local
  tensor are cut into boxes of the local tensor ([Note: flat slices as chunks] in
  zerofast/checkpoint/dcp.py) and shifted by where the local tensor sits in the whole
  (local_geometry); a replicated parameter's "tp" ranks describe the same boxes, which DCP writes
  once. So a checkpoint of (dp, tp) loads into another tp degree, another dp size, plain ZeroAdam
  or one process, and back.
- Stage 3 plans its units over the model's parameters (its modules hold the DTensors) and lays them
  out over the stand-ins (zerofast/optim/placement.py, core_of), sized by the local tensors; a unit
  gather runs across "dp" only, so during forward and backward each DTensor's local tensor is a view
  of the gathered unit buffer and the DTensor stays on "tp". Frozen DTensors get stand-ins too,
  made when the layouts ask for them (after mixed precision has converted them), sharded by
  FrozenShard and relinked before their storage is released. gathered_params(gather_tp=True) swaps
  in Replicate DTensors of the whole tensors for the block (replicated() below, read-only).
- The optimizer's own collectives over "tp" (the norm's and the overflow flag's sums, the step's
  agreement joined, the offloaded write's agreement) go through BucketComm.all_reduce_tp: counted,
  their Work kept, a failure named. Each rank's offloaded state is its part's; a failed write on one
  rank is a step applied on no rank of the mesh ([Note: the all-or-none offloaded step]).
Not served yet, each a named error: ZeroMuon, checkpoints with 8-bit state (its blocks are the local
tensor's), DTensors on another mesh or with placements other than one Shard or Replicate.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "TensorParallel",
    "has_storage",
    "has_tp_dim",
    "is_dtensor",
    "local_copy",
    "replicated",
    "set_local",
    "whole_copy",
]


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor, without importing DTensor's module where nothing did (about a second)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def whole_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`, whole: a DTensor gathered over its mesh (a collective: every rank of the mesh
    calls it, in the same order), any other tensor cloned."""
    if is_dtensor(t):
        return t.detach().full_tensor().clone()  # a Replicate DTensor's full_tensor() is its local tensor
    return t.detach().clone()


def local_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` as this rank holds it: a DTensor's local tensor (no collective), any other cloned."""
    return (t._local_tensor if is_dtensor(t) else t).detach().clone()


@contextlib.contextmanager
def replicated(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every DTensor parameter of `model` not already replicated is whole on every
    rank: a Replicate DTensor of its full tensor (a collective over its mesh) swapped in, the
    Parameter object kept (torch.utils.swap_tensors), so p.to_local() is the whole tensor and forward
    still runs. Read-only: the copies do not require grad, writes to them are dropped, and on exit
    the parameters are swapped back."""
    from torch.distributed.tensor import DTensor, Replicate

    swapped: list[tuple[nn.Parameter, nn.Parameter]] = []
    try:
        with torch.no_grad():
            for p in model.parameters():
                if not is_dtensor(p) or all(pl.is_replicate() for pl in p.placements):
                    continue
                mesh = p.device_mesh
                whole = DTensor.from_local(p.full_tensor(), mesh, [Replicate()] * mesh.ndim, run_check=False)
                copy = nn.Parameter(whole, requires_grad=False)
                torch.utils.swap_tensors(p, copy)
                swapped.append((p, copy))
        yield model
    finally:
        for p, original in reversed(swapped):
            torch.utils.swap_tensors(p, original)


def has_storage(t: torch.Tensor) -> bool:
    """Whether `t`'s values exist now (stage 3 frees a parameter's storage between uses)."""
    t = t._local_tensor if is_dtensor(t) else t
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


def set_local(p: nn.Parameter, local: torch.Tensor) -> None:
    """`p` reads `local` from now on: p.data = local for a plain parameter; for a DTensor, its local
    tensor (the same dtype), or a DTensor of local's dtype swapped in (the Parameter object kept)."""
    if not is_dtensor(p):
        p.data = local
        return
    if local.dtype == p.dtype:
        p._local_tensor = local
        return
    from torch.distributed.tensor import DTensor

    new = nn.Parameter(
        DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()),
        requires_grad=p.requires_grad,
    )
    torch.utils.swap_tensors(p, new)


def has_tp_dim(process_group) -> bool:
    """Whether process_group is a DeviceMesh with a "tp" dim (tensor parallelism)."""
    return isinstance(process_group, DeviceMesh) and "tp" in (process_group.mesh_dim_names or ())


class TensorParallel:
    """The DTensor parameters of a model trained over a mesh with a "tp" dim, and their stand-ins
    ([Note: tensor parallelism])."""

    @classmethod
    def of(cls, model: nn.Module, named, tp_group, tp_size: int, who: str) -> TensorParallel | None:
        """The model's DTensor parameters and their stand-ins where there is a "tp" group (None: there
        is none); a DTensor it cannot serve is named."""
        if tp_group is None:
            return None
        return cls(named, tp_group, tp_size, who, [(n, p) for n, p in model.named_parameters() if not p.requires_grad])

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        tp_group: dist.ProcessGroup,
        tp_size: int,
        who: str,
        frozen_named: list[tuple[str, nn.Parameter]] = (),
    ):
        """named: the trainable parameters, in the optimizer's order; frozen_named: the model's frozen
        ones (their DTensors are checked as the trainable ones are)."""
        self.tp_group, self.tp_size = tp_group, tp_size
        self.tp_rank = dist.get_rank(tp_group)
        tp_ranks = dist.get_process_group_ranks(tp_group)
        self.params = [p for _, p in named]
        self.standins: list[torch.Tensor] = []
        self.replicated: list[bool] = []  # per parameter: the same on every "tp" rank
        for name, p in named:
            if not is_dtensor(p):
                self.standins.append(p)
                self.replicated.append(True)
                continue
            _check_dtensor(name, p, tp_ranks, who)
            self.standins.append(p._local_tensor.detach().requires_grad_(p.requires_grad))
            self.replicated.append(p.placements[0].is_replicate())
        self.dtensor_indices = [i for i, p in enumerate(self.params) if is_dtensor(p)]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Stage 3's frozen DTensors, which it shards too ([Note: frozen parameters in stage 3]): their
        # stand-ins are made when the layouts ask for them (standin_of), after mixed precision has
        # converted them, and relinked with the trainable ones.
        self.frozen: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._frozen_index: dict[int, int] = {}
        for name, p in frozen_named:
            if is_dtensor(p):
                _check_dtensor(name, p, tp_ranks, who)
        self._hooks: list = []

    def standin_of(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor the core shards for the model's parameter `p`: a trainable parameter's stand-in;
        a frozen DTensor's, made on the first ask (stage 3 shards it); any other plain parameter itself."""
        if id(p) in self._index:
            return self.standins[self._index[id(p)]]
        if not is_dtensor(p):
            return p
        if id(p) not in self._frozen_index:
            self._frozen_index[id(p)] = len(self.frozen)
            self.frozen.append((p, p._local_tensor.detach()))
        return self.frozen[self._frozen_index[id(p)]][1]

    def local_geometry(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, ...]:
        """Per parameter, where its local tensor sits in the whole one: (local shape, offsets), or None
        for a plain parameter (the whole). A Shard(d) parameter's "tp" rank r holds torch.chunk's
        r-th chunk of dim d (chunks of ceil(n / tp) rows, the last ones shorter or empty)."""
        return tuple(self.geometry(p) for p in self.params)

    def geometry(self, p: nn.Parameter) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Where the model's parameter `p`'s local tensor sits in the whole one (local_geometry's)."""
        if not is_dtensor(p):
            return None
        offsets = [0] * p.ndim
        placement = p.placements[0]
        if placement.is_shard():
            d = placement.dim % p.ndim
            offsets[d] = min(p.shape[d], self.tp_rank * -(-p.shape[d] // self.tp_size))
        return tuple(p._local_tensor.shape), tuple(offsets)

    def local_part(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """narrow() for the optimizer's parameter `index`."""
        return self.narrow(self.params[index], whole)

    def narrow(self, p: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the model's parameter `p`'s whole tensor (a plain parameter's: all of it)."""
        geometry = self.geometry(p)
        if geometry is None:
            return whole
        for d, (size, offset) in enumerate(zip(*geometry)):
            whole = whole.narrow(d, offset, size)
        return whole

    def relink(self) -> None:
        """After the core bound the stand-ins to their slots: each DTensor reads its stand-in's storage."""
        with torch.no_grad():
            for i in self.dtensor_indices:
                set_local(self.params[i], self.standins[i].detach())
            for p, standin in self.frozen:
                set_local(p, standin.detach())

    def install_grad_hooks(self, on_grad: Callable[[int], None]) -> None:
        """A post-accumulate hook per DTensor parameter: its gradient, in the parameter's placements,
        into the stand-in's .grad; then on_grad(index), the gradient path's Python entry."""
        for i in self.dtensor_indices:
            self._hooks.append(self.params[i].register_post_accumulate_grad_hook(_GradHook(self, i, on_grad)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def norm_runs(self, layout, rank: int, owned_lengths: list[int]) -> list[tuple[int, int, int]]:
        """(owned tensor, start, length): the parts of this rank's owned gradients whose squares count
        toward the global norm. Every part on "tp" rank 0; elsewhere all but the parameters replicated
        across "tp" (rank 0 counts those). owned_lengths: each owned gradient tensor's length, in the
        order of the rank's shard (ShardState.owned_grads)."""
        starts, total = [], 0
        for n in owned_lengths:
            starts.append(total)
            total += n
        skip = [] if self.tp_rank == 0 else [pc for pc in layout.pieces(rank) if self.replicated[pc.param]]
        cuts = sorted((pc.state_offset, pc.state_offset + pc.numel) for pc in skip)
        runs = []
        for t, (start, n) in enumerate(zip(starts, owned_lengths)):
            pos = start
            for lo, hi in cuts:
                if hi <= start or lo >= start + n:
                    continue
                if lo > pos:
                    runs.append((t, pos - start, lo - pos))
                pos = max(pos, hi)
            if pos < start + n:
                runs.append((t, pos - start, start + n - pos))
        return runs


class _GradHook:
    """One DTensor parameter's post-accumulate hook ([Note: tensor parallelism])."""

    def __init__(self, tp: TensorParallel, index: int, on_grad: Callable[[int], None]):
        self.tp, self.index, self.on_grad = tp, index, on_grad

    def __call__(self, p) -> None:
        grad, p.grad = p.grad, None
        if tuple(grad.placements) != tuple(p.placements):  # Partial: the sum over "tp", once
            grad = grad.redistribute(p.device_mesh, p.placements)
        local = grad._local_tensor
        standin = self.tp.standins[self.index]
        if standin.grad is None:
            standin.grad = local
        else:  # accumulated locally (no_sync), or stage 1's slot
            standin.grad.add_(local)
        self.on_grad(self.index)


def _check_dtensor(name: str, p, tp_ranks: list[int], who: str) -> None:
    """A DTensor parameter the configuration can serve: on the mesh's "tp" dim, one Shard or Replicate."""
    mesh = p.device_mesh
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if mesh.ndim != 1 or ranks != tp_ranks:
        raise ValueError(
            f"{who}: parameter {name!r} is a DTensor on a {mesh.ndim}-D DeviceMesh over ranks {ranks} "
            f"(mesh_dim_names={mesh.mesh_dim_names}); with tensor parallelism every DTensor parameter must live "
            f"on the process_group mesh's 'tp' dim (ranks {tp_ranks} here): parallelize_module(model, mesh['tp'], plan)"
        )
    placement = p.placements[0]
    if not (placement.is_shard() or placement.is_replicate()) or type(placement).__name__ not in ("Shard", "Replicate"):
        raise ValueError(
            f"{who}: parameter {name!r} is a DTensor placed {placement!r}; zerofast takes DTensor parameters "
            f"placed Shard(dim) or Replicate() on 'tp'"
        )
