"""Kernel layer: zerofast.fused_adam_ against torch.optim.AdamW / Adam (the oracle), opcheck, errors.

CPU and CUDA share one helper per property (`_check_x(device)`); the CUDA cases skip where there is
no GPU or no CUDA kernels.
"""

import math
import os

import pytest
import torch
from oracles import opcheck_adam_op

import zerofast

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
STEPS = 20

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
    reason="needs a CUDA GPU and zerofast's CUDA kernels",
)
DEVICES = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error max|out - ref| / max|ref| (0 for two empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    scale = ref.double().abs().max().item() or 1.0
    return (out.double() - ref.double()).abs().max().item() / scale


def awkward_values(n: int, gen: torch.Generator, huge: float = 1e15) -> torch.Tensor:
    """Random values with exact zeros, tiny (1e-30) and huge entries mixed in.

    Gradients use huge=1e15, the largest decade whose square (the second moment) stays finite in fp32.
    """
    x = torch.randn(n, generator=gen)
    if n >= 8:
        x[::7] = 0.0
        x[1::11] *= 1e-30
        x[2::13] *= huge
    return x


def run_both(
    device,
    n,
    *,
    adamw=True,
    weight_decay=0.1,
    grad_dtype=torch.float32,
    grad_scale=None,
    param_copy_dtype=None,
    steps=STEPS,
    seed=0,
):
    """Run `steps` steps of fused_adam_ and of torch's optimizer on the same gradients."""
    gen = torch.Generator().manual_seed(seed)
    init = awkward_values(n, gen, huge=1e20)
    param = init.clone().to(device)
    exp_avg = torch.zeros(n, device=device)
    exp_avg_sq = torch.zeros(n, device=device)
    copy = None if param_copy_dtype is None else torch.empty(n, dtype=param_copy_dtype, device=device)
    ref = init.clone().to(device).requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(
        [ref],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=weight_decay,
        foreach=False,
    )
    for step in range(1, steps + 1):
        # fp16 tops out at 65504: its huge gradients are 1e3 times a normal draw.
        huge = 1e3 if grad_dtype == torch.float16 else 1e15
        grad = awkward_values(n, gen, huge=huge).to(device).to(grad_dtype)
        zerofast.fused_adam_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            **HYPER,
            weight_decay=weight_decay,
            step=step,
            adamw=adamw,
            grad_scale=grad_scale,
            param_copy=copy,
        )
        scale = 1.0 if grad_scale is None else float(grad_scale)
        ref.grad = grad.float() * scale
        opt.step()
    state = opt.state[ref]
    return (param, exp_avg, exp_avg_sq, copy), (ref.detach(), state["exp_avg"], state["exp_avg_sq"])


def assert_matches(ours, ref, tol=1e-6):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours[:3], ref):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        assert rel_err(a, b) <= tol, f"{name}: relative error {rel_err(a, b):.3g} > {tol}"


# --- agreement with torch -----------------------------------------------------------------------


