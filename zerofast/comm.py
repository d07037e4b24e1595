"""BucketComm, the thin Python face of the compiled bucket communication (csrc/buckets.h: the
reduce/gather core, its buffer pool and its replica reducer), counting bytes.

Every collective of the engine goes through here, so `stats` is the last step's whole traffic in
payload bytes (the data reduced or gathered, the unit of the ZeRO paper's 2Φ/3Φ: a reduce of a
Φ-byte gradient counts Φ), by group and collective: "shard/<collective>" within the ranks sharing
the state, "replicate/<collective>" across hybrid sharding's replicas, the traffic that crosses
machines ([Note: hybrid sharding] in zerofast/topology.py). A group of one rank is not counted.

[Note: faults]
Every wait on a collective is bounded by the process group's timeout (gloo: the `timeout` given to
init_process_group, 30 minutes by default; stage 3's gather group is created with the same): a rank
that died ends its peers' waits at once ("connection closed"), one that is alive but stuck (stopped,
blocked in I/O, looping) ends them after the timeout. Either way the waiting ranks raise
CollectiveError with one message naming the step, the phase (`where`, kept current by the optimizer
and the stage-3 hooks) and the collective, the backend's own message after it. With
check_collectives (ZEROFAST_DEBUG=1) every collective is first described to every rank (what, which
bucket, how many elements, step, micro-batch) and a rank whose description differs makes all of
them raise OutOfStepError before the collective is issued, as TORCH_DISTRIBUTED_DEBUG=DETAIL does
for torch's own collectives; it costs one small blocking all_gather per collective.
Errors are told apart by their class, never by their text: the compiled engine throws CommError for
a c10d call that failed (csrc/errors.h), which run() turns into CollectiveError; an error raised by
a torch.distributed collective issued from here is the communication's too (_collective); every
other error (a GradientError naming a parameter, running out of memory, a bug) is raised as itself,
on the rank where it happened, and never says that a peer failed.

[Note: two communicators on one comm stream]
Stage 3 gathers on a process group of its own ([Note: two process groups] in csrc/buckets.cpp), so
each group issues its collectives in the same order on every rank. Under NCCL the two groups are
two communicators, and both are issued from the one comm stream ([Note: comm stream]): each
ProcessGroupNCCL runs its kernels on a stream of its own that first waits for the comm stream.
Between the groups the order can differ by rank: a bucket that some rank fills during backward
(every parameter of it got its gradient there) reduces at once, before the re-gathers of the
earlier units, while a rank where one of its parameters got no gradient reduces it only at the end
of backward, after them. NCCL kernels wait on the GPU for their peers, and NCCL documents that
operations on several communicators must then be issued in the same order on every rank: nothing
guarantees the two kernels run concurrently, so rank A's reduce can wait for rank B's while B's
gather waits for A's. gloo cannot show it (each collective runs on host threads of its own), nor
can one GPU (NCCL refuses two ranks there). The test that would, on two GPUs:
tests/test_cuda_ranks.py::test_stage3_reduces_and_gathers_on_two_gpus_neither_hang_nor_drift (a
parameter of the last unit used on rank 0 only; a deadlock shows as the harness's timeout). The
remedies, if it does: launch such a late bucket's reduce at the end of backward on every rank
(the step's agreement already knows which parameters got a gradient anywhere, one step late), or
give the reduces and the gathers separate comm streams, each ordered against compute by events
as now (which alone does not remove the cross-communicator order NCCL asks for).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _C, exit_drain
from .collectives import collective_names
from .errors import CollectiveError, GradientError, OutOfStepError  # noqa: F401  (raised here, and re-exported)
from .layout import Layout
from .topology import group_timeout

exit_drain.install(_C.drain_kept_works)  # a process that used the core ends cleanly: [Note: clean exit]


@dataclass
class Where:
    """Where this rank is, for error messages: steps completed, and the phase of the current one."""

    step: int = 0
    micro_batch: int = 0
    phase: str = "forward"

    def describe(self) -> str:
        if self.phase in ("forward", "backward"):
            return f"step {self.step + 1}, micro-batch {self.micro_batch + 1}, {self.phase}"
        m = self.micro_batch
        return f"step {self.step + 1}, {self.phase}, after {m} micro-batch{'' if m == 1 else 'es'}"


_KINDS = ("reduce", "gather", "agree_used", "agree_stats", "forward", "replicate")


def _options(struct, **fields):
    """A compiled engine's options struct (csrc/buckets.h, csrc/bucket_layout.h), filled by field name."""
    for name, value in fields.items():
        setattr(struct, name, value)
    return struct


