"""Lightning's precision flag as ZeroAdam's mixed precision: PRECISIONS (flag -> mixed_precision) and
ZeroPrecisionMixin, which each of the two modules puts before its package's Precision."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection

from ...optim.zero_adam import ZeroAdam

# Lightning's precision flag -> ZeroAdam's mixed_precision ("-mixed" and "-true" alike: the model runs
# in that dtype over an fp32 master shard, as DeepSpeed's bf16 / fp16 do; fp16 with loss scaling).
PRECISIONS = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The precision plugins Lightning's connector builds from a flag alone; any other plugin is the user's.
_FLAG_PLUGINS = {"Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision"}


def _zero_dtype(precision: str) -> torch.dtype | None:
    return _DTYPES.get(PRECISIONS[precision])


class ZeroPrecisionMixin:
    """Lightning's precision flag as ZeroAdam's mixed precision: no autocast and no GradScaler. The
    model runs in the parameters' dtype (ZeroAdam converts it when built), the floating-point tensors
    of each batch are cast to it (convert_input, as Lightning's HalfPrecision and DeepSpeedPrecision
    do), fp16's loss scaling is ZeroAdam's (backward goes through opt.backward), and clipping is
    ZeroAdam's, across the shards."""

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(
                f"ZeroStrategy: precision={precision!r} is not supported; choose one of "
                f"{', '.join(PRECISIONS)} (zerofast keeps an fp32 master and Adam state)"
            )
        self.precision = precision
        self.zero: ZeroAdam | None = None  # set by the strategy once the optimizer exists

    @property
    def dtype(self) -> torch.dtype | None:
        return _zero_dtype(self.precision)

    def convert_input(self, data: Any) -> Any:
        dtype = self.dtype
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # ZeroAdam converts it when built (its fp32 master from the fp32 initial values)

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if self.zero is not None and self.zero.plan.scales_loss:
            if args:
                raise TypeError(f"ZeroStrategy: backward takes keyword arguments only under fp16; got {args!r}")
            self.zero.backward(tensor, **kwargs)  # scaled by the loss scale, as ZeroAdam requires
            return
        model.backward(tensor, *args, **kwargs)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        self._require_zero("gradient_clip_val").clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        self._require_zero("gradient_clip_val").clip_grad_value_(float(clip_val))

    def _require_zero(self, what: str) -> ZeroAdam:
        if self.zero is None:
            raise RuntimeError(f"ZeroStrategy: {what} needs the ZeroAdam, which the strategy builds in fit()")
        return self.zero
