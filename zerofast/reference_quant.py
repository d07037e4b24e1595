"""AdamW with 8-bit moments in plain PyTorch: the correctness oracle of fused_adam_8bit_ and of
ZeroAdam with MixedPrecisionPolicy(state_bits=8), beside the reference stages (reference.py).

Every operation of the compiled step (csrc/adam_math.h) is written here as one float32 operation
of torch, each correctly rounded, so the result is bitwise the kernel's on any machine:
- the host scalars in double, rounded once to float32, as make_adam_scalars does;
- the fused multiply-adds the kernel writes (lerp, the second moment, Adam's L2 term) with `fmaf`
  below, an exact emulation (the product in float64 is exact; the sum is rounded to odd in float64
  and then to nearest in float32, which is the correctly rounded fused result);
- divisions by a tensor of the divisor, never by a Python scalar (which torch may turn into a
  multiplication by the reciprocal), and sqrt through float64 (`_sqrt`);
- the quantization of zerofast.quant ([Note: quantized state]).
`ReferenceAdam8` steps whole parameters with it: the single-process run that ZeroAdam's 8-bit state
equals bitwise at any world size, stage and partition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quant import DEFAULT_STATE_BLOCK, dequantize, dynamic_code, num_blocks, quantize

__all__ = ["fmaf", "AdamScalars", "adam_scalars", "adam8_step", "ReferenceAdam8"]


def fmaf(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c with one rounding (C's fmaf), elementwise."""
    a64 = a.double()
    b64 = b.double() if isinstance(b, torch.Tensor) else torch.full_like(a64, float(b))
    c64 = c.double()
    product = a64 * b64  # exact: 24 + 24 significant bits fit in 53
    total = product + c64
    # TwoSum: the exact rounding error of product + c.
    back = total - product
    err = (product - (total - back)) + (c64 - back)
    inexact = (err != 0) & torch.isfinite(total) & torch.isfinite(err)
    even = (total.view(torch.int64) & 1) == 0
    # Round to odd: an inexact sum with an even last bit moves one ulp towards the exact value, so
    # the second rounding (to float32, 29 bits fewer) cannot fall on a false tie.
    toward = torch.where(err > 0, torch.full_like(total, math.inf), torch.full_like(total, -math.inf))
    total = torch.where(inexact & even, torch.nextafter(total, toward), total)
    return total.float()


def _f32(x: float) -> float:
    """x rounded to float32 (round to nearest), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).float().item()


@dataclass(frozen=True)
class AdamScalars:
    """make_adam_scalars (csrc/adam_math.h): host constants of one step, each a float32 value."""

    decay_factor: float
    l2_weight_decay: float
    lerp_weight: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float
    eps: float
    neg_step_size: float
    grad_scale: float


def adam_scalars(
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool,
    grad_scale: float = 1.0,
) -> AdamScalars:
    bias_correction1 = 1.0 - math.pow(beta1, float(step))
    bias_correction2 = 1.0 - math.pow(beta2, float(step))
    return AdamScalars(
        decay_factor=_f32(1.0 - lr * weight_decay) if adamw else 1.0,
        l2_weight_decay=0.0 if adamw else _f32(weight_decay),
        lerp_weight=_f32(1.0 - beta1),
        beta2=_f32(beta2),
        one_minus_beta2=_f32(1.0 - beta2),
        bias_correction2_sqrt=_f32(math.sqrt(bias_correction2)),
        eps=_f32(eps),
        neg_step_size=_f32(-(lr / bias_correction1)),
        grad_scale=_f32(grad_scale),
    )


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """adam_math.h's lerp (ATen's two branches), the branch chosen by the scalar weight."""
    diff = end - start
    if weight < 0.5:
        return fmaf(torch.full_like(start, weight), diff, start)
    one_minus_weight = (torch.tensor(1.0) - torch.tensor(weight)).item()  # 1.0f - weight, in float32
    return fmaf(-diff, one_minus_weight, end)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt (the kernel's sqrtf). torch.sqrt on CPU is not (measured: 20%
    of random inputs 1 ulp off); the float64 root rounded to float32 is, as 53 >= 2 * 24 + 2 bits."""
    return x.double().sqrt().float()


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value)


def adam8_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    *,
    block: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = True,
    grad_scale: float = 1.0,
    param_copy: torch.Tensor | None = None,
    codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """fused_adam_8bit_ in plain torch, on the same flat tensors, in place (no found_inf: a caller
    that skips a step simply does not call it)."""
    code_avg, code_avg_sq = codes if codes is not None else (dynamic_code(True), dynamic_code(False))
    s = adam_scalars(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale)
    m_old = dequantize(exp_avg, exp_avg_scale, code_avg, block)
    v_old = dequantize(exp_avg_sq, exp_avg_sq_scale, code_avg_sq, block)
    # adam_moments
    g = grad.float() * s.grad_scale
    p = param * s.decay_factor
    g = fmaf(p, s.l2_weight_decay, g)
    m = _lerp(m_old, g, s.lerp_weight)
    v = fmaf(g * s.one_minus_beta2, g, v_old * s.beta2)
    # adam_param
    denom = _sqrt(v) / _full(v, s.bias_correction2_sqrt) + s.eps
    new_param = p + (m * s.neg_step_size) / denom
    q_avg, scale_avg = quantize(m, code_avg, block)
    q_avg_sq, scale_avg_sq = quantize(v, code_avg_sq, block)
    param.copy_(new_param)
    exp_avg.copy_(q_avg)
    exp_avg_sq.copy_(q_avg_sq)
    exp_avg_scale.copy_(scale_avg)
    exp_avg_sq_scale.copy_(scale_avg_sq)
    if param_copy is not None:
        param_copy.copy_(new_param)


class ReferenceAdam8:
    """Single-process AdamW (or Adam) with 8-bit moments over whole parameters, blocks keyed to each
    parameter's own flattened element index: what ZeroAdam with MixedPrecisionPolicy(state_bits=8)
    computes, at any world size. `master`: fp32 copies of low-precision parameters (the parameters
    then receive the rounded update, as ZeroAdam's param_copy)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        adamw: bool = True,
        block: int = DEFAULT_STATE_BLOCK,
    ):
        self.params = list(params)
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, adamw=adamw)
        self.block = block
        self.codes = (dynamic_code(True), dynamic_code(False))
        self.state = []
        for p in self.params:
            n, blocks = p.numel(), num_blocks(p.numel(), block)
            self.state.append(
                dict(
                    step=0,
                    master=p.detach().float().reshape(-1).clone(),
                    exp_avg=torch.zeros(n, dtype=torch.uint8),
                    exp_avg_sq=torch.zeros(n, dtype=torch.uint8),
                    exp_avg_scale=torch.zeros(blocks),
                    exp_avg_sq_scale=torch.zeros(blocks),
                )
            )

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        for p, st in zip(self.params, self.state):
            if p.grad is None:
                continue
            st["step"] += 1
            copy = torch.empty(p.numel(), dtype=p.dtype)
            adam8_step(
                st["master"],
                p.grad.reshape(-1),
                st["exp_avg"],
                st["exp_avg_sq"],
                st["exp_avg_scale"],
                st["exp_avg_sq_scale"],
                block=self.block,
                step=st["step"],
                grad_scale=grad_scale,
                param_copy=copy,
                codes=self.codes,
                **self.hyper,
            )
            p.copy_(copy.view_as(p))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
