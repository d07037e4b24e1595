"""The main job under torchrun: a worker killed mid-run and restarted by torchrun's agent
resumes from the newest checkpoint and ends bitwise equal to an uninterrupted run; a relaunch on
fewer ranks continues resharded; a stuck worker ends the job after --timeout with one message.
(Two torchrun launches as two "machines", c10d rendezvous, stages 1-3 against single-process AdamW:
tests/test_hybrid.py.) Slow (real launches); run in `make test`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import torch

from zerofast import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
JOB = ["--model", "small", "--batch", "2", "--lr", "1e-3"]


def _train(*argv, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "zerofast.train", *argv],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start(*argv):
    return subprocess.Popen(
        [sys.executable, "-m", "zerofast.train", *argv],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _workers(pid: int) -> list[int]:
    """The launcher's child processes (torchrun's agent runs inside it and starts the workers)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def _worker(pid: int, rank: int) -> int:
    """The launcher's worker of global rank `rank` (torchrun puts RANK in each worker's environment)."""
    for kid in _workers(pid):
        with open(f"/proc/{kid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return kid
    raise AssertionError(f"no worker of rank {rank} among {_workers(pid)}")


def _wait_for(path: str, proc, limit: float = 120.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < limit, f"{path} did not appear"
        time.sleep(0.02)


def _read_until(stream, out: list, prefix: str, seen: threading.Event) -> None:
    """Every line of `stream` into `out`; `seen` set once a line starts with `prefix`."""
    for line in stream:
        out.append(line)
        if line.startswith(prefix):
            seen.set()


def _same_checkpoints(a: str, b: str) -> bool:
    (am, ao), (bm, bo) = checkpoint.to_torch(a), checkpoint.to_torch(b)
    return (
        am.keys() == bm.keys()
        and all(torch.equal(am[k], bm[k]) for k in am)
        and all(torch.equal(s[k], bo["state"][i][k]) for i, s in ao["state"].items() for k in s)
    )


def test_a_killed_worker_is_restarted_and_resumes_bitwise(tmp_path):
    whole, faulty = str(tmp_path / "whole"), str(tmp_path / "faulty")
    steps = ["--steps", "12", "--save-every", "3"]
    out = _train("--nproc", "2", *JOB, *steps, "--save-dir", whole)
    assert out.returncode == 0, out.stdout + out.stderr
    proc = _start("--nproc", "2", *JOB, *steps, "--save-dir", faulty, "--max-restarts", "1")
    # The kill point: as soon as the checkpoint of step 3 is complete (it appears under its final
    # name only then), rank 1's worker is killed, three steps and a save before the next checkpoint.
    # The same worker, right after the same event, every run: no sleep, no random choice.
    _wait_for(os.path.join(faulty, "step-000003"), proc)
    os.kill(_worker(proc.pid, rank=1), signal.SIGKILL)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert "resumed from" in log, log  # the restarted workers loaded the newest checkpoint
    assert _same_checkpoints(os.path.join(whole, "step-000012"), os.path.join(faulty, "step-000012"))


def test_a_relaunch_on_fewer_ranks_continues_resharded(tmp_path):
    d = str(tmp_path / "ckpt")
    out = _train("--nproc", "3", *JOB, "--stage", "2", "--steps", "4", "--save-dir", d)
    assert out.returncode == 0, out.stdout + out.stderr
    out = _train("--nproc", "2", *JOB, "--stage", "2", "--steps", "6", "--save-dir", d, "--resume")
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "at step 4" in log and "over 2 steps" in log, log
    (m4, o4), (m6, o6) = (checkpoint.to_torch(os.path.join(d, f"step-00000{s}")) for s in (4, 6))
    assert all(s["step"] == 6 for s in o6["state"].values())
    assert any(not torch.equal(m4[k], m6[k]) for k in m4)  # it trained on


def test_a_stuck_worker_ends_the_job_after_the_timeout(tmp_path):
    d = str(tmp_path / "ckpt")
    proc = _start("--nproc", "2", *JOB, "--steps", "200", "--save-every", "2", "--save-dir", d, "--timeout", "3")
    _wait_for(os.path.join(d, "step-000002"), proc)
    victim = _worker(proc.pid, rank=1)
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    # The survivor's report ends what this test is about. torchrun would then give the stopped worker
    # 30 s of grace for SIGTERM before its SIGKILL (its failure path ignores --shutdown-timeout in torch
    # 2.14); the test sends that SIGKILL itself once the report is out.
    out, reported = [], threading.Event()
    reader = threading.Thread(target=_read_until, args=(proc.stdout, out, "zerofast.train rank 0", reported))
    reader.start()
    try:
        assert reported.wait(timeout=120), "".join(out)
        print(f"the survivor reported {time.monotonic() - t0:.1f} s after the worker was stopped")
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:  # torchrun ended it
            pass
    proc.wait(timeout=120)
    reader.join()
    log = "".join(out)
    assert proc.returncode != 0, log
    # The survivor's one line: where it was, then the backend's words, which say that the wait ended
    # through the timeout (a dead peer would read "Connection reset/closed by peer" instead).
    lines = [line for line in log.splitlines() if line.startswith("zerofast.train rank 0")]
    assert len(lines) == 1 and "failed at step" in lines[0] and "timeout, 3 s" in lines[0], log
    assert re.search(r"Backend: .*(Timed out waiting 3000ms|Application timeout caused pair closure)", lines[0]), log


def test_the_fault_line_starts_its_own_line_after_the_progress_bar():
    """The one-line fault report is a line of its own, also when it interrupts rank 0's progress bar
    (drawn with carriage returns and no newline until the last step): a stuck peer during a
    checkpoint save once left it glued to the bar, where no reader of lines finds it. About 2 s."""
    code = (
        "from zerofast.tools.train import Progress, exit_on_fault\n"
        "Progress(5, True).update(1, 2.5, 100.0)\n"
        "exit_on_fault(RuntimeError('saving the checkpoint failed at step 2'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()  # as the launch tests read them: \r and \n both end a line
    assert "zerofast.train rank ?: saving the checkpoint failed at step 2" in lines, lines
    assert lines[-2].startswith("[") and "2/5" in lines[-2], lines
