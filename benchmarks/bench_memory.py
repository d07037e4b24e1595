"""Resident memory after opt.step(), every system side by side, in units of the fp32 parameter bytes.

The measure (rank 0 of 2 gloo ranks x 1 thread; a GPT of 25.4M fp32 parameters, d=512, 8 blocks;
batch 2 x 64 per rank, so activations are small): the process's resident memory (VmRSS) right after
the last opt.step() of 3 training steps, less its resident memory right before the model was built,
less what a no-communication run of the same precision holds besides tensors:

    overhead  = growth(no comm) - bytes of the no-comm run's tensors (parameters, gradients, AdamW's
                state, counted from the tensors themselves, distinct storages once)
    row value = (growth(row) - overhead) / (4 * numel)

so the no-communication row is its own tensor count by construction (4.0 in fp32), and every other
row is what it holds beyond a plain single-process training loop's non-tensor costs (allocator,
kernels' workspaces, pages of libraries first touched by a training step), which are the same in
every system. The unit is the fp32 form of the ZeRO paper's 16-Phi memory table: parameters 1 +
gradients 1 + Adam 2. Each row stands beside the paper's formula for it (N = 2 ranks):

  fp32   no comm 4; DDP 4, plus its gradient buckets (1); stage 1: 1 + 1 + 2/N = 3;
         stage 2: 1 + 1/N + 2/N = 2.5; stage 3 and FSDP2: (1 + 1 + 2)/N = 2.
  bf16   ZeroAdam (mixed: bf16 parameters and gradients, fp32 master + Adam state, 12 bytes per
         element = 3 units): stage 1: 0.5 + 0.5 + 3/N = 2.5; stage 2: 0.5 + 0.5/N + 3/N = 2.25;
         stage 3: (0.5 + 0.5 + 3)/N = 2. FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
         reduce_dtype=bf16) keeps fp32 sharded parameters, gradients and Adam state: 4/N = 2.
         No comm and DDP in bf16 are *pure* bf16 (model.to(bfloat16) + AdamW, no fp32 master, Adam
         state in bf16): 0.5 + 0.5 + 1 = 2 (DDP: plus 0.5 of buckets) -- not the same arithmetic as
         mixed precision, shown for scale, and the bf16 rows' overhead comes from that run.
  8-bit Adam state ("zeroadam S state_bits=8": MixedPrecisionPolicy(state_bits=8), the moments one
         byte per element each plus an fp32 scale per block of 256, so 2 + 8/256 bytes per element
         = 0.5 + 1/128 units instead of 2): fp32 stage 1: 1 + 1 + 0.508/N = 2.25; stage 2:
         1 + 1.508/N = 1.75; stage 3: 2.508/N = 1.25. bf16 (fp32 master kept, 1.508 units of state
         and master): stage 1: 0.5 + 0.5 + 1.508/N = 1.75; stage 2: 0.5 + 2.008/N = 1.5; stage 3:
         (0.5 + 0.5 + 1.508)/N = 1.25 -- the (2 + 2 + 4 + 2)/N of 16 bytes per parameter of mixed
         precision's table, against 2 for 32-bit state. The padding that aligns each parameter to a
         block (at most 255 elements per tensor) is not in the formulas.
DeepSpeed ZeRO 1/2/3 rows (the ZeroAdam formulas) run only when deepspeed is installed.

Method, identical in every case:
- Every case runs in fresh rank processes (benchmarks/rankpool.RankPool spawns new ones per case),
  so no earlier case's pages, allocator state or lazily loaded libraries are in its RSS.
- Per rank: torch.set_num_threads(1), gloo initialized, every module the case needs imported; then
  gc.collect() and glibc's malloc_trim(0), read VmRSS (/proc/self/status) as the baseline, build the
  model (seed 0, the same on every rank), build the optimizer, and run 3 steps of the plain loop
  (zero_grad(set_to_none=True), forward, backward, step). Right after the last opt.step() (before
  any zero_grad, so gradients are still held), the loss and logits are dropped, gc.collect() and
  malloc_trim(0) run again, and VmRSS is read. malloc_trim is there because glibc keeps the freed
  heap pages of the activations (and of the full model that sharded systems build and then drop)
  resident until trimmed; without it RSS would count memory that no tensor holds.
- pytest-benchmark times the 3 steps (one round each; cheap, the memory is the point). The step
  time in the summary is rank 0's median, timed inside the rank, without the measurement.

Run: .venv/bin/python -m pytest -q benchmarks/bench_memory.py --benchmark-only -s
Rows named "zeroadam S k=v ..." pass those arguments to ZeroAdam (the defaults' alternatives:
stage 2 with 25 MB buckets, as before the buffer budget, and with no bound on its buffers; stage 3
unbounded); state_bits=8 goes to its MixedPrecisionPolicy.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import statistics

import pytest
from rankpool import RankPool

WORLD = 2
BATCH, SEQ = 2, 64
STEPS = 3
D_MODEL = 512  # CONFIGS["small"] with n_embd=512: 25.4M parameters in 92 tensors
GROUP = f"memory after opt.step(): 2 gloo ranks x 1 thread, GPT 25.4M params (d={D_MODEL}), batch {BATCH}x{SEQ}"
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
PRECISIONS = ("fp32", "bf16")

_RESULTS: dict = {}  # (precision, case) -> rank 0's result dict (plus rank 1's growth)


# --- in the rank processes --------------------------------------------------------------------


def _settle() -> None:
    """The same before both readings in every case: collect cycles, give freed heap pages back."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _rss() -> dict:
    """VmRSS and its anonymous / file-backed parts, in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied or viewed tensor counts once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor (FSDP2): this rank's shard
            t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _torch_tensors(model, opt) -> list:
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    return params + [p.grad for p in params] + state


def _torch_bytes(model, opt) -> int:
    return _storage_bytes(_torch_tensors(model, opt))


def _zeroadam_tensor_bytes(opt) -> tuple[int, dict]:
    r = dataclasses.asdict(opt.report().memory)
    keys = ("params", "grad_shard", "optimizer", "master_copy", "grads", "bucket_buffers", "bucket_pool")
    return sum(int(r[k]) for k in keys), {k: int(v) for k, v in r.items()}


def build(case, precision, rank, world):
    """Runs in each rank: baseline RSS, build the case, return a function doing one training step;
    step.info() returns the measurement taken after the last (STEPS-th) step."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerofast import CommPolicy, MixedPrecisionPolicy, ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    kind, _, rest = case.partition(" ")
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    bf16 = precision == "bf16"

    _settle()
    base = _rss()
    model = make_gpt("small", seed=0, n_embd=D_MODEL)
    numel = sum(p.numel() for p in model.parameters())
    module = model
    tensor_bytes = None  # a function: bytes the case's tensors hold now
    report = None

    if kind in ("nocomm", "ddp"):
        if bf16:
            model = model.to(torch.bfloat16)  # pure bf16: no fp32 master anywhere
        if kind == "ddp":
            module = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
        tensor_bytes = functools.partial(_torch_bytes, model, opt)
    elif kind == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
        kw = dict(mesh=mesh, **({"mp_policy": mp} if mp is not None else {}))
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
        tensor_bytes = functools.partial(_torch_bytes, model, opt)
    elif kind == "zeroadam":
        extra = {k: float(v) if k == "bucket_mb" else int(v) for k, v in (kv.split("=") for kv in rest.split()[1:])}
        state_bits = extra.pop("state_bits", 32)
        if state_bits == 32:
            precision_policy = "bf16" if bf16 else None
        else:
            precision_policy = MixedPrecisionPolicy(torch.bfloat16 if bf16 else torch.float32, state_bits=state_bits)
        opt = ZeroAdam(
            model,
            stage=int(rest.split()[0]),
            mixed_precision=precision_policy,
            comm=CommPolicy(**extra),
            **HYPER,
        )  # "k=v" words: CommPolicy's bucket_mb, bucket_buffers; MixedPrecisionPolicy's state_bits

        def tensor_bytes():
            nonlocal report
            total, report = _zeroadam_tensor_bytes(opt)
            return total
    elif kind == "deepspeed":
        cfg = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": int(rest)},
            "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "weight_decay": HYPER["weight_decay"]}},
        }
        if bf16:
            cfg["bf16"] = {"enabled": True}
        module, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        raise ValueError(case)

    def train_step(x, y):
        if kind == "deepspeed":
            logits, loss = module(x, y)
            module.backward(loss)
            module.step()  # zeroes the gradients itself
            return logits, loss
        opt.zero_grad(set_to_none=True)
        logits, loss = module(x, y)
        loss.backward()
        opt.step()
        return logits, loss

    state = {"step": 0, "times": [], "result": None}

    def step():
        x, y = random_batch(model.cfg, BATCH, SEQ, seed=1000 * (state["step"] % 4) + rank)
        t0 = time.perf_counter()
        logits, loss = train_step(x, y)
        state["times"].append(time.perf_counter() - t0)
        state["step"] += 1
        if state["step"] == STEPS:  # right after the last opt.step(), gradients still held
            del logits, loss, x, y
            _settle()
            after = _rss()
            state["result"] = {
                "numel": numel,
                "world": dist.get_world_size(),
                "baseline": base,
                "after": after,
                "growth": after["VmRSS"] - base["VmRSS"],
                "growth_anon": after["RssAnon"] - base["RssAnon"],
                "tensor_bytes": tensor_bytes() if tensor_bytes is not None else None,
                "memory_report": report,
                "step_ms": [1e3 * t for t in state["times"]],
            }

    step.info = lambda: state["result"]
    return step


