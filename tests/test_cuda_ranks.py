"""The multi-rank path on one GPU: 2 and 3 gloo ranks sharing cuda:0, and NCCL at world size 1, over
one matrix (stages 1-3, flat and owner layouts, fp32 and bf16, no_sync, overlap_param_gather,
bucket_buffers=1, clipping by norm and by value, a checkpoint save and load), each case against
single-process AdamW on the same GPU. Skips without a GPU and zerofast's CUDA kernels.

Why gloo: NCCL refuses two ranks on one GPU, but gloo takes CUDA tensors for every collective
zerofast issues on it. ProcessGroupGloo (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, and
ProcessGroupGlooCuda.cpp / ProcessGroupGlooDetail.hpp in newer torch) accepts at::kCUDA in
allreduce, reduce and broadcast: each copies the tensor into pinned host memory on a stream that
waits for the caller's, runs the collective on the host, copies back, and Work::wait() makes the
caller's stream wait for the copy back. zerofast's collectives on gloo (config.collective_names)
are all_reduce + broadcast for the flat layout and reduce + broadcast for the owner layouts
(round_robin, greedy), so both layouts run here. What gloo does NOT take with CUDA tensors:
allreduce_coalesced (CPU only), which zerofast issues only for hybrid sharding's replicas when
several ranges are pending, so hybrid sharding is not in this matrix. These ranks exercise what
world size 1 cannot: rank offsets in the layout, the comm side stream waiting on backward's stream
across real cross-rank waits, owners other than rank 0, and stage 3's gathers from other ranks.

Cost: one launch per world size runs the whole matrix inside the ranks (the processes, the CUDA
context and the process group are made once); the oracles run in this process on the GPU. About a
minute on one H200 for the three launches together (estimate: tiny GPT, 4 steps per case).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from dataclasses import dataclass, field

import pytest
import torch
from harness import run_ranks
from oracles import (
    HYPER,
    fp32_tol,
    global_batch,
    lp_param_tol,
    max_abs_diff,
    rank_batch,
    single_process_mixed,
    zero_options,
)

import zerofast

# ZEROFAST_CUDA_RANKS_DEVICE=cpu rehearses the gloo half of this file on the CPU (the same matrix
# and oracles, the CUDA stream path aside), so that a machine without a GPU can check the file itself.
DEVICE = os.environ.get("ZEROFAST_CUDA_RANKS_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        ON_GPU and not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
        reason="needs a CUDA GPU and zerofast's CUDA kernels",
    ),
]

STEPS = 4
CLIP_NORM = 0.05  # below the tiny GPT's gradient norm in these steps, so clipping acts
CLIP_VALUE = 0.002  # clamps some elements of every step's averaged gradient (as test_trainer_api)


@dataclass(frozen=True)
class Case:
    """One training run of the matrix."""

    stage: int
    partition: str = "flat"
    precision: str | None = None  # None: fp32; "bf16"
    micro: int = 1  # micro-batches per step (more than 1: all but the last under no_sync())
    options: dict = field(default_factory=dict, hash=False)  # more zero_options keywords
    clip_norm: bool = False  # ZeroAdam(max_grad_norm=CLIP_NORM)
    clip_value: bool = False  # opt.clip_grad_value_(CLIP_VALUE) before each step
    checkpoint: bool = False  # save after STEPS // 2, load into a new model and optimizer, go on

    @property
    def name(self) -> str:
        parts = [f"s{self.stage}", self.partition, self.precision or "fp32"]
        parts += [f"{k}={v}" for k, v in self.options.items()]
        parts += ["no_sync"] * (self.micro > 1) + ["clip_norm"] * self.clip_norm + ["clip_value"] * self.clip_value
        return "-".join(parts + ["checkpoint"] * self.checkpoint)


def _matrix() -> list[Case]:
    cases = [
        Case(stage, partition, precision)
        for stage in (1, 2, 3)
        for partition in ("flat", "round_robin")
        for precision in (None, "bf16")
    ]
    cases += [Case(stage, micro=2) for stage in (1, 2, 3)]
    cases += [
        Case(1, options=dict(overlap_param_gather=True)),
        Case(2, "round_robin", options=dict(overlap_param_gather=True)),
        Case(2, options=dict(bucket_buffers=1)),
        Case(3, "round_robin", options=dict(bucket_buffers=1)),
        Case(2, clip_norm=True),
        Case(3, "round_robin", clip_norm=True),
        Case(1, clip_value=True),
        Case(3, clip_value=True),
        Case(2, checkpoint=True),
        Case(3, "round_robin", checkpoint=True),
    ]
    return cases


CASES = _matrix()


# --- inside the ranks ---------------------------------------------------------------------------------


def _build(case: Case):
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").to(DEVICE)
    # Small buckets (stages 1, 2) and one unit per block (stage 3): several collectives per step.
    options = zero_options(
        case.stage,
        partition=case.partition,
        bucket_mb=0.01,
        min_unit_mb=0 if case.stage == 3 else None,
        mixed_precision=case.precision,
        **case.options,
    )
    clip = dict(max_grad_norm=CLIP_NORM) if case.clip_norm else {}
    return model, ZeroAdam(model, **options, **clip, **HYPER)


def _train(model, opt, case: Case, rank: int, world: int, steps: range) -> None:
    for step in steps:
        for micro in range(case.micro):
            # Micro-batch k of rank r is the oracle's batch k * world + r of this step.
            x, y = (t.to(DEVICE) for t in rank_batch(model, step, micro * world + rank))
            last = micro == case.micro - 1
            with opt.no_sync() if not last else contextlib.nullcontext():
                _, loss = model(x, y)
                (loss / case.micro).backward()
        if case.clip_value:
            opt.clip_grad_value_(CLIP_VALUE)
        opt.step()
        opt.zero_grad()


def _params(model, opt) -> dict[str, torch.Tensor]:
    opt.quiesce()  # overlap_param_gather: the last gather may still be in flight
    if ON_GPU:
        torch.cuda.synchronize()
    with opt.gathered_params():
        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


def _run_case(case: Case, rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    model, opt = _build(case)
    if not case.checkpoint:
        _train(model, opt, case, rank, world, range(STEPS))
        return _params(model, opt)
    from zerofast import checkpoint

    half = STEPS // 2
    _train(model, opt, case, rank, world, range(half))
    path = os.path.join(folder, case.name)
    checkpoint.save(path, model, opt)
    opt.remove_hooks()
    del model, opt
    model, opt = _build(case)  # a new model at step 0, then the checkpoint's state
    checkpoint.load(path, model, opt)
    _train(model, opt, case, rank, world, range(half, STEPS))
    return _params(model, opt)


def _run_matrix(rank: int, world: int, names: list[str], folder: str) -> dict[str, dict | str]:
    """Each case's parameters, or the traceback of the first case that raised (the later ones are
    not run: a rank that raised may have left the others' collectives out of step)."""
    import traceback

    if ON_GPU:
        torch.cuda.set_device(0)  # every rank on the one GPU
    by_name = {c.name: c for c in CASES}
    out: dict[str, dict | str] = {}
    for name in names:
        try:
            out[name] = _run_case(by_name[name], rank, world, folder)
        except Exception:  # noqa: BLE001 (reported by this case's test; the rest are not run)
            out[name] = f"rank {rank} raised in {name}:\n{traceback.format_exc()}"
            break
    return out


