"""The multi-rank path on one GPU: 2 and 3 gloo ranks sharing cuda:0, and NCCL at world size 1, over
one matrix (stages 1-3, flat and owner layouts, fp32 and bf16, no_sync, overlap_param_gather,
bucket_buffers=1, clipping by norm and by value, a checkpoint save and load), each case against
single-process AdamW on the same GPU. The CUDA tests are marked `cuda` and skip without a GPU and
zerofast's CUDA kernels.

Why gloo: NCCL refuses two ranks on one GPU, but gloo takes CUDA tensors for every collective
zerofast issues on it. ProcessGroupGloo (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, and
ProcessGroupGlooCuda.cpp / ProcessGroupGlooDetail.hpp in newer torch) accepts at::kCUDA in
allreduce, reduce and broadcast: each copies the tensor into pinned host memory on a stream that
waits for the caller's, runs the collective on the host, copies back, and Work::wait() makes the
caller's stream wait for the copy back. zerofast's collectives on gloo (collectives.collective_names)
are all_reduce + broadcast for the flat layout and reduce + broadcast for the owner layouts
(round_robin, greedy), so both layouts run here. What gloo does NOT take with CUDA tensors:
allreduce_coalesced (CPU only), which zerofast issues only for hybrid sharding's replicas when
several ranges are pending, so hybrid sharding is not in this matrix. These ranks exercise what
world size 1 cannot: rank offsets in the layout, the comm side stream waiting on backward's stream
across real cross-rank waits, owners other than rank 0, and stage 3's gathers from other ranks.

The CPU rehearsal, in the normal suite (not marked `cuda`): the same gloo matrix, every case, on 2
ranks on the CPU against single-process AdamW on the CPU, so that this file's code (the rank
functions, the oracles, the API it calls) cannot rot between GPU runs. Every case of the matrix,
so every stage, partition, precision and option the GPU run takes; not the CUDA stream path, nor
the 3-rank launch (2 ranks already have rank offsets, owners other than rank 0 and stage 3's
gathers from another rank). Measured on 2 idle cores, this file alone:
25 cases in 14 s by pytest's count, 16 s of wall time with its start-up (20-23 s with the other
core busy). ZEROFAST_CUDA_RANKS_DEVICE=cpu adds the 3-rank launch (the full rehearsal, 50 cases:
22 s, 25 s of wall time).

Cost on a GPU: one launch per world size runs the whole matrix inside the ranks (the processes, the
CUDA context and the process group are made once); the oracles run in this process on the GPU.
About a minute on one H200 for the three launches together (estimate: tiny GPT, 4 steps per case;
not measured on a GPU yet). Under scripts/gpu_check.sh each launch's timeout ends before the step's
own limit (ZEROFAST_RANKS_DEADLINE, _ranks_timeout), so that a hang is reported by the harness,
naming the ranks that did not finish.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from dataclasses import dataclass, field

import pytest
import torch
from harness import RankFailed, run_ranks
from oracles import single_process_mixed
from tolerances import HYPER, fp32_tol, lp_param_tol, max_abs_diff
from training import global_batch, rank_batch, zero_options

import zerofast

NEEDS_CUDA = pytest.mark.skipif(
    not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
    reason="needs a CUDA GPU and zerofast's CUDA kernels",
)
ON_CUDA = [pytest.mark.cuda, NEEDS_CUDA]
# The reason pytest prints for the two-GPU test on a machine with one GPU: scripts/gpu_check.sh lets
# exactly this skip through (tests/test_gpu_check.py feeds it pytest's own output for that test).
TWO_GPUS = "needs 2 GPUs (NCCL: one rank per GPU)"


def _full_rehearsal() -> bool:
    """ZEROFAST_CUDA_RANKS_DEVICE=cpu: the CPU rehearsal on 3 ranks as well as 2 (the variable's name
    is from when it moved the whole file to the CPU)."""
    value = os.environ.get("ZEROFAST_CUDA_RANKS_DEVICE", "")
    if value not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROFAST_CUDA_RANKS_DEVICE={value!r}: 'cpu' adds 3 ranks to the CPU rehearsal; unset, 2")
    return value == "cpu"


def _gloo_runs() -> list:
    """(device, world) of the gloo matrix: on the GPU 2 and 3 ranks; on the CPU 2 (3 as well under
    the full rehearsal)."""
    runs = [pytest.param("cuda", world, marks=ON_CUDA, id=f"cuda-{world}") for world in (2, 3)]
    return runs + [pytest.param("cpu", world, id=f"cpu-{world}") for world in ((2, 3) if _full_rehearsal() else (2,))]


def _ranks_timeout(default: float) -> float:
    """run_ranks' timeout for one launch: `default`, cut so as to end by ZEROFAST_RANKS_DEADLINE (a Unix
    time) where that is set. scripts/gpu_check.sh sets it some seconds before its step's own limit,
    so that a hang is reported by the harness, naming the ranks that did not finish, rather than by
    the step's kill, which names nothing. A deadline already past still gives the ranks 1 s."""
    deadline = os.environ.get("ZEROFAST_RANKS_DEADLINE", "")
    if not deadline:
        return default
    return max(1.0, min(default, float(deadline) - time.time()))


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


