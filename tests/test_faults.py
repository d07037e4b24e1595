"""Faults: a rank stopped (SIGSTOP) or killed (SIGKILL) during forward, backward, a reduce, step()
or a parameter gather, in every stage, makes the other ranks leave with one message naming the
step, the phase and the collective; a killed rank's peers leave on the closed connection (the
backend says so), a stopped rank's through the process group's timeout (the backend says that).
Ranks out of step are caught; a step that fails on one rank is applied on none. No assertion reads
a clock: the cases run several at a time on a shared machine, and only a generous join timeout
guards against a survivor that never leaves.

The fault matrix runs each case in fresh processes (a broken process group cannot be reused), forked
from a forkserver that has imported torch and zerofast once, a few cases at a time."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch
from harness import context, free_port, run_ranks
from tolerances import HYPER
from training import rank_batch, train_steps, zero_options

from zerofast import ZeroAdam
from zerofast.optim.zero_adam import parts_of
from zerofast.tools.models import make_gpt

TIMEOUT_S = 4.0  # the process groups' timeout in the fault cases
FAULT_STEP = 2  # the victim's fault comes in its third step (0-based 2)
POINTS = ("forward", "backward", "reduce", "step", "gather")
STAGES = (1, 2, 3)
SIGNALS = ("SIGKILL", "SIGSTOP")
PARALLEL = 5  # cases at once (2 processes each)
HANG_S = TIMEOUT_S + 60  # a survivor still running after this never left: a hang, not slowness
# How the backend ends a survivor's wait: a killed rank's connections close (gloo reads a reset or
# closed connection at once); a stopped rank's stay open, and the wait ends at the timeout.
PEER_GONE = r"Connection (reset|closed) by peer|Broken pipe"
TIMED_OUT = r"Timed out waiting \d+ms|Application timeout caused pair closure"


def _install_fault(model, opt, point: str, sig: int, state: dict) -> None:
    """On the victim: deliver `sig` to itself at `point` of step FAULT_STEP."""

    def fire():
        if state["step"] == FAULT_STEP:
            os.kill(os.getpid(), sig)

    if point == "forward":  # in the middle of the forward
        model.blocks[1].register_forward_pre_hook(lambda *_: fire())
    elif point == "backward":  # the first gradient backward computes, before any reduce
        state["on_logits"] = lambda logits: logits.register_hook(lambda g: fire())
    elif point == "reduce":  # at the first gradient after a bucket's reduce was launched, mid-backward
        comm = parts_of(opt).comm  # the test seam: faults injected into one part

        def after_a_launch(_):
            if comm.stats.get("shard/" + comm.reduce_name):  # some reduce of this step is in flight
                fire()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(after_a_launch)
    elif point == "step":  # inside step(), after the agreement, before the update
        shard = parts_of(opt).shard
        apply = shard.apply_adam

        def fire_then_apply(*args, **kwargs):
            fire()
            return apply(*args, **kwargs)

        shard.apply_adam = fire_then_apply
    elif point == "gather":  # stage 3: a unit's gather in forward; stages 1 and 2: phase 4 of step()
        comm = parts_of(opt).comm
        start = comm.gather_start
        calls = {"n": 0}

        def start_then_fire(bucket, buffer):
            start(bucket, buffer)
            if state["step"] == FAULT_STEP:
                calls["n"] += 1
                if calls["n"] == 2:
                    fire()

        comm.gather_start = start_then_fire


def _rank_main(rank, world, port, stage, point, sig_name, out_dir):
    import torch.distributed as dist

    from zerofast.tools.train import exit_on_fault

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    # The rendezvous waits up to a minute for a peer that starts late (five cases start at once on a
    # loaded machine: a 4 s rendezvous failed here once before any fault); the collectives, what the
    # test is about, wait TIMEOUT_S.
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    model = make_gpt("tiny", n_layer=4)
    opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.002, min_unit_mb=0), **HYPER)
    state = {"step": 0}
    if rank == world - 1:
        _install_fault(model, opt, point, getattr(signal, sig_name), state)
    path = os.path.join(out_dir, f"rank{rank}.json")

    def forward(model, x, y, step):
        state["step"] = step
        if step == FAULT_STEP:
            with open(path + ".t0", "w") as f:
                f.write(repr(time.monotonic()))
        logits, loss = model(x, y)
        if "on_logits" in state:
            state["on_logits"](logits)
        return loss

    try:
        train_steps(model, opt, rank, FAULT_STEP + 3, forward=forward)
    except Exception as e:  # noqa: BLE001
        with open(path, "w") as f:
            json.dump({"type": type(e).__name__, "message": str(e), "t": time.monotonic()}, f)
        exit_on_fault(e)  # zerofast.train's handler: one line on stderr, exit code 1
    with open(path, "w") as f:
        json.dump({"type": None, "t": time.monotonic()}, f)
    os._exit(0)


def _run_cases(cases, tmp_path, world=2):
    """Run the cases, PARALLEL at a time; return {case: [per-survivor result dicts]}."""
    ctx = context()
    results = {}
    for i in range(0, len(cases), PARALLEL):
        batch = []
        for case in cases[i : i + PARALLEL]:
            out = tmp_path / "-".join(map(str, case))
            out.mkdir()
            port = free_port()
            procs = [
                ctx.Process(target=_rank_main, args=(r, world, port, *case, str(out)), daemon=True)
                for r in range(world)
            ]
            for p in procs:
                p.start()
            batch.append((case, out, procs))
        for case, out, procs in batch:
            survivors = procs[:-1]
            for p in survivors:
                p.join(timeout=HANG_S)
            rows = []
            for r, p in enumerate(survivors):
                alive = p.is_alive()
                if alive:
                    p.kill()
                    p.join()
                row = {"hung": alive, "exitcode": None if alive else p.exitcode}
                path = out / f"rank{r}.json"
                if path.exists():
                    row.update(json.loads(path.read_text()))
                    row["elapsed"] = row["t"] - float((out / f"rank{r}.json.t0").read_text())
                rows.append(row)
            victim = procs[-1]
            if victim.is_alive():  # stopped: SIGKILL ends it too
                victim.kill()
                victim.join()
            results[case] = rows
    return results


PHASES = r"(forward|backward|after backward|step\(\) \(phase 2: the reduces and the agreement\)|step\(\) \(phase 4: the parameter gather\))"
COLLECTIVES = (
    r"(the reduce of bucket \d+|an earlier reduce|the wait for this step's bucket reduces|the step's agreement|"
    r"the gather of bucket \d+|the gradient path at bucket \d+|the reduce of a complete bucket)"
)


def _check_survivors(case, rows):
    stage, point, sig = case
    for r, row in enumerate(rows):
        where = f"rank {r}, stage {stage}, {point}, {sig}: {row}"
        assert not row["hung"], f"{where}: still waiting after {HANG_S:g} s (the timeout is {TIMEOUT_S:g} s)"
        assert row["exitcode"] == 1 and row.get("type") == "CollectiveError", where
        msg = row["message"]
        # One message: who, where (the step; stage 3 may meet the fault in the next step's forward
        # gather, after a fault inside step()), which collective, then the backend's own words.
        m = re.match(
            rf"ZeroAdam \(rank {r} of 2\): {COLLECTIVES}.* failed at step (\d), (micro-batch \d, )?{PHASES}(, after \d micro-batch(es)?)?: "
            r"another rank died, is stuck or is out of step \(the wait is bounded by the process group's "
            rf"timeout, {TIMEOUT_S:g} s\)\. Backend: .+",
            msg,
        )
        assert m, where
        assert int(m.group(2)) in (FAULT_STEP + 1, FAULT_STEP + 2), where
        assert "\n" not in msg, where
        backend = msg.split("Backend: ", 1)[1]
        if sig == "SIGKILL":  # the connection closed: the wait ended without the timeout
            assert re.search(PEER_GONE, backend) and not re.search(TIMED_OUT, backend), where
        else:  # stopped: only the timeout could end the wait
            assert re.search(TIMED_OUT, backend) and not re.search(PEER_GONE, backend), where


# Stages 1 and 3: stage 2 issues stage 1's collectives (the bucket reduces in backward, the
# agreement, the gather after the step) through the same engine calls; stage 3 adds the gathers in
# forward and backward. (A failed step on one rank, below, runs every stage.)
@pytest.mark.parametrize("stage", (1, 3))
def test_a_dead_or_stopped_rank_ends_the_others_with_one_message(stage, tmp_path):
    cases = [(stage, point, sig) for point in POINTS for sig in SIGNALS]
    results = _run_cases(cases, tmp_path)
    for case, rows in results.items():
        _check_survivors(case, rows)
    # For the record (`pytest -s`), not asserted: how long the survivors took from the start of the
    # fault's step (a killed rank's: a fraction of a second; a stopped rank's: about the timeout).
    for sig in SIGNALS:
        took = [row["elapsed"] for (_, _, s), rows in results.items() if s == sig for row in rows]
        print(
            f"stage {stage}, {sig}: survivors left {min(took):.2f}-{max(took):.2f} s after the fault's step began "
            f"(timeout {TIMEOUT_S:g} s)"
        )


# --- out of step -------------------------------------------------------------------------------------


def _out_of_step(rank, world, stage, how, check):
    """Rank 0 runs an extra micro-batch in step 2 (how="extra"), or skips step()'s micro-batch
    entirely and calls step() with no backward (how="skip"); returns the error each rank raised."""
    model = make_gpt("tiny", n_layer=4)
    opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.002, min_unit_mb=0, check_collectives=check), **HYPER)
    try:
        for step in range(3):
            micro = 1
            if step == 1 and rank == 0:
                micro = 2 if how == "extra" else 0
            for k in range(micro):
                ctx = opt.no_sync() if k < micro - 1 else _nothing()
                with ctx:
                    _, loss = model(*rank_batch(model, step, rank))
                    loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_ranks_out_of_step_raise_on_every_rank():
    # Stage 1 communicates nothing in an extra micro-batch (it accumulates locally), so the step's
    # agreement sees the counts differ; a rank that runs no micro-batch at all also differs there.
    for how in ("extra", "skip"):
        for rank, (kind, msg) in enumerate(run_ranks(_out_of_step, 2, args=(1, how, False), timeout=60)):
            assert kind == "OutOfStepError" and "the ranks are out of step at step() of step 2" in msg, (how, rank, msg)
            assert ("run 1 to 2 micro-batches" if how == "extra" else "run 0 to 1 micro-batches") in msg, msg


def test_check_collectives_catches_what_the_agreement_cannot():
    # Stages 2 and 3 reduce in every micro-batch: rank 0's extra micro-batch issues reduces the others
    # do not. check_collectives compares each collective before it is issued, on every rank.
    for stage in (2, 3):
        for rank, (kind, msg) in enumerate(run_ranks(_out_of_step, 2, args=(stage, "extra", True), timeout=60)):
            assert kind == "OutOfStepError" and "the ranks are out of step" in msg, (stage, rank, msg)
            assert "rank 0: #" in msg and "rank 1: #" in msg, msg


class _Ordered(torch.nn.Module):
    """Four equal blocks (each its own stage-3 unit), run in the order given."""

    def __init__(self, order):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.order = order

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return x.square().mean()


def _module_order(rank, world, check):
    """Stage 3, rank 1 running two blocks the other way round: equal sizes, so without a check the
    gathers would pair up with the wrong blocks and mix their data silently."""
    model = _Ordered([0, 2, 1, 3] if rank == 1 else [0, 1, 2, 3])
    opt = ZeroAdam(model, **zero_options(3, min_unit_mb=0, check_collectives=check), **HYPER)
    master = opt.checkpoint_view.trainable
    before = master.state_pieces("master")
    try:
        for step in range(2):
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001
        after = master.state_pieces("master")
        return type(e).__name__, str(e), all(torch.equal(x[2], y[2]) for x, y in zip(before, after))
    return None


def test_stage3_modules_in_another_order_are_caught():
    for check, wanted in (
        (False, "they issued different gathers (stage 3: the modules ran in another order)"),
        (True, "the collective each rank was about to issue"),
    ):
        for rank, r in enumerate(run_ranks(_module_order, 2, args=(check,), timeout=60)):
            assert r is not None, (check, rank)
            kind, msg, unchanged = r
            assert kind == "OutOfStepError" and wanted in msg, (check, rank, msg)
            assert unchanged, (check, rank)  # nothing was applied


# --- all or nothing ------------------------------------------------------------------------------------


def _failing_step(rank, world, stage, fault):
    """Rank 1's step 3 fails before the update (a bad lr left by user code, or any exception raised
    in step()'s last checks); every rank must raise and keep the state of step 2, and training then
    continues in step."""
    model = make_gpt("tiny", n_layer=4)
    opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.002, min_unit_mb=0), **HYPER)

    def snapshot():
        with opt.gathered_params():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        view = opt.checkpoint_view
        return params, view.trainable.state_pieces("master"), view.trainable.state_pieces("exp_avg"), view.step_counts()

    errors = []
    for step in range(5):
        _, loss = model(*rank_batch(model, step, rank))
        loss.backward()
        if step == 2:
            before = snapshot()
            if rank == 1:
                if fault == "lr":
                    opt.param_groups[0]["lr"] = -1.0
                else:

                    def boom(index, group):
                        raise RuntimeError("injected fault")

                    parts_of(opt).rule.check_group = boom  # the test seam: step()'s last checks fail
            try:
                opt.step()
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                errors.append((type(e).__name__, str(e)))
            after = snapshot()
            opt.param_groups[0]["lr"] = HYPER["lr"]
            vars(parts_of(opt).rule).pop("check_group", None)
        else:
            opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
    same = all(torch.equal(a[k], b[k]) for a, b in [(before[0], after[0])] for k in a)
    same = same and all(torch.equal(x[2], y[2]) for x, y in zip(before[1] + before[2], after[1] + after[2]))
    return dict(errors=errors, same=same, counts=(before[3], after[3]), final=final)


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_that_fails_on_one_rank_is_applied_on_none(stage):
    for fault, wanted in (("lr", "ValueError"), ("raise", "RuntimeError")):
        results = run_ranks(_failing_step, 2, args=(stage, fault), timeout=60)
        for rank, r in enumerate(results):
            where = f"stage {stage} {fault} rank {rank}"
            kind, msg = r["errors"][0]
            assert kind == (wanted if rank == 1 else "StepNotAppliedError"), (where, kind, msg)
            assert r["same"] and r["counts"][0] == r["counts"][1], where
            if rank == 0:
                assert "step 3 was not applied on any rank: rank 1 failed before the update" in msg, msg
        # The ranks went on in step: stages 1-3 hold the same full parameters on every rank.
        assert all(torch.equal(results[0]["final"][k], results[1]["final"][k]) for k in results[0]["final"]), fault
