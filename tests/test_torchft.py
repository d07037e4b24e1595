"""Replica groups on torchft ([Note: replica groups on torchft] in zerofast/integrations/torchft.py):
2 replica groups x 2 gloo ranks, the Lighthouse in this process. Group 1 is lost at step LOSE_AT
(SIGKILLed, or one rank leaving inside backward); group 0's processes train on alone, the broken
step applying nothing; group 1 is relaunched and heals from group 0. At the end every rank's state
is bitwise equal to its peer's in the other group, and the parameters equal single-process AdamW
replaying the same membership history: each committed step on the batches of the groups that took
part in it. Real processes (one launch of 4, one relaunch of 2 per scenario): about 30 s each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from harness import free_port
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import global_batch

pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

from zerofast import checkpoint  # noqa: E402
from zerofast.tools.models import make_gpt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
STEPS, LOSE_AT, K = 8, 2, 2  # group 0 parks before step RELAUNCH_AT = 5, once alone (tests/jobs/ft_job.py)


class Events:
    """Every rank's JSON lines, as they come, and a wait for one."""

    def __init__(self):
        self.items, self.cond = [], threading.Condition()

    def read(self, proc):
        for line in proc.stdout:
            if line.startswith("{"):
                with self.cond:
                    self.items.append(json.loads(line))
                    self.cond.notify_all()
            else:
                sys.stdout.write(line)

    def wait(self, pred, what: str, timeout: float = 120):
        with self.cond:
            if not self.cond.wait_for(lambda: any(pred(e) for e in self.items), timeout=timeout):
                raise AssertionError(f"no {what} within {timeout} s; the last events: {self.items[-12:]}")
            return next(e for e in self.items if pred(e))

    def of(self, g: int, r: int, kind: str, after: float = 0.0) -> list[dict]:
        with self.cond:
            return [e for e in self.items if e["g"] == g and e["r"] == r and e["event"] == kind and e["at"] > after]


def _launch(group, port, lighthouse, gates, stage, events, fault="none", offload="none"):
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "jobs", "ft_job.py"), str(group), str(r), str(port), lighthouse, gates]
            + [str(stage), str(STEPS), fault if r == 1 or fault == "relaunch" else "none", offload],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(K)
    ]
    for p in procs:
        threading.Thread(target=events.read, args=(p,), daemon=True).start()
    return procs


