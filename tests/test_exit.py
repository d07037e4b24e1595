"""Every process ends cleanly ([Note: clean exit] in csrc/work_keeper.cpp): ranks launched as their
own interpreters (tests/jobs/exit_job.py), as torchrun launches them, exit 0 however their collectives
stand at exit.

The first test reproduces the abort finished jobs showed now and then (a gloo thread that must take
the GIL, to drop a Work whose last reference it held, while the interpreter finalizes) every time
on the code before the fix: the ranks hold the GIL into finalization while the work completes.
That is the mechanism a core dump of an aborted README run showed; scripts/exit_check.sh counts the
launches of the README example itself under load (docs/testing.md).
Cost: one launch of two ranks, about 10 s (each rank imports torch and zerofast, a few seconds, and
holds its exit 3 s), and one job on two forked ranks (a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys

from harness import ROOT, free_port, launch_env

from zerofast import checkpoint

JOB = os.path.join(ROOT, "tests", "jobs", "exit_job.py")


def _launch(*args: str, world: int = 2, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Run exit_job.py on `world` ranks, each its own interpreter; each rank's outcome."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = launch_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, JOB, *args], env=env, stdout=subprocess.PIPE, text=True, stderr=subprocess.STDOUT
            )
        )
    outcomes = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outcomes.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outcomes


def _assert_clean(outcomes: list[subprocess.CompletedProcess]) -> None:
    for rank, out in enumerate(outcomes):
        assert out.returncode == 0, f"rank {rank} exited with {out.returncode}:\n{out.stdout}"
        assert "terminate called" not in out.stdout, f"rank {rank}:\n{out.stdout}"
        assert f"rank {rank}: exiting" in out.stdout, f"rank {rank} did not reach its end:\n{out.stdout}"
        assert "in flight at exit failed" not in out.stdout, f"rank {rank}:\n{out.stdout}"


def test_ranks_that_end_with_everything_in_flight_exit_cleanly(tmp_path):
    """Everything that may be in flight when a script ends, in one launch: an overlapped parameter
    gather, an asynchronous checkpoint save and stage 3's prefetch; then rank 0 drops its optimizer
    with its backward's reduces in flight and exits, and rank 1 completes them while rank 0 holds
    the GIL into finalization. Before [Note: clean exit], rank 0 died of SIGABRT every time (gloo's
    thread dropped the last reference, with autograd's Python context in it). Now every rank exits
    0 and the checkpoint is complete."""
    _assert_clean(_launch(str(tmp_path)))
    assert "zerofast checkpoint" in checkpoint.info(os.path.join(tmp_path, "step-3"))


def _kept_after_steps(rank: int, world: int) -> dict[str, list[int]]:
    """How many of this process's collectives are still kept ([Note: clean exit]) after steps of
    each stage: while gathers are in flight by design (overlap_param_gather, between step() and the
    next forward), and once a step is over."""
    import time

    from tolerances import HYPER
    from training import rank_batch, zero_options

    from zerofast import _C, ZeroAdam
    from zerofast.tools.models import make_gpt

    def settled() -> int:
        # The backend drops its own reference just after completing a Work: a moment, not a step.
        deadline = time.monotonic() + 10
        while (held := _C.release_kept_works()) and time.monotonic() < deadline:
            time.sleep(0.001)
        return held

    out = {}
    for name, options in (
        ("stage 1", zero_options(1, bucket_mb=0.01)),
        ("stage 2, overlapped gather", zero_options(2, bucket_mb=0.01, overlap_param_gather=True)),
        ("stage 3", zero_options(3, min_unit_mb=0)),
    ):
        model = make_gpt("tiny")
        opt = ZeroAdam(model, **options, **HYPER)
        counts = []
        for step in range(2):
            model(*rank_batch(model, step, rank))[1].backward()
            opt.step()
            opt.zero_grad()
            counts.append(_C.release_kept_works())  # right after step(): gathers in flight, if overlapped
        with opt.gathered_params():  # waits for them
            pass
        counts.append(settled())
        opt.remove_hooks()
        out[name] = counts
    return out


def test_no_collective_outlives_its_step():
    """Every collective of a step is complete and released on the rank's own thread once the step
    is over: none is left for the backend to release. Between step() and the next forward only the
    overlapped parameter gather is in flight, as it promises ([Note: overlapped parameter gather])."""
    from harness import run_ranks

    for rank, kept in enumerate(run_ranks(_kept_after_steps, 2, fresh=True)):
        assert kept["stage 1"][-1] == 0 and kept["stage 3"][-1] == 0, (rank, kept)
        overlapped = kept["stage 2, overlapped gather"]
        assert overlapped[0] > 0 and overlapped[1] > 0, (rank, kept)  # the gathers, in flight after step()
        assert overlapped[-1] == 0, (rank, kept)


def test_the_exit_waits_while_a_backend_thread_is_runnable():
    """[Note: clean exit], 4: a thread named as gloo's workers are, kept runnable (hashing, which
    lets go of the GIL) until told to stop, is waited for at exit, and only as long as the limit."""
    import ctypes
    import hashlib
    import threading
    import time

    from zerofast import exit_drain

    named, stop = threading.Event(), threading.Event()
    block = bytes(1 << 24)  # about 20-50 ms of sha256 per round, without the GIL

    def worker():
        ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME: the name torch gives them
        named.set()
        while not stop.is_set():
            hashlib.sha256(block).digest()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        assert named.wait(30)
        began = time.monotonic()
        assert not exit_drain.backend_threads_settled(0.3), "a runnable worker thread was taken for settled"
        assert time.monotonic() - began >= 0.3
        threading.Timer(0.3, stop.set).start()
        assert exit_drain.backend_threads_settled(60)
        assert stop.is_set(), "settled before the worker thread stopped running"
    finally:
        stop.set()
        thread.join()
