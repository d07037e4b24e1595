"""The main job's closing table: report (each rank's measured bytes next to the ZeRO paper's memory table, the
offloaded state and its I/O, the communication per step next to 2Φ / 3Φ) and _median (warm-up left out)."""

from __future__ import annotations

from ...config import CommPolicy
from ...estimate import estimate_memory
from ..quantities import format_bytes
from ._loop import _precision
from ._progress import io_cost, placement


def _median(xs):
    xs = sorted(xs[1:] or xs)  # the first step pays for warm-up
    return xs[len(xs) // 2] if xs else float("nan")


def report(args, measured_all, comm, numel, world, device: str) -> None:
    tp = getattr(args, "tp", None) or 1  # --tp: each rank holds 1/tp of the model, ZeRO over world/tp
    pp = getattr(args, "pp", None) or 1  # --pp: each rank a stage's part (its own numel), ZeRO over its stage's
    piped = bool(getattr(args, "pp", None))  # --pp 1 too: one stage, its parts kept gathered for the step

    everyone = world

    def estimate(count):  # device: the model's device type; offloaded, the optimizer column is what stays on it
        return estimate_memory(
            count,
            everyone,
            args.stage,
            mixed_precision=_precision(args),
            offload=args.offload,
            device=device,
            tp=tp,
            pp=pp,
            comm=CommPolicy(shard_size=args.shard_size),
        )

    p_bytes = 2 if args.mixed_precision else 4
    phi = p_bytes * -(-numel // tp)
    world //= tp * pp
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
        est = estimate(m["numel"] if pp > 1 else numel)  # a DTensor's numel is the whole tensor's
        print(
            f"{r:4d} {m['params']:12,d} {est.params:12,d} {m['grads']:12,d} {est.grads:12,d} "
            f"{m['optimizer']:12,d} {est.optimizer:12,d} {m['buckets']:10,d}"
        )
    _offload_report(args, measured_all)
    # Stage 3 under --pp keeps the parts gathered from the step's first forward to its last backward
    # ([Note: pipeline accumulation]): one gather a step, not the paper's two.
    paper = 3 if args.stage == 3 and not piped else 2
    k = args.shard_size or world
    for group, formula, f_bytes in (("shard", f"{paper}Φ", paper * phi), ("replicate", f"Φ/K = Φ/{k}", phi // k)):
        mine = {name: v for name, v in comm.items() if name.startswith(group + "/")}
        if not mine:
            continue
        moved = sum(v for name, v in mine.items() if not name.split("/")[-1].startswith("all_reduce_"))
        where = (
            ("within each group of K ranks" if group == "shard" else "across machines, between the replicas")
            if k != world
            else ("between the data-parallel ranks of each tp rank" if tp > 1 else "between all ranks")
            if pp == 1
            else "between the data-parallel ranks of rank 0's pipeline stage"
        )
        print(
            f"communication per step, {group} ({where}): {moved:,d} bytes = {moved / phi:.2f} Φ (formula: "
            f"{formula} = {f_bytes:,d}; Φ = {phi:,d} bytes of {args.mixed_precision or 'fp32'} parameters"
            f"{f' on each of {tp} tensor-parallel ranks' if tp > 1 else ''}"
            f"{' of the part rank 0 holds' if pp > 1 else ''})  "
            f"by collective: {mine}"
        )


def _offload_report(args, measured_all) -> None:
    """With --offload: where each rank's optimizer state lives (the table's optimizer column counts
    only what stays with the parameters) and, on disk, what the last step's I/O cost."""
    offloads = [m.get("offload") for m in measured_all]
    if not any(offloads):
        return
    where = placement(offloads[0])
    if offloads[0].state == "disk":
        print(
            f"optimizer state {where} under {args.offload[len('disk:') :]} (not in the optimizer column), "
            f"per rank: files (two generations), window in memory, the last step's I/O"
        )
        for r, o in enumerate(offloads):
            print(
                f"{r:4d} files {format_bytes(o.disk_bytes)}, window {format_bytes(o.window_bytes)}, {io_cost(o)} "
                f"({o.io_wait_seconds * 1e3:.1f} of {o.phase3_seconds * 1e3:.1f} ms waiting for I/O)"
            )
    elif not any(o.host_bytes for o in offloads):
        print(f"optimizer state {where} (--offload host): on the CPU it is there already, in the optimizer column")
    else:
        held = ", ".join(format_bytes(o.host_bytes) for o in offloads)
        print(f"optimizer state {where} (--offload host; not in the optimizer column), per rank: {held}")
