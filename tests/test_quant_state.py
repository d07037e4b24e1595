"""8-bit Adam state, kernel and format layers: fused_adam_8bit_ bitwise against the plain-torch
oracle (zerofast/reference_quant.py) on every instruction set and on CUDA, the per-block error
bound, zero / constant / huge / denormal blocks, fp16's non-finite gradients skipped, opcheck, the
block-aligned layout, and the named errors. Cost: about 5 s on 2 cores."""

import pytest
import torch
from oracles import opcheck_adam_op

import zerofast
from zerofast import MixedPrecisionPolicy
from zerofast.layout import build_layout
from zerofast.quant import dequantize, dynamic_code, num_blocks, quantize, thresholds
from zerofast.reference_quant import adam8_step, fmaf

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and zerofast.has_cuda_kernels()),
    reason="needs a CUDA GPU and zerofast's CUDA kernels",
)
DEVICES = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
CODES = (dynamic_code(True), dynamic_code(False))


def _state(n: int, block: int, device="cpu"):
    """Fresh 8-bit state of n elements: (exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale)."""
    b = num_blocks(n, block)
    return [
        torch.zeros(n, dtype=torch.uint8, device=device),
        torch.zeros(n, dtype=torch.uint8, device=device),
        torch.zeros(b, device=device),
        torch.zeros(b, device=device),
    ]


def _grads(n: int, steps: int, dtype, gen) -> list[torch.Tensor]:
    """Gradients with exact zeros, tiny and huge entries mixed in, and whole blocks of very
    different magnitudes (a block's scale is its own)."""
    out = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        g *= torch.logspace(-6, 2, n, dtype=torch.float64).float()[torch.randperm(n, generator=gen)]
        if n >= 16:
            g[::7] = 0.0
            g[3::11] *= 1e-20
        out.append(g.to(dtype))
    return out


