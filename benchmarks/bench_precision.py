"""ZeroAdam in bf16 (mixed precision: bf16 parameters and gradients, fp32 master shard and Adam
state) against fp32, stages 1-3, on the step benchmark's setting: gloo, 2 ranks x 1 thread, a GPT
of 6.4M parameters, batch 8 x 64 per rank. Each case also reports the bytes rank 0 holds after a
step (parameters, gradients, gradient shard, optimizer state, master copy, bucket buffers), from
ZeroAdam.report().memory; the summary prints it next to the step time.

The step time of bf16 on a CPU depends on whether the CPU multiplies bf16 natively (AMX or
AVX512-BF16); without that, bf16 matmuls are slower than fp32 ones and the step is too, while the
memory halves for parameters and gradients as the ZeRO paper's memory table says.
"""

import dataclasses
import functools

import pytest
from bench_step import BATCH, HYPER, SEQ, WORLD
from rankpool import RankPool

ROUNDS, WARMUP = 6, 2
GROUP = "mixed precision: 2 gloo ranks x 1 thread, GPT 6.4M params, batch 8x64"


def build(case, rank, world):
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt("small")
    precision, stage = case.split()[0], int(case.split()[-1])
    opt = ZeroAdam(model, stage=stage, mixed_precision=None if precision == "fp32" else precision, **HYPER)
    state = {"step": 0}

    def step():
        x, y = random_batch(model.cfg, BATCH, SEQ, seed=1000 * (state["step"] % 4) + rank)
        state["step"] += 1
        _, loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep stage 1's gradients for the memory count

    def info():
        r = dataclasses.asdict(opt.report().memory)
        keys = ("params", "grads", "grad_shard", "optimizer", "master_copy", "bucket_buffers", "bucket_pool")
        return {k: r[k] for k in keys}

    step.info = info
    return step


CASES = [f"{p} stage {s}" for s in (1, 2, 3) for p in ("fp32", "bf16")]


@pytest.mark.parametrize("case", CASES)
def test_precision_step(benchmark, record, case):
    pool = RankPool(functools.partial(build, case), world=WORLD)
    try:
        benchmark.pedantic(pool.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        memory = pool.info()[0]
    finally:
        pool.close()
    benchmark.extra_info.update(memory)
    benchmark.extra_info["rank_mib"] = sum(memory.values()) / 2**20
    record(benchmark, GROUP, case)
