"""Python faces of the compiled ops (torch.ops.zerofast.*) and their fake kernels.

Importing this module loads zerofast._C, which registers the ops with the dispatcher.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.zerofast.*)

__all__ = [
    "fused_adam_",
    "fused_adam_8bit_",
    "nonfinite_check_",
    "has_cuda_kernels",
    "cpu_isa",
    "pool_unit_storage",
    "unit_pool_stats",
]


def has_cuda_kernels() -> bool:
    """Whether this build of zerofast contains its CUDA kernels."""
    return bool(_C.has_cuda_kernels())


def cpu_isa() -> str:
    """The instruction set of the CPU loop that fused_adam_ runs now (avx512, avx2 or portable): the
    widest the CPU supports, unless ZEROFAST_CPU_ISA forces one."""
    return _C.cpu_isa()


def pool_unit_storage(buffer: torch.Tensor, limit: int) -> None:
    """From now on `buffer`'s storage (a CPU stage-3 unit buffer) allocates through the unit pool,
    which keeps up to `limit` bytes of released buffers for the next gather ([Note: unit buffer pool]
    in csrc/unit_pool.cpp)."""
    _C.pool_unit_storage(buffer, int(limit))


def unit_pool_stats() -> dict[str, int]:
    """The unit pool's kept_bytes, limit, allocated (from the system) and reused (from what it kept)."""
    return dict(_C.unit_pool_stats())


def _check_devices(op: str, param: torch.Tensor, named: dict) -> None:
    """Every tensor argument on param's device, named in the error (before dispatch picks a kernel)."""
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.device != param.device:
            raise RuntimeError(f"{op}: {name} is on {t.device} but param is on {param.device}")


def fused_adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = True,
    grad_scale: float | torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    param_copy: torch.Tensor | None = None,
    follow_copy: bool = False,
) -> None:
    """One Adam (adamw=False) or AdamW (adamw=True) step on flat fp32 state, in one pass.

    param, exp_avg, exp_avg_sq: flat contiguous float32 tensors (the master copy and the moments),
      updated in place. grad: same numel, float32, bfloat16 or float16.
    step: this step's number, counting from 1 (bias corrections use it; nothing is kept in C++).
    grad_scale: float or 1-element float32 tensor; every gradient value is multiplied by it first
      (the loss-scale unscale and the clip coefficient in the same pass).
    found_inf: 1-element float32 tensor; set to 1 when any scaled gradient value is inf or nan, and
      then nothing is updated. A value already non-zero (set by an earlier call) also skips the update.
    param_copy: float32, bfloat16 or float16 tensor of the same numel that receives the updated
      parameter, cast, in the same pass.
    follow_copy: param_copy is read first: an element whose copy differs from param's rounding (it
      was written since the last step) takes the copy's value as its param before the update
      ([Note: the master follows the copy] in csrc/adam_math.h). Needs param_copy.
    """
    state = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    hyper = (lr, beta1, beta2, eps, weight_decay, step, adamw)
    kw = _step_kwargs("fused_adam_", param, state, *hyper, grad_scale, found_inf, param_copy, follow_copy)
    torch.ops.zerofast.fused_adam_(param, *state.values(), **kw)


def fused_adam_8bit_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    exp_avg_code: torch.Tensor,
    exp_avg_sq_code: torch.Tensor,
    *,
    block: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = True,
    grad_scale: float | torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    param_copy: torch.Tensor | None = None,
    follow_copy: bool = False,
) -> None:
    """fused_adam_'s step with 8-bit moments, in one pass ([Note: quantized state] in zerofast/quant.py).

    exp_avg, exp_avg_sq: flat uint8 tensors of param's numel (indices into the codes), updated in
      place. exp_avg_scale, exp_avg_sq_scale: float32, one per `block` elements (the last block may
      be shorter), updated in place. exp_avg_code, exp_avg_sq_code: the 256 float32 values of each
      code, increasing (zerofast.quant.dynamic_code). Everything else as fused_adam_.
    """
    state = {
        "grad": grad,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "exp_avg_scale": exp_avg_scale,
        "exp_avg_sq_scale": exp_avg_sq_scale,
        "exp_avg_code": exp_avg_code,
        "exp_avg_sq_code": exp_avg_sq_code,
    }
    hyper = (lr, beta1, beta2, eps, weight_decay, step, adamw)
    kw = _step_kwargs("fused_adam_8bit_", param, state, *hyper, grad_scale, found_inf, param_copy, follow_copy)
    torch.ops.zerofast.fused_adam_8bit_(param, *state.values(), block=int(block), **kw)


def _step_kwargs(
    op, param, state, lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale, found_inf, param_copy, follow_copy
) -> dict:
    """Both fused steps' op keywords: hyperparameters as the op's types, grad_scale split into float
    and tensor parts. Checks first that every tensor (`state`: the op's positional tensors after param)
    is on param's device, as the dispatcher routes on the "highest" one (a meta or CUDA tensor among
    CPU ones would reach another kernel), and that follow_copy comes with a param_copy."""
    scale_value, scale_tensor = _split_grad_scale(grad_scale)
    _check_devices(op, param, {**state, "grad_scale": scale_tensor, "found_inf": found_inf, "param_copy": param_copy})
    if follow_copy and param_copy is None:
        raise ValueError(f"{op}: follow_copy=True reads param_copy, which is None")
    return dict(
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        step=_as_step(step),
        adamw=bool(adamw),
        grad_scale=scale_value,
        grad_scale_tensor=scale_tensor,
        found_inf=found_inf,
        param_copy=param_copy,
        follow_copy=bool(follow_copy),
    )


def nonfinite_check_(grad: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Set found_inf (1-element float32) to 1 when any value of the flat tensor grad (float32,
    bfloat16 or float16) is inf or nan; otherwise leave it as it is. The check fused_adam_'s
    found_inf runs, alone: ZeroAdam runs it on every rank's shard and agrees on the result before
    any rank updates (see [Note: loss scaling] in zerofast/optim/precision.py)."""
    if found_inf.device != grad.device:
        raise RuntimeError(f"nonfinite_check_: found_inf is on {found_inf.device} but grad is on {grad.device}")
    torch.ops.zerofast.nonfinite_check_(grad, found_inf)


def _split_grad_scale(grad_scale) -> tuple[float, torch.Tensor | None]:
    if grad_scale is None:
        return 1.0, None
    if isinstance(grad_scale, torch.Tensor):
        return 1.0, grad_scale
    if isinstance(grad_scale, (int, float)) and not isinstance(grad_scale, bool):
        return float(grad_scale), None
    raise TypeError(f"fused_adam_: grad_scale must be a float or a 1-element tensor; got {grad_scale!r}")


def _as_step(step) -> int:
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, bool) or not float(step).is_integer():
        raise TypeError(f"fused_adam_: step must be a whole number counting from 1; got {step!r}")
    return int(step)


@torch.library.register_fake("zerofast::fused_adam_")
@torch.library.register_fake("zerofast::fused_adam_8bit_")
def _fused_step_fake(*args, **kwargs):
    # Both steps mutate their arguments in place and return nothing: no output to describe.
    return None


@torch.library.register_fake("zerofast::nonfinite_check_")
def _nonfinite_check_fake(grad, found_inf):
    return None
