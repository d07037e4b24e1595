"""Replica groups on torchft against plain hybrid sharding, side by side in one run (real launches of
the main job on 4 gloo ranks x 1 thread: 2 replica groups x 2 ranks; see docs/surviving-failures.md):

- the step time when nothing fails: ZeroAdam over torchft's replica groups (`--replica-groups 2
  --nproc 2`: the quorum each step, the managed all_reduce, the commit) against ZeroAdam with
  CommPolicy(shard_size=2) on one world of 4 (`--nproc 4 --shard-size 2`), the same model, batch and
  stage; the median of the steps after the first three;
- a group lost and relaunched (`--lose-group-at 3`): the time from the kill to the others' first
  step alone, and the relaunched group's heal (received, loaded, its first quorum) after its
  processes were up, for the tiny and the small GPT (the state's size), and the steps lost (0: the
  broken step is retried).

- the torchrun restart path on the same job: a run without a failure against one whose worker is
  killed as a checkpoint completes (every worker restarts and reloads it).

Each case is one launch (rounds=1): the figures are in the summary's extra columns.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
JOB = ["--stage", "2", "--batch", "4", "--steps", "20", "--timeout", "10"]
GROUP = "torchft: 2 replica groups x 2 gloo ranks vs shard_size=2 on 4 ranks, stage 2, batch 4"


def _train(*argv) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "zerofast.train", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _ft_step_ms(log: str) -> float:
    took = [float(ms) for step, ms in re.findall(r"group 0  step\s+(\d+) .* (\d+) ms", log) if int(step) >= 3]
    return statistics.median(took)


@pytest.mark.parametrize("model", ["small"])
def test_step_time_when_nothing_fails(benchmark, record, model):
    def both():
        hybrid = _train("--nproc", "4", "--shard-size", "2", "--model", model, *JOB)
        ft = _train("--replica-groups", "2", "--nproc", "2", "--model", model, *JOB)
        return float(re.search(r"(\d+) ms per step", hybrid).group(1)), _ft_step_ms(ft)

    hybrid_ms, ft_ms = benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update(hybrid_ms=hybrid_ms, torchft_ms=ft_ms, ratio=ft_ms / hybrid_ms)
    print(f"\n{model}: step {hybrid_ms:.0f} ms with shard_size=2, {ft_ms:.0f} ms on torchft ({ft_ms / hybrid_ms:.2f}x)")
    record(benchmark, GROUP, f"step time, {model}")


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_a_lost_group_and_its_heal(benchmark, record, model):
    log = benchmark.pedantic(
        lambda: _train("--replica-groups", "2", "--nproc", "2", "--model", model, *JOB, "--lose-group-at", "3"),
        rounds=1,
        iterations=1,
    )
    alone = float(re.search(r"the others' next committed step: ([\d.]+) s after the kill", log).group(1))
    heal = float(re.search(r"healed from a live group: it starts at step \d+, ([\d.]+) s after", log).group(1))
    steps = [int(s) for s in re.findall(r"group 0  step\s+(\d+) ", log)]
    lost = 20 - len(set(steps))
    assert "bitwise equal to group 0's, rank by rank: True" in log
    benchmark.extra_info.update(kill_to_next_step_s=alone, heal_s=heal, steps_lost=lost)
    print(f"\n{model}: kill -> next step alone {alone:.1f} s, heal {heal:.2f} s, steps lost {lost}")
    record(benchmark, GROUP, f"lost and healed, {model}")


def _rank_worker(launcher_pid: int, rank: int) -> int:
    """The launcher's worker of global rank `rank` (torchrun puts RANK in each worker's environment)."""
    from zerofast.tools.replica_demo import _descendants

    for pid in _descendants(launcher_pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no worker of rank {rank}")


def test_the_restart_path(benchmark, record, tmp_path):
    """The same job as test_step_time_when_nothing_fails's shard_size=2 run, with a checkpoint every 10
    steps and torchrun's restart: the wall time of a run without a failure against one whose rank 3
    is SIGKILLed as the step-10 checkpoint completes (every worker restarts and reloads it; the
    steps since the save are done again: here the kill lands right after a save, the best case)."""
    import signal
    import time

    argv = ["--nproc", "4", "--shard-size", "2", "--model", "small", *JOB, "--save-every", "10", "--max-restarts", "1"]

    def both():
        t0 = time.perf_counter()
        _train(*argv, "--save-dir", str(tmp_path / "clean"))
        clean = time.perf_counter() - t0
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerofast.train", *argv, "--save-dir", str(tmp_path / "kill")],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not os.path.exists(tmp_path / "kill" / "step-000010"):
            assert proc.poll() is None
            time.sleep(0.02)
        os.kill(_rank_worker(proc.pid, 3), signal.SIGKILL)
        assert proc.wait(timeout=900) == 0
        return clean, time.perf_counter() - t0

    clean, killed = benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update(clean_s=clean, killed_s=killed, lost_s=killed - clean)
    print(f"\nrestart path: {clean:.1f} s without a failure, {killed:.1f} s with one ({killed - clean:.1f} s lost)")
    record(benchmark, GROUP, "torchrun restart + reload")
