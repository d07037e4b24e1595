"""The 8-bit format of Adam's moments: the codes, the block layout, and quantize / dequantize in
plain torch (the compiled kernel's result, for the oracle and the checkpoint readers). No compiled
code: config.py, the estimator and the reference import it.

[Note: quantized state]
With MixedPrecisionPolicy(state_bits=8), exp_avg and exp_avg_sq are kept as one byte per element
(an index into a 256-entry code) plus one fp32 scale per block of `state_block` elements: element i
of a block holds code[q[i]] * scale, where scale is the largest |value| of the block when it was
written (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022).
- The codes: exp_avg (signed) uses bitsandbytes' signed dynamic tree code, exp_avg_sq (unsigned) its
  unsigned one (`dynamic_code`). Chosen by measurement (benchmarks/quant_codes.py: the moments of a
  small GPT after 100 AdamW steps on the shipped text, block 256; docs/8bit-state.md has the table).
  Relative error of the Adam direction m / (sqrt(v) + eps), median / 99th percentile: linear codes
  0.96% / 100% (a linear exp_avg code rounds a block's small entries to zero, and a linear
  exp_avg_sq code rounds 0.5% of the entries to zero: the zero-point problem of Li et al., NeurIPS
  2023); dynamic exp_avg with Li et al.'s zero-free linear exp_avg_sq 1.2% / 16%; dynamic codes for
  both 1.2% / 7.1%. The dynamic codes spend their values evenly per decade over seven decades below
  the block's largest value, which is how both moments are spread inside a block; the linear codes'
  finer steps near the top buy a slightly smaller median error and lose the tail.
- Rounding: to the nearest code value. The normalized value x / scale (one IEEE division) is
  compared with the midpoints of neighbouring code values, computed in float32 as
  (code[k] + code[k + 1]) * 0.5: q = how many midpoints are < x (a tie goes to the lower code).
  Every step is one correctly rounded float32 operation or a comparison, so the CPU loops of every
  instruction set, the CUDA kernel and `quantize` below give the same bytes. An all-zero block is
  stored with scale 0 (any code value times 0 is 0).
- But no positive value rounds to an unsigned code's zero: exp_avg_sq's first threshold is 0, not
  the midpoint, so a second moment below half the code's smallest nonzero value (about 10^-7 of its
  block's largest) is stored as that smallest value, and 0 stands for 0 alone ([Note: no positive
  value rounds to zero] in csrc/adam_math.h). Rounded to 0 while its first moment is not, the
  element's update would be lr * m / eps: in a fine-tune of a pretrained GPT-2 (docs/8bit-state.md)
  some hundreds of elements (embedding rows of bytes the new text lacks) did that every step and
  the loss ended 0.17-0.47 above 32-bit state's; with the floor, within 0.001 of it.
- The kernel's Adam update uses the moments before they are requantized (the new fp32 values of
  this step, held in registers, or on CPU in a scratch of one chunk of blocks), as bitsandbytes'
  does; the rounding affects the next step.
- Blocks are keyed to each parameter's own element index: block k of a parameter is its flattened
  elements [k * block, (k + 1) * block), the last block of a parameter possibly shorter. The layout
  (zerofast/layout.py, `block=`) starts every parameter's slot, every rank's slice and every owner's
  segment at a multiple of the block, so a rank's shard holds whole blocks of whole parameters, the
  scales of its shard are one per block at state_offset // block, and the bytes and scales of a
  parameter are the same at any world size, stage and partition ([Note: padding] in layout.py).
- NaN: a NaN moment (a NaN gradient with no loss scaling to skip the step) is left out of its
  block's scale and stored as code 0; the parameter it updated is NaN already, which is what the
  user sees, as with 32-bit state.
"""

from __future__ import annotations

import torch

STATE_BITS = (8, 32)  # the widths MixedPrecisionPolicy(state_bits=...) takes
DEFAULT_STATE_BLOCK = 256  # elements per scale: bitsandbytes' and Dettmers et al.'s choice
MIN_STATE_BLOCK = 32  # a smaller block spends more on scales (4 bytes each) than it saves


def dynamic_code(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic tree code (`create_dynamic_map(signed, 7, 8)`), 256 float32 values in
    increasing order: for each decade 10^-6 .. 10^0 of the block's largest value, 2^i (signed) or
    2^(i+1) (unsigned) evenly spaced values, plus 0 and 1. Built in float64, rounded once."""
    values = [0.0, 1.0]
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = [0.1 + 0.9 * k / (items - 1) for k in range(items)]
        means = [(a + b) / 2.0 for a, b in zip(bounds[:-1], bounds[1:])]
        decade = 10.0 ** (i - 6)
        values += [decade * m for m in means]
        if signed:
            values += [-decade * m for m in means]
    assert len(values) == 256, len(values)
    return torch.tensor(sorted(values), dtype=torch.float64).float()


def thresholds(code: torch.Tensor) -> torch.Tensor:
    """The 255 rounding thresholds of a code, in float32 as the kernels compute them: the midpoints
    of neighbouring values, but 0 for an unsigned code's first ([Note: quantized state])."""
    t = (code[:-1] + code[1:]) * 0.5
    if code[0] == 0:
        t[0] = 0.0
    return t


def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of the flat float32 `x` (the last block possibly shorter), its largest |value|,
    NaN left out (see [Note: quantized state])."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.abs().nan_to_num(nan=0.0, posinf=float("inf"))
    return padded.view(blocks, block).amax(dim=1) if blocks else padded[:0]


def quantize(x: torch.Tensor, code: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat float32 `x` as (uint8 indices, float32 per-block scales); see [Note: quantized state]."""
    scales = block_scales(x, block)
    per_elem = scales.repeat_interleave(block)[: x.numel()]
    safe = torch.where(per_elem > 0, per_elem, torch.ones_like(per_elem))
    normalized = torch.where(per_elem > 0, x / safe, torch.zeros_like(x))
    normalized = normalized.nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)  # NaN: index 0
    q = torch.searchsorted(thresholds(code.to(x.device)), normalized.contiguous(), right=False)
    return q.to(torch.uint8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 values of (uint8 indices, per-block scales): code[q] * scale."""
    per_elem = scales.repeat_interleave(block)[: q.numel()]
    return code.to(q.device)[q.long()] * per_elem


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


SIGNED_KINDS = ("exp_avg", "momentum_buffer")  # stored in the signed code (Muon's momentum: exp_avg's slot)
QUANTIZED_KINDS = (*SIGNED_KINDS, "exp_avg_sq")


def code_of(kind: str) -> torch.Tensor:
    """The code a state is stored in: signed for exp_avg and momentum_buffer, unsigned for exp_avg_sq."""
    if kind not in QUANTIZED_KINDS:
        raise ValueError(f"zerofast.quant.code_of: kind must be one of {', '.join(QUANTIZED_KINDS)}; got {kind!r}")
    return dynamic_code(kind in SIGNED_KINDS)


def scale_kind(kind: str) -> str:
    """The checkpoint name of a moment's per-block scales ("exp_avg_scale", ...)."""
    return kind + "_scale"


def block_slice(offset: int, numel: int, block: int) -> slice:
    """The blocks of the elements [offset, offset + numel) of one parameter, `offset` a multiple of
    `block` ([Note: quantized state]): a slice of the parameter's per-block scales."""
    return slice(offset // block, offset // block + num_blocks(numel, block))
