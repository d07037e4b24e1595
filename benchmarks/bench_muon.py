"""ZeroMuon on 4 gloo ranks x 1 thread, the bench GPT (make_gpt("small"): 6.4M parameters, 32 Muon
matrices of 4 shapes), one run, a printed table:

    PYTHONPATH=. python benchmarks/bench_muon.py [--world 4] [--steps 5] [--batch 4]

Per case: the optimizer step's time (opt.step(), median over steps, the slowest rank), Newton-Schulz
time per step on each rank (process CPU time, so that 4 ranks sharing fewer cores do not count each
other's time: max over ranks, mean, and max / (total / N), the makespan against the ideal), payload
bytes per step (report().comm's convention: each reduce's and gather's payload once), and the bytes of
state each rank holds after a step (parameters, gradients, optimizer state, master, bucket buffers,
counted from the tensors: a CPU run has no allocator peak to read; the max over ranks).

Cases: ZeroAdam (stages 1-3, greedy: the baseline for step time and bytes); ZeroMuon stages 1-3 with
greedy by Newton-Schulz cost (the default), greedy by size (balance="numel") and round_robin; DDP +
torch.optim.Muon + AdamW (every rank repeats every Newton-Schulz); "distributed muon": Moonlight's
Distributed Muon on a flat partition (reduce_scatter the gradient, all_gather each matrix's momentum
slices, Newton-Schulz on the whole matrix on every rank, keep this rank's slice, all_gather the
parameters), which isolates the layout's effect. DeepSpeed is not installed here (its Muon is not run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import free_port  # noqa: E402

MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class NSTimer:
    """Wraps zerofast.optim.muon's Newton-Schulz (and torch's, for the DDP case) to sum its CPU time."""

    def __init__(self):
        from torch.optim import _muon

        from zerofast.optim import muon

        self.seconds = 0.0
        self.wall = 0.0
        for module in (muon, _muon):
            inner = module._zeropower_via_newtonschulz if module is _muon else module.zeropower_via_newtonschulz

            def timed(*a, _inner=inner, **k):
                t, w = time.process_time(), time.perf_counter()
                out = _inner(*a, **k)
                self.seconds += time.process_time() - t
                self.wall += time.perf_counter() - w
                return out

            if module is _muon:
                module._zeropower_via_newtonschulz = timed
            else:
                module.zeropower_via_newtonschulz = timed


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def build(case: str, rank: int, world: int):
    """(model, step function doing backward's aftermath: opt.step(), bytes-per-step fn, state-bytes fn)."""
    from zerofast import CommPolicy, ZeroAdam, ZeroMuon
    from zerofast.tools.models import make_gpt

    model = make_gpt("small")
    kind, *rest = case.split()
    if kind in ("zeroadam", "zeromuon"):
        stage, partition = int(rest[0]), rest[1]
        balance = "numel" if partition == "greedy-size" else "cost"
        comm = CommPolicy(partition="round_robin" if partition == "round_robin" else "greedy")
        if kind == "zeroadam":
            opt = ZeroAdam(model, stage=stage, comm=comm, **ADAMW)
        else:
            opt = ZeroMuon(
                model,
                stage=stage,
                comm=comm,
                balance=balance,
                adamw_lr=ADAMW["lr"],
                adamw_betas=ADAMW["betas"],
                adamw_eps=ADAMW["eps"],
                adamw_weight_decay=ADAMW["weight_decay"],
                **MUON,
            )

        def state_bytes():
            r = opt.report().memory
            return r.params + r.grad_shard + r.optimizer + r.master_copy + r.grads + r.bucket_buffers

        return model, opt.step, opt.zero_grad, lambda: sum(opt.report().comm.values()), state_bytes
    muon_params = [p for n, p in model.named_parameters() if p.ndim == 2 and p is not model.wte.weight]
    others = [p for p in model.parameters() if all(p is not q for q in muon_params)]
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opts = [torch.optim.Muon(muon_params, **MUON), torch.optim.AdamW(others, foreach=False, **ADAMW)]

        def step():
            for o in opts:
                o.step()

        def zero():
            for o in opts:
                o.zero_grad()

        total = sum(p.numel() for p in model.parameters()) * 4

        def state_bytes():
            st = [t for o in opts for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
            return _tensor_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + st)

        return ddp, step, zero, lambda: total, state_bytes
    if kind == "distributed_muon":
        dm = DistributedMuon(model, muon_params, others, rank, world)
        return model, dm.step, dm.zero_grad, lambda: dm.bytes, dm.state_bytes
    raise ValueError(case)


class DistributedMuon:
    """Moonlight's Distributed Muon on a flat partition, per matrix: the gradient reduce_scattered
    into N padded slices (each rank keeps its momentum slice), the Nesterov update's slices
    all_gathered into the whole matrix, Newton-Schulz on it on every rank, this rank's slice applied,
    the parameter slices all_gathered. The AdamW parameters: all_reduce and a replicated AdamW (small)."""

    def __init__(self, model, muon_params, others, rank, world):
        from zerofast.optim import muon

        self.muon_mod = muon
        self.model, self.params, self.others, self.rank, self.world = model, muon_params, others, rank, world
        self.slices = [-(-p.numel() // world) for p in muon_params]
        self.momentum = [torch.zeros(n) for n in self.slices]
        self.adamw = torch.optim.AdamW(others, foreach=False, **ADAMW)
        self.bytes = 0

    def _flat(self, t, n):
        flat = torch.zeros(n * self.world)
        flat[: t.numel()] = t.reshape(-1)
        return flat

    def step(self):
        w, r = self.world, self.rank
        self.bytes = 0
        for p in self.others:
            dist.all_reduce(p.grad)
            p.grad /= w
            self.bytes += p.grad.numel() * 4
        self.adamw.step()
        for p, n, buf in zip(self.params, self.slices, self.momentum):
            g = torch.empty(n)
            dist.reduce_scatter_tensor(g, self._flat(p.grad, n))
            g /= w
            buf.lerp_(g, 1 - MUON["momentum"])
            update = g.lerp(buf, MUON["momentum"])
            whole = torch.empty(n * w)
            dist.all_gather_into_tensor(whole, update)
            ortho = self.muon_mod.zeropower_via_newtonschulz(
                whole[: p.numel()].view(p.shape),
                self.muon_mod.NS_COEFFICIENTS,
                self.muon_mod.NS_STEPS,
                self.muon_mod.EPS,
            )
            mine = self._flat(ortho.float(), n)[r * n : (r + 1) * n]
            pflat = self._flat(p.detach(), n)
            own = pflat[r * n : (r + 1) * n]
            own.mul_(1 - MUON["lr"] * MUON["weight_decay"])
            own.add_(mine, alpha=-self.muon_mod.adjust_lr(MUON["lr"], None, tuple(p.shape)))
            gathered = torch.empty(n * w)
            dist.all_gather_into_tensor(gathered, own.clone())
            with torch.no_grad():
                p.copy_(gathered[: p.numel()].view(p.shape))
            self.bytes += 3 * n * w * 4  # reduce_scatter, update all_gather, parameter all_gather

    def zero_grad(self):
        for p in self.model.parameters():
            p.grad = None

    def state_bytes(self):
        st = [t for s in self.adamw.state.values() for t in s.values() if torch.is_tensor(t)]
        return _tensor_bytes(
            list(self.model.parameters()) + [p.grad for p in self.model.parameters()] + st + self.momentum
        )


def run_case(case, rank, world, steps, batch):
    from zerofast.tools.models import random_batch

    timer = NSTimer()
    module, step, zero, bytes_fn, state_fn = build(case, rank, world)
    model = module.module if hasattr(module, "module") else module
    step_times, ns_times, ns_walls, state = [], [], [], 0
    for k in range(steps + 2):  # 2 warm-up steps
        x, y = random_batch(model.cfg, batch, model.cfg.block_size, seed=1000 * k + rank)
        _, loss = module(x, y)
        loss.backward()
        dist.barrier()
        before_ns, before_wall = timer.seconds, timer.wall
        t = time.perf_counter()
        step()
        elapsed = time.perf_counter() - t
        if k >= 2:
            step_times.append(elapsed)
            ns_times.append(timer.seconds - before_ns)
            ns_walls.append(timer.wall - before_wall)
            state = max(state, state_fn())
        zero()
    nbytes = bytes_fn()
    if hasattr(step, "__self__") and hasattr(step.__self__, "remove_hooks"):
        step.__self__.remove_hooks()
    return dict(
        step=statistics.median(step_times),
        ns=statistics.mean(ns_times),
        ns_wall=statistics.mean(ns_walls),
        bytes=nbytes,
        state=state,
    )


CASES = (
    ["zeroadam 1 greedy", "zeroadam 2 greedy", "zeroadam 3 greedy"]
    + [f"zeromuon {s} {p}" for s in (1, 2, 3) for p in ("greedy", "greedy-size", "round_robin")]
    + ["ddp", "distributed_muon"]
)


def _rank_main(rank, world, port, steps, batch, out_path):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = {}
    for case in CASES:
        mine = run_case(case, rank, world, steps, batch)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        rows[case] = everyone
    if rank == 0:
        torch.save(rows, out_path)
    dist.destroy_process_group()


def table(rows, world) -> str:
    lines = [
        f"{'case':28} {'step ms':>8} {'NS max ms':>9} {'NS mean':>8} {'NS max/ideal':>12} "
        f"{'goal ms':>8} {'MB/step':>8} {'state MB':>9} {'NS wall max':>11}"
    ]
    for case, per_rank in rows.items():
        step = max(r["step"] for r in per_rank)
        ns = [r["ns"] for r in per_rank]
        # the ideal: each matrix's Newton-Schulz once, spread evenly. ZeroMuon runs each once, so the
        # total over ranks; DDP and Distributed Muon run every one on every rank, so one rank's.
        once = sum(ns) if case.startswith("zeromuon") else statistics.mean(ns)
        ratio = max(ns) / (once / world) if once else float("nan")
        goal = ""
        if case.startswith("zeromuon"):
            adam_step = max(r["step"] for r in rows[f"zeroadam {case.split()[1]} greedy"])
            goal = f"{(adam_step + max(ns)) * 1.05 * 1e3:.1f}"
        lines.append(
            f"{case:28} {step * 1e3:8.1f} {max(ns) * 1e3:9.1f} {statistics.mean(ns) * 1e3:8.1f} "
            f"{ratio:12.2f} {goal:>8} {per_rank[0]['bytes'] / 2**20:8.2f} "
            f"{max(r['state'] for r in per_rank) / 2**20:9.2f} {max(r['ns_wall'] for r in per_rank) * 1e3:11.1f}"
        )
    return "\n".join(lines)


def _run(world: int, steps: int, batch: int) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(_rank_main, args=(world, free_port(), steps, batch, out), nprocs=world)
        return torch.load(out)


def test_muon_table(benchmark, capsys):
    """`make bench`: the whole table, one run (its own timings inside; pytest-benchmark times the run)."""
    rows = benchmark.pedantic(_run, args=(4, 5, 4), rounds=1, iterations=1)
    with capsys.disabled():
        print("\n" + table(rows, 4))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    rows = _run(args.world, args.steps, args.batch)
    print(
        f"ZeroMuon benchmark: {args.world} gloo ranks x 1 thread, GPT small (6.4M), batch {args.batch}x64, "
        f"median of {args.steps} steps"
    )
    print(table(rows, args.world))
    print(
        "goal ms: ZeroAdam's step (same stage) + the Newton-Schulz makespan, + 5%; "
        "NS max/ideal: the busiest rank's Newton-Schulz over the total / N"
    )


if __name__ == "__main__":
    main()