def _run(kind, device, n, block, *, steps=4, adamw=True, grad_dtype=torch.float32, copy_dtype=None, grads=None):
    """`steps` steps of fused_adam_8bit_ (kind "kernel") or of the oracle (kind "oracle") from the
    same start; returns every tensor they write."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen).to(device)
    state = _state(n, block, device)
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=device)
    grads = grads if grads is not None else _grads(n, steps, grad_dtype, gen)
    for step, g in enumerate(grads, start=1):
        kw = dict(block=block, weight_decay=0.1, step=step, adamw=adamw, grad_scale=0.5, param_copy=copy, **HYPER)
        if kind == "kernel":
            zerofast.fused_adam_8bit_(param, g.to(device), *state, *(c.to(device) for c in CODES), **kw)
        else:
            adam8_step(param, g, *state, codes=CODES, **kw)
    return [param, *state] + ([copy] if copy is not None else [])


def _assert_same(ours, ref, where):
    names = ("param", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "param_copy")
    for name, a, b in zip(names, ours, ref):
        a = a.cpu()
        same = torch.equal(a, b) or (
            a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        )
        assert same, f"{where}: {name} differs from the oracle in {(a != b).sum().item()} of {a.numel()} elements"


# --- the oracle's pieces ----------------------------------------------------------------------------


def test_fmaf_is_fused():
    """fmaf rounds once: (1 + 2^-23)(1 - 2^-23) - 1 is -2^-46 fused, 0 when the product is rounded."""
    a, b = torch.tensor([1 + 2**-23]), torch.tensor([1 - 2**-23])
    assert fmaf(a, b, torch.tensor([-1.0])).item() == -(2.0**-46)
    assert (a * b - 1).item() == 0.0
    # Against float64 on random values, where the double rounding is rare: off by at most 1 ulp.
    gen = torch.Generator().manual_seed(1)
    x, y, z = (torch.randn(10_000, generator=gen) for _ in range(3))
    exact = (x.double() * y.double() + z.double()).float()
    assert ((fmaf(x, y, z) - exact).abs() <= torch.finfo(torch.float32).eps * exact.abs()).all()


def test_codes_are_bitsandbytes_dynamic_maps():
    signed, unsigned = CODES
    for code in CODES:
        assert code.numel() == 256 and bool((code[1:] > code[:-1]).all())
        assert code[-1].item() == 1.0 and 0.0 in code.tolist()
    assert signed[0].item() < -0.99 and unsigned[0].item() == 0.0
    # seven decades: the smallest non-zero magnitude is 10^-6 times the first decade's first mean
    assert abs(signed[signed > 0].min().item() - 0.55e-6) < 1e-12
    assert abs(unsigned[unsigned > 0].min().item() - 0.325e-6) < 1e-12


# --- the kernel against the oracle, bitwise -----------------------------------------------------------


def _isas(monkeypatch):
    for isa in ("portable", "avx2", "avx512"):
        monkeypatch.setenv("ZEROFAST_CPU_ISA", isa)
        try:
            zerofast.cpu_isa()
        except RuntimeError as e:
            assert "lacks" in str(e)
            continue
        yield isa


@pytest.mark.parametrize("block", [32, 256, 4096])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_every_isa_is_the_oracle_bitwise(monkeypatch, block, adamw):
    # Several of the CPU loops' chunks (2048 elements, or one block above that; [Note: one pass per
    # block] in csrc/adam_cpu_loop.h), the last one partial, and a last block shorter than the others.
    n = max(3 * block, 2 * 2048 + block) + 17
    ref = _run("oracle", "cpu", n, block, adamw=adamw)
    seen = []
    for isa in _isas(monkeypatch):
        _assert_same(_run("kernel", "cpu", n, block, adamw=adamw), ref, isa)
        seen.append(isa)
    assert "portable" in seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "grad_dtype, copy_dtype",
    [
        (torch.float32, None),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_low_precision_grads_and_copies_are_the_oracle_bitwise(device, grad_dtype, copy_dtype):
    n = 1000
    ref = _run("oracle", "cpu", n, 64, grad_dtype=grad_dtype, copy_dtype=copy_dtype)
    _assert_same(_run("kernel", device, n, 64, grad_dtype=grad_dtype, copy_dtype=copy_dtype), ref, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name, value",
    [("zero", 0.0), ("constant", 0.25), ("huge", 1e15), ("denormal", 1e-41), ("mixed", None)],
)
def test_special_blocks(device, name, value):
    """A block of zeros keeps scale 0 (and the parameter only decays); a constant block, one of
    huge gradients (v = 1e30) and one of denormal gradients (m denormal too, v underflowing to 0)
    each hold their own scales, finite, and equal the oracle bitwise; `mixed`: all of them side by
    side, one block each."""
    block, steps = 32, 3
    if value is None:
        parts = [torch.full((block,), v) for v in (0.0, 0.25, 1e15, 1e-41)]
        grads = [torch.cat(parts) * (1 + 0.1 * s) for s in range(steps)]
    else:
        grads = [torch.full((2 * block - 5,), value) * (1 + 0.1 * s) for s in range(steps)]
    n = grads[0].numel()
    ours = _run("kernel", device, n, block, grads=grads)
    _assert_same(ours, _run("oracle", "cpu", n, block, grads=grads), name)
    param, _, _, scale_m, scale_v = (t.cpu() for t in ours)
    assert torch.isfinite(param).all() and torch.isfinite(scale_m).all() and torch.isfinite(scale_v).all()
    if value == 0.0:
        assert (scale_m == 0).all() and (scale_v == 0).all()
    elif value is not None:
        assert (scale_m > 0).all()
        # a denormal gradient's square underflows to 0 in fp32, as it does in fp32 state
        assert (scale_v == 0).all() if name == "denormal" else (scale_v > 0).all()


def _edge_values(code: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks of values x whose first moment after one step with beta1 = 0 is x itself, scale 1:
    every threshold, one ulp either side of it, every code value, 0, -0, values around the
    quantizing table's clamp limits (2^-24 and 1), denormals and NaN; the last block all zero
    but one NaN (its scale is 0, and NaN must come out as 0's index)."""
    thr = thresholds(code)
    inf = torch.tensor(torch.inf)
    parts = [thr, thr.nextafter(inf), thr.nextafter(-inf), code]
    edges = [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-25, 1e-41, -1e-41, 1e-7, 0.99999994, -0.99999994]
    edges = torch.tensor(edges + [2.0**-12, -(2.0**-12)])  # squared: exp_avg_sq at 2^-24, the lowest bucket's start
    parts += [edges, edges.nextafter(inf), torch.tensor([torch.nan, -torch.nan])]
    x = torch.cat(parts)
    rows = x.split(block - 1)
    blocks = [torch.cat([torch.ones(1), r, torch.zeros(block - 1 - r.numel())]) for r in rows]  # 1.0: scale 1
    nan_block = torch.zeros(block)
    nan_block[5] = torch.nan
    return torch.cat(blocks + [nan_block])


