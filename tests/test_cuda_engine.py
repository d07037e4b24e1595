"""ZeroAdam's whole path on a GPU: buckets, the comm side stream and its events, NCCL, the fused CUDA
step. World size 1 (runs on a machine with one GPU); skips without a GPU and CUDA kernels."""

import pytest
import torch
from harness import run_ranks
from tolerances import HYPER, fp32_tol, lp_param_tol, max_abs_diff
from training import rank_batch, zero_options

import zerofast

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
        reason="needs a CUDA GPU and zerofast's CUDA kernels",
    ),
]

STEPS = 10


def _zero_on_gpu(rank, world, stage, partition):
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").cuda()
    opt = ZeroAdam(model, **zero_options(stage, partition=partition, bucket_mb=0.01), **HYPER)
    for step in range(STEPS):
        x, y = rank_batch(model, step, rank)
        _, loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _adamw_on_gpu():
    from zerofast.tools.models import make_gpt

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
    assert diff <= fp32_tol(STEPS), f"stage {stage} {partition}: {diff:.3g}"


def _mixed_on_gpu(rank, world, precision, scaler):
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").cuda()
    options = zero_options(3, mixed_precision=precision, **(scaler or {}))  # fp16: LossScalePolicy's fields
    opt = ZeroAdam(model, **options, max_grad_norm=0.5, **HYPER)
    history = []
    for step in range(STEPS):
        x, y = rank_batch(model, step, rank)
        scale = opt.loss_scale
        _, loss = model(x.cuda(), y.cuda())
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        history.append((scale, opt.step_was_skipped))
    torch.cuda.synchronize()
    with opt.gathered_params():
        return {n: p.detach().float().cpu() for n, p in model.named_parameters()}, history


@pytest.mark.parametrize("precision, scaler", [("bf16", None), ("fp16", dict(init_scale=2.0**16, growth_interval=3))])
def test_mixed_precision_nccl_world1_matches_torch(precision, scaler):
    """Stage 3 in bf16, and in fp16 with loss scaling, clipped, on the GPU (the fused CUDA kernel's
    param_copy, nonfinite_check_ on CUDA) against single-process mixed precision on the same GPU."""
    from oracles import single_process_mixed

    got, history = run_ranks(_mixed_on_gpu, 1, args=(precision, scaler), backend="nccl", timeout=300)[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    want, _, want_history = single_process_mixed(
        1, STEPS, dtype, reduce_dtype=dtype, scaler=scaler, max_norm=0.5, device="cuda"
    )
    assert history == [h[:2] for h in want_history]
    diff = max_abs_diff(got, want)
    tol = lp_param_tol(dtype, STEPS, want)  # see the tolerances in tests/tolerances.py
    assert diff <= tol, f"{precision}: {diff:.3g} > {tol:.3g}"


def _syncs_on_gpu(rank, world, precision):
    import warnings

    from zerofast import ZeroAdam
    from zerofast.optim import host_reads
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").cuda()
    opt = ZeroAdam(model, **zero_options(2, bucket_mb=0.01, mixed_precision=precision), max_grad_norm=0.5, **HYPER)
    out = []
    for step in range(3):
        x, y = rank_batch(model, step, rank)
        _, loss = model(x.cuda(), y.cuda())
        opt.backward(loss)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, host_reads.counting() as seam:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        out.append((sum(seam.values()), syncs))
        opt.zero_grad()
    return out


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_step_synchronizes_only_through_its_named_reads(precision):
    """torch's sync debug mode counts what waits for the GPU inside step() (stage 2, clipped): only
    the reads named in [Note: host syncs] (zerofast/optim/host_reads.py), one per step, two with fp16."""
    for reads, syncs in run_ranks(_syncs_on_gpu, 1, args=(precision,), backend="nccl", timeout=300)[0]:
        assert reads == (2 if precision == "fp16" else 1)
        assert len(syncs) == reads, syncs
