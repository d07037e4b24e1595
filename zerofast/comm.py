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


class BucketComm:
    def __init__(self, group: dist.ProcessGroup, layout: Layout, rank: int, grad_shard: torch.Tensor,
                 gather_group: dist.ProcessGroup | None = None):
        self.layout = layout
        self.flat = layout.flat
        # See [Note: collectives per backend] in csrc/buckets.cpp.
        on_gloo = dist.get_backend(group) == "gloo"
        self.reduce_name = ("all_reduce" if on_gloo else "reduce_scatter") if self.flat else "reduce"
        self.gather_name = ("broadcast" if on_gloo else "all_gather") if self.flat else "broadcast"
        self._impl = _C.BucketComm(
            group,
            group if gather_group is None else gather_group,
            [b.numel for b in layout.buckets],
            [layout.used_numel(b.index) for b in layout.buckets],
            [list(b.bounds) for b in layout.buckets],
            self.flat,
            grad_shard,
            layout.shard_offsets(rank),
            self.reduce_name if self.flat else "reduce_scatter",
            self.gather_name if self.flat else "all_gather",
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