@pytest.mark.parametrize("stage,loss,offload", [(3, "sigkill", "none"), (2, "exit_in_backward", "disk")])
def test_a_lost_group_leaves_the_other_training_and_heals_when_relaunched(tmp_path, stage, loss, offload):
    """offload "disk": every rank's optimizer state in its own files (OffloadPolicy), which the healed
    group receives its peer's state into."""
    gates = str(tmp_path)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=3000, quorum_tick_ms=50, heartbeat_timeout_ms=1000
    )
    events, procs = Events(), []
    try:
        addr = lighthouse.address()
        fault = f"exit_in_backward:{LOSE_AT}" if loss == "exit_in_backward" else "none"
        g0 = _launch(0, free_port(), addr, gates, stage, events, offload=offload)
        g1 = _launch(1, free_port(), addr, gates, stage, events, fault, offload)
        procs += g0 + g1
        for g in (0, 1):
            for r in range(K):
                events.wait(lambda e, g=g, r=r: (e["g"], e["r"], e["event"]) == (g, r, "started"), "start")
        open(os.path.join(gates, "start"), "w").close()
        if loss == "sigkill":  # as group 0 starts step LOSE_AT
            events.wait(lambda e: (e["g"], e["event"], e.get("step")) == (0, "commit", LOSE_AT - 1), "commit")
            for p in g1:
                os.kill(p.pid, signal.SIGKILL)
        t_lost = time.time()
        for p in g1:  # the rank that left takes its peer down with it (its collectives fail)
            p.wait(timeout=60)
        alone = events.wait(lambda e: e["g"] == 0 and e["event"] == "commit" and e["participants"] == 1, "alone")
        print(f"lost -> the survivor's first step alone: {alone['at'] - t_lost:.2f} s")
        t_relaunch = time.time()
        g1b = _launch(1, free_port(), addr, gates, stage, events, "relaunch", offload)
        procs += g1b
        for r in range(K):
            events.wait(lambda e, r=r: (e["g"], e["r"], e["event"]) == (0, r, "parked"), "group 0 parked")
            events.wait(
                lambda e, r=r: e["g"] == 1 and e["r"] == r and e["event"] == "started" and e["at"] > t_relaunch, "up"
            )
        open(os.path.join(gates, "rejoin"), "w").close()
        for p in g0 + g1b:
            assert p.wait(timeout=180) == 0
        first = events.wait(lambda e: e["g"] == 1 and e["event"] == "commit" and e["at"] > t_relaunch, "healed")
        print(f"relaunch -> its first committed step: {first['at'] - t_relaunch:.2f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()

    # The survivor's processes never changed (the same PIDs ran every step) and it trained alone.
    history = [(e["step"], e["participants"]) for e in events.of(0, 0, "commit")]
    assert [s for s, _ in history] == list(range(len(history))) and len(history) >= STEPS, history
    assert history[0][1] == 2 and any(n == 1 for _, n in history), history
    assert [n for _, n in history[-3:]] == [2, 2, 2], history  # three joint steps after the heal
    # The broken step applied nothing on group 0 (no_commit, then the same step again).
    for r in range(K):
        assert len(events.of(0, r, "no_commit")) <= 1
    # Healed: the relaunched group began at the survivor's step and every rank ends bitwise equal.
    healed = events.of(1, 0, "built", after=t_relaunch)[0]
    assert healed["step"] == healed["where"] >= 4, healed
    for r in range(K):
        (a,), (b,) = events.of(0, r, "done"), events.of(1, r, "done", after=t_relaunch)
        assert a["sha256"] == b["sha256"] and a["step"] == b["step"] == len(history)
    # The oracle: each committed step on the batches of the groups in it.
    # One group saved (the first participating one): its checkpoint holds the final parameters.
    assert sum(len(events.of(g, 0, "saved")) for g in (0, 1)) == 1
    saved, _ = checkpoint.to_torch(os.path.join(gates, "ckpt"))
    want = _replay(history)
    got = {k: v for k, v in torch.load(os.path.join(gates, "final.pt")).items() if k in want}  # (tied: one name)
    assert max_abs_diff(got, want) <= fp32_tol(len(history)), max_abs_diff(got, want)
    assert all(torch.equal(saved[k], got[k]) for k in got)


def _replay(history: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    model = make_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step, participants in history:
        x, y = global_batch(model, step, K * participants)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _no_lighthouse(rank, world, port):
    from zerofast.integrations.torchft import ReplicaGroups

    t0 = time.monotonic()
    try:
        ReplicaGroups("g0", lighthouse=f"http://127.0.0.1:{port}", timeout=2)
    except ConnectionError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_no_lighthouse_is_a_named_error_within_the_timeout():
    from harness import run_ranks

    ((message, took),) = run_ranks(_no_lighthouse, 1, args=(free_port(),), fresh=True, timeout=60)
    assert message is not None and "lighthouse='http://127.0.0.1:" in message and "timeout=2 s" in message
    assert took < 30  # the 2 s connect timeout and torchft's retries, not a hang


def _another_layout(rank, world):
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    from zerofast import ZeroAdam
    from zerofast.integrations.torchft import LayoutMismatchError, ReplicaGroups
    from zerofast.integrations.torchft.replicas import _fingerprint

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    replicas = ReplicaGroups("g0", lighthouse=lighthouse.address(), timeout=10)
    opt = ZeroAdam(make_gpt("tiny"), stage=2, process_group=replicas, **HYPER)
    other = ZeroAdam(make_gpt("tiny"), stage=3, **HYPER)  # flat over this rank: another layout
    state = replicas._state()
    state["layout"] = _fingerprint(other.checkpoint_view)
    try:
        replicas._load(state)
    except LayoutMismatchError as e:
        return str(e)
    finally:
        replicas.manager.shutdown(wait=False)
        lighthouse.shutdown()
        del opt
        dist.barrier()
    return None


def test_a_group_with_another_layout_cannot_heal_from_its_peer():
    from harness import run_ranks

    (message,) = run_ranks(_another_layout, 1, fresh=True, timeout=120)
    assert message is not None and "'stage': 3" in message and "'stage': 2" in message, message


def test_the_main_job_shows_a_group_lost_and_healed():
    """`python -m zerofast.train --replica-groups 2 --lose-group-at S`: what a user watches; stage 1 (the
    scenarios above run stages 3 and 2), whose separate owned ranges go one all_reduce each."""
    out = subprocess.run(
        [sys.executable, "-m", "zerofast.train", "--replica-groups", "2", "--nproc", "2", "--model", "tiny"]
        + ["--batch", "2", "--steps", "9", "--lose-group-at", "2", "--timeout", "5", "--stage", "1"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.stdout
    assert out.returncode == 0, log + out.stderr[-3000:]
    assert "-- SIGKILLed replica group 1" in log and "groups in the step: 1" in log, log
    assert "-- group 1 healed from a live group" in log, log
    assert "every replica group's state bitwise equal to group 0's, rank by rank: True" in log, log


def test_the_main_job_ends_at_once_when_a_group_dies_on_its_own(tmp_path):
    """A replica group whose processes end before they report (here: group 1's rank 0 exits as it
    starts, through a sitecustomize on its path) ends the job at once, naming the group, its exit code
    and its log, instead of waiting for events that cannot come (the job waited out its 600 s)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('ZEROFAST_REPLICA_GROUP') == '1' and os.environ.get('LOCAL_RANK') == '0':\n"
        "    print('group 1 rank 0 exits as it starts (the test)', file=sys.stderr, flush=True)\n"
        "    os._exit(3)\n"
    )
    env = dict(ENV, PYTHONPATH=str(tmp_path) + os.pathsep + ENV["PYTHONPATH"])
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "zerofast.train", "--replica-groups", "2", "--nproc", "1", "--model", "tiny"]
        + ["--batch", "2", "--steps", "9", "--timeout", "5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout + out.stderr[-3000:]
    assert "replica group 1's torchrun exited with code" in out.stderr, out.stderr[-3000:]
    assert "group 1 rank 0 exits as it starts (the test)" in out.stderr, out.stderr[-3000:]
    assert took < 120, f"the job took {took:.0f} s to notice"  # the group's torchrun ends in seconds


def _muon_alone_and_flat(rank, world):
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer
    from training import rank_batch

    from zerofast import ZeroMuon
    from zerofast.integrations.torchft import ReplicaGroups

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1) if rank == 0 else None
    address = [lighthouse.address() if lighthouse else None]
    dist.broadcast_object_list(address)  # one Lighthouse; rank 0's Manager server talks to it
    replicas = ReplicaGroups("g0", lighthouse=address[0], timeout=10)
    models = [make_gpt("tiny"), make_gpt("tiny")]
    opts = [ZeroMuon(models[0], stage=2, process_group=replicas), ZeroMuon(models[1], stage=2)]
    try:
        for step in range(3):
            for model, opt in zip(models, opts):
                opt.zero_grad()
                model(*rank_batch(model, step, rank))[1].backward()
                opt.step()
        return replicas.step, [torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters())]
    finally:
        replicas.manager.shutdown(wait=False)
        dist.barrier()
        if lighthouse:
            lighthouse.shutdown()


def test_zero_muon_on_one_replica_group_equals_zero_muon_without_torchft():
    """The same front (ZeroMuon's update rule through the builder): one replica group alone steps
    exactly as the flat optimizer over its ranks, bitwise (the same reduction order)."""
    from harness import run_ranks

    (steps, same), (_, same1) = run_ranks(_muon_alone_and_flat, 2, fresh=True, timeout=120)
    assert steps == 3 and all(same) and all(same1), same
