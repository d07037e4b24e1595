"""What a step costs the host and the launcher, counted on the CPU: the values step() reads back from
the device ([Note: host syncs] in zerofast/optim/host_reads.py: on CUDA each one waits for the
stream) and the fused Adam calls it makes ([Note: one kernel per range] in zerofast/optim/state.py).

The reads are counted twice, independently: through the named seam (host_reads.counting()), and by
a TorchFunctionMode that sees every Tensor method that hands a value to Python (.item(), .tolist(),
float(), bool(), ...), so a read that bypasses the seam fails the test. The fused Adam calls are
counted at the dispatcher (a TorchDispatchMode on zerofast::fused_adam_). Cost: one pooled 2-rank
launch, a few seconds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from harness import run_ranks
from tolerances import HYPER
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from training import rank_batch, zero_options

# Tensor methods that move a value to the host (on CUDA: wait for the stream).
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


class _CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "zerofast":
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# (stage, partition, mixed precision, clipping by norm)
CONFIGS = [
    (1, "flat", None, False),
    (2, "flat", None, False),
    (2, "flat", None, True),
    (2, "round_robin", "bf16", True),
    (2, "flat", "fp16", False),
    (2, "flat", "fp16", True),
    (3, "flat", None, True),
    (3, "round_robin", "fp16", True),
]


def _count_step(rank, world):
    from zerofast import ZeroAdam
    from zerofast.optim import host_reads
    from zerofast.optim.zero_adam import parts_of
    from zerofast.tools.models import make_gpt

    out = []
    for stage, partition, precision, clip in CONFIGS:
        model = make_gpt("tiny")
        options = zero_options(
            stage, partition=partition, bucket_mb=0.01, min_unit_mb=0 if stage == 3 else None, mixed_precision=precision
        )
        opt = ZeroAdam(model, **options, max_grad_norm=0.5 if clip else None, **HYPER)
        for step in range(2):  # the second step is counted (the first has no state yet)
            _, loss = model(*rank_batch(model, step, rank))
            opt.backward(loss)
            reads, ops = _CountReads(), _CountOps()
            with host_reads.counting() as seam, reads, ops:
                opt.step()
            opt.zero_grad()
        # As few Adam calls as the buffers allow: stage 3 one (one parameter group, every
        # parameter used, one step count), stages 1 and 2 one per bucket this rank owns a part of.
        buckets = len({pc.bucket for pc in parts_of(opt).shard.pieces})
        out.append((dict(seam), dict(reads.reads), ops.ops["fused_adam_"], 1 if stage == 3 else buckets))
    return out


@pytest.fixture(scope="module")
def counted():
    return run_ranks(_count_step, 2)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: "s{}-{}-{}-clip{}".format(*CONFIGS[i]))
def test_step_reads_back_only_what_it_must(counted, index):
    """One read per step (the agreement), two with fp16 (and its overflow flag); clipping reads
    nothing; and every read goes through the seam."""
    precision = CONFIGS[index][2]
    for rank, results in enumerate(counted):
        seam, reads, _, _ = results[index]
        want = {"agreement": 1, **({"found_inf": 1} if precision == "fp16" else {})}
        assert seam == want, f"rank {rank}: {seam}"
        assert sum(reads.values()) == sum(seam.values()), f"rank {rank}: reads outside the seam: {reads} vs {seam}"


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: "s{}-{}-{}-clip{}".format(*CONFIGS[i]))
def test_adam_runs_as_few_kernels_as_the_buffers_allow(counted, index):
    for rank, results in enumerate(counted):
        _, _, launches, want = results[index]
        assert launches == want, f"rank {rank}: {launches} fused_adam_ calls, want {want}"
