"""The main job under torchrun: a worker killed mid-run and restarted by torchrun's agent
resumes from the newest checkpoint and ends bitwise equal to an uninterrupted run; a relaunch on
fewer ranks continues resharded; a stuck worker ends the job after --timeout with one message; and
two torchrun launches of 2 ranks each (two "machines" on this one, c10d rendezvous) run stage 3
and equal the same job on 4 local ranks (stages 1-3 on two machines: tests/test_hybrid.py). Slow (real launches); run in `make test`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from harness import free_port

from zerofast import checkpoint
from zerofast.checkpoint.io import read_small

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


# Stage 3 only: stages 1-3 (flat and hybrid) on two such machines are tests/test_hybrid.py's, against
# single-process AdamW; here the main job itself, checkpoint included, against 4 local ranks bitwise.
@pytest.mark.parametrize("stage", [3])
def test_two_machines_on_torchrun_equal_four_local_ranks(tmp_path, stage):
    job = [*JOB, "--model", "tiny", "--stage", str(stage), "--steps", "3"]
    local, nodes = str(tmp_path / "local"), str(tmp_path / "nodes")
    out = _train("--nproc", "4", *job, "--save-dir", local)
    assert out.returncode == 0, out.stdout + out.stderr
    port = free_port()
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(i),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "-m",
                "zerofast.train",
                *job,
                "--save-dir",
                nodes,
            ],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in launches]
    assert all(p.returncode == 0 for p in launches), "\n".join(logs)
    assert _same_checkpoints(os.path.join(local, "step-000003"), os.path.join(nodes, "step-000003"))
    # And the single-process result: AdamW on the 4 ranks' batches together. The job's losses (the
    # mean over ranks, saved in the checkpoint) against the single process's: within 1e-4 of ~5. Two
    # reduction orders differ by rounding, except for elements whose gradient is ~0 (their Adam step
    # follows the sign of rounding noise, up to lr; see tests/oracles.py), and the loss is first-order
    # insensitive to exactly those elements.
    saved = read_small(os.path.join(nodes, "step-000003"))["extra"]["losses"]
    want = _single_process_losses(steps=3, world=4, batch=2, lr=1e-3)
    assert len(saved) == 3 and max(abs(a - b) for a, b in zip(saved, want)) < 1e-4, (saved, want)


def _single_process_losses(steps: int, world: int, batch: int, lr: float) -> list[float]:
    """zerofast.train's job (tiny GPT over the shipped text, AdamW lr, weight decay 0.1) in one
    process on the concatenation of every rank's batch."""
    from zerofast.tools.data import corpus_tokens, text_batch
    from zerofast.tools.models import make_gpt

    model = make_gpt("tiny", vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    tokens, seq, losses = corpus_tokens(), model.cfg.block_size, []
    for step in range(steps):
        parts = [text_batch(tokens, batch, seq, seed=step * world + r) for r in range(world)]
        _, loss = model(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