# --- the cases ------------------------------------------------------------------------------------

CASES = (
    ["nocomm", "ddp", "fsdp2"]
    + [f"zeroadam {s}" for s in (1, 2, 3)]
    + ["zeroadam 2 bucket_mb=25", "zeroadam 2 bucket_mb=25 bucket_buffers=0", "zeroadam 3 bucket_buffers=0"]
    + [f"zeroadam {s} state_bits=8" for s in (1, 2, 3)]
    + [f"deepspeed {s}" for s in (1, 2, 3)]
)

STATE8_UNITS = 0.5 + 2 / 256 / 4  # two 1-byte moments and two fp32 scales per 256 elements, in 4-byte units


def formula(case: str, precision: str, n: int) -> tuple[float, str]:
    """The ZeRO paper's figure for a row, in units of 4 * numel bytes, and how it is made up."""
    kind, _, rest = case.partition(" ")
    stage = int(rest.split()[0]) if rest else None
    if "state_bits=8" in rest:
        q = STATE8_UNITS
        if precision == "fp32":
            return {
                1: (2 + q / n, "1+1+.508/N"),
                2: (1 + (1 + q) / n, "1+1.508/N"),
                3: ((2 + q) / n, "(1+1+.508)/N"),
            }[stage]
        return {
            1: (1 + (1 + q) / n, ".5+.5+1.508/N"),
            2: (0.5 + (1.5 + q) / n, ".5+2.008/N"),
            3: ((2 + q) / n, "(.5+.5+1.508)/N"),
        }[stage]
    if precision == "fp32":
        if kind == "nocomm":
            return 4.0, "1+1+2"
        if kind == "ddp":
            return 4.0, "1+1+2 (+1 buckets)"
        if kind == "fsdp2":
            return 4.0 / n, "(1+1+2)/N"
        return {1: (2 + 2 / n, "1+1+2/N"), 2: (1 + 3 / n, "1+1/N+2/N"), 3: (4 / n, "(1+1+2)/N")}[stage]
    if kind == "nocomm":
        return 2.0, "pure bf16 .5+.5+1"
    if kind == "ddp":
        return 2.0, "pure bf16 .5+.5+1 (+.5 bkt)"
    if kind == "fsdp2":
        return 4.0 / n, "fp32 shards (1+1+2)/N"
    return {1: (1 + 3 / n, ".5+.5+3/N"), 2: (0.5 + 3.5 / n, ".5+.5/N+3/N"), 3: (4 / n, "(.5+.5+3)/N")}[stage]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_memory(benchmark, summary, precision, case):
    if case.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (optional: pip install deepspeed)")
    pool = RankPool(functools.partial(build, case, precision), world=WORLD)
    try:
        benchmark.pedantic(pool.step, rounds=STEPS, warmup_rounds=0, iterations=1)
        infos = pool.info()
    finally:
        pool.close()
    r = dict(infos[0])
    r["growth_rank1"] = infos[1]["growth"]
    _RESULTS[(precision, case)] = r
    phi4 = 4 * r["numel"]
    benchmark.extra_info.update(
        growth_mib=r["growth"] / 2**20,
        growth_rank1_mib=r["growth_rank1"] / 2**20,
        growth_anon_mib=r["growth_anon"] / 2**20,
        numel=r["numel"],
        tensor_units=None if r["tensor_bytes"] is None else r["tensor_bytes"] / phi4,
        formula_units=formula(case, precision, WORLD)[0],
        step_ms_median=statistics.median(r["step_ms"]),
        **({"memory_report": r["memory_report"]} if r["memory_report"] else {}),
    )


