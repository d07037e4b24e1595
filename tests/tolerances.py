"""The tolerances of the tests that compare two runs, each with the reason for its size, the
hyper-parameters they hold for (HYPER: its lr and eps are part of the argument), and the distance
they bound (max_abs_diff)."""

from __future__ import annotations

import torch

# lr 1e-3: Adam's first steps move each element by about lr * sign(g), so an element whose true
# gradient is ~0 (pure rounding noise, whose sign depends on summation order) moves by up to lr in a
# direction no two reduction orders agree on; at lr 1e-2 that alone reached 1.6e-5 on 3 ranks.
# eps 1e-6 for the same reason: an element whose gradient is near eps (an embedding row of a token
# absent from the batch, ~1e-9) is updated by lr * g / (|g| + eps), whose relative error is that of
# g itself; with eps 1e-8 and 4 ranks that reached 2.07e-5 (the engine and the reference stage
# agreed bitwise there; only the single-process summation order differed).
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


# --- Tolerances: why each number is what it is ------------------------------------------------------
# Two correct runs differ only by rounding: the order in which N rank gradients are added (gloo's
# ring against one process's sum), a norm summed per shard against torch's per tensor, and matmul
# blocking, which differs between processors (oneDNN/AMX on Intel Sapphire Rapids, AVX2 on AMD
# EPYC: the same test rounds differently there). So no tolerance is a number that happened to pass
# on one machine; each is a bound in units of the compared quantity's own precision:
#
# fp32_tol(steps): 16 ulps of the parameters' scale (1.0: layer norm weights; the largest in
#   every model here) per step. Per step, the reduced gradients differ by the rounding of a sum of
#   N <= 4 terms (<= N ulps relative); Adam's step lr * m^/(sqrt(v^) + eps) is scale-free, so a
#   relative error carries through m^ and through sqrt(v^) (x2), and both runs round (x2):
#   2 * 2 * N = 16 ulps of the parameter per step at most, for elements whose gradient is well above
#   eps. An element whose true gradient is near zero has no relative precision at all; eps = 1e-6
#   keeps its step at lr * g / eps, of the size of the rounding of g itself (see HYPER above).
# low_precision_tol(dtype, steps): bf16/fp16 parameters round the fp32 master; a last-bit
#   difference upstream can round one of them to its neighbour, and every later gradient then
#   differs by up to one ulp relative of that dtype (fp16 2^-10, bf16 2^-7). Adam carries a
#   relative gradient change into the step at most twice over (through m^ and sqrt(v^)):
#   2 * steps * lr * ulp of the fp32 master.
# lp_param_tol(dtype, steps, params): that master drift, plus one ulp of the dtype at the largest
#   parameter's magnitude (the two masters may round to neighbouring values).
# norm_rel_tol(numel): a sum of numel squares in another order differs by at most numel * 2^-24
#   relative (the classic worst-case bound gamma_n for float32).
ULP_REL = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def fp32_tol(steps: int, scale: float = 1.0) -> float:
    return steps * 16 * ulp(torch.float32, scale)


def low_precision_tol(dtype: torch.dtype, steps: int) -> float:
    return 2 * steps * HYPER["lr"] * ULP_REL[dtype]


def lp_param_tol(dtype: torch.dtype, steps: int, params: dict[str, torch.Tensor]) -> float:
    largest = max(p.abs().max().item() for p in params.values())
    return low_precision_tol(dtype, steps) + ulp(dtype, largest)


def norm_rel_tol(numel: int) -> float:
    return numel * 2.0**-24


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s values at `magnitude` (its unit in the last place there)."""
    import math

    exponent = math.floor(math.log2(magnitude)) if magnitude > 0 else 0
    return 2.0**exponent * ULP_REL[dtype]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
