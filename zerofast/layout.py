"""The flat buffer layout as plain data (no process group): which bucket each parameter sits in,
where, and which part of each bucket each rank owns. build_layout / layout_from_groups make a Layout;
bind_views makes parameters views of its buffers.

[Note: bucket order]
Buckets follow backward order (the reverse of registration order, which is how gradients arrive in
a feed-forward model), so the first bucket completes first and its reduce starts while backward
still computes the others. Buckets are launched strictly in index order on every rank, so the
collectives pair up across ranks even when a bucket fills late on one of them.

[Note: padding]
"flat" pads each bucket to a multiple of world * ALIGN elements: every rank's slice is then equally
long (reduce_scatter and all_gather need that) and starts 16 bytes aligned (ALIGN fp32 elements),
which the CUDA kernel's vector loads need. Padding is zero in gradients and never updated.
Owner partitions ("round_robin", "greedy") need no padding: a bucket's parameters are grouped by
owner, so each owner's part is one contiguous segment, reduced to and broadcast from that owner.
With 8-bit Adam state (`block` > 1) every parameter's slot also starts at a multiple of the block,
and "flat" pads each bucket to a multiple of world * block, so every rank's slice and every owner's
segment starts at one: a rank owns whole blocks of whole parameters ([Note: quantized state] in
zerofast/quant.py). The gaps between slots are padding like the rest: a fresh gradient buffer is
zeroed from the first gap on (Layout.padding_start), since no gradient ever writes there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 4  # elements: 16 bytes of fp32, one CUDA vector access


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives."""

    param: int  # index in the engine's parameter list
    bucket: int
    offset: int  # first element inside the bucket's flat buffer
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    params: tuple[int, ...]  # parameter indices in buffer order
    numel: int  # buffer length, padding included
    bounds: tuple[int, ...]  # world + 1 offsets: rank r owns [bounds[r], bounds[r + 1])


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's owned range of one bucket."""

    param: int
    bucket: int
    bucket_offset: int  # first element inside the bucket buffer
    param_offset: int  # first element inside the flattened parameter
    numel: int
    state_offset: int  # first element inside the rank's flat shard buffers (grads, Adam state)


