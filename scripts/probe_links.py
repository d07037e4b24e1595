"""Calibrate and check the step-time model (zerofast/estimate/timemodel.py) on this machine's gloo ranks.

    python scripts/probe_links.py [--worlds 2 4] [--reps 5]

1. Probe: on W gloo processes (loopback, one thread each), all_reduce and broadcast of 4 KiB to
   16 MiB, median of `reps`; one Link (bandwidth, latency) fitted by least squares to all of
   them through the model's own cost formulas ([Note: the time model]).
2. Compute: the bench GPT (benchmarks/bench_step.py: make_gpt("small"), 6.4M parameters, batch
   8 x 64 per rank) with no communication, on all W ranks at once (so an oversubscribed machine
   slows each rank's compute as it does in the real run): forward, backward, and torch's fused
   AdamW over all parameters (the update of a 1/W shard is taken as 1/W of it).
3. Measured: ZeroAdam stages 1-3, flat, on the same W ranks, median step time.
4. Predicted: timemodel.predict over estimate_traffic's exact collectives of that model, the
   fitted link, the measured compute; with overlap (the model's default) and without (every
   collective exposed), and the error of each against the measured step.
Timing, so not a test: the numbers vary with the machine's load.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
BATCH, SEQ = 8, 64


def _time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {"probe": {}, "compute": {}, "measured": {}}
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4)
        result["probe"][("all_reduce", nbytes)] = _time(lambda: dist.all_reduce(t), reps)
        result["probe"][("broadcast", nbytes)] = _time(lambda: dist.broadcast(t, 0), reps)
    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    x, y = random_batch(make_gpt("small").cfg, BATCH, SEQ, seed=rank)
    plain = make_gpt("small")
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    zero = {}
    for stage in (1, 2, 3):
        model = make_gpt("small")
        zero[stage] = (model, ZeroAdam(model, stage=stage, lr=1e-3))
    state = {}

    def fwd():
        state["loss"] = plain(x, y)[1]

    def bwd():
        plain(x, y)[1].backward()

    def zero_step(stage):
        model, opt = zero[stage]
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()

    # Interleaved rounds: the machine's load (other processes) falls on every case alike.
    cases = {
        "forward": fwd,
        "forward+backward": bwd,
        "adamw": adamw.step,
        **{stage: functools.partial(zero_step, stage) for stage in (1, 2, 3)},
    }
    times = {name: [] for name in cases}
    for _ in range(2):  # warm-up round
        for fn in cases.values():
            fn()
    for _ in range(reps):
        for name, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        (result["measured"] if isinstance(name, int) else result["compute"])[name] = statistics.median(ts)
    for stage in (1, 2, 3):
        result["measured"][f"{stage} comm"] = zero[stage][1].report().comm
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, reps: int) -> dict:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.pt")
        mp.start_processes(_rank, args=(world, port, reps, out), nprocs=world, start_method="spawn")
        return torch.load(out, weights_only=False)


def fit_link(probe: dict, world: int):
    """One Link through the model's formulas: t = bytes_factor * B / bw + latency_factor * alpha +
    reduce_factor * B / reduce_rate, least squares in (1/bw, alpha, 1/reduce_rate), each point
    weighted by 1/t (relative error: the small sizes fix the latency, the large the bandwidths)."""
    import numpy as np

    from zerofast.estimate.timemodel import Link, collective_time

    units = [Link("bw", 1.0, 0.0), Link("lat", float("inf"), 1.0), Link("gamma", float("inf"), 0.0, 1.0)]
    a, b = [], []
    for (name, nbytes), t in probe.items():
        a.append([collective_time(name, nbytes if u.name != "lat" else 0, 1, world, u) / t for u in units])
        b.append(1.0)
    x, *_ = np.linalg.lstsq(np.array(a), np.array(b), rcond=None)
    inv_bw, alpha, inv_gamma = (max(float(v), 1e-15) for v in x)
    return Link("loopback", 1.0 / inv_bw, alpha, 1.0 / inv_gamma)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    from zerofast.estimate.timemodel import Cluster, collective_time, predict
    from zerofast.estimate.traffic import traffic_ops
    from zerofast.tools.models import make_gpt
    from zerofast.tools.quantities import format_bytes, format_seconds

    print(
        f"{os.cpu_count()} cores; gloo ranks on loopback, 1 thread each"
        + ("; more ranks than cores: oversubscribed" if max(args.worlds) > (os.cpu_count() or 1) else "")
    )
    for world in args.worlds:
        r = run(world, args.reps)
        link = fit_link(r["probe"], world)
        print(
            f"\n== W = {world}: fitted link {link.bandwidth / 1e9:.2f} GB/s, latency {link.latency * 1e6:.0f} us, "
            f"reduction {link.reduce_rate / 1e9:.2f} GB/s"
        )
        print(f"{'collective':12s} {'bytes':>9s} {'measured':>10s} {'model':>10s}")
        for (name, nbytes), t in sorted(r["probe"].items()):
            print(
                f"{name:12s} {format_bytes(nbytes):>9s} {format_seconds(t):>10s} "
                f"{format_seconds(collective_time(name, nbytes, 1, world, link)):>10s}"
            )
        c = r["compute"]
        fwd, bwd, adam = c["forward"], c["forward+backward"] - c["forward"], c["adamw"]
        print(
            f"compute per rank: forward {format_seconds(fwd)}, backward {format_seconds(bwd)}, "
            f"AdamW (all {sum(p.numel() for p in make_gpt('small').parameters()):,} params) {format_seconds(adam)}"
        )
        cluster = Cluster(gpus_per_node=world, intra=link, inter=link)
        print(f"{'stage':6s} {'measured':>10s} {'pred.':>10s} {'err':>7s} {'pred. no-ovl':>13s} {'err':>7s}  traffic")
        for stage in (1, 2, 3):
            ops = traffic_ops(make_gpt("small"), world, stage, backend="gloo")
            est = {op.key: 0 for op in ops}
            for op in ops:
                est[op.key] += op.nbytes
            got = {k if "/" in k else "shard/" + k: v for k, v in r["measured"][f"{stage} comm"].items()}
            assert est == got, (est, got)  # unprefixed keys: before shard_size, every collective was the shard group's
            measured = r["measured"][stage]
            preds = [
                predict(ops, world, world, cluster, fwd, bwd, adam / world, overlap).step for overlap in (True, False)
            ]
            errs = [(pr - measured) / measured * 100 for pr in preds]
            print(
                f"{stage:<6d} {format_seconds(measured):>10s} {format_seconds(preds[0]):>10s} {errs[0]:>+6.0f}% "
                f"{format_seconds(preds[1]):>13s} {errs[1]:>+6.0f}%  {format_bytes(sum(est.values()))} (= report().comm)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
