"""The per-gradient cost: one training step of a model made of 1,024 tiny linear layers
(2,048 parameter tensors of 64 or 8 elements), 1 gloo rank x 1 thread, so that the step's time is
mostly per-tensor overhead. Beside each step's time the summary prints the median time of its
backward alone: the difference to the no-communication backward, divided by the tensor count, is
what each gradient costs there: DDP's reducer (C++) against ZeroAdam's post-accumulate-grad hook
(Python) and its bucket copy. (The whole step is faster with DDP and ZeroAdam than without
communication here: torch's fused AdamW pays per tensor, ZeroAdam's flat update does not.)
"""

import functools
import time

import pytest
from rankpool import RankPool

LAYERS, WIDTH = 1024, 8
ROUNDS, WARMUP = 8, 2
GROUP = f"grad path: 1 gloo rank x 1 thread, {2 * LAYERS} tensors of {WIDTH * WIDTH} or {WIDTH} elements"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def build(case, rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerofast import ZeroAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    x = torch.randn(4, WIDTH)
    if case == "nocomm":
        opt, run = torch.optim.AdamW(model.parameters(), fused=True, **HYPER), model
    elif case == "ddp":
        run = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    else:
        opt, run = ZeroAdam(model, stage=int(case.split()[-1]), **HYPER), model

    backward_s = []

    def step():
        loss = run(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()

    step.info = lambda: sorted(backward_s)[len(backward_s) // 2]
    return step


CASES = ["nocomm", "ddp", "zerofast 1", "zerofast 2", "zerofast 3"]


@pytest.mark.parametrize("case", CASES)
def test_grad_path(benchmark, record, case):
    pool = RankPool(functools.partial(build, case), world=1)
    try:
        benchmark.pedantic(pool.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        benchmark.extra_info["backward_ms"] = pool.info()[0] * 1e3
    finally:
        pool.close()
    record(benchmark, GROUP, case)