def collectives_for(backend: str, flat: bool) -> tuple[_C.Collective, _C.Collective]:
    """The (reduce, gather) collectives of a layout on a backend, as the compiled engine's enum:
    zerofast/collectives.py chooses them."""
    reduce, gather = collective_names(backend, flat)
    return _C.Collective.__members__[reduce], _C.Collective.__members__[gather]


class BucketComm:
    def __init__(
        self,
        group: dist.ProcessGroup,
        layout: Layout,
        rank: int,
        grad_shard: torch.Tensor,
        gather_group: dist.ProcessGroup | None = None,
        grad_buckets: list[torch.Tensor] | None = None,
        max_buffers: int = 0,
        check_collectives: bool = False,
        replicate_group: dist.ProcessGroup | None = None,
        replicate_grads_group: dist.ProcessGroup | None = None,
        replicate_min_bytes: int = 0,
        dp_rank: int | None = None,
        dp_world: int | None = None,
        replication=None,
    ):
        """group: the shard group (the ranks `layout` is cut for). grad_buckets: stage 1's persistent
        buckets, which .grad are views of (else buffers come from a pool). max_buffers: the most pooled
        buffers alive at once, 0 for no bound ([Note: buffers in flight] in csrc/bucket_pool.cpp).
        replicate_group: hybrid sharding's replicas of this rank's shard (None: none), for the step's
        agreement. replicate_grads_group: the same ranks again, for the engine's gradient all_reduces
        during backward (timed differently per rank, so never paired with the agreement), each at
        least replicate_min_bytes of consecutive owned ranges ([Note: replicas in backward]).
        dp_rank, dp_world: this rank among every data-parallel rank, for messages (None: its rank in
        `group`). replication: zerofast.topology.Replication (None: fixed replicas); one whose
        membership changes agrees through its own agree() and takes one tensor per all_reduce."""
        self.layout = layout
        self.flat = layout.flat
        reduce_op, gather_op = collectives_for(dist.get_backend(group), self.flat)
        self.reduce_name, self.gather_name = reduce_op.name, gather_op.name  # the keys of `stats`
        self._impl = _C.BucketComm(
            _options(
                _C.BucketCommOptions(),
                group=group,
                gather_group=group if gather_group is None else gather_group,
                layout=_options(
                    _C.BucketLayout(),
                    bucket_numels=[b.numel for b in layout.buckets],
                    used_numels=[
                        layout.padding_start(b.index) for b in layout.buckets
                    ],  # zeroed from there: [Note: padding]
                    bounds=[list(b.bounds) for b in layout.buckets],
                    shard_offsets=layout.shard_offsets(rank),
                    flat=self.flat,
                ),
                reduce_op=reduce_op,
                gather_op=gather_op,
                grad_shard=grad_shard,
                grad_buckets=list(grad_buckets or []),
                max_buffers=max_buffers,
            )
        )
        self.group = group
        self.gather_group = group if gather_group is None else gather_group
        self.replicate_group = replicate_group
        # The engine all_reduces each owned range over the replicas as its bucket's last reduce of the
        # step finishes ([Note: replicas in backward] in csrc/replica_reducer.cpp); with check_collectives, step() does.
        self.replicates_in_engine = replicate_grads_group is not None and not check_collectives
        # Only a replication whose membership changes needs a say in the agreement.
        self.live = replication if replication is not None and replication.changes_membership else None
        if self.replicates_in_engine:
            self._impl.replicas.set_group(replicate_grads_group, replicate_min_bytes, coalesce=self.live is None)
        self.rank, self.world = rank, dist.get_world_size(group)
        # Messages name the data-parallel rank: under hybrid sharding shard ranks repeat across replicas.
        self.dp_rank = rank if dp_rank is None else dp_rank
        self.dp_world = self.world if dp_world is None else dp_world
        self.device = grad_shard.device
        self._agreements: Counter = Counter()  # payload bytes of the step's small all_reduces
        self.where = Where()  # see [Note: faults]
        self.timeout = group_timeout(group)
        self.check = check_collectives
        self._checked = {id(self.group): 0, id(self.gather_group): 0, id(replicate_group): 0}  # per group, in order

    def share_bookkeeping(self, main: BucketComm) -> None:
        """A second BucketComm gathering on `main`'s gather group (stage 3's frozen parameters): one
        `where` for error messages and one check sequence per group, shared with `main`."""
        self.where = main.where
        self._checked = main._checked

    def new_step(self) -> None:
        self._agreements = Counter()
        self._impl.new_step()

    @property
    def stats(self) -> dict[str, int]:
        """Payload bytes this step by group and collective ("shard/reduce", "replicate/all_reduce", ...);
        reduces and gathers are counted in C++, where the gradient path issues them without Python."""
        out = dict(self._agreements)
        traffic = self._impl.traffic
        if self.world > 1:
            for name, nbytes in (
                (self.reduce_name, traffic.reduce_bytes),
                (self.gather_name, traffic.gather_bytes),
            ):
                if nbytes:
                    out["shard/" + name] = out.get("shard/" + name, 0) + nbytes
        else:
            out = {k: v for k, v in out.items() if not k.startswith("shard/")}
        replicated = self._impl.replicas.bytes
        if replicated:
            out["replicate/all_reduce"] = out.get("replicate/all_reduce", 0) + replicated
        return out

    def set_last_micro_batch(self, last: bool) -> None:
        """Whether the reduces launched from now on are the step's last (outside no_sync): their
        owned ranges are then all_reduced over the replicas as they finish ([Note: replicas in
        backward] in csrc/replica_reducer.cpp)."""
        self._impl.replicas.set_last_micro_batch(last)

    def order_hashes(self) -> tuple[int, int]:
        """Running hashes of the buckets reduced and gathered this step, in order."""
        traffic = self._impl.traffic
        return traffic.reduce_hash, traffic.gather_hash

    # --- errors and checks: [Note: faults] -----------------------------------------------------

    def failed(self, what: str, error: BaseException) -> CollectiveError:
        timeout = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the backend's"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return CollectiveError(
            f"ZeroAdam (rank {self.dp_rank} of {self.dp_world}): {what} failed at {self.where.describe()}: another "
            f"rank died, is stuck or is out of step (the wait is bounded by the process group's timeout, "
            f"{timeout}). Backend: {first}"
        )

    def grad_path(
        self, params, names, layout: Layout, views, grads_sharded, overlap, on_grad, on_error, before_launch, who
    ):
        """The compiled gradient path over this comm's buckets ([Note: the gradient path] in
        csrc/grad_path.cpp): each parameter's slot (bucket, offset), the buckets' sizes, stage 1's
        bucket views, the reducer's callbacks (on_grad for a gradient Python handles, on_error for a
        CommError, before_launch for check_collectives), and the optimizer its errors name."""
        slots = layout.slots
        return _C.GradPath(
            self._impl,
            params,
            names,
            [s.bucket for s in slots],
            [s.offset for s in slots],
            [len(b.params) for b in layout.buckets],
            views,
            grads_sharded,
            overlap,
            on_grad,
            on_error,
            before_launch,
            who,
        )

    @staticmethod
    def error(message: str) -> Exception:
        """The compiled engine's CommError with `message` (a failure the gradient path reported)."""
        return _C.CommError(message)

    def run(self, what, fn, *args):
        """fn: a call into the compiled engine (BucketComm, GradPath). Only its CommError (a failed c10d
        call: csrc/errors.h) is the communication's; any other error is raised as it is. what: the
        collective, for the message (or a function returning it)."""
        try:
            return fn(*args)
        except _C.CommError as e:
            raise self.failed(what() if callable(what) else what, e) from e

    def _issue(self, what: str, fn, *args):
        """fn (a torch.distributed collective on our own small tensors) issued asynchronously, its Work
        handed to the compiled keeper so that gloo's thread never drops the last reference ([Note:
        clean exit] in csrc/work_keeper.cpp). Anything fn raises but running out of memory is the
        communication's: torch's DistError, or a plain RuntimeError from some gloo calls ("Connection
        reset by peer", "Application timeout caused pair closure": measured)."""
        try:
            work = fn(*args, async_op=True)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise self.failed(what, e) from e
        if work is not None:  # None: this rank is not in the group
            _C.keep_work(work)
        return work

    def _wait(self, what: str, work) -> None:
        if work is None:
            return
        try:
            work.wait()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise self.failed(what, e) from e

    def _collective(self, what: str, fn, *args) -> None:
        """fn, issued (_issue) and waited for."""
        self._wait(what, self._issue(what, fn, *args))

    def _verify(self, kind: str, bucket: int, numel: int, group: dist.ProcessGroup) -> None:
        """check_collectives: every rank describes the collective it is about to issue; any
        difference raises OutOfStepError on every rank, naming each rank's description."""
        seq = self._checked[id(group)]
        self._checked[id(group)] = seq + 1
        mine = torch.tensor(
            [seq, _KINDS.index(kind), bucket, numel, self.where.step, self.where.micro_batch],
            dtype=torch.int64,
            device=self.device,
        )  # NCCL takes device tensors only
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        self._collective(f"the check of {kind} {bucket}", dist.all_gather, everyone, mine, group)
        rows = [t.tolist() for t in everyone]
        if any(r != rows[0] for r in rows):

            def show(r):
                return (
                    f"#{r[0]} {_KINDS[r[1]]} bucket {r[2]} of {r[3]} elements at step {r[4] + 1} micro-batch {r[5] + 1}"
                )

            raise OutOfStepError(
                f"ZeroAdam (rank {self.dp_rank}): the ranks are out of step at {self.where.describe()}; the "
                f"collective each rank was about to issue: "
                + "; ".join(
                    f"rank {dist.get_global_rank(group, r) if group is not dist.group.WORLD else r}: {show(row)}"
                    for r, row in enumerate(rows)
                )
                + ". Every rank must run the same micro-batches, steps and (stage 3) modules in the same order"
            )

    def check_forward(self) -> None:
        """check_collectives, stage 3: a forward's start is checked on the reduce group too. The gathers
        have a group of their own, so a rank running an extra micro-batch would otherwise wait in a gather
        while the others wait in step()'s agreement, until the timeout. The order is the same on every
        rank: every reduce of the previous micro-batch is issued before its forward starts."""
        if self.check:
            self._verify("forward", 0, 0, self.group)

    # --- the collectives ----------------------------------------------------------------------

    # The reduces are launched by the compiled gradient path (csrc/grad_path.cpp), which copies the
    # gradients into the buckets too; with check_collectives it calls verify_reduce first.

    def verify_reduce(self, bucket: int) -> None:
        """check_collectives: every rank describes the reduce of `bucket` it is about to launch."""
        self._verify("reduce", bucket, self.layout.buckets[bucket].numel, self.group)

    def wait_reduces(self) -> None:
        self.run(f"the wait for this step's bucket reduces ({self.reduce_name})", self._impl.wait_reduces)

    def gather_start(self, bucket: int, param_buffer: torch.Tensor) -> None:
        if self.check:
            self._verify("gather", bucket, param_buffer.numel(), self.gather_group)
        self.run(
            lambda: f"the gather of bucket {bucket} ({self.gather_name})", self._impl.gather_start, bucket, param_buffer
        )

    def gather_wait(self, bucket: int) -> None:
        self.run(lambda: f"the gather of bucket {bucket} ({self.gather_name})", self._impl.gather_wait, bucket)

    def all_reduce_max(self, t: torch.Tensor, shard_only: tuple[slice, ...] = ()) -> None:
        """A small agreement (which parameters got a gradient, the step and micro-batch counts, a
        failure before the update), counted too: a MAX over the shard group, then the replicate group
        ([Note: hybrid sharding]). shard_only: the entries that torchft's replica groups agree on
        within their own group only ([Note: replica groups on torchft])."""
        if self.check:
            self._verify("agree_used", 0, t.numel(), self.group)
        self._agreements["shard/all_reduce_flags"] += t.numel() * t.element_size()
        self._collective(
            "the step's agreement (all_reduce of flags and counters)", dist.all_reduce, t, dist.ReduceOp.MAX, self.group
        )
        if self.live is not None:  # after the step's gradient all_reduces: [Note: replica groups on torchft]
            self.wait_reduces()
            self._agreements["replicate/all_reduce_flags"] += t.numel() * t.element_size()
            own = [(s, t[s].clone()) for s in shard_only]
            self.live.agree(t)
            for s, values in own:
                t[s] = values
        elif self.replicate_group is not None:
            if self.check:
                self._verify("agree_used", 0, t.numel(), self.replicate_group)
            self._agreements["replicate/all_reduce_flags"] += t.numel() * t.element_size()
            self._collective(
                "the step's agreement across replicas (all_reduce of flags and counters)",
                dist.all_reduce,
                t,
                dist.ReduceOp.MAX,
                self.replicate_group,
            )

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """A small agreement (overflow flag and squared gradient norm), counted too: over the shard
        group only, where each gradient element sits in exactly one rank's shard."""
        if self.check:
            self._verify("agree_stats", 0, t.numel(), self.group)
        self._agreements["shard/all_reduce_stats"] += t.numel() * t.element_size()
        self._collective(
            "the step's agreement on overflow and gradient norm (all_reduce)",
            dist.all_reduce,
            t,
            dist.ReduceOp.SUM,
            self.group,
        )

    def all_reduce_tp(
        self, t: torch.Tensor, op, tp_group: dist.ProcessGroup, kind: str, what: str, dim: str = "tp"
    ) -> None:
        """The step's small all_reduce over a model-parallel dim, "tp" or "pp" (the norm's and the
        overflow flag's sum, the agreement joined: [Note: tensor parallelism] in
        zerofast/tensor_parallel.py, [Note: pipeline accumulation] in zerofast/pipelining.py), issued
        as this comm's own (_collective) and counted as "<dim>/all_reduce_<kind>"."""
        self._agreements[f"{dim}/all_reduce_{kind}"] += t.numel() * t.element_size()
        self._collective(what, dist.all_reduce, t, op, tp_group)

    def all_reduce_replicas(self, shards: list[torch.Tensor]) -> None:
        """Hybrid sharding with check_collectives: sum this rank's reduced gradient shard over its
        replicas in step() ([Note: hybrid sharding] in zerofast/topology.py), each collective described
        first; one per tensor given (stage 1 reducing in place: each bucket's owned range), issued
        together, then waited for. Without the check the engine does it during backward."""
        if self.replicate_group is None or self.replicates_in_engine:
            return
        works = []
        for i, t in enumerate(shards):
            if t.numel() == 0:
                continue
            if self.check:
                self._verify("replicate", i, t.numel(), self.replicate_group)
            self._agreements["replicate/all_reduce"] += t.numel() * t.element_size()
            works.append(
                self._issue(
                    "the all_reduce of the gradient shard across replicas",
                    dist.all_reduce,
                    t,
                    dist.ReduceOp.SUM,
                    self.replicate_group,
                )
            )
        for w in works:
            self._wait("the all_reduce of the gradient shard across replicas", w)

    @property
    def buffer_bytes(self) -> int:
        return self._impl.pool.bytes_in_use

    @property
    def peak_buffer_bytes(self) -> int:
        return self._impl.pool.peak_bytes

    @property
    def pooled_bytes(self) -> int:
        return self._impl.pool.kept_bytes

    def buffer_counts(self) -> dict[str, int]:
        """Pooled bucket buffers, counted by the C++ side: alive now, the most in use and the most
        alive (in use + kept) at once since reset_peak(), the budget, and how often it was exceeded
        because no reduce was in flight to wait for."""
        pool = self._impl.pool
        return {
            "live": pool.live,
            "peak_live": pool.peak_live,
            "peak_alive": pool.peak_alive,
            "max": pool.max_buffers,
            "over_budget": pool.over_budget,
        }

    def reset_peak(self) -> None:
        self._impl.pool.reset_peak()