def test_code_changed_in_place_is_not_served_stale_tables(monkeypatch):
    """The CPU driver keeps each code's quantizing table between calls, keyed by the code's values:
    the same code tensor, its values changed in place between two steps, and a second tensor holding
    the first values again, are each quantized as the oracle does with the code they hold then."""
    n, block = 1000, 64
    kw = dict(block=block, weight_decay=0.1, step=1, adamw=True, **HYPER)
    g = _grads(n, 1, torch.float32, torch.Generator().manual_seed(1))[0]
    bent = tuple(c.sign() * c.abs() ** 0.9 for c in CODES)  # another increasing code in [-1, 1] and [0, 1]
    for isa in _isas(monkeypatch):
        codes = tuple(c.clone() for c in CODES)
        for values in (CODES, bent, CODES):
            for c, v in zip(codes, values):
                c.copy_(v)
            state, ref = _state(n, block), _state(n, block)
            zerofast.fused_adam_8bit_(torch.ones(n), g, *state, *codes, **kw)
            adam8_step(torch.ones(n), g, *ref, codes=values, **kw)
            for name, a, b in zip(("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"), state, ref):
                assert torch.equal(a, b), f"{isa}: {name} differs from the oracle in {(a != b).sum().item()} elements"


def _searched_code() -> torch.Tensor:
    """A signed code the quantizing table cannot serve: a threshold of 1e-9, below its clamp."""
    values = torch.linspace(-1, 1, 255).tolist()
    return torch.tensor(sorted(values[:127] + [0.0, 2e-9] + values[128:]))


