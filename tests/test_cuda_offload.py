"""The optimizer state offloaded from a GPU (OffloadPolicy "host" and "disk", zerofast/offload): the
model, its gradients and the collectives on cuda:0, the state in (pinned) host memory or in files,
stepped by the fused CPU kernel. NCCL world 1 and two gloo ranks on cuda:0; each against
torch.optim.AdamW on the GPU over the global batch (the CPU and CUDA kernels share adam_math.h, so
the two differ by rounding alone: fp32_tol / lp_param_tol, tests/tolerances.py), and the offloaded
step against the same ZeroAdam with its state on the GPU. Skips without a GPU and CUDA kernels."""

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tolerances import HYPER, fp32_tol, lp_param_tol, max_abs_diff
from training import global_batch, rank_batch, zero_options

import zerofast

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
        reason="needs a CUDA GPU and zerofast's CUDA kernels",
    ),
]

STEPS = 6


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-cuda-offload-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _train(rank, world, stage, precision, offload):
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt

    torch.cuda.set_device(0)
    model = make_gpt("tiny").cuda()
    group = dist.new_group(list(range(world)))
    opt = ZeroAdam(
        model,
        **zero_options(stage, mixed_precision=precision, bucket_mb=0.01),
        process_group=group,
        offload=offload,
        max_grad_norm=1.0,
        **HYPER,
    )
    for step in range(STEPS):
        x, y = rank_batch(model, step, rank)
        _, loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    report = opt.report()
    with opt.gathered_params():
        params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    return params, report.offload.state, report.memory.optimizer


def _adamw_on_gpu(world):
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        x, y = global_batch(model, step, world)
        _, loss = model(x.cuda(), y.cuda())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("state", ["host", "disk"])
def test_offloaded_state_on_nccl_world1_matches_adamw(stage, state, root):
    offload = zerofast.OffloadPolicy(state, root if state == "disk" else None, window_mb=0.05)
    params, placement, on_device = run_ranks(_train, 1, args=(stage, None, offload), backend="nccl", timeout=300)[0]
    assert placement == state and on_device == 0, (placement, on_device)
    diff = max_abs_diff(params, _adamw_on_gpu(1))
    assert diff <= fp32_tol(STEPS), f"stage {stage} {state}: {diff:.3g}"


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_bf16_on_two_gloo_ranks_on_one_gpu_matches_the_state_on_the_gpu(stage, root):
    host = run_ranks(_train, 2, args=(stage, "bf16", zerofast.OffloadPolicy("host")), timeout=300)
    device = run_ranks(_train, 2, args=(stage, "bf16", None), timeout=300)
    for (got, placement, _), (want, _, _) in zip(host, device):
        assert placement == "host"
        tol = lp_param_tol(torch.bfloat16, STEPS, want)  # the CPU kernel against the CUDA one, rounded to bf16
        diff = max_abs_diff(got, want)
        assert diff <= tol, f"stage {stage}: {diff:.3g} > {tol:.3g}"