def _build(case: Case, device: str):
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").to(device)
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


def _train(model, opt, case: Case, device: str, rank: int, world: int, steps: range) -> None:
    for step in steps:
        for micro in range(case.micro):
            # Micro-batch k of rank r is the oracle's batch k * world + r of this step.
            x, y = (t.to(device) for t in rank_batch(model, step, micro * world + rank))
            last = micro == case.micro - 1
            with opt.no_sync() if not last else contextlib.nullcontext():
                _, loss = model(x, y)
                (loss / case.micro).backward()
        if case.clip_value:
            opt.clip_grad_value_(CLIP_VALUE)
        opt.step()
        opt.zero_grad()


def _params(model, opt, device: str) -> dict[str, torch.Tensor]:
    if device == "cuda":
        torch.cuda.synchronize()
    # gathered_params() first finishes the gathers still in flight (overlap_param_gather leaves the
    # last step's running).
    with opt.gathered_params():
        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


def _run_case(case: Case, device: str, rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    model, opt = _build(case, device)
    if not case.checkpoint:
        _train(model, opt, case, device, rank, world, range(STEPS))
        return _params(model, opt, device)
    from zerofast import checkpoint

    half = STEPS // 2
    _train(model, opt, case, device, rank, world, range(half))
    path = os.path.join(folder, case.name)
    checkpoint.save(path, model, opt)
    opt.remove_hooks()
    del model, opt
    model, opt = _build(case, device)  # a new model at step 0, then the checkpoint's state
    checkpoint.load(path, model, opt)
    _train(model, opt, case, device, rank, world, range(half, STEPS))
    return _params(model, opt, device)


def _run_matrix(rank: int, world: int, device: str, names: list[str], folder: str) -> dict[str, dict | str]:
    """Each case's parameters, or the traceback of the first case that raised (the later ones are
    not run: a rank that raised may have left the others' collectives out of step)."""
    import traceback

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    by_name = {c.name: c for c in CASES}
    out: dict[str, dict | str] = {}
    for name in names:
        try:
            out[name] = _run_case(by_name[name], device, rank, world, folder)
        except Exception:  # noqa: BLE001 (reported by this case's test; the rest are not run)
            out[name] = f"rank {rank} raised in {name}:\n{traceback.format_exc()}"
            break
    return out


_LAUNCHES: dict[tuple[str, str, int], list | RankFailed] = {}


def _launch(backend: str, device: str, world: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """The whole matrix on `world` ranks, once per (backend, device, world) for every test of the file.
    A launch that failed fails each of its cases with its error, without launching again: a hang
    would otherwise cost its timeout once per case."""
    key = (backend, device, world)
    if key not in _LAUNCHES:
        try:
            with tempfile.TemporaryDirectory(prefix="zerofast-cuda-ranks-") as folder:
                names = [c.name for c in CASES]
                args = (device, names, folder)
                _LAUNCHES[key] = run_ranks(_run_matrix, world, args=args, backend=backend, timeout=_ranks_timeout(240))
        except RankFailed as failed:
            _LAUNCHES[key] = failed
    got = _LAUNCHES[key]
    if isinstance(got, RankFailed):
        pytest.fail(f"the {backend} launch of {world} rank(s) on {device} failed:\n{got}")
    return got


# --- the oracles, in this process, on the ranks' device -----------------------------------------------------


@functools.cache
def _adamw(device: str, world: int, micro: int, clip_norm: bool, clip_value: bool) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW over the global batch (world * micro rank batches per step), clipped as
    torch.nn.utils does."""
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny").to(device)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        x, y = (t.to(device) for t in global_batch(model, step, world * micro))
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
def _bf16(device: str, world: int) -> dict[str, torch.Tensor]:
    return single_process_mixed(world, STEPS, torch.bfloat16, reduce_dtype=torch.bfloat16, device=device)[0]


def _check(case: Case, device: str, world: int, per_rank: list[dict]) -> None:
    if case.precision == "bf16":
        want = _bf16(device, world)
        tol = lp_param_tol(torch.bfloat16, STEPS, want)  # see the tolerances in tests/tolerances.py
    else:
        want = _adamw(device, world, case.micro, case.clip_norm, case.clip_value)
        # fp32_tol assumes a sum of at most 4 gradients per element per step; no_sync sums
        # world * micro of them, each adding its rounding.
        tol = fp32_tol(STEPS) * max(1.0, world * case.micro / 4)
    for rank, results in enumerate(per_rank):
        got = results.get(case.name, f"rank {rank} did not run {case.name}: an earlier case failed")
        if isinstance(got, str):
            pytest.fail(got)
        diff = max_abs_diff(got, want)
        assert diff <= tol, f"{case.name} on {world} {device} rank(s), rank {rank}: {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("device, world", _gloo_runs())
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gloo_ranks_match_adamw(case, device, world):
    _check(case, device, world, _launch("gloo", device, world))


@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_nccl_world1_matches_adamw(case):
    _check(case, "cuda", 1, _launch("nccl", "cuda", 1))


def test_ranks_timeout_ends_by_the_deadline(monkeypatch):
    monkeypatch.delenv("ZEROFAST_RANKS_DEADLINE", raising=False)
    assert _ranks_timeout(240) == 240
    deadline = time.time() + 100
    monkeypatch.setenv("ZEROFAST_RANKS_DEADLINE", str(deadline))
    before = time.time()
    got = _ranks_timeout(240)
    after = time.time()  # bounds that hold however long this process waits for a core in between
    assert deadline - after <= got <= deadline - before, f"deadline in 100 s: timeout {got}"
    monkeypatch.setenv("ZEROFAST_RANKS_DEADLINE", str(time.time() + 1000))
    assert _ranks_timeout(240) == 240
    monkeypatch.setenv("ZEROFAST_RANKS_DEADLINE", str(time.time() - 5))
    assert _ranks_timeout(240) == 1.0


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
    return _params(model, opt, "cuda")


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


# The two-GPU skip is evaluated first (pytest takes the mark nearest the function first), so that its
# reason is the one printed on a machine without a GPU as on one with a single GPU (see TWO_GPUS).
@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=TWO_GPUS)
def test_stage3_reduces_and_gathers_on_two_gpus_neither_hang_nor_drift():
    """[Note: two communicators on one comm stream] in zerofast/comm.py, on 2 NCCL ranks: rank 0's
    last unit fills its bucket in backward (its reduce issued before the re-gathers of the earlier
    units), rank 1's only at step() (after them). A deadlock shows as the harness's timeout,
    naming the ranks still running; a mix-up as a difference from AdamW."""
    steps = 3
    got = run_ranks(_uneven_stage3_nccl, 2, args=(steps,), backend="nccl", timeout=_ranks_timeout(120))
    want = _uneven_adamw(2, steps)
    for rank, params in enumerate(got):
        diff = max_abs_diff(params, want)
        assert diff <= fp32_tol(steps), f"rank {rank}: {diff:.3g}"
