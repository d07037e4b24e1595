"""Run a function on N gloo ranks, each in its own process, and bring back what each returned.

    results = run_ranks(fn, world_size=3, args=(...), timeout=120)

- Every rank: a spawned process, `torch.set_num_threads(1)`, a gloo process group on a free
  loopback port, then `fn(rank, world_size, *args)`.
- Results travel through files (torch.save), never through a pipe: a large result sent through a
  multiprocessing queue can deadlock when the pipe fills before the parent reads.
- A rank that raises: its traceback is raised in the test (RankFailed), every rank's shown.
- A rank still running after `timeout` seconds: all ranks are killed and the test fails naming the
  ranks that did not finish, instead of hanging the suite.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """One or more ranks raised or hung."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, outdir, fn, args, timeout, backend):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    path = os.path.join(outdir, f"rank{rank}")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path + ".tmp")
    except BaseException:  # noqa: BLE001 (every failure must reach the parent)
        torch.save({"ok": False, "error": traceback.format_exc()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0, backend: str = "gloo") -> list:
    """Run fn(rank, world_size, *args) on `world_size` ranks (gloo unless told; nccl puts rank r on
    GPU r); return their results by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zerofast-ranks-") as outdir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, outdir, fn, args, timeout, backend),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        paths = [os.path.join(outdir, f"rank{r}") for r in range(world_size)]
        while time.monotonic() < deadline:
            if all(os.path.exists(p) for p in paths):
                break
            # A rank that failed writes its file at once, and one that died writes none: don't wait
            # for the others to time out.
            if any(_failed(p) for p in paths) or any(
                    not proc.is_alive() and not os.path.exists(path) for proc, path in zip(procs, paths)):
                time.sleep(0.5)
                break
            time.sleep(0.05)
        hung = [r for r, path in enumerate(paths) if not os.path.exists(path) and procs[r].is_alive()]
        died = [f"--- rank {r} exited with code {procs[r].exitcode} without a result (see its stderr above)"
                for r, path in enumerate(paths) if not os.path.exists(path) and not procs[r].is_alive()]
        outcomes = [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        errors = [f"--- rank {r} raised:\n{o['error']}" for r, o in enumerate(outcomes)
                  if o is not None and not o["ok"]] + died
        if errors:
            raise RankFailed(f"{len(errors)} of {world_size} ranks failed"
                             + (f" (ranks {hung} did not finish)" if hung else "") + "\n" + "\n".join(errors))
        if hung:
            raise RankFailed(f"ranks {hung} of {world_size} did not finish within {timeout:.0f} s "
                             f"(a hang: a collective some ranks never reached?)")
        return [o["result"] for o in outcomes]


def _failed(path: str) -> bool:
    if not os.path.exists(path):
        return False
    try:
        return not torch.load(path, weights_only=False)["ok"]
    except Exception:  # noqa: BLE001 (being written)
        return False
