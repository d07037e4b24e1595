"""The main job's closing table: report (each rank's measured bytes next to the ZeRO paper's memory
table, and the communication per step next to its 2Φ / 3Φ) and _median (a step time, warm-up left
out)."""

from __future__ import annotations

from ...estimate import estimate_memory
from ._loop import _precision


def _median(xs):
    xs = sorted(xs[1:] or xs)  # the first step pays for warm-up
    return xs[len(xs) // 2] if xs else float("nan")


def report(args, measured_all, comm, numel, world) -> None:
    est = estimate_memory(numel, world, args.stage, _precision(args), shard_size=args.shard_size)
    p_bytes = 2 if args.mixed_precision else 4
    phi = p_bytes * numel
    moments = "8" if args.state_bits == 32 else "2 + scales"
    table = f"2 + 2 + 4 + {moments}" if args.mixed_precision else f"4 + 4 + {moments}"
    print(
        f"\nper rank, bytes after step() ({args.mixed_precision or 'fp32'}: {table} per parameter; "
        f"estimate = the ZeRO paper's memory table)"
    )
    print(
        f"{'rank':>4s} {'params':>12s} {'(est)':>12s} {'grads':>12s} {'(est)':>12s} "
        f"{'optimizer':>12s} {'(est)':>12s} {'buckets':>10s}"
    )
    for r, m in enumerate(measured_all):
        print(
            f"{r:4d} {m['params']:12,d} {est.params:12,d} {m['grads']:12,d} {est.grads:12,d} "
            f"{m['optimizer']:12,d} {est.optimizer:12,d} {m['buckets']:10,d}"
        )
    paper = 3 if args.stage == 3 else 2
    k = args.shard_size or world
    for group, formula, f_bytes in (("shard", f"{paper}Φ", paper * phi), ("replicate", f"Φ/K = Φ/{k}", phi // k)):
        mine = {name: v for name, v in comm.items() if name.startswith(group + "/")}
        if not mine:
            continue
        moved = sum(v for name, v in mine.items() if not name.split("/")[-1].startswith("all_reduce_"))
        where = (
            ("within each group of K ranks" if group == "shard" else "across machines, between the replicas")
            if k != world
            else "between all ranks"
        )
        print(
            f"communication per step, {group} ({where}): {moved:,d} bytes = {moved / phi:.2f} Φ (formula: "
            f"{formula} = {f_bytes:,d}; Φ = {phi:,d} bytes of {args.mixed_precision or 'fp32'} parameters)  "
            f"by collective: {mine}"
        )
