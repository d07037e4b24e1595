"""Persistent gloo ranks that a benchmark drives one step at a time.

pytest-benchmark times a function in this (parent) process; each call sends "step" to every rank
and waits until all have finished one training step, so a round is exactly one distributed step
(plus a queue round trip, well under a millisecond). Only small messages cross the queues.
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp
from harness import free_port


def _worker(rank, world, port, build, commands, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        step = build(rank, world)
        results.put(("ready", rank, None))
        while True:
            cmd = commands.get()
            if cmd == "stop":
                break
            if cmd == "info":  # what the case reports about itself (step.info(), when it has one)
                results.put(("info", rank, getattr(step, "info", lambda: None)()))
                continue
            step()
            results.put(("done", rank, None))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put(("error", rank, traceback.format_exc()))


class RankPool:
    """`build(rank, world)` runs once in each rank and returns a no-argument `step` function."""

    def __init__(self, build, world: int = 2, timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, build, self.commands[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect("ready")

    def _get(self):
        """The next result, or a RuntimeError as soon as a rank has died without one (a crash that
        no except clause sees: a signal, the OOM killer), instead of waiting out the timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    self.close()
                    what = (
                        f"rank {dead[0][0]} died (exit code {dead[0][1]})" if dead else f"no result in {self.timeout} s"
                    )
                    raise RuntimeError(f"RankPool: {what}") from None

    def _collect(self, expected: str) -> None:
        for _ in range(self.world):
            kind, rank, info = self._get()
            if kind == "error":
                self.close()
                raise RuntimeError(f"rank {rank} failed:\n{info}")
            assert kind == expected, (kind, expected)

    def info(self) -> list:
        """Each rank's step.info() (None where the case has none), by rank."""
        for q in self.commands:
            q.put("info")
        out = [None] * self.world
        for _ in range(self.world):
            kind, rank, info = self._get()
            if kind == "error":
                self.close()
                raise RuntimeError(f"rank {rank} failed:\n{info}")
            out[rank] = info
        return out

    def step(self) -> None:
        for q in self.commands:
            q.put("step")
        self._collect("done")

    def close(self) -> None:
        for q in self.commands:
            q.put("stop")
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run_interleaved(build, cases, world: int, rounds: int, benchmark) -> tuple[dict, dict]:
    """One RankPool per case (`build(case, rank, world)` sets one rank up, as RankPool's build), all
    alive together: a warm-up step each, then `rounds` rounds of one step per case, the order reversed
    every other round, so that a change in the machine's load hits every case alike; timed once under
    benchmark.pedantic. Returns each case's step seconds and each pool's info() by rank."""
    import functools

    pools = {}
    try:
        for case in cases:
            pools[case] = RankPool(functools.partial(build, case), world=world)
        times = benchmark.pedantic(_interleaved, args=(pools, rounds), rounds=1, iterations=1)
        return times, {case: pool.info() for case, pool in pools.items()}
    finally:
        for pool in pools.values():
            pool.close()


def _interleaved(pools: dict, rounds: int) -> dict[str, list[float]]:
    times = {case: [] for case in pools}
    for pool in pools.values():  # warm-up: one step each
        pool.step()
    for r in range(rounds):
        order = list(pools) if r % 2 == 0 else list(reversed(pools))
        for case in order:
            start = time.perf_counter()
            pools[case].step()
            times[case].append(time.perf_counter() - start)
    return times
