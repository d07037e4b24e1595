"""LossScaler, fp16's dynamic loss scale, and the notes on mixed precision (the model's conversion and
input cast: zerofast/model_setup.py).

[Note: mixed precision]
mixed_precision="bf16" or "fp16" converts the model as model.to(dtype) would (trainable and frozen
parameters, floating buffers) and casts floating-point inputs of its forward, so forward and backward
run in that dtype. The optimizer keeps what the ZeRO paper's 16Φ memory table keeps, each part
sharded as the stage says: 2Φ parameters (the flat buffers the model's parameters are views of;
stage 3: a low-precision shard plus the units gathered now), 2Φ gradients (buckets and the reduced
shard, in reduce_dtype, default the parameter dtype) and 12Φ of optimizer state (an fp32 master
shard, initialised from the user's exact fp32 values, and m and v: zerofast/optim/state.py). The
fused kernel reads the low-precision gradient shard, updates the fp32 master, m and v, and writes
the rounded parameter through its param_copy in the same pass; the gather then moves 2-byte
parameters.

[Note: loss scaling]
fp16: opt.backward(loss) multiplies the loss by the scale, as torch.amp.GradScaler.scale does. At
step(), after the reduces, every rank runs the fused kernel's non-finite check
(zerofast::nonfinite_check_) over its gradient shard, and one small all_reduce (with the squared
norm, when clipping) tells every rank whether any shard overflowed, before any rank updates: then
every rank skips the update together (parameters, master, m, v and step counts untouched) and the
scale is multiplied by backoff_factor; after growth_interval clean steps in a row it is multiplied
by growth_factor. Rule and float32 rounding are GradScaler's. Unscaling costs nothing: 1/scale is
part of the kernel's grad_scale. A reduce in fp16 can itself overflow (two finite gradients whose
sum is not); that is caught the same way, one reason to reduce in float32
(MixedPrecisionPolicy(torch.float16, reduce_dtype=torch.float32)).
"""

from __future__ import annotations

import math

import torch

from ..config import LossScalePolicy


class LossScaler:
    """fp16's dynamic loss scale, with torch.amp.GradScaler's rule and float32 rounding ([Note: loss scaling])."""

    def __init__(self, policy: LossScalePolicy | None):
        """policy: the plan's loss scaling (fp16 only); None: disabled, the scale stays 1."""
        self.enabled = policy is not None
        self.scale = to_f32(policy.init_scale) if policy is not None else 1.0
        self.policy = policy
        self.growth_tracker = 0
        self.in_scaled_backward = False  # inside backward(): gradients arriving now were scaled

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), the loss multiplied by the scale when enabled."""
        if self.enabled:
            loss = loss.float() * self.scale
        self.in_scaled_backward = True
        try:
            loss.backward(**kwargs)
        finally:
            self.in_scaled_backward = False

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = to_f32(self.scale * self.policy.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.policy.growth_interval:
            grown = to_f32(self.scale * self.policy.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0


def to_f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))
