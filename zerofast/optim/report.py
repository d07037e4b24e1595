"""opt.report(): what an optimizer holds and moved, as plain data measured at the call.

A report describes; it is never the state. The state a checkpoint saves (the fp32 master, the
optimizer's moments, the step counts) is read and written through opt.checkpoint_view
(zerofast/checkpoint/view.py), whose values are live tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..partition import imbalance
from .builder import Parts


@dataclass(frozen=True)
class PartitionReport:
    """Who owns what, over the ranks sharing the state (the shard group)."""

    owned_numel: list[int]  # per rank: elements it owns (real parameters, not padding)
    imbalance: float  # max / mean of owned_numel
    ns_flops: list[int] | None = None  # ZeroMuon: per rank, Newton-Schulz FLOPs per step
    ns_imbalance: float | None = None  # ZeroMuon: max / mean of ns_flops


@dataclass(frozen=True)
class UnitReport:
    """Stage 3: one unit, what it gathers together ([Note: choosing units] in zerofast/stage3/units.py)."""

    unit: int  # its index (unit 0 is the root's remaining parameters, when there are any)
    module: str  # the qualified names of its modules, ", "-joined ("" for the root)
    module_class: str  # the class of its (first) module
    modules: int  # how many modules it holds (several when small ones were merged)
    tensors: int  # parameter tensors, frozen ones included (stage 3 shards them too)
    numel: int  # their elements
    bytes: int  # numel in the parameters' dtype
    frozen_tensors: int  # of `tensors`, the frozen ones ([Note: frozen parameters in stage 3])
    frozen_numel: int
    gathered_bytes: int  # what gathering it materializes: its buckets at their padded size, both parts


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank holds now, by kind, counted from the tensors."""

    params: int  # trainable parameter storage that exists now (stage 3: its shard + gathered units)
    param_padding: int  # of the parameter buffers, padding
    grad_shard: int  # the reduced owned gradients of stages 2 and 3 (and stage 1 reducing in another dtype)
    optimizer: int  # Adam's moments (exp_avg, exp_avg_sq; ZeroMuon's momentum shares exp_avg's)
    master_copy: int  # the separate fp32 master of mixed precision (0 in fp32: the parameters are it)
    grads: int  # the full local gradients (stage 1: its buckets, which .grad are views of; else .grad)
    bucket_buffers: int  # pooled gradient bucket buffers in use now
    bucket_buffers_peak: int  # the most in use at once
    bucket_pool: int  # released buffers kept for reuse (<= the peak)
    frozen_params: int  # stage 3's frozen parameters (shard + gathered); 0 in stages 1 and 2

    @property
    def materialized_params(self) -> int:
        """All parameter storage that exists now: trainable and (stage 3) frozen, shards and
        gathered units (stages 1 and 2 count the trainable parameters only: their frozen ones are
        the model's own tensors)."""
        return self.params + self.frozen_params


@dataclass(frozen=True)
class BufferCounts:
    """The pooled gradient bucket buffers, as the compiled BucketComm counts them."""

    live: int  # alive now
    peak_live: int  # the most in use at once
    peak_alive: int  # the most in use + kept at once
    budget: int  # CommPolicy.bucket_buffers (0: no bound)
    over_budget: int  # how often backward found no reduce in flight to wait for


@dataclass(frozen=True)
class OffloadReport:
    """Where this rank's optimizer state lives (OffloadPolicy) and what the last step's I/O cost."""

    state: str  # "device" (no offload), "host" or "disk"
    folder: str | None  # disk: this optimizer's folder of state files (removed with the optimizer)
    host_bytes: int  # host memory held for the state: host's pinned state; disk's window (once stepped)
    disk_bytes: int  # bytes of the state files (two generations: [Note: the all-or-none offloaded step])
    window_bytes: int  # disk: the window's three slots
    read_bytes: int  # the last step's reads of the files
    write_bytes: int  # and writes
    io_wait_seconds: float  # of the last step's phase 3, waiting for reads and writes
    phase3_seconds: float  # the last step's phase 3 through the store
    delayed_update: bool = False  # OffloadPolicy(delayed_update=True): parameters one update behind
    delayed_bytes: int = 0  # host memory of the delayed update in flight: its gradient and parameter copies
    direct_io: bool = False  # disk: the window's reads and writes bypass the page cache (O_DIRECT)
    # OffloadPolicy(params=...), stage 3's parameter, gradient and frozen shards: "device" (None),
    # "host" (a CPU model's: where they were, nothing moved) or "disk" (files, mapped; then not
    # counted in report().memory: [Note: parameters on disk] in zerofast/offload/__init__.py).
    params: str = "device"
    params_folder: str | None = None  # "disk": the shards' folder (removed with the optimizer)
    params_disk_bytes: int = 0  # "disk": the shards' files
    params_resident_bytes: int = 0  # "disk": of those, pages this process holds resident now
    # "disk": the shards' explicit I/O since the optimizer was built (the gathers' reads and, with the
    # state on disk, the step's gradient reads and parameter writes), and the seconds spent inside the
    # reads and inside the writes (each call's, summed): bytes over seconds is the rate the shards'
    # files were read and written at.
    params_read_bytes: int = 0
    params_write_bytes: int = 0
    params_read_seconds: float = 0.0
    params_write_seconds: float = 0.0

    @property
    def io_bandwidth(self) -> float:
        """Bytes per second read and written over the last step's phase 3 (0 without a step on disk)."""
        return (self.read_bytes + self.write_bytes) / self.phase3_seconds if self.phase3_seconds else 0.0


