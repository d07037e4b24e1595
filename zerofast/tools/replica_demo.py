"""The main job on torchft's replica groups: `python -m zerofast.train --replica-groups R --nproc K`.

This process starts a Lighthouse, then R replica groups, each its own torchrun job of K local ranks
(its own c10d world) training the bench GPT with ZeroAdam over zerofast.integrations.torchft.
--lose-group-at S: the last group is SIGKILLed once the others have committed step S; they train
on alone, and after two steps it is relaunched and heals from a live group. The output shows every
committed step with its participants, the loss, the kill, the heal, and at the end whether every
group's state is bitwise equal to the others' (rank by rank). See docs/surviving-failures.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from .data import corpus_tokens, text_batch
from .models import make_gpt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replica-groups",
        type=int,
        default=0,
        help="run R replica groups of --nproc ranks on torchft (a Lighthouse in this process); 0: off",
    )
    p.add_argument(
        "--lose-group-at",
        type=int,
        default=None,
        help="with --replica-groups: SIGKILL the last group after step S, relaunch it two steps later",
    )


def check_arguments(p: argparse.ArgumentParser, args) -> None:
    if args.replica_groups == 0:
        if args.lose_group_at is not None:
            p.error("--lose-group-at needs --replica-groups")
        return
    if args.replica_groups < 2:
        p.error(f"--replica-groups must be 0 (off) or at least 2; got {args.replica_groups}")
    if args.lose_group_at is not None and not 0 <= args.lose_group_at < args.steps - 3:
        p.error(f"--lose-group-at must be in [0, --steps - 3) = [0, {args.steps - 3}); got {args.lose_group_at}")
    if args.save_dir or args.resume or args.compare or args.plot:
        p.error("--replica-groups runs its own demo: without --save-dir, --resume, --compare and --plot")


# --- one rank ------------------------------------------------------------------------------------


def worker(args) -> None:
    """One rank of one replica group (under torchrun): train, print each committed step as JSON."""
    import torch.distributed as dist

    from zerofast import ZeroAdam
    from zerofast.integrations.torchft import ReplicaGroups

    dist.init_process_group("gloo")
    rank, k = dist.get_rank(), dist.get_world_size()
    group = int(os.environ["ZEROFAST_REPLICA_GROUP"])
    replicas = ReplicaGroups(f"group{group}", timeout=args.timeout)
    # The demo's pauses: before step k, wait for the file gates[k] (the kill, the relaunched processes).
    gates = {int(k): path for k, path in json.loads(os.environ.get("ZEROFAST_DEMO_GATES", "{}")).items()}

    def say(event, **kw):
        if rank == 0:
            print(json.dumps({"group": group, "event": event, "at": time.time(), **kw}), flush=True)

    def wait_for_gate(path):
        say("parked", step=replicas.step)
        while not os.path.exists(path):
            time.sleep(0.05)

    model = make_gpt(args.model, vocab_size=256)
    opt = ZeroAdam(model, stage=args.stage, lr=args.lr, weight_decay=0.1, process_group=replicas)
    tokens, seq = corpus_tokens(), model.cfg.block_size
    say("up")
    # The first quorum (the first zero_grad) holds every group: one up earlier would train alone. A
    # relaunched group asks for its first quorum (its heal) as the others resume.
    wait_for_gate(
        os.environ["ZEROFAST_DEMO_RELAUNCHED" if os.environ.get("ZEROFAST_DEMO_RELAUNCH") else "ZEROFAST_DEMO_START"]
    )
    say("asking")
    opt.zero_grad()
    say("joined", step=replicas.step)
    # Every group stops after the same committed step, one with every group in it (as tests/jobs/ft_job.py's
    # groups do): on a loaded machine the relaunched group's first quorum can come after the others' last
    # step, and it would then have no live peer to heal from.
    together = 0  # groups in the last step this group took (none yet: every group takes one)
    while replicas.step < args.steps or together < args.replica_groups:
        if replicas.step in gates and not os.path.exists(gates[replicas.step]):
            wait_for_gate(gates[replicas.step])
        t0 = time.perf_counter()
        opt.zero_grad()
        step, participants = replicas.step, replicas.participants
        together = participants
        # Every group's ranks read the windows of their data-parallel position at this step: a healed
        # group reads what the lost one would have.
        _, loss = model(*text_batch(tokens, args.batch, seq, seed=(step * args.replica_groups + group) * k + rank))
        loss.backward()
        opt.step()
        took = time.perf_counter() - t0
        say(
            "skipped" if opt.step_was_skipped else "step",
            step=step,
            participants=participants,
            loss=loss.item(),
            took=took,
        )
    digest = hashlib.sha256()
    for t in opt.checkpoint_view.flat_state().values():
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * k
    dist.all_gather_object(digests, digest.hexdigest())
    say("done", step=replicas.step, sha256=digests)
    replicas.manager.shutdown(wait=False)
    dist.destroy_process_group()


# --- the parent ----------------------------------------------------------------------------------


class _Group:
    def __init__(self, index: int, argv: list[str], nproc: int, lighthouse: str, events: list, cond, gate: dict):
        env = dict(os.environ, ZEROFAST_REPLICA_GROUP=str(index), TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1")
        env.update(gate)
        self.index, self.killed, self.read_all = index, False, False
        self.log = tempfile.TemporaryFile(mode="w+")  # torchft's and gloo's logs: shown if the group fails
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            + ["-m", "zerofast.train", *argv],
            env=env,
            stdout=subprocess.PIPE,  # the events
            stderr=self.log,
            text=True,
        )
        threading.Thread(target=self._read, args=(events, cond), daemon=True).start()

    def _read(self, events, cond):
        try:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    with cond:
                        events.append(json.loads(line))
                        cond.notify_all()
        finally:
            with cond:
                self.read_all = True  # every event it printed is in `events`
                cond.notify_all()

    def failed(self, events: list) -> str | None:
        """Why this group's torchrun ended before it said "done" (None: it runs, finished, or was
        killed here): its exit code and the last lines of its log."""
        if self.killed or not self.read_all or self.proc.poll() is None:
            return None
        if any(e["event"] == "done" and e["group"] == self.index for e in events):
            return None
        self.log.seek(0)
        tail = "".join(self.log.readlines()[-60:])
        return f"replica group {self.index}'s torchrun exited with code {self.proc.returncode}; its log ends:\n{tail}"

    def kill(self) -> None:
        """SIGKILL torchrun and its workers (they run in sessions of their own), as a lost machine."""
        self.killed = True
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def run(args, argv: list[str]) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse's log of every quorum
    from torchft.coordination import LighthouseServer

    gate_dir = tempfile.mkdtemp(prefix="zerofast-demo-")
    # Every group waits at these gates until this process opens them, so that what the demo shows
    # happens in its order however the machine schedules the processes: the start (every group up),
    # the kill (the groups wait before step S + 1: none runs ahead into the next gate before the
    # last is killed), the relaunch (the others wait before step S + 3 for the relaunched processes).
    kill_gate, rejoin_gate = os.path.join(gate_dir, "killed"), os.path.join(gate_dir, "rejoin")
    gate = {
        "ZEROFAST_DEMO_START": os.path.join(gate_dir, "start"),
        "ZEROFAST_DEMO_RELAUNCHED": os.path.join(gate_dir, "relaunched"),
    }
    if args.lose_group_at is not None:
        park_step = args.lose_group_at + 3
        gate["ZEROFAST_DEMO_GATES"] = json.dumps({args.lose_group_at + 1: kill_gate, park_step: rejoin_gate})
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1000)
    events: list[dict] = []
    cond = threading.Condition()
    shown = 0

    def show_until(pred, since=0, timeout=600.0) -> dict:
        """Print the events as they come until one from events[since:] satisfies pred; return it. A
        group whose processes ended on their own before it is a RuntimeError at once, not a wait."""
        nonlocal shown
        deadline = time.monotonic() + timeout
        with cond:
            while True:
                for e in events[shown:]:
                    _print(e)
                shown = len(events)
                hit = next((e for e in events[since:] if pred(e)), None)
                if hit is not None:
                    return hit
                failed = [why for grp in groups if (why := grp.failed(events))]
                if failed:
                    raise RuntimeError("\n".join(failed))
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica groups stopped reporting")
                cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))

    worker_argv = _without(argv, "--lose-group-at")  # argv: without --nproc already (torchrun's own)
    print(
        f"Lighthouse at {lighthouse.address()}; {args.replica_groups} replica groups x {args.nproc} ranks", flush=True
    )
    groups = [
        _Group(g, worker_argv, args.nproc, lighthouse.address(), events, cond, gate) for g in range(args.replica_groups)
    ]
    try:
        for g in range(args.replica_groups):
            show_until(lambda e, g=g: e["event"] == "up" and e["group"] == g)
        open(gate["ZEROFAST_DEMO_START"], "w").close()
        if args.lose_group_at is not None:
            last = args.replica_groups - 1
            kill_step = args.lose_group_at + 1
            show_until(lambda e: e["event"] == "parked" and e["group"] == 0 and e["step"] == kill_step)
            groups[last].kill()
            t_lost = time.time()
            open(kill_gate, "w").close()
            print(f"-- SIGKILLed replica group {last} (its torchrun and workers) after step {args.lose_group_at}")
            alone = show_until(lambda e: e["event"] == "step" and e["group"] == 0 and e["participants"] == 1)
            print(f"-- the others' next committed step: {alone['at'] - t_lost:.1f} s after the kill")
            show_until(lambda e: e["event"] == "step" and e["group"] == 0 and e["step"] == args.lose_group_at + 1)
            # The relaunched group's events are told from the lost one's by their place in the list,
            # not by a clock: the others may park before this process reads their last step.
            with cond:
                relaunched = len(events)
            t_relaunch = time.time()
            groups[last] = _Group(
                last,
                worker_argv,
                args.nproc,
                lighthouse.address(),
                events,
                cond,
                dict(gate, ZEROFAST_DEMO_RELAUNCH="1"),
            )
            print(
                f"-- relaunched replica group {last}; the others wait for its processes at step {args.lose_group_at + 3}"
            )
            for g in range(last):  # the demo's pause: a real job trains on meanwhile
                show_until(lambda e, g=g: e["event"] == "parked" and e["group"] == g and e["step"] == park_step)
            show_until(lambda e: e["event"] == "parked" and e["group"] == last, since=relaunched)
            t_up = time.time()
            # The relaunched group asks for its quorum first (the Lighthouse holds it for the others, who
            # were in the last quorum), then the others resume.
            open(gate["ZEROFAST_DEMO_RELAUNCHED"], "w").close()
            show_until(lambda e: e["event"] == "asking" and e["group"] == last, since=relaunched)
            open(rejoin_gate, "w").close()
            joined = show_until(lambda e: e["event"] == "joined" and e["group"] == last, since=relaunched)
            print(
                f"-- group {last} healed from a live group: it starts at step {joined['step']}, "
                f"{joined['at'] - t_up:.2f} s after its processes were up ({t_up - t_relaunch:.1f} s to start them)"
            )
        for g in range(args.replica_groups):
            show_until(lambda e, g=g: e["event"] == "done" and e["group"] == g)
        codes = [grp.proc.wait(timeout=120) for grp in groups]
    finally:
        for grp in groups:
            if grp.proc.poll() is None:
                grp.kill()
        lighthouse.shutdown()
    with cond:
        done = {e["group"]: e["sha256"] for e in events if e["event"] == "done"}
    same = all(done[g] == done[0] for g in done)
    print(f"every replica group's state bitwise equal to group 0's, rank by rank: {same}")
    return 0 if same and not any(codes) else 1


def _print(e: dict) -> None:
    if e["event"] == "step":
        print(
            f"group {e['group']}  step {e['step']:4d}  loss {e['loss']:.4f}  groups in the step: {e['participants']}"
            f"  {e['took'] * 1e3:.0f} ms"
        )
    elif e["event"] == "skipped":
        print(f"group {e['group']}  step {e['step']:4d}  not committed (a group failed in it); applied nothing")


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(k) for k in f.read().split()]
    except FileNotFoundError:
        return []
    return out + [d for k in out for d in _descendants(k)]


def _without(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out