@functools.cache
def _launch(backend: str, world: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """The whole matrix on `world` ranks, once per (backend, world) for every test of the file."""
    with tempfile.TemporaryDirectory(prefix="zerofast-cuda-ranks-") as folder:
        return run_ranks(_run_matrix, world, args=([c.name for c in CASES], folder), backend=backend, timeout=240)


# --- the oracles, in this process, on the GPU -------------------------------------------------------------


@functools.cache
def _adamw_on_gpu(world: int, micro: int, clip_norm: bool, clip_value: bool) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW over the global batch (world * micro rank batches per step), clipped as
    torch.nn.utils does."""
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        x, y = (t.to(DEVICE) for t in global_batch(model, step, world * micro))
        _, loss = model(x, y)
        loss.backward()
        if clip_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


@functools.cache
def _bf16_on_gpu(world: int) -> dict[str, torch.Tensor]:
    return single_process_mixed(world, STEPS, torch.bfloat16, reduce_dtype=torch.bfloat16, device=DEVICE)[0]


def _check(case: Case, world: int, per_rank: list[dict]) -> None:
    if case.precision == "bf16":
        want = _bf16_on_gpu(world)
        tol = lp_param_tol(torch.bfloat16, STEPS, want)  # see the tolerances in tests/oracles.py
    else:
        want = _adamw_on_gpu(world, case.micro, case.clip_norm, case.clip_value)
        # fp32_tol assumes a sum of at most 4 gradients per element per step; no_sync sums
        # world * micro of them, each adding its rounding.
        tol = fp32_tol(STEPS) * max(1.0, world * case.micro / 4)
    for rank, results in enumerate(per_rank):
        got = results.get(case.name, f"rank {rank} did not run {case.name}: an earlier case failed")
        if isinstance(got, str):
            pytest.fail(got)
        diff = max_abs_diff(got, want)
        assert diff <= tol, f"{case.name} on {world} rank(s), rank {rank}: {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gloo_ranks_sharing_one_gpu_match_adamw(case, world):
    _check(case, world, _launch("gloo", world))


@pytest.mark.skipif(not ON_GPU, reason="NCCL needs the GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_nccl_world1_matches_adamw(case):
    _check(case, 1, _launch("nccl", 1))


# --- several GPUs: the two communicators on one comm stream ------------------------------------------------


class _Rank0Shift(torch.nn.Module):
    """The GPT's last block, plus a shift of its output that only rank 0 applies (`active`): that
    block's unit is the first whose gradients complete in backward, on rank 0 only."""

    def __init__(self, block: torch.nn.Module, width: int):
        super().__init__()
        self.block = block
        self.shift = torch.nn.Parameter(torch.full((width,), 0.01))
        self.active = True

    def forward(self, x):
        out = self.block(x)
        return out + self.shift if self.active else out


def _uneven_gpt():
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny")
    model.blocks[-1] = _Rank0Shift(model.blocks[-1], model.cfg.n_embd)
    return model


def _uneven_stage3_nccl(rank, world, steps):
    from zerofast import ZeroAdam

    model = _uneven_gpt().cuda()
    model.blocks[-1].active = rank == 0
    opt = ZeroAdam(model, **zero_options(3, min_unit_mb=0), **HYPER)
    for step in range(steps):
        x, y = (t.cuda() for t in rank_batch(model, step, rank))
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return _params(model, opt)


def _uneven_adamw(world: int, steps: int) -> dict[str, torch.Tensor]:
    model = _uneven_gpt().cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(steps):
        for r in range(world):  # the loss averaged over what each rank computes
            model.blocks[-1].active = r == 0
            (model(*(t.cuda() for t in rank_batch(model, step, r)))[1] / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one rank per GPU)")
def test_stage3_reduces_and_gathers_on_two_gpus_neither_hang_nor_drift():
    """[Note: two communicators on one comm stream] in zerofast/comm.py, on 2 NCCL ranks: rank 0's
    last unit fills its bucket in backward (its reduce issued before the re-gathers of the earlier
    units), rank 1's only at step() (after them). A deadlock shows as the harness's timeout,
    naming the ranks still running; a mix-up as a difference from AdamW."""
    steps = 3
    got = run_ranks(_uneven_stage3_nccl, 2, args=(steps,), backend="nccl", timeout=120)
    want = _uneven_adamw(2, steps)
    for rank, params in enumerate(got):
        diff = max_abs_diff(params, want)
        assert diff <= fp32_tol(steps), f"rank {rank}: {diff:.3g}"
