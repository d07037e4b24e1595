"""The thin Python face of the compiled bucket communication (csrc/buckets.cpp), counting bytes.

Every collective the engine issues goes through here, so `stats` is the whole step's traffic: the
payload bytes of each collective (the size of the data it reduces or gathers, the seed's unit: a
reduce of a Φ-byte gradient counts Φ), by collective, for the last step.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from . import _C
from .layout import Layout


def collectives_for(backend: str, flat: bool) -> tuple[_C.Collective, _C.Collective]:
    """The (reduce, gather) collectives of a layout on a backend: the one place that chooses them.
    Owner layouts reduce to and broadcast from each owner. The flat layout uses NCCL's ring-optimal
    reduce_scatter and all_gather, and on gloo all_reduce and broadcasts, which gloo runs faster
    with the same result ([Note: collectives per backend] in csrc/buckets.cpp)."""
    if not flat:
        return _C.Collective.reduce, _C.Collective.broadcast
    if backend == "gloo":
        return _C.Collective.all_reduce, _C.Collective.broadcast
    return _C.Collective.reduce_scatter, _C.Collective.all_gather


class BucketComm:
    def __init__(self, group: dist.ProcessGroup, layout: Layout, rank: int, grad_shard: torch.Tensor,
                 gather_group: dist.ProcessGroup | None = None, grad_buckets: list[torch.Tensor] | None = None,
                 max_buffers: int = 0):
        """grad_buckets: stage 1's persistent buckets, which .grad are views of (else buffers come
        from a pool); max_buffers: at most this many pooled buffers alive at once, 0 for no bound
        ([Note: buffers in flight] in csrc/buckets.cpp)."""
        self.layout = layout
        self.flat = layout.flat
        reduce_op, gather_op = collectives_for(dist.get_backend(group), self.flat)
        self.reduce_name, self.gather_name = reduce_op.name, gather_op.name  # the keys of `stats`
        self._impl = _C.BucketComm(
            group,
            group if gather_group is None else gather_group,
            [b.numel for b in layout.buckets],
            [layout.used_numel(b.index) for b in layout.buckets],
            [list(b.bounds) for b in layout.buckets],
            self.flat,
            grad_shard,
            layout.shard_offsets(rank),
            reduce_op,
            gather_op,
            list(grad_buckets or []),
            max_buffers,
        )
        self.group = group
        self.element_size = grad_shard.element_size()
        self.stats: Counter = Counter()  # payload bytes by collective, this step

    def new_step(self) -> None:
        self.stats = Counter()

    def add_grad(self, bucket: int, offset: int, grad: torch.Tensor) -> None:
        self._impl.add_grad(bucket, offset, grad)

    def zero_slot(self, bucket: int, offset: int, numel: int) -> None:
        self._impl.zero_slot(bucket, offset, numel)

    def reduce(self, bucket: int, accumulate: bool = False) -> None:
        self.stats[self.reduce_name] += self.layout.buckets[bucket].numel * self.element_size
        self._impl.reduce(bucket, accumulate)

    def wait_reduces(self) -> None:
        self._impl.wait_reduces()

    def gather_start(self, bucket: int, param_buffer: torch.Tensor) -> None:
        self.stats[self.gather_name] += param_buffer.numel() * param_buffer.element_size()
        self._impl.gather_start(bucket, param_buffer)

    def gather_wait(self, bucket: int) -> None:
        self._impl.gather_wait(bucket)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        """A small agreement (which parameters got a gradient), counted too."""
        self.stats["all_reduce_flags"] += t.numel() * t.element_size()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """A small agreement (overflow flag and squared gradient norm), counted too."""
        self.stats["all_reduce_stats"] += t.numel() * t.element_size()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    @property
    def buffer_bytes(self) -> int:
        return self._impl.buffer_bytes

    @property
    def peak_buffer_bytes(self) -> int:
        return self._impl.peak_buffer_bytes

    @property
    def pooled_bytes(self) -> int:
        return self._impl.pooled_bytes

    def buffer_counts(self) -> dict[str, int]:
        """Pooled bucket buffers, counted by the C++ side: alive now, the most in use and the most
        alive (in use + kept) at once since reset_peak(), the budget, and how often it was exceeded
        because no reduce was in flight to wait for."""
        i = self._impl
        return {"live": i.live_buffers, "peak_live": i.peak_live_buffers, "peak_alive": i.peak_alive_buffers,
                "max": i.max_buffers, "over_budget": i.over_budget}

    def reset_peak(self) -> None:
        self._impl.reset_peak()