@dataclass(frozen=True)
class Report:
    """opt.report(): this rank's view of the partition, the units, memory, buffers and traffic."""

    partition: PartitionReport
    units: list[UnitReport]  # stage 3, in unit order; empty for stages 1 and 2 (they gather by bucket)
    memory: MemoryReport
    buffers: BufferCounts
    comm: dict[str, int] = field(default_factory=dict)  # payload bytes per collective in the last step
    # Stage 3: unit gathers started since the optimizer was built (a forward outside
    # gathered_params() gathers each unit it runs; generation's cost per token); 0 in stages 1 and 2.
    unit_gathers: int = 0
    offload: OffloadReport | None = None  # where the optimizer state lives


def offload_report(parts) -> OffloadReport:
    store, offload, files = parts.store, parts.offload, parts.files
    stats = store.stats
    return OffloadReport(
        state=store.placement,
        folder=store.folder,
        host_bytes=store.host_bytes,
        disk_bytes=store.disk_bytes,
        window_bytes=store.window_bytes,
        read_bytes=stats.read_bytes,
        write_bytes=stats.write_bytes,
        io_wait_seconds=stats.wait_seconds,
        phase3_seconds=stats.seconds,
        delayed_update=parts.plan.offload.delayed_update,
        delayed_bytes=offload.delayed_bytes if offload is not None else 0,
        direct_io=getattr(store, "direct_io", False),
        params=parts.plan.offload.params or "device",
        params_folder=files.folder if files is not None else None,
        params_disk_bytes=files.disk_bytes if files is not None else 0,
        params_resident_bytes=files.resident_bytes() if files is not None else 0,
        **_shard_io(files),
    )


def _shard_io(files) -> dict:
    """report().offload's params_read_* and params_write_* from the shards' files (none: zeros)."""
    if files is None:
        return {}
    (rb, rs), (wb, ws) = files.io_total("read"), files.io_total("write")
    return dict(params_read_bytes=rb, params_read_seconds=rs, params_write_bytes=wb, params_write_seconds=ws)


def partition_report(layout, shard_size: int, step_costs: list[int] | None) -> PartitionReport:
    owned = [layout.owned_numel(r) for r in range(shard_size)]
    if step_costs is None:
        return PartitionReport(owned, imbalance(owned))
    flops = [sum(step_costs[pc.param] for pc in layout.pieces(r)) for r in range(shard_size)]
    mean = sum(flops) / len(flops)
    return PartitionReport(owned, imbalance(owned), flops, max(flops) / mean if mean else 1.0)


def units_report(unit_plan, unit_params: list, buffers, param_dtype: torch.dtype) -> list[UnitReport]:
    """Stage 3's units (UnitPlan over unit_params, gathered by UnitBuffers `buffers`)."""
    size = torch.empty(0, dtype=param_dtype).element_size()
    report = []
    for u, (group, name) in enumerate(zip(unit_plan.groups, unit_plan.names)):
        params = [unit_params[i] for i in group]
        numel = sum(p.numel() for p in params)
        frozen = [p for p in params if not p.requires_grad]
        padded = sum(
            part.layout.buckets[part.bucket_of[u]].numel for part in buffers.parts if part.bucket_of[u] is not None
        )
        report.append(
            UnitReport(
                unit=u,
                module=name,
                module_class=type(unit_plan.modules[u]).__name__,
                modules=len(unit_plan.members[u]),
                tensors=len(group),
                numel=numel,
                bytes=numel * size,
                frozen_tensors=len(frozen),
                frozen_numel=sum(p.numel() for p in frozen),
                gathered_bytes=padded * size,
            )
        )
    return report


def buffer_counts(comm) -> BufferCounts:
    c = comm.buffer_counts()
    return BufferCounts(c["live"], c["peak_live"], c["peak_alive"], c["max"], c["over_budget"])


def memory_report(parts: Parts) -> MemoryReport:
    nbytes = parts.shard.nbytes()
    grad_buckets = nbytes.pop("grad_buckets")
    local = sum(p.grad.numel() * p.grad.element_size() for p in parts.params if p.grad is not None)
    comm = parts.comm
    return MemoryReport(
        **nbytes,
        grads=grad_buckets if parts.plan.grads_as_bucket_views else local,
        bucket_buffers=comm.buffer_bytes,
        bucket_buffers_peak=comm.peak_buffer_bytes,
        bucket_pool=comm.pooled_bytes,
        frozen_params=parts.units.buffers.materialized_bytes(first=1) if parts.frozen is not None else 0,
    )


def build_report(parts: Parts, last_comm: dict[str, int]) -> Report:
    """The report of the optimizer wired as `parts`; last_comm: its last step's payload bytes."""
    sharded = parts.plan.params_sharded
    return Report(
        partition=partition_report(parts.layout, parts.topology.shard_size, parts.rule.step_costs),
        units=units_report(parts.unit_plan, parts.unit_params, parts.units.buffers, parts.plan.param_dtype)
        if sharded
        else [],
        memory=memory_report(parts),
        buffers=buffer_counts(parts.comm),
        comm=dict(last_comm),
        unit_gathers=parts.units.gathers if sharded else 0,
        offload=offload_report(parts),
    )
