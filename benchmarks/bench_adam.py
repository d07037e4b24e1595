"""zerofast.fused_adam_ against torch's AdamW on one flat parameter (50M elements on CPU, 500M on
GPU; ZEROFAST_BENCH_NUMEL overrides), fp32 and mixed precision (bf16 gradient in, bf16 weights out).

Effective GB/s counts the bytes an ideal step must move: fp32, 28 per element (read param, grad,
exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq); mixed precision, 28 as well (the gradient
read and the weights written are bf16: 2 + 2 + 24). The machine's in-place streaming bandwidth is
measured in the same run as `a.add_(b)` on the same size, counted as 12 bytes per element.

The 8-bit rows (test_zerofast_8bit, test_anchor_adamw8bit) put zerofast's fused_adam_8bit_ beside
the fp32 step and beside torchao's and bitsandbytes' AdamW8bit (block 256 all, the same
hyperparameters, one flat parameter). An anchor that raises on this device is recorded with the
error it raised (the summary's "not run" line) instead of a time.

    make bench        # or: pytest benchmarks/bench_adam.py --benchmark-only
"""

import os
import statistics
import time

import pytest
import torch

import zerofast
from zerofast.quant import dynamic_code

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and zerofast.has_cuda_kernels() else [])
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def numel_for(device: str) -> int:
    default = 500_000_000 if device == "cuda" else 50_000_000
    return int(os.environ.get("ZEROFAST_BENCH_NUMEL", default))


BLOCK = 256  # the 8-bit rows' block, zerofast's and the anchors' default


def numel_8bit(device: str) -> int:
    """The 8-bit rows' size: numel_for's rounded down to whole blocks, which the anchors need to
    quantize at all (quantized_anchor)."""
    return numel_for(device) // BLOCK * BLOCK


def run(benchmark, device, fn, rounds=15):
    def timed():
        fn()
        if device == "cuda":
            torch.cuda.synchronize()

    fn()  # warm-up: first-touch page faults, lazy state allocation, kernel load
    benchmark.pedantic(timed, rounds=rounds, warmup_rounds=1, iterations=1)


class FlatState:
    """One flat parameter with its gradient and fp32 moments, filled with random data."""

    def __init__(self, n, device, grad_dtype=torch.float32):
        g = torch.Generator(device=device).manual_seed(0)
        self.param = torch.randn(n, device=device, generator=g)
        self.grad = torch.randn(n, device=device, generator=g).to(grad_dtype)
        self.exp_avg = torch.zeros(n, device=device)
        self.exp_avg_sq = torch.zeros(n, device=device)
        self.step = 0

    def zerofast_step(self, param_copy=None):
        self.step += 1
        zerofast.fused_adam_(
            self.param,
            self.grad,
            self.exp_avg,
            self.exp_avg_sq,
            lr=HYPER["lr"],
            beta1=HYPER["betas"][0],
            beta2=HYPER["betas"][1],
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            step=self.step,
            param_copy=param_copy,
        )


