"""Run a function on N gloo ranks, each in its own process, and bring back what each returned.

    results = run_ranks(fn, world_size=3, args=(...), timeout=120)

- Every rank: a process with `torch.set_num_threads(1)` and a gloo process group on a free loopback
  port, running `fn(rank, world_size, *args)`.
- The processes are kept for the next call of the same world size (a pool per world size, as
  benchmarks/rankpool.py keeps its ranks): spawning a rank, importing torch and forming the
  group costs seconds, paid once per world size instead of once per test. Before each call every
  rank re-seeds torch's default generator with the seed a fresh process starts from, so a function
  sees what it would in a new process, and the process groups a call created are destroyed before
  the next (_drop_groups); the default group and imported modules carry over.
- Results travel through files (torch.save), never through a pipe: a large result sent through a
  multiprocessing queue can deadlock when the pipe fills before the parent reads.
- A rank that raises: its traceback is raised in the test (RankFailed), every rank's shown. The
  rank's process then exits, so that the ranks waiting for it in a collective fail at once (the
  connection closes) and report too: the test waits until every rank has written its outcome or
  died, with no grace period to guess.
- A rank still running after `timeout` seconds, or one that died: all ranks of that pool are killed
  (the next call starts a new pool) and the test fails naming the ranks that did not finish,
  instead of hanging the suite.
- backend="nccl" (rank r on GPU r) starts fresh processes every call, as each test needs its GPUs;
  so does fresh=True on gloo.
- Every rank process is a fork of one server process that imported torch, zerofast, transformers
  and the test helpers once (multiprocessing's forkserver, `context()`): an interpreter that
  starts from nothing spends 3-5 CPU seconds importing them (measured: 3 spawned ranks 13 CPU
  seconds, 3 forks of the server none to speak of, 0.09 s). The server only imports: no process
  group, no CUDA, no thread pool of torch's exists in it when it forks, so a fork starts as clean
  as a spawned process (and with torch's default generator at the same seed).
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
_FRESH_SEED = torch.initial_seed()  # the default generator's seed in a new process
# What the ranks use, imported once in the server: `import zerofast` leaves Dynamo (imported by every
# torch optimizer when made), the optimizer and DCP to first use, which in each rank would cost
# seconds of CPU (a fault test's ten ranks at once: 20 s of its wall time).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "zerofast",
    "zerofast.optim.zero_adam",
    "zerofast.checkpoint.io",
]
_PRELOAD += [
    "zerofast.tools.models",
    "transformers",
    "harness",
    "tolerances",
    "models",
    "training",
    "oracles",
    "probes",
]
_CONTEXT = None


def context():
    """The multiprocessing context every rank process of the tests starts from: forks of a server
    that imported _PRELOAD once (see the module's docstring)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
    return _CONTEXT


def launch_env() -> dict[str, str]:
    """The environment of a launched job (torchrun, a trainer): this checkout importable, one thread
    a rank, Hugging Face offline (models from a config, never a download), and no WORLD_SIZE left
    from an enclosing launch."""
    env = dict(
        os.environ,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("WORLD_SIZE", None)
    return env


class RankFailed(AssertionError):
    """One or more ranks raised or hung."""


_PORT_BLOCK = 1000  # ports a pytest-xdist worker draws from
_drawn = [0]  # ports this process has drawn


def free_port() -> int:
    """A port for a launch's store (MASTER_PORT, a rendezvous endpoint) that no other process is given
    before the launch binds it. Not bind(0)'s: the kernel hands that port out again as soon as it is
    closed, to the next ephemeral port asked for, and under load the suite opens gloo connections by
    the hundred, so another test's connection could take it before this launch's store bound it (a
    store that could not bind, its clients reaching another job's socket: a launch that hung now and
    then on the loaded CI machine). These come from below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range), where it never picks one itself, a block of its own
    for each pytest-xdist worker, in turn; one still bound (a job left running, a connection in
    TIME_WAIT) is passed over."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % 8 if worker[2:].isdigit() else 0
    start = _ephemeral_low() - _PORT_BLOCK * (index + 1)
    for _ in range(_PORT_BLOCK):
        port = start + _drawn[0] % _PORT_BLOCK
        _drawn[0] += 1
        if port < 1024:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in this worker's block below {_ephemeral_low()}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _run_one(rank, world_size, path, fn, args, pooled: bool = False) -> bool:
    """Run the function and write its outcome to `path` (complete when the name appears); True if
    it returned."""
    try:
        if pooled:
            _drop_groups()
        torch.manual_seed(_FRESH_SEED)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path + ".tmp")
        ok = True
    except BaseException:  # noqa: BLE001 (every failure must reach the parent)
        torch.save({"ok": False, "error": traceback.format_exc()}, path + ".tmp")
        ok = False
    os.replace(path + ".tmp", path)
    return ok


def _drop_groups() -> None:
    """Destroy the process groups the previous pooled job created, so that this job finds the process
    as a fresh one would. Each gloo group keeps its own threads (a run loop and a TCP loop per group,
    polling), which live as long as the group: a rank that had run a few hundred tests held hundreds
    of them, and ten idle pool ranks took most of a core from the launches running beside them. The
    garbage collection first releases what the job's optimizers still held through reference
    cycles; the barrier lets every rank finish the previous job's last collective before the
    connections close (a job's outcome is published when its function returns, as a fresh process's
    would be)."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    gc.collect()
    dist.barrier()
    for group in list(distributed_c10d._world.pg_map):  # no public list of live groups in torch 2.14
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _init(rank, world_size, port, timeout, backend):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


def _pool_main(rank, world_size, port, commands):
    """A pooled rank: form the group once, then run each (fn, args, path) it is sent."""
    try:
        _init(rank, world_size, port, 600, "gloo")
    except BaseException:  # noqa: BLE001 (the parent sees the rank die and reports it)
        traceback.print_exc()
        return
    while True:
        job = commands.get()
        if job is None:
            return
        if not _run_one(rank, world_size, *job, pooled=True):
            # The pool is discarded after a failure anyway. Leaving now closes this rank's
            # connections, so a peer blocked in a collective with it raises at once and writes its
            # own outcome, for which the parent then waits. os._exit: an orderly exit can block on
            # the process group's threads.
            os._exit(1)


def _fresh_main(rank, world_size, port, path, fn, args, timeout, backend):
    import torch.distributed as dist

    try:
        _init(rank, world_size, port, timeout, backend)
    except BaseException:  # noqa: BLE001
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        return
    _run_one(rank, world_size, path, fn, args)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class _Pool:
    def __init__(self, world_size: int):
        ctx = context()
        port = free_port()
        self.commands = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_pool_main, args=(r, world_size, port, self.commands[r]), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def close(self, kill: bool) -> None:
        for p, q in zip(self.procs, self.commands):
            if not kill and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close(kill=False)
    _POOLS.clear()


def run_ranks(
    fn, world_size: int, args: tuple = (), timeout: float = 120.0, backend: str = "gloo", fresh: bool = False
) -> list:
    """Run fn(rank, world_size, *args) on `world_size` ranks (gloo unless told; nccl puts rank r on
    GPU r); return their results by rank. fresh=True: new processes for this call (gloo too), for
    a test about what a process has accumulated (Dynamo's caches), which the pool carries over."""
    pooled = backend == "gloo" and not fresh
    with tempfile.TemporaryDirectory(prefix="zerofast-ranks-") as outdir:
        paths = [os.path.join(outdir, f"rank{r}") for r in range(world_size)]
        if pooled:
            pool = _POOLS.get(world_size)
            if pool is None or not all(p.is_alive() for p in pool.procs):
                if pool is not None:
                    pool.close(kill=True)
                pool = _POOLS[world_size] = _Pool(world_size)
            for q, path in zip(pool.commands, paths):
                q.put((path, fn, args))
            procs = pool.procs
        else:
            ctx = context()
            port = free_port()
            procs = [
                ctx.Process(
                    target=_fresh_main, args=(r, world_size, port, paths[r], fn, args, timeout, backend), daemon=True
                )
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
        hung, died, outcomes = _collect(procs, paths, timeout)
        broken = bool(hung or died or any(o is not None and not o["ok"] for o in outcomes))
        if pooled and broken:  # a rank may be stuck in a collective: start afresh next time
            _POOLS.pop(world_size).close(kill=True)
        elif not pooled:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        errors = [
            f"--- rank {r} raised:\n{o['error']}" for r, o in enumerate(outcomes) if o is not None and not o["ok"]
        ] + died
        if errors:
            raise RankFailed(
                f"{len(errors)} of {world_size} ranks failed"
                + (f" (ranks {hung} did not finish)" if hung else "")
                + "\n"
                + "\n".join(errors)
            )
        if hung:
            raise RankFailed(
                f"ranks {hung} of {world_size} did not finish within {timeout:.0f} s "
                f"(a hang: a collective some ranks never reached?)"
            )
        return [o["result"] for o in outcomes]


def _collect(procs, paths, timeout):
    """Wait until every rank has written its outcome or died, at most `timeout` seconds. A rank that
    raised has written its outcome and left (see _pool_main), and one that died has closed its
    connections: the ranks blocked in a collective with either fail at once and write theirs, so
    this returns promptly after a failure; only a rank stuck outside any collective runs into the
    timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(path) or not proc.is_alive() for proc, path in zip(procs, paths)):
            break
        time.sleep(0.02)
    hung = [r for r, path in enumerate(paths) if not os.path.exists(path) and procs[r].is_alive()]
    died = [
        f"--- rank {r} exited with code {procs[r].exitcode} without a result (see its stderr above)"
        for r, path in enumerate(paths)
        if not os.path.exists(path) and not procs[r].is_alive()
    ]
    outcomes = [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]
    return hung, died, outcomes
