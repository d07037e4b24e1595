"""Stage 3's frozen parameters (FrozenShard, built by frozen_part): sharded and gathered with their
unit, never given a gradient or optimizer state.

[Note: frozen parameters in stage 3]
Fine-tuning a large base with few trainable parameters (LoRA, adapters, a new head) is where stage 3
matters most, and the base is frozen: kept whole on every rank, it would hold the whole model per
rank. So stage 3 shards every parameter. The unit plan is computed over all the parameters (so a
unit's size, and merging small units, counts what is gathered), and each unit's group is split into
its trainable and its frozen parameters:
  - the trainable parts form the optimizer's Layout, one bucket per unit that has any (a frozen-only
    unit has no bucket there: UnitBuffers keeps a unit -> bucket map with None), reduced, updated
    and checkpointed as before;
  - the frozen parts form a second, parameter-only Layout, one bucket per unit that has any, with
    its own flat buffers (the frozen parameters are views of them, in the parameters' dtype: mixed
    precision has converted them first) and this rank's shard of them (FrozenShard below). It has
    no gradient shard, no reduce and no Adam state: its BucketComm gathers only, on the same gather
    process group as the trainable part ([Note: two process groups] in csrc/buckets.cpp), so the
    collectives of both pair up in the same order on every rank.
UnitBuffers gathers and releases both parts of a unit together; the hooks see units only.
Why not one layout with the frozen parameters inside the trainable buckets: every bucket's gradient
buffer, reduce, gradient shard, Adam moments and fp32 master span the whole bucket, so a frozen
element would cost 14 bytes of state it never uses (and 2x in the reduce); keeping them apart costs
one more gather per unit that has both.
Only frozen parameters of the managed parameters' dtype and device are sharded (a frozen int8 or
bf16 tensor beside fp32 training stays whole on every rank, as in stages 1 and 2).
Checkpoints save a frozen parameter from its shard as DCP chunks, like the trainable ones
([Note: flat slices as chunks] in zerofast/checkpoint/dcp.py), so DCP reshards it on load into any
world size or stage.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..comm import BucketComm
from ..layout import Layout, Piece, bind_views
from .runtime import UnitPart


def frozen_part(
    named: list[tuple[str, torch.nn.Parameter]],
    layout: Layout,
    bucket_of: list[int | None],
    rank: int,
    group,
    gather_group,
    grad_dtype: torch.dtype,
    check_collectives: bool = False,
    dp_rank: int | None = None,
    dp_world: int | None = None,
    shard: torch.Tensor | None = None,
    meta_device: torch.device | None = None,
):
    """The FrozenShard (the parameters become views of its buffers) and the gather-only BucketComm on
    `gather_group`; the runtime's UnitPart is FrozenShard.unit_part(comm). Used by ZeroAdam's stage 3
    (zerofast/optim/builder.py) and shard_frozen (inference.py). shard: the tensor to hold this rank's
    shard (a file's: [Note: parameters on disk]; None: a new one in memory)."""
    frozen = FrozenShard(layout, rank, [n for n, _ in named], [p for _, p in named], bucket_of, shard, meta_device)
    comm = BucketComm(
        group,
        layout,
        rank,
        placeholder_grad_shard(layout.shard_numel(rank), grad_dtype, frozen.device),
        gather_group,
        None,
        0,
        check_collectives,
        dp_rank=dp_rank,
        dp_world=dp_world,
    )
    return frozen, comm


class FrozenShard:
    """The frozen parameters' flat buffers (one per bucket; the parameters become views of them) and
    this rank's shard. Built full: UnitBuffers.shard_out fills the shard and releases the buffers."""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        names: list[str],
        params: list[torch.nn.Parameter],
        bucket_of: list[int | None],
        shard: torch.Tensor | None = None,
        meta_device: torch.device | None = None,
    ):
        self.layout, self.rank, self.names, self.bucket_of = layout, rank, names, bucket_of
        # meta_device: [Note: models built on the meta device] in zerofast/model_setup.py; values come later
        self.meta = meta_device is not None
        dtype, device = params[0].dtype, meta_device or params[0].device
        alloc = torch.empty if self.meta else torch.zeros
        self.buffers = [alloc(b.numel, dtype=dtype, device=device) for b in layout.buckets]
        self.in_files = shard is not None
        self.shard = shard if shard is not None else torch.zeros(layout.shard_numel(rank), dtype=dtype, device=device)
        self.pieces: list[Piece] = layout.pieces(rank)
        bind_views(params, layout, self.buffers)

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def unit_part(self, comm):
        """The runtime's view of these buffers (runtime.py's UnitPart), gathered by `comm`."""
        return UnitPart(
            self.buffers, self.shard, self.layout, comm, self.bucket_of, in_files=self.in_files, empty=self.meta
        )

    @property
    def device(self) -> torch.device:
        return self.shard.device

    def piece_view(self, pc: Piece) -> torch.Tensor:
        """A live 1-D view of the shard: a checkpoint reads and writes it with the units released."""
        return self.shard[pc.state_offset : pc.state_offset + pc.numel]

    def load_pieces(self, full: Mapping[int, torch.Tensor]) -> None:
        """Write this rank's pieces from whole tensors, by frozen parameter index."""
        with torch.no_grad():
            for pc in self.pieces:
                if pc.param in full:
                    src = full[pc.param].reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
                    self.piece_view(pc).copy_(src)


def placeholder_grad_shard(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gradient shard of `numel` with 0-byte storage: the frozen part never reduces, but the compiled
    BucketComm checks that every bucket's owned range fits its gradient shard."""
    t = torch.empty(numel, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t