def _check_adamw_and_adam(device, adamw, n):
    ours, ref = run_both(device, n, adamw=adamw)
    assert_matches(ours, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("n", [0, 1, 3, 17, 1000, 70_001])
def test_matches_torch(device, adamw, n):
    _check_adamw_and_adam(device, adamw, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_dtypes(device, grad_dtype):
    # The oracle receives the same low-precision gradient, upcast: only storage differs.
    ours, ref = run_both(device, 4099, grad_dtype=grad_dtype)
    assert_matches(ours, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_grad_scale(device, as_tensor):
    scale = 0.125 if not as_tensor else torch.tensor([0.125], device=device)
    ours, ref = run_both(device, 5003, grad_scale=scale)
    assert_matches(ours, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_param_copy(device, copy_dtype):
    ours, ref = run_both(device, 3001, param_copy_dtype=copy_dtype)
    assert_matches(ours, ref)
    param, copy = ours[0], ours[3]
    finite = param.abs() < 6e4 if copy_dtype == torch.float16 else torch.ones_like(param, dtype=torch.bool)
    # The copy is the updated fp32 parameter rounded (to nearest even) by torch's own cast.
    assert torch.equal(copy[finite], param.to(copy_dtype)[finite])


# --- follow_copy: the master takes what was written into the copy --------------------------------


def _check_follow_copy(device, copy_dtype, quantized):
    """An element whose copy was written (no longer the master's rounding) steps from the copy's value;
    every other from its master: bitwise the same step on a master where those elements were set."""
    from zerofast.quant import dynamic_code, num_blocks

    n, block = 3001, 256
    g = torch.Generator().manual_seed(3)
    master = torch.randn(n, generator=g).to(device)
    grad = torch.randn(n, generator=g).to(device)
    copy = master.to(copy_dtype)
    written = torch.arange(n, device=device) % 5 == 0
    copy[written] = (torch.randn(n, generator=g).to(device) * 3).to(copy_dtype)[written]
    # The oracle: the master set to the written values first; their rounding is then the copy again.
    expected = torch.where(written, copy.float(), master) if copy_dtype != torch.float32 else copy.clone()

    def step(param, param_copy, follow):
        kw = dict(weight_decay=0.1, step=3, param_copy=param_copy, follow_copy=follow, **HYPER)
        if quantized:
            q = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(2)]
            scales = [torch.zeros(num_blocks(n, block), device=device) for _ in range(2)]
            codes = [dynamic_code(True).to(device), dynamic_code(False).to(device)]
            zerofast.fused_adam_8bit_(param, grad, *q, *scales, *codes, block=block, **kw)
        else:
            zerofast.fused_adam_(param, grad, torch.zeros(n, device=device), torch.zeros(n, device=device), **kw)

    ref_copy = expected.to(copy_dtype)
    step(expected, ref_copy, False)
    step(master, copy, True)
    assert torch.equal(master, expected)
    assert torch.equal(copy, ref_copy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32-state", "8bit-state"])
def test_follow_copy(device, copy_dtype, quantized):
    _check_follow_copy(device, copy_dtype, quantized)


def test_follow_copy_every_isa(monkeypatch):
    for isa in ("portable", "avx2", "avx512"):
        monkeypatch.setenv("ZEROFAST_CPU_ISA", isa)
        try:
            zerofast.cpu_isa()
        except RuntimeError:
            continue
        for quantized in (False, True):
            _check_follow_copy("cpu", torch.bfloat16, quantized)


# --- found_inf ----------------------------------------------------------------------------------


def _check_found_inf(device, bad_value, where, grad_dtype):
    n = 1001
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(n, generator=gen).to(device)
    exp_avg = torch.randn(n, generator=gen).abs().to(device)
    exp_avg_sq = torch.randn(n, generator=gen).abs().to(device)
    copy = torch.zeros(n, dtype=torch.bfloat16, device=device)
    grad = torch.randn(n, generator=gen).to(device).to(grad_dtype)
    grad[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = bad_value
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq, copy)]
    found_inf = torch.zeros(1, device=device)
    zerofast.fused_adam_(
        param, grad, exp_avg, exp_avg_sq, **HYPER, weight_decay=0.1, step=4, found_inf=found_inf, param_copy=copy
    )
    assert found_inf.item() == 1.0
    for b, a in zip(before, (param, exp_avg, exp_avg_sq, copy)):
        assert torch.equal(a, b), "a step with a non-finite gradient must change nothing"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_found_inf_skips_everything(device, bad_value, where, grad_dtype):
    _check_found_inf(device, bad_value, where, grad_dtype)


def _check_found_inf_clean(device):
    ours_found = torch.zeros(1, device=device)
    n = 777
    gen = torch.Generator().manual_seed(5)
    p1 = torch.randn(n, generator=gen).to(device)
    g = torch.randn(n, generator=gen).to(device)
    p2 = p1.clone()
    m1, v1, m2, v2 = (torch.zeros(n, device=device) for _ in range(4))
    zerofast.fused_adam_(p1, g, m1, v1, **HYPER, weight_decay=0.0, step=1, found_inf=ours_found)
    zerofast.fused_adam_(p2, g, m2, v2, **HYPER, weight_decay=0.0, step=1)
    assert ours_found.item() == 0.0
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)
    # A flag already set (by an earlier bucket of the same step) skips the update too.
    ours_found.fill_(1.0)
    before = p1.clone()
    zerofast.fused_adam_(p1, g, m1, v1, **HYPER, weight_decay=0.0, step=2, found_inf=ours_found)
    assert torch.equal(p1, before)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_clean_step_updates(device):
    _check_found_inf_clean(device)


def test_scaled_overflow_counts_as_inf():
    # A finite gradient that the scale pushes to inf is what the update would use: it must skip.
    n = 10
    g = torch.full((n,), 3e38)
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    found = torch.zeros(1)
    zerofast.fused_adam_(p, g, m, v, **HYPER, weight_decay=0.0, step=1, grad_scale=4.0, found_inf=found)
    assert found.item() == 1.0 and torch.equal(p, torch.ones(n))


# --- nonfinite_check_: the same check alone (ZeroAdam's overflow agreement) -----------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_value", [None, math.inf, -math.inf, math.nan], ids=["clean", "inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 1000, 70_000])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_check(device, bad_value, where, grad_dtype):
    g = torch.randn(70_001, device=device).to(grad_dtype)
    if bad_value is not None:
        g[where] = bad_value
    found = torch.zeros(1, device=device)
    zerofast.nonfinite_check_(g, found)
    assert found.item() == (0.0 if bad_value is None else 1.0)
    if bad_value is None:  # a flag set by an earlier call is kept, never cleared
        found.fill_(1.0)
        zerofast.nonfinite_check_(g, found)
        assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_check_opcheck_and_errors(device):
    torch.library.opcheck(
        torch.ops.zerofast.nonfinite_check_.default,
        (torch.randn(33, device=device).half(), torch.zeros(1, device=device)),
    )
    with pytest.raises(RuntimeError, match="found_inf must be a 1-element float32 tensor; got dtype Half"):
        zerofast.nonfinite_check_(torch.randn(4, device=device), torch.zeros(1, device=device).half())
    with pytest.raises(RuntimeError, match="grad must be float32, bfloat16 or float16; got Long"):
        zerofast.nonfinite_check_(torch.ones(4, device=device, dtype=torch.long), torch.zeros(1, device=device))
    with pytest.raises(RuntimeError, match="grad must be a flat contiguous 1-D tensor"):
        zerofast.nonfinite_check_(torch.ones(2, 2, device=device), torch.zeros(1, device=device))


# --- instruction sets ---------------------------------------------------------------------------


def test_portable_path_matches_torch(monkeypatch):
    monkeypatch.setenv("ZEROFAST_CPU_ISA", "portable")
    assert zerofast.cpu_isa() == "portable"
    for adamw in (True, False):
        ours, ref = run_both("cpu", 10_007, adamw=adamw)
        assert_matches(ours, ref)
    ours, ref = run_both("cpu", 1003, grad_dtype=torch.bfloat16, param_copy_dtype=torch.float16)
    assert_matches(ours, ref)
    _check_found_inf("cpu", math.nan, "last", torch.float16)


def test_every_isa_gives_identical_bits(monkeypatch):
    """The loops differ only in vector width, so every ISA this CPU has gives the same bits."""
    results = {}
    for isa in ("portable", "avx2", "avx512"):
        monkeypatch.setenv("ZEROFAST_CPU_ISA", isa)
        try:
            zerofast.cpu_isa()
        except RuntimeError as e:
            assert "lacks" in str(e)
            continue
        results[isa] = run_both("cpu", 4001, grad_dtype=torch.bfloat16, param_copy_dtype=torch.bfloat16)[0]
    assert "portable" in results
    first = next(iter(results.values()))
    for isa, tensors in results.items():
        for a, b in zip(tensors, first):
            assert torch.equal(a, b), f"{isa} differs from the first ISA"


def test_bad_isa_name(monkeypatch):
    monkeypatch.setenv("ZEROFAST_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="ZEROFAST_CPU_ISA must be portable, avx2, avx512 or auto; got 'sse9'"):
        zerofast.cpu_isa()


# --- the op as torch sees it --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    n = 257

    def args():
        return (
            torch.randn(n, device=device),
            torch.randn(n, device=device).bfloat16(),
            torch.zeros(n, device=device),
            torch.zeros(n, device=device),
        )

    opcheck_adam_op(torch.ops.zerofast.fused_adam_.default, args, n, device, grad_scale=0.5)


def test_torch_compile_traces_the_op():
    def step(p, g, m, v):
        zerofast.fused_adam_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        return p

    n = 64
    p, g = torch.randn(n), torch.randn(n)
    p2 = p.clone()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(p, g, torch.zeros(n), torch.zeros(n))
    step(p2, g, torch.zeros(n), torch.zeros(n))
    assert torch.equal(p, p2)


# --- bad input ----------------------------------------------------------------------------------


def _call(param, grad=None, exp_avg=None, exp_avg_sq=None, **kw):
    n = param.numel()
    grad = torch.zeros(n) if grad is None else grad
    exp_avg = torch.zeros(n) if exp_avg is None else exp_avg
    exp_avg_sq = torch.zeros(n) if exp_avg_sq is None else exp_avg_sq
    base = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    base.update(kw)
    zerofast.fused_adam_(param, grad, exp_avg, exp_avg_sq, **base)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _call(torch.zeros(4), grad=torch.zeros(5)), "grad has 5 elements but param has 4"),
        (lambda: _call(torch.zeros(4), exp_avg=torch.zeros(3)), "exp_avg has 3 elements but param has 4"),
        (lambda: _call(torch.zeros(4, dtype=torch.float64)), "param must be float32 .*got Double"),
        (lambda: _call(torch.zeros(4), exp_avg_sq=torch.zeros(4).half()), "exp_avg_sq must be float32; got Half"),
        (
            lambda: _call(torch.zeros(4), grad=torch.zeros(4, dtype=torch.int32)),
            "grad must be float32, bfloat16 or float16; got Int",
        ),
        (lambda: _call(torch.zeros(8)[::2]), "param must be contiguous"),
        (lambda: _call(torch.zeros(4), grad=torch.zeros(8)[::2]), "grad must be contiguous"),
        (lambda: _call(torch.zeros(2, 2)), r"param must be a flat 1-D tensor .*got shape \[2, 2\]"),
        (lambda: _call(torch.zeros(4), step=0), "step counts from 1.*got 0"),
        (
            lambda: _call(torch.zeros(4), found_inf=torch.zeros(2)),
            "found_inf must be a 1-element float32 tensor; got dtype Float with 2 elements",
        ),
        (lambda: _call(torch.zeros(4), param_copy=torch.zeros(3).half()), "param_copy has 3 elements but param has 4"),
        (
            lambda: _call(torch.zeros(4), param_copy=torch.zeros(4, dtype=torch.int8)),
            "param_copy must be float32, bfloat16 or float16; got Char",
        ),
        (lambda: _call(torch.zeros(4), grad_scale="2"), "grad_scale must be a float or a 1-element tensor; got '2'"),
        (lambda: _call(torch.zeros(4), follow_copy=True), "follow_copy=True reads param_copy, which is None"),
        (lambda: _call(torch.zeros(4), step=1.5), "step must be a whole number counting from 1; got 1.5"),
        (lambda: _call(torch.zeros(4), grad=torch.zeros(4, device="meta")), "grad is on meta but param is on cpu"),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        call()


@pytest.mark.skipif(zerofast.has_cuda_kernels(), reason="this build has CUDA kernels")
def test_cuda_tensor_without_cuda_kernels_is_named():
    if not torch.cuda.is_available():
        # No GPU to make a CUDA tensor on: the dispatcher entry is still there; check it directly.
        assert torch._C._dispatch_has_kernel_for_dispatch_key("zerofast::fused_adam_", "CUDA")
        return
    p = torch.zeros(4, device="cuda")
    with pytest.raises(RuntimeError, match="built without its CUDA kernels"):
        _call(
            p,
            grad=torch.zeros(4, device="cuda"),
            exp_avg=torch.zeros(4, device="cuda"),
            exp_avg_sq=torch.zeros(4, device="cuda"),
        )


def test_has_cuda_kernels_reports_the_build():
    """has_cuda_kernels() says whether the build made the CUDA kernels, as asked (make exports
    ZEROFAST_CUDA; CI sets 1 where nvcc exists). Either way every op has a CUDA kernel in the
    dispatcher: the real one, or in a CPU-only build one that raises naming the missing kernels
    (csrc/ops.cpp), so a CUDA tensor never meets the dispatcher's generic error."""
    for op in ("fused_adam_", "fused_adam_8bit_", "nonfinite_check_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"zerofast::{op}", "CUDA"), op
    requested = os.environ.get("ZEROFAST_CUDA")
    if requested == "1":
        assert zerofast.has_cuda_kernels(), "built with ZEROFAST_CUDA=1, but has_cuda_kernels() is False"
    elif requested == "0":
        assert not zerofast.has_cuda_kernels(), "built with ZEROFAST_CUDA=0, but has_cuda_kernels() is True"