# --- the summary ----------------------------------------------------------------------------------


def _overhead(precision: str):
    """Growth of the no-comm run of `precision` (else fp32's) less its tensors: (bytes, whose)."""
    for p in (precision, "fp32"):
        r = _RESULTS.get((p, "nocomm"))
        if r is not None and r["tensor_bytes"] is not None:
            return r["growth"] - r["tensor_bytes"], p
    return None, None


class _Summary:
    def pytest_terminal_summary(self, terminalreporter):
        if not _RESULTS:
            return
        tr = terminalreporter
        tr.write_sep("=", f"zerofast summary: {GROUP}")
        numel = next(iter(_RESULTS.values()))["numel"]
        phi4 = 4 * numel
        tr.write_line(
            f"numel {numel / 1e6:.2f}M; unit = 4*numel bytes = {phi4 / 2**20:.1f} MiB; rank 0; "
            f"RSS read after gc.collect() + malloc_trim(0)"
        )
        for p in PRECISIONS:
            ov, whose = _overhead(p)
            if ov is not None and any(q == p for q, _ in _RESULTS):
                tr.write_line(
                    f"{p} rows: overhead (no-comm {whose} growth less its tensors) = {ov / 2**20:.1f} MiB"
                    f" = {ov / phi4:.3f} units"
                )
        head = (
            f"{'precision':9s} {'case':32s} {'growth MiB':>10s} {'rank1 MiB':>9s} {'measured':>8s} "
            f"{'formula':>7s} {'':27s} {'diff':>6s} {'tensors':>7s} {'step ms':>8s}"
        )
        tr.write_line(head)
        for p in PRECISIONS:
            ov, _ = _overhead(p)
            for c in CASES:
                r = _RESULTS.get((p, c))
                if r is None:
                    continue
                f, ftext = formula(c, p, r["world"])
                meas = None if ov is None else (r["growth"] - ov) / phi4
                tens = "" if r["tensor_bytes"] is None else f"{r['tensor_bytes'] / phi4:7.3f}"
                tr.write_line(
                    f"{p:9s} {c:32s} {r['growth'] / 2**20:10.1f} {r['growth_rank1'] / 2**20:9.1f} "
                    f"{'' if meas is None else f'{meas:8.3f}':>8s} {f:7.3f} {ftext:27s} "
                    f"{'' if meas is None else f'{meas - f:+6.3f}':>6s} {tens:>7s} "
                    f"{statistics.median(r['step_ms']):8.1f}"
                )
        tr.write_line(
            "measured = (growth - overhead) / unit; tensors = the case's own count of its tensors "
            "(ZeroAdam: opt.report().memory, bucket buffers and pool included), same unit"
        )


@pytest.fixture(scope="module")
def summary(request):
    """Registers this file's summary table (a late-registered plugin gets pytest_terminal_summary)."""
    pm = request.config.pluginmanager
    if pm.get_plugin("zerofast_bench_memory_summary") is None:
        pm.register(_Summary(), "zerofast_bench_memory_summary")
    yield
