"""The seed's memory table as an estimator, and the per-rank bytes measured from the tensors.

Per parameter, mixed-precision Adam holds 2 bytes of parameter, 2 of gradient and 12 of optimizer
state (fp32 master copy, m, v): the seed's 16Φ. In fp32 there is no separate master copy (the
parameter is the master): 4 + 4 + 8. Each stage keeps a part of each on a rank:

| stage       | parameters | gradients | optimizer state |
|-------------|------------|-----------|-----------------|
| 0 (DDP)     | all        | all       | all             |
| 1           | all        | all       | 1/N             |
| 2           | all        | 1/N       | 1/N             |
| 3           | 1/N        | 1/N       | 1/N             |

ZeroAdam adds buffers the table has no row for ("zerofast_extra"): in stages 2 and 3 the gradient
bucket buffers alive at once (bucket_buffers of them: [Note: buffers in flight] in
csrc/buckets.cpp), and padding (each bucket padded to a multiple of world x 4 elements). Stage 1's
gradients are its buckets, reduced in place ([Note: grads as bucket views]): padding only.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch.nn as nn

from ..layout import ALIGN
from ..optim.zero_adam import DEFAULT_BUCKET_MB

BYTES = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}  # parameter, gradient, optimizer state per element


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int             # 0 is DDP
    world: int
    params: int            # bytes per rank
    grads: int
    optimizer: int
    zerofast_extra: int    # bucket buffers, padding, stage 1's gradient shard (0 for DDP)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.zerofast_extra


def estimate_memory(model_or_param_count, world: int, stage: int, precision: str = "fp32",
                    bucket_mb: float | None = None, bucket_buffers: int = 2) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state for DDP (stage 0) or a ZeRO stage,
    by the seed's formulas, plus the buffers ZeroAdam adds. bucket_mb and bucket_buffers as ZeroAdam
    takes them (None: ZeroAdam's default for the stage; stage 3's buckets are its units, which
    bucket_mb stands for here)."""
    if isinstance(model_or_param_count, nn.Module):
        numel = sum(p.numel() for p in model_or_param_count.parameters() if p.requires_grad)
    elif isinstance(model_or_param_count, int) and not isinstance(model_or_param_count, bool) \
            and model_or_param_count >= 0:
        numel = model_or_param_count
    else:
        raise ValueError(f"estimate_memory: model_or_param_count must be an nn.Module or a count >= 0; "
                         f"got {model_or_param_count!r}")
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"estimate_memory: world must be an integer >= 1; got {world!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"estimate_memory: stage must be 0 (DDP), 1, 2 or 3; got {stage!r}")
    if precision not in BYTES:
        raise ValueError(f"estimate_memory: precision must be fp32 or mixed; got {precision!r}")
    if bucket_mb is None:
        bucket_mb = DEFAULT_BUCKET_MB.get(stage, DEFAULT_BUCKET_MB[2])
    if not bucket_mb > 0:
        raise ValueError(f"estimate_memory: bucket_mb must be positive; got {bucket_mb!r}")
    if not (isinstance(bucket_buffers, int) and bucket_buffers >= 1):
        raise ValueError(f"estimate_memory: bucket_buffers must be an integer >= 1; got {bucket_buffers!r}")
    p_bytes, g_bytes, o_bytes = BYTES[precision]
    shard = -(-numel // world)  # ceil: this rank's part
    params = p_bytes * (shard if stage == 3 else numel)
    grads = g_bytes * (shard if stage >= 2 else numel)
    optimizer = o_bytes * (shard if stage >= 1 else numel)
    extra = 0
    if stage >= 1:
        buckets = min(bucket_buffers * int(bucket_mb * 2**20), g_bytes * numel) if stage >= 2 else 0
        padding_elements = ALIGN * world * max(1, -(-g_bytes * numel // int(bucket_mb * 2**20)))
        extra = buckets + padding_elements * (p_bytes + g_bytes + o_bytes)
    return MemoryEstimate(stage, world, params, grads, optimizer, extra)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(rows: list[MemoryEstimate]) -> str:
    head = f"{'':10s} {'params':>12s} {'grads':>12s} {'optimizer':>12s} {'zerofast+':>12s} {'total':>12s}"
    lines = [head]
    for r in rows:
        name = "DDP" if r.stage == 0 else f"stage {r.stage}"
        lines.append(f"{name:10s} {format_bytes(r.params):>12s} {format_bytes(r.grads):>12s} {format_bytes(r.optimizer):>12s} "
                     f"{format_bytes(r.zerofast_extra):>12s} {format_bytes(r.total):>12s}")
    return "\n".join(lines)


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """A parameter count as people write it: 7000000, 7_000_000, 7e9, 7.5B, 350M, 1.2T, 125K."""
    s = text.strip().replace("_", "").replace(",", "")
    scale = 1
    if s[-1:].upper() in _SUFFIXES:
        scale, s = _SUFFIXES[s[-1].upper()], s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7e9, 7.5B or 350M)") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}")
    if abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise argparse.ArgumentTypeError(f"not a whole number of parameters: {text!r} = {value}")
    return int(round(value))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerofast.estimate",
                                description="Per-rank memory of DDP and ZeRO stages 1-3 by the seed's formulas.")
    p.add_argument("--params", type=parse_count, required=True,
                   help="trainable parameters (Φ): 7000000, 7e9, 7.5B, 350M, 1.2T, 125K")
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks (N)")
    p.add_argument("--stage", type=int, default=None, help="one stage (0 = DDP, 1, 2, 3); default: all")
    p.add_argument("--precision", default="mixed", help="mixed (2+2+12 bytes) or fp32 (4+4+8); default mixed")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="ZeroAdam's bucket size (default: ZeroAdam's, 25 for stage 1 and 8 for stages 2 and 3)")
    p.add_argument("--bucket-buffers", type=int, default=2, help="ZeroAdam's bucket_buffers (default 2)")
    args = p.parse_args(argv)
    if args.params < 0:
        p.error(f"--params must be 0 or more; got {args.params}")
    if args.world < 1:
        p.error(f"--world must be at least 1; got {args.world}")
    if args.stage is not None and args.stage not in (0, 1, 2, 3):
        p.error(f"--stage must be 0 (DDP), 1, 2 or 3; got {args.stage}")
    if args.precision not in BYTES:
        p.error(f"--precision must be mixed or fp32; got {args.precision!r}")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        p.error(f"--bucket-mb must be positive; got {args.bucket_mb}")
    if args.bucket_buffers < 1:
        p.error(f"--bucket-buffers must be at least 1; got {args.bucket_buffers}")
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    rows = [estimate_memory(args.params, args.world, s, args.precision, args.bucket_mb, args.bucket_buffers)
            for s in stages]
    print(f"Φ = {args.params:,} parameters, N = {args.world} ranks, {args.precision} Adam; bytes per rank")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