@pytest.mark.parametrize("code", ["dynamic", "linear", "searched"])
def test_quantize_ties_and_edges_every_isa(monkeypatch, code):
    """The CPU loops quantize through a table ([Note: quantizing by table] in adam_math.h), or search
    for a code the table cannot serve ("searched": a threshold below 2^-24): at every threshold (a
    tie goes to the lower code), one ulp either side, the table's clamp limits, signed zeros,
    denormals and NaN, the index is the oracle's search on every instruction set. The linear codes
    have thresholds of exactly 0 (the signed one between its middle values; the unsigned one its
    first, [Note: no positive value rounds to zero]), which the table serves."""
    block = 64
    linear = torch.linspace(-1, 1, 256)
    linear[:128] = -linear[128:].flip(0)  # symmetric: the threshold between the middle two is 0
    codes = {
        "dynamic": CODES,
        "linear": (linear, torch.linspace(0, 1, 256)),
        "searched": (_searched_code(), CODES[1]),
    }[code]
    g = _edge_values(codes[0], block)
    n = g.numel()
    kw = dict(block=block, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, step=1)
    expect_m, expect_scale = quantize(g, codes[0], block)  # m = g exactly: lerp with weight 1
    for isa in _isas(monkeypatch):
        state = _state(n, block)
        zerofast.fused_adam_8bit_(torch.zeros(n), g, *state, *codes, **kw)
        ref = _state(n, block)
        adam8_step(torch.zeros(n), g, *ref, codes=codes, **kw)
        for name, a, b in zip(("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"), state, ref):
            assert torch.equal(a, b), f"{isa}: {name} differs from the oracle in {(a != b).sum().item()} elements"
        assert torch.equal(state[0], expect_m) and torch.equal(state[2], expect_scale), isa
    # the ties themselves: threshold k (between codes k and k + 1) rounds down to k
    k = torch.arange(255)
    assert torch.equal(expect_m[k // (block - 1) * block + 1 + k % (block - 1)], k.to(torch.uint8))
    zero_index = torch.searchsorted(thresholds(codes[0]), torch.tensor(0.0)).item()
    assert expect_m[-block + 5] == zero_index and expect_scale[-1] == 0  # NaN in a block of zeros
    # exp_avg_sq (g * g): 0 only where it is 0 or NaN, every positive value at least index 1
    v = g * g
    assert torch.equal(state[1] == 0, ~(v > 0))


@pytest.mark.parametrize("device", DEVICES)
def test_every_moment_rounds_to_its_nearest_code_value(device):
    """The per-block error bound: after a step from zero state (whose new moments are fp32
    fused_adam_'s exactly), each stored moment is the code value nearest to the true one, times its
    block's scale, so its error is at most half the gap between the two code values around it (up
    to the rounding of code * scale, one float32 ulp of the result). But a positive second moment
    is never stored as 0 ([Note: no positive value rounds to zero]): one far below its block's
    largest (every 64th element here, 10^-12 of it) is the smallest nonzero code value instead."""
    n, block = 4 * 256, 256
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(n, generator=gen) * torch.logspace(-4, 1, n).float()
    grad[5::64] *= 1e-6
    grad[7::64] = 0.0
    param = torch.randn(n, generator=gen)
    state = _state(n, block, device)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    kw = dict(weight_decay=0.0, step=1, **HYPER)
    p8 = param.clone().to(device)
    zerofast.fused_adam_8bit_(p8, grad.to(device), *state, *(c.to(device) for c in CODES), block=block, **kw)
    zerofast.fused_adam_(param.clone(), grad, m32, v32, **kw)
    for q, scale, exact, code in ((state[0], state[2], m32, CODES[0]), (state[1], state[3], v32, CODES[1])):
        q, scale = q.cpu(), scale.cpu()
        assert torch.equal(scale, exact.view(-1, block).abs().amax(1))
        got = dequantize(q, scale, code, block)
        per_elem = scale.repeat_interleave(block)
        distance = (code[None, :] * per_elem[:, None] - exact[:, None]).abs()
        if code[0] == 0:  # unsigned: a positive moment's candidates leave out the zero
            distance[:, 0] = torch.where(exact > 0, torch.inf, distance[:, 0])
            assert torch.equal(q == 0, exact == 0)
            assert (q[5::64] == 1).all() and (q[7::64] == 0).all()
        nearest = distance.min(1).values
        slack = torch.finfo(torch.float32).eps * got.abs()
        assert ((got - exact).abs() <= nearest + slack).all()
        gaps = (code[1:] - code[:-1]).max().item()
        assert ((got - exact).abs() <= torch.maximum(0.5 * gaps * per_elem, nearest) + slack).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_nonfinite_gradients_skip_the_step(device):
    """As fused_adam_: one inf or nan gradient sets found_inf and nothing is written."""
    n, block = 200, 32
    for bad in (float("inf"), float("nan")):
        before = _run("kernel", device, n, block, steps=2, grad_dtype=torch.float16, copy_dtype=torch.float16)
        after = [t.clone() for t in before]
        grad = torch.randn(n).half()
        grad[-1] = bad
        found = torch.zeros(1, device=device)
        zerofast.fused_adam_8bit_(
            after[0],
            grad.to(device),
            *after[1:5],
            *(c.to(device) for c in CODES),
            block=block,
            weight_decay=0.1,
            step=3,
            found_inf=found,
            param_copy=after[5],
            **HYPER,
        )
        assert found.item() == 1.0
        for a, b in zip(after, before):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    n, block = 100, 32

    def args():
        return (
            torch.randn(n, device=device),
            torch.randn(n, device=device).bfloat16(),
            *_state(n, block, device),
            *(c.to(device) for c in CODES),
        )

    opcheck_adam_op(torch.ops.zerofast.fused_adam_8bit_.default, args, n, device, block=block)


# --- the format -------------------------------------------------------------------------------------


def test_quantize_round_trip_is_nearest():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1000, generator=gen) * 3
    q, scales = quantize(x, CODES[0], 128)
    assert scales.numel() == 8 and q.dtype == torch.uint8
    got = dequantize(q, scales, CODES[0], 128)
    per_elem = scales.repeat_interleave(128)[:1000]
    nearest = (CODES[0][None, :] * per_elem[:, None] - x[:, None]).abs().min(1).values
    assert ((got - x).abs() <= nearest * (1 + 1e-6) + 1e-30).all()
    assert torch.equal(thresholds(CODES[0]), (CODES[0][:-1] + CODES[0][1:]) * 0.5)
    unsigned = thresholds(CODES[1])  # [Note: no positive value rounds to zero]
    assert unsigned[0] == 0 and torch.equal(unsigned[1:], (CODES[1][1:-1] + CODES[1][2:]) * 0.5)


@pytest.mark.parametrize("partition", ["flat", "owners"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_cuts_only_at_block_boundaries(partition, world):
    """Every slot, rank slice and owner segment starts at a multiple of the block, so every piece a
    rank owns starts at a block boundary of its parameter ([Note: quantized state])."""
    block = 32
    numels = [1000, 17, 64, 3, 4096, 31, 32, 33]
    owners = None if partition == "flat" else [i % world for i in range(len(numels))]
    layout = build_layout(numels, list(reversed(range(len(numels)))), world, 2000, owners, 500, block=block)
    covered = [0] * len(numels)
    for b in layout.buckets:
        assert all(x % block == 0 for x in b.bounds)
    for s in layout.slots:
        assert s.offset % block == 0
    for r in range(world):
        assert layout.shard_numel(r) % block == 0
        for pc in layout.pieces(r):
            assert pc.param_offset % block == 0 and pc.state_offset % block == 0 and pc.bucket_offset % block == 0
            covered[pc.param] += pc.numel
    assert covered == numels
    for b in layout.buckets:  # a fresh gradient buffer is zeroed from the first gap on
        ends = sorted((layout.slots[i].offset, layout.slots[i].offset + layout.slots[i].numel) for i in b.params)
        start = layout.padding_start(b.index)
        assert all(hi <= start or lo >= start for lo, hi in ends)  # no slot cut
        assert [e for e in ends if e[1] <= start] == ends[: len([e for e in ends if e[1] <= start])]
        held = sum(hi - lo for lo, hi in ends if hi <= start)
        assert held == start  # everything before it is slots, back to back
    # block 1 is the layout without blocks
    plain = build_layout(numels, list(reversed(range(len(numels)))), world, 2000, owners, 500)
    assert build_layout(numels, list(reversed(range(len(numels)))), world, 2000, owners, 500, block=1) == plain


# --- named errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(state_bits=16), "state_bits must be 32 or 8; got 16"),
        (dict(state_bits=True), "state_bits must be 32 or 8; got True"),
        (dict(state_bits=8, state_block=100), "state_block must be a power of two >= 32; got 100"),
        (dict(state_bits=8, state_block=16), "state_block must be a power of two >= 32; got 16"),
        (dict(state_bits=8, state_block="256"), "state_block must be a power of two >= 32; got '256'"),
    ],
)
def test_policy_errors_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixedPrecisionPolicy(**kwargs)


def test_policy_defaults():
    p = MixedPrecisionPolicy()
    assert (p.state_bits, p.state_block) == (32, 256)
    assert MixedPrecisionPolicy(torch.bfloat16, state_bits=8, state_block=1024).state_block == 1024


def _call8(n=64, block=32, **over):
    blocks = num_blocks(n, max(block, 1))
    args = dict(
        param=torch.zeros(n),
        grad=torch.zeros(n),
        exp_avg=torch.zeros(n, dtype=torch.uint8),
        exp_avg_sq=torch.zeros(n, dtype=torch.uint8),
        exp_avg_scale=torch.zeros(blocks),
        exp_avg_sq_scale=torch.zeros(blocks),
        exp_avg_code=CODES[0],
        exp_avg_sq_code=CODES[1],
    )
    kw = dict(block=block, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    zerofast.fused_adam_8bit_(*args.values(), **kw)


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(exp_avg=torch.zeros(64)), "fused_adam_8bit_: exp_avg must be uint8 .*got Float"),
        (dict(exp_avg_sq=torch.zeros(63, dtype=torch.uint8)), "exp_avg_sq has 63 elements but param has 64"),
        (dict(exp_avg_scale=torch.zeros(3)), "exp_avg_scale has 3 elements but needs 2"),
        (dict(exp_avg_sq_code=torch.zeros(255)), "exp_avg_sq_code has 255 elements but needs 256"),
        (dict(block=0), "block must be positive; got 0"),
        (dict(step=0), "step counts from 1"),
        (dict(param=torch.zeros(64).double()), "param must be a flat contiguous float32 tensor"),
        (dict(exp_avg_scale=torch.zeros(2, device="meta")), "exp_avg_scale is on meta but param is on cpu"),
    ],
)
def test_kernel_errors_are_named(over, message):
    with pytest.raises(RuntimeError, match=message):
        _call8(**over)
