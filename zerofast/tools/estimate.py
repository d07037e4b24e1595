"""The ZeRO paper's memory table as an estimator: per-rank bytes by its formulas.

Per parameter, mixed-precision Adam holds 2 bytes of parameter, 2 of gradient and 12 of optimizer
state (fp32 master copy, m, v): the paper's 16Φ. In fp32 there is no separate master copy (the
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
gradients are its buckets, reduced in place ([Note: grads as bucket views]): padding only, unless
it reduces in another dtype (then it copies, as stage 2 does, and keeps a reduced shard).

Pure arithmetic: the options are checked and resolved by zerofast/config.py, the same code as
ZeroAdam's, so the estimator accepts exactly what ZeroAdam accepts; no compiled code is imported.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import (DEFAULT_BUCKET_MB, CommPolicy, check_stage, comm_policy, precision_policy, resolve_plan,
                      unit_policy)
from ..layout import ALIGN


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


# Where the estimator's keywords of before the policies live now.
_MOVED = {"precision": "mixed_precision= (None, 'bf16', 'fp16' or a MixedPrecisionPolicy, as ZeroAdam takes it)",
          "bucket_mb": "comm=CommPolicy(bucket_mb=...)", "bucket_buffers": "comm=CommPolicy(bucket_buffers=...)"}


def estimate_memory(model_or_param_count, world: int, stage: int, mixed_precision=None, comm=None, units=None,
                    **moved) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state for DDP (stage 0) or a ZeRO stage,
    by the paper's formulas, plus the buffers ZeroAdam adds. mixed_precision, comm and units as
    ZeroAdam takes them (stage 0 checks them alone). Stage 3's buckets are its units, whose size
    the estimate cannot know from a count: it takes stage 2's default bucket for each. A count is
    of trainable parameters; a module's frozen parameters are counted apart, as parameter bytes
    only (in the parameters' dtype; sharded in stage 3, whole in stages 0-2)."""
    for name in moved:
        if name in _MOVED:
            raise TypeError(f"estimate_memory: the keyword {name}= is now {_MOVED[name]}")
        raise TypeError(f"estimate_memory got an unexpected keyword argument {name!r}")
    frozen = 0  # frozen parameters: their bytes only, sharded in stage 3 ([Note: frozen parameters in stage 3])
    if isinstance(model_or_param_count, nn.Module):
        numel = sum(p.numel() for p in model_or_param_count.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model_or_param_count.parameters() if not p.requires_grad)
    elif isinstance(model_or_param_count, int) and not isinstance(model_or_param_count, bool) \
            and model_or_param_count >= 0:
        numel = model_or_param_count
    else:
        raise ValueError(f"estimate_memory: model_or_param_count must be an nn.Module or a count >= 0; "
                         f"got {model_or_param_count!r}")
    if not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise ValueError(f"estimate_memory: world must be an integer >= 1; got {world!r}")
    check_stage(stage, "estimate_memory", stages=(0, 1, 2, 3))
    if stage == 0:  # DDP: the options are checked all the same, so a typo is not silently ignored
        precision, comm_p = precision_policy(mixed_precision), comm_policy(comm)
        unit_policy(units)
        param_dtype, reduce_dtype = precision.param_dtype, precision.reduce_dtype or precision.param_dtype
        bucket_bytes, buffers, views = 0, comm_p.bucket_buffers, False
    else:
        plan = resolve_plan(stage, mixed_precision=mixed_precision, comm=comm, units=units)
        param_dtype, reduce_dtype = plan.param_dtype, plan.reduce_dtype
        bucket_bytes = plan.bucket_bytes or int(DEFAULT_BUCKET_MB[2] * 2**20)  # stage 3: a unit's stand-in
        buffers, views = plan.bucket_buffers, plan.grads_as_bucket_views
    p_bytes, r_bytes = _itemsize(param_dtype), _itemsize(reduce_dtype)
    g_bytes = p_bytes if stage < 2 else r_bytes      # full gradients in the parameters' dtype
    o_bytes = 8 + (4 if param_dtype != torch.float32 else 0)  # m, v and a separate fp32 master
    shard = -(-numel // world)  # ceil: this rank's part
    params = p_bytes * (shard if stage == 3 else numel)
    params += p_bytes * (-(-frozen // world) if stage == 3 else frozen)
    grads = g_bytes * (shard if stage >= 2 else numel)
    optimizer = o_bytes * (shard if stage >= 1 else numel)
    extra = 0
    if stage >= 1:
        all_grads = r_bytes * numel
        copied = stage >= 2 or not views  # gradients copied into pooled buffers (bucket_buffers=0: no bound)
        pooled = min(buffers * bucket_bytes, all_grads) if buffers else all_grads
        extra += pooled if copied else 0
        extra += r_bytes * shard if stage == 1 and not views else 0  # stage 1's reduced shard in reduce_dtype
        padding_elements = ALIGN * world * max(1, -(-r_bytes * numel // bucket_bytes))
        extra += padding_elements * (p_bytes + r_bytes + o_bytes)
    return MemoryEstimate(stage, world, params, grads, optimizer, extra)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


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
                                description="Per-rank memory of DDP and ZeRO stages 1-3 by the ZeRO paper's formulas.")
    p.add_argument("--params", type=parse_count, required=True,
                   help="trainable parameters (Φ): 7000000, 7e9, 7.5B, 350M, 1.2T, 125K")
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks (N)")
    p.add_argument("--stage", type=int, default=None, help="one stage (0 = DDP, 1, 2, 3); default: all")
    p.add_argument("--precision", default="mixed",
                   help="mixed or bf16 (2+2+12 bytes), fp16 (the same), or fp32 (4+4+8); default mixed")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="ZeroAdam's CommPolicy.bucket_mb, stages 1 and 2 (default 25 for stage 1, 8 for stage 2)")
    p.add_argument("--bucket-buffers", type=int, default=CommPolicy.bucket_buffers,
                   help=f"ZeroAdam's CommPolicy.bucket_buffers (default {CommPolicy.bucket_buffers}; 0: no bound)")
    args = p.parse_args(argv)
    if args.params < 0:
        p.error(f"--params must be 0 or more; got {args.params}")
    if args.world < 1:
        p.error(f"--world must be at least 1; got {args.world}")
    if args.stage is not None and args.stage not in (0, 1, 2, 3):
        p.error(f"--stage must be 0 (DDP), 1, 2 or 3; got {args.stage}")
    precisions = {"mixed": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": None}
    if args.precision not in precisions:
        p.error(f"--precision must be mixed, bf16, fp16 or fp32; got {args.precision!r}")
    try:
        comm = CommPolicy(bucket_mb=args.bucket_mb, bucket_buffers=args.bucket_buffers)
    except ValueError as e:
        p.error(str(e).replace("CommPolicy: bucket_mb", "--bucket-mb").replace("CommPolicy: bucket_buffers",
                                                                               "--bucket-buffers"))
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    rows = []
    for s in stages:
        # Stage 3 takes no bucket size (its buckets are its units): in the table of every stage the
        # option applies to the others; asked for stage 3 alone, it is ZeroAdam's error.
        stage_comm = CommPolicy(bucket_buffers=comm.bucket_buffers) if s == 3 and args.stage is None else comm
        try:
            rows.append(estimate_memory(args.params, args.world, s, precisions[args.precision], stage_comm))
        except ValueError as e:
            p.error(str(e))
    print(f"Φ = {args.params:,} parameters, N = {args.world} ranks, {args.precision} Adam; bytes per rank")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