def torch_optimizer(n, device, **kw):
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    return p, torch.optim.AdamW([p], **HYPER, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_stream_bandwidth(benchmark, record, device):
    n = numel_for(device)
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    run(benchmark, device, lambda: a.add_(b))
    record(benchmark, f"adam fp32 {device} {n / 1e6:.0f}M", "stream a.add_(b)", 12 * n)
    record(benchmark, f"adam mixed {device} {n / 1e6:.0f}M", "stream a.add_(b)", 12 * n)


@pytest.mark.parametrize("device", DEVICES)
def test_zerofast_fp32(benchmark, record, device):
    n = numel_for(device)
    s = FlatState(n, device)
    run(benchmark, device, s.zerofast_step)
    record(
        benchmark,
        f"adam fp32 {device} {n / 1e6:.0f}M",
        f"zerofast fused_adam_ ({zerofast.cpu_isa() if device == 'cpu' else 'cuda'})",
        28 * n,
    )


class FlatState8(FlatState):
    """The same parameter and gradient with 8-bit moments (block 256, [Note: quantized state])."""

    def __init__(self, n, device, grad_dtype=torch.float32, block=BLOCK):
        super().__init__(n, device, grad_dtype)
        blocks = -(-n // block)
        self.exp_avg = torch.zeros(n, dtype=torch.uint8, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.uint8, device=device)
        self.scales = (torch.zeros(blocks, device=device), torch.zeros(blocks, device=device))
        self.codes = (dynamic_code(True).to(device), dynamic_code(False).to(device))
        self.block = block

    def zerofast_step(self, param_copy=None):
        self.step += 1
        zerofast.fused_adam_8bit_(
            self.param,
            self.grad,
            self.exp_avg,
            self.exp_avg_sq,
            *self.scales,
            *self.codes,
            block=self.block,
            lr=HYPER["lr"],
            beta1=HYPER["betas"][0],
            beta2=HYPER["betas"][1],
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            step=self.step,
            param_copy=param_copy,
        )


@pytest.mark.parametrize("device", DEVICES)
def test_zerofast_8bit(benchmark, record, device):
    """Side by side with test_zerofast_fp32: the same step with 8-bit moments moves 16 bytes per
    element (param and grad read, param written, 4 bytes each; the two moments read and written, 1
    byte each; the scales 1/32 byte) instead of 28; the count below stays 28, the fp32 step's, so
    the two rows' GB/s compare their times directly."""
    n = numel_for(device)
    s = FlatState8(numel_8bit(device), device)
    run(benchmark, device, s.zerofast_step)
    isa = zerofast.cpu_isa() if device == "cpu" else "cuda"
    record(benchmark, f"adam fp32 {device} {n / 1e6:.0f}M", f"zerofast fused_adam_8bit_ ({isa})", 28 * s.param.numel())


def anchor_adamw8bit(name: str):
    """The AdamW8bit class of an anchor library: torchao's (block 256 by default, its step compiled
    by torch.compile on first use) or bitsandbytes' (block-wise, block 256 on CPU and GPU)."""
    if name == "torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit
    from bitsandbytes.optim import AdamW8bit

    return AdamW8bit


def quantized_anchor(library: str, n: int, device: str):
    """An anchor's AdamW8bit over one flat parameter of n elements, after its first step (which
    allocates the state, and compiles torchao's), checked to keep its moments in 8 bits: torchao
    0.18 quietly keeps fp32 moments for a tensor whose size is not a multiple of its block (256;
    50M elements is not), and so would time plain AdamW. Raises with the reason where it does not."""
    p, _ = torch_optimizer(n, device)
    opt = anchor_adamw8bit(library)([p], **HYPER)
    opt.step()
    state = opt.state[p]
    moments = [v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq", "state1", "state2")]
    if not moments or any(type(m) is torch.Tensor and m.dtype != torch.uint8 for m in moments):
        kinds = ", ".join(f"{k} {type(v).__name__} {getattr(v, 'dtype', '')}" for k, v in state.items())
        raise RuntimeError(f"its state over {n:,} elements is not 8-bit ({kinds})")
    return opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("library", ["torchao", "bitsandbytes"])
def test_anchor_adamw8bit(benchmark, record, record_not_run, device, library):
    """torchao's and bitsandbytes' AdamW8bit on the same flat parameter as test_zerofast_8bit, bytes
    counted as the fp32 step's (28 per element) so the GB/s column compares times. Where the anchor
    does not run on this device, the error it raised is recorded and the case skipped."""
    n = numel_for(device)
    group = f"adam fp32 {device} {n / 1e6:.0f}M"
    try:
        opt = quantized_anchor(library, numel_8bit(device), device)
    except Exception as e:  # the anchor's own error, whatever its type: recorded, not hidden
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        record_not_run(group, f"{library} AdamW8bit", reason)
        pytest.skip(f"{library} AdamW8bit does not run on {device}: {reason}")
    run(benchmark, device, opt.step, rounds=5)
    version = __import__(library).__version__
    record(benchmark, group, f"{library} {version} AdamW8bit", 28 * numel_8bit(device))


# The cache-resident size of test_8bit_interleaved: 64K elements, 1 MiB of fp32 state (param, grad
# and the two moments) or 640 KiB of 8-bit, inside the L2 caches of the threads that share it.
IN_CACHE = 65_536


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["memory", "cache"])
def test_8bit_interleaved(benchmark, record_ratios, device, where):
    """The ratios of the 8-bit rows, robust to a machine shared with other work: each round runs the
    fp32 fused step, zerofast's 8-bit step and torchao's AdamW8bit (where it runs) once each, in an
    order that rotates, so every case sees the same load; the medians over the rounds and their
    ratios to the fp32 step go to the summary. (bitsandbytes' CPU step, two orders of magnitude
    slower, stays in test_anchor_adamw8bit.)

    where="memory" steps the 50M-element parameter; where="cache" a 64K-element one that stays in
    cache, each timing covering enough steps for 50M elements in all (so each step's fixed cost, the
    Python call and the kernel launch, is in it too). A step's time per element in cache is what its
    arithmetic costs: the fp32 step's is below its 50M time (it waits on memory there), the 8-bit
    step's about equal to its 50M time (it is bound by its arithmetic, the lookups of its codes), so
    moving fewer bytes does not make it faster on CPU (docs/8bit-state.md, "Speed")."""
    n = numel_8bit(device) if where == "memory" else IN_CACHE
    repeats = max(1, numel_for(device) // n)
    fp32, q8 = FlatState(n, device), FlatState8(n, device)
    cases = {"zerofast fused_adam_ (fp32)": fp32.zerofast_step, "zerofast fused_adam_8bit_": q8.zerofast_step}
    try:
        cases["torchao AdamW8bit"] = quantized_anchor("torchao", n, device).step
    except Exception as e:  # recorded below instead of a time
        cases_error = f"torchao AdamW8bit not run: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    else:
        cases_error = None
    times = {name: [] for name in cases}
    names = list(cases)

    def one_round():
        for name in names:
            t0 = time.perf_counter()
            for _ in range(repeats):
                cases[name]()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / repeats)
        names.append(names.pop(0))  # the next round starts with the next case

    for step in cases.values():
        step()  # warm-up
    benchmark.pedantic(one_round, rounds=15, warmup_rounds=0, iterations=1)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["zerofast fused_adam_ (fp32)"]
    lines = [
        f"{name:44s} {1e3 * m:10.3f} ms {1e9 * m / n:8.3f} ns/element {m / base:8.2f}x the fp32 step"
        for name, m in medians.items()
    ]
    if cases_error:
        lines.append(cases_error)
    threads = torch.get_num_threads() if device == "cpu" else "-"
    record_ratios(
        f"8-bit side by side, interleaved rounds: {device} {n:,} elements ({where}), {threads} threads", lines
    )
    benchmark.extra_info.update({f"{name} ms": 1e3 * m for name, m in medians.items()})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["fused", "foreach", "for-loop"])
def test_torch_adamw_fp32(benchmark, record, device, variant):
    n = numel_for(device)
    kw = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[variant]
    p, opt = torch_optimizer(n, device, **kw)
    run(benchmark, device, opt.step, rounds=15 if variant == "fused" else 5)
    record(benchmark, f"adam fp32 {device} {n / 1e6:.0f}M", f"torch AdamW {variant}", 28 * n)


@pytest.mark.parametrize("device", DEVICES)
def test_zerofast_mixed(benchmark, record, device):
    n = numel_for(device)
    s = FlatState(n, device, grad_dtype=torch.bfloat16)
    weights = torch.empty(n, dtype=torch.bfloat16, device=device)
    run(benchmark, device, lambda: s.zerofast_step(param_copy=weights))
    record(benchmark, f"adam mixed {device} {n / 1e6:.0f}M", "zerofast bf16 grad in, bf16 weights out", 28 * n)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_mixed(benchmark, record, device):
    """torch's fastest way to the same result: bf16 grad copied into a preallocated fp32 buffer,
    fused AdamW, fp32 weights copied out to bf16."""
    n = numel_for(device)
    p, opt = torch_optimizer(n, device, fused=True)
    grad_bf16 = torch.randn(n, device=device).bfloat16()
    weights = torch.empty(n, dtype=torch.bfloat16, device=device)

    def step():
        p.grad.copy_(grad_bf16)
        opt.step()
        weights.copy_(p.detach())

    run(benchmark, device, step)
    record(benchmark, f"adam mixed {device} {n / 1e6:.0f}M", "torch copy-in + fused AdamW + copy-out", 28 * n)
