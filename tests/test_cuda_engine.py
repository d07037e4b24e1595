"""ZeroAdam's whole path on a GPU: buckets, the comm side stream and its events, NCCL, the fused CUDA
step. World size 1 (one GPU is what a lent machine has); skips without a GPU and CUDA kernels."""
import pytest
import torch

import zerofast
from harness import run_ranks
from oracles import HYPER, max_abs_diff, rank_batch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
    reason="needs a CUDA GPU and zerofast's CUDA kernels")]

STEPS = 10


def _zero_on_gpu(rank, world, stage, partition):
    from zerofast import ZeroAdam
    from zerofast.models import make_gpt
    model = make_gpt("tiny").cuda()
    opt = ZeroAdam(model, stage=stage, partition=partition, bucket_mb=0.01, **HYPER)
    for step in range(STEPS):
        x, y = rank_batch(model, step, rank)
        _, loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _adamw_on_gpu():
    from zerofast.models import make_gpt
    model = make_gpt("tiny").cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        x, y = rank_batch(model, step, 0)
        _, loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("partition", ["flat", "round_robin"])
def test_zero_adam_nccl_world1_matches_adamw(stage, partition):
    got = run_ranks(_zero_on_gpu, 1, args=(stage, partition), backend="nccl", timeout=300)[0]
    diff = max_abs_diff(got, _adamw_on_gpu())
    assert diff <= 2e-5, f"stage {stage} {partition}: {diff:.3g}"