@dataclass(frozen=True)
class Layout:
    world: int
    flat: bool  # True: equal padded slices per rank; False: one segment per owner
    buckets: tuple[Bucket, ...]
    slots: tuple[Slot, ...]  # indexed by parameter

    def used_numel(self, bucket: int) -> int:
        """Elements of bucket `bucket` that hold parameters (the rest is padding)."""
        return sum(self.slots[i].numel for i in self.buckets[bucket].params)

    def padding_start(self, bucket: int) -> int:
        """The first element of bucket `bucket` that no slot holds, the first gap or the tail: the
        engine's `used_numels`, from which a fresh gradient buffer is zeroed ([Note: padding])."""
        end = 0
        for s in sorted((self.slots[i] for i in self.buckets[bucket].params), key=lambda s: s.offset):
            if s.offset != end:
                return end
            end += s.numel
        return end

    def owned_range(self, bucket: int, rank: int) -> tuple[int, int]:
        b = self.buckets[bucket]
        return b.bounds[rank], b.bounds[rank + 1]

    def owned_numel(self, rank: int) -> int:
        """Elements of real parameters (not padding) that `rank` owns."""
        return sum(p.numel for p in self.pieces(rank))

    def shard_numel(self, rank: int) -> int:
        """Length of `rank`'s flat shard buffers: its owned ranges, padding included."""
        return sum(b.bounds[rank + 1] - b.bounds[rank] for b in self.buckets)

    def shard_offsets(self, rank: int) -> list[int]:
        """Where each bucket's owned range starts inside `rank`'s shard buffers."""
        out, total = [], 0
        for b in self.buckets:
            out.append(total)
            total += b.bounds[rank + 1] - b.bounds[rank]
        return out

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of parameters `rank` owns, in shard order."""
        pieces = []
        offsets = self.shard_offsets(rank)
        for b in self.buckets:
            lo, hi = b.bounds[rank], b.bounds[rank + 1]
            for i in b.params:
                s = self.slots[i]
                start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
                if start < end:
                    pieces.append(
                        Piece(i, b.index, start, start - s.offset, end - start, offsets[b.index] + start - lo)
                    )
        return pieces


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _group_into_buckets(order: list[int], numels: list[int], cap: int, first_cap: int) -> list[list[int]]:
    """Consecutive parameters (in `order`) packed until the next would exceed the cap (`first_cap`
    for the first bucket, `cap` after); a parameter larger than the cap gets a bucket of its own."""
    buckets, current, size = [], [], 0
    for i in order:
        if current and size + numels[i] > (first_cap if not buckets else cap):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numels[i]
    if current:
        buckets.append(current)
    return buckets


def build_layout(
    numels: list[int],
    order: list[int],
    world: int,
    bucket_numel: int,
    owners: list[int] | None = None,
    first_bucket_numel: int | None = None,
    block: int = 1,
) -> Layout:
    """Lay parameters (given by numel, in `order`) out in buckets of at most `bucket_numel` elements
    (the first at most `first_bucket_numel`, when given: a small first bucket starts communication
    early in backward, as DDP's 1 MiB first bucket does).

    owners None: "flat", each bucket cut into world equal padded slices. Otherwise owners[i] is
    parameter i's rank and each bucket is grouped into one contiguous segment per owner.
    block: slots, slices and segments start at multiples of it ([Note: padding]).
    """
    if sorted(order) != list(range(len(numels))):
        raise ValueError("order must be a permutation of the parameter indices")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be positive; got {bucket_numel}")
    first = min(bucket_numel, first_bucket_numel or bucket_numel)
    return layout_from_groups(numels, _group_into_buckets(order, numels, bucket_numel, first), world, owners, block)


def layout_from_groups(
    numels: list[int], groups: list[list[int]], world: int, owners: list[int] | None = None, block: int = 1
) -> Layout:
    """One bucket per group of parameter indices, in the given order (stage 3: one per unit);
    `block` as build_layout takes it."""
    if sorted(i for g in groups for i in g) != list(range(len(numels))):
        raise ValueError("groups must hold every parameter index exactly once")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two; got {block}")
    slots: dict[int, Slot] = {}
    buckets = []
    for index, members in enumerate(groups):
        if owners is not None:
            members = sorted(members, key=lambda i: owners[i])  # stable: keeps order within an owner
        offset = 0
        for i in members:
            offset = _round_up(offset, block)
            slots[i] = Slot(i, index, offset, numels[i])
            offset += numels[i]
        if owners is None:
            total = _round_up(max(offset, 1), world * max(ALIGN, block))
            shard = total // world
            bounds = tuple(r * shard for r in range(world + 1))
        else:
            bounds = [0] * (world + 1)
            for r in range(world):
                ends = [slots[i].offset + numels[i] for i in members if owners[i] == r]
                bounds[r + 1] = _round_up(max(ends, default=bounds[r]), block)
            bounds = tuple(bounds)
            total = bounds[world]
        buckets.append(Bucket(index, tuple(members), total, bounds))
    return Layout(world, owners is None, tuple(buckets), tuple(slots[i] for i in range(len(numels))))


def bind_views(params: list, layout: Layout, buffers: list) -> None:
    """Make each parameter a view of its slot in `buffers` (one flat buffer per bucket of `layout`),
    its values copied in first: what the optimizer's and stage 3's frozen flat buffers both do. A
    parameter on the meta device has no values: it is swapped into a view of its slot, the same
    object on the buffers' device ([Note: models built on the meta device] in zerofast/model_setup.py)."""
    with torch.no_grad():
        for i, p in enumerate(params):
            s = layout.slots[i]
            view = buffers[s.bucket].narrow(0, s.offset, s.numel).view(p.shape)
            if p.is_meta:
                # Its own version counter, as p.data = view keeps one: a Parameter made from the view
                # would share the buffer's, which each gather's copy bumps under autograd's saved tensors.
                fresh = torch.nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad)
                fresh.data = view
                torch.utils.swap_tensors(p, fresh)
                continue
            view.copy_(p)
            p.data = view
