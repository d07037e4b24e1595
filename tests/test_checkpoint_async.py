"""Asynchronous saves (zerofast.checkpoint.save(blocking=False), [Note: asynchronous save]) on real
gloo ranks: training continues while the copy is written, and the checkpoint equals a blocking save
taken at the same step, bitwise, in stages 1-3 and in bf16; the staging memory is one copy of the
shard, reused; a second save and a load wait for the one in flight; a write error (on one rank)
is raised later, by wait() or by the next save, naming the path, on every rank; a rank SIGKILLed
during the background write leaves the previous checkpoint the latest, and keep=K deleted nothing."""

import os
import shutil
import tempfile
import threading

import pytest
import torch
from harness import RankFailed, run_ranks
from tolerances import HYPER
from training import train_steps

from zerofast import ZeroAdam
from zerofast import checkpoint as ck
from zerofast.checkpoint import io as ck_io
from zerofast.tools.models import make_gpt


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-async-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _make(stage, precision=None):
    model = make_gpt("tiny")
    model.register_buffer("seen", torch.zeros(3))  # a buffer the loop changes after each save
    opt = ZeroAdam(model, stage=stage, mixed_precision=precision, **HYPER)
    return model, opt


HOLD_S = 120.0  # the longest a held writer waits for its release: far beyond two training steps


def _held_writes(filesystem):
    """DCP's item writer, held until `release` is set: the training steps after an asynchronous save
    then surely run before any of its data is written, so a writer reading the live state would
    differ. A writer never released (the training side failed first) gives up at HOLD_S, failing
    the save, instead of hanging the rank."""
    real = filesystem._write_item
    release = threading.Event()

    def held(*args, **kwargs):
        if not release.wait(timeout=HOLD_S):
            raise TimeoutError(f"the held checkpoint writer was not released within {HOLD_S:g} s")
        return real(*args, **kwargs)

    return real, held, release


def _async_equals_blocking(rank, world, root):
    from torch.distributed.checkpoint import filesystem

    out = {}
    for stage, precision in ((1, None), (2, None), (3, None), (3, "bf16")):
        tag = f"{stage}{precision or ''}"
        model, opt = _make(stage, precision)
        train_steps(model, opt, rank, 2)
        extra = {"step": 2, "rng": torch.get_rng_state()}
        model.seen.fill_(2.0)
        blocking = ck.save(os.path.join(root, f"blocking{tag}"), model, opt, extra=extra)
        real, held, release = _held_writes(filesystem)
        filesystem._write_item = held
        try:
            handle = ck.save(os.path.join(root, f"async{tag}"), model, opt, extra=extra, blocking=False)
            # Training goes on at once: the live state changes while the copy waits to be written.
            model.seen.fill_(3.0)
            train_steps(model, opt, rank, 2, start=2)
            assert not handle.done()  # held: the steps ran before any of it was written
            release.set()
            seen = []
            handle.then(lambda: seen.append(os.path.isdir(handle.path)))  # runs once the folder exists
            staged = ck_io.staging_of(opt)
            pointers = {k: t.data_ptr() for k, t in staged.flat.items()}
            assert handle.wait() == os.path.join(root, f"async{tag}") and handle.done() and seen == [True]
            handle.then(lambda: seen.append("now"))  # after the end: at once, on this thread
            assert seen == [True, "now"]
        finally:
            release.set()  # a failed assertion must not leave the writer held
            filesystem._write_item = real
        # A second asynchronous save reuses the staging memory; load() waits for it.
        again = ck.save(os.path.join(root, f"again{tag}"), model, opt, blocking=False)
        assert {k: t.data_ptr() for k, t in staged.flat.items()} == pointers
        ck.load(again.path, model, opt)  # waits for `again`, which exists afterwards
        import warnings

        with warnings.catch_warnings(record=True) as caught:  # a failing then(): a warning, not the save's error
            warnings.simplefilter("always")
            again.then(lambda: 1 / 0)
        assert any(again.path in str(w.message) and "ZeroDivisionError" in str(w.message) for w in caught)
        out[tag] = dict(
            blocking=blocking,
            shard_numel=opt.checkpoint_view.trainable.layout.shard_numel(rank),
            buffer_bytes=model.seen.numel() * model.seen.element_size(),  # bf16: the buffer too
            staging_bytes=ck_io.staging_bytes(opt),
            steps=opt.checkpoint_view.step_counts(),
        )
    return out


def test_an_asynchronous_save_equals_a_blocking_one_while_training_goes_on(root):
    results = run_ranks(_async_equals_blocking, 2, args=(root,), timeout=300)
    for tag in ("1", "2", "3", "3bf16"):
        a_model, a_opt = ck.to_torch(os.path.join(root, f"async{tag}"))
        b_model, b_opt = ck.to_torch(os.path.join(root, f"blocking{tag}"))
        assert a_model.keys() == b_model.keys() and all(torch.equal(a_model[k], b_model[k]) for k in a_model), tag
        assert torch.equal(a_model["seen"], torch.full((3,), 2.0)), tag  # the buffer as it was at the call
        for i, state in b_opt["state"].items():
            assert all(torch.equal(state[k], a_opt["state"][i][k]) for k in state), (tag, i)
        small_a, small_b = (ck_io.read_small(os.path.join(root, f"{kind}{tag}")) for kind in ("async", "blocking"))
        assert small_a["steps"] == small_b["steps"] and torch.equal(small_a["extra"]["rng"], small_b["extra"]["rng"])
        for rank, out in enumerate(results):
            # One fp32 copy of master, exp_avg and exp_avg_sq of the rank's shard, plus the buffer.
            assert out[tag]["staging_bytes"] == 3 * 4 * out[tag]["shard_numel"] + out[tag]["buffer_bytes"], (tag, rank)
            assert set(out[tag]["steps"].values()) == {4}, tag  # loaded `again`, saved after 4 steps


def _write_error(rank, world, root):
    from torch.distributed.checkpoint import filesystem

    model, opt = _make(2)
    train_steps(model, opt, rank, 1)
    ck.save(os.path.join(root, "step-1"), model, opt)
    real = filesystem._write_item
    out = {}
    try:
        if rank == 1:  # one rank's disk fails

            def fail(*args, **kwargs):
                raise OSError(28, "No space left on device (injected)")

            filesystem._write_item = fail
        # Noticed by the next save: it raises, and writes nothing.
        ck.save(os.path.join(root, "step-2"), model, opt, blocking=False)
        train_steps(model, opt, rank, 1, start=1)
        try:
            ck.save(os.path.join(root, "step-3"), model, opt)
        except RuntimeError as err:
            out["next save"] = str(err)
        # Noticed by wait(): raised there once, not again by the next save; then() never runs.
        handle = ck.save(os.path.join(root, "step-4"), model, opt, blocking=False)
        handle.then(lambda: out.setdefault("then ran", True))
        try:
            handle.wait()
        except RuntimeError as err:
            out["wait"] = str(err)
    finally:
        filesystem._write_item = real
    ck.save(os.path.join(root, "step-5"), model, opt, keep=2)
    out["latest"] = ck.latest(root)
    # Rank 0 failing after the data is written (its manifest): every rank raises, none waits.
    real_counter = ck_io.next_save_counter
    try:
        if rank == 0:

            def no_manifest(root):
                raise OSError(5, "Input/output error (injected)")

            ck_io.next_save_counter = no_manifest
        ck.save(os.path.join(root, "step-6"), model, opt)
    except (OSError, RuntimeError) as err:
        out["rank 0 failing"] = str(err)
    finally:
        ck_io.next_save_counter = real_counter
    return out


def test_a_write_error_is_raised_later_naming_the_path_on_every_rank(root):
    for rank, out in enumerate(run_ranks(_write_error, 2, args=(root,), timeout=120)):
        assert "asynchronous save of " + os.path.join(root, "step-2") + " failed" in out.get("next save", ""), (
            rank,
            out,
        )
        assert "step-4" in out.get("wait", "") and "No space left" in str(out), (rank, out)
        assert out["latest"] == os.path.join(root, "step-5") and "then ran" not in out, (rank, out)
        assert "Input/output error (injected)" in out.get("rank 0 failing", ""), (rank, out)
        if rank == 1:
            assert "rank 0 could not complete " + os.path.join(root, "step-6") in out["rank 0 failing"], out
    assert sorted(os.listdir(root)) == ["step-1", "step-5"]  # the failed ones left nothing behind


def _killed_during_async_write(rank, world, root):
    import signal

    from torch.distributed.checkpoint import filesystem

    model, opt = _make(3)
    for step in (1, 2):
        train_steps(model, opt, rank, 1, start=step - 1)
        ck.save(os.path.join(root, f"step-{step}"), model, opt, keep=2)
    train_steps(model, opt, rank, 1, start=2)
    if rank == 1:  # the writer thread dies in the middle of this rank's data: the whole process does
        real = filesystem._write_item

        def write_then_die(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        filesystem._write_item = write_then_die
    handle = ck.save(os.path.join(root, "step-3"), model, opt, keep=2, blocking=False)
    train_steps(model, opt, rank, 1, start=3)  # training goes on meanwhile
    # Rank 1 dies in its write; rank 0's wait then fails on the closed connection (the save cannot
    # complete without rank 1's data), and the harness reports rank 1's death.
    handle.wait()


def _load_latest(rank, world, root):
    model, opt = _make(2)
    path = ck.latest(root)
    ck.load(path, model, opt)
    return path, opt.checkpoint_view.step_counts()


def test_a_rank_killed_during_an_asynchronous_write_leaves_the_previous_checkpoint(root):
    with pytest.raises(RankFailed, match="rank 1 exited with code -9"):
        run_ranks(_killed_during_async_write, 2, args=(root,), timeout=120)
    assert not os.path.exists(os.path.join(root, "step-3"))
    assert {"step-1", "step-2"} <= set(os.listdir(root))  # keep=2 ran only after a complete save
    for path, steps in run_ranks(_load_latest, 2, args=(root,)):
        assert path == os.path.join(root, "step-2") and set(steps.values()) == {2}


_EXIT_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from zerofast import ZeroAdam, checkpoint
from zerofast.tools.models import make_gpt
model = make_gpt("tiny")
opt = ZeroAdam(model, stage=2, lr=1e-3)
checkpoint.save(sys.argv[1], model, opt, blocking=False)
print("returned before written:", not os.path.isdir(sys.argv[1]), flush=True)
"""  # and the interpreter exits at once, with the write in flight


def test_the_process_exit_waits_for_the_write(root):
    """A script that ends right after an asynchronous save leaves the complete checkpoint: the
    writer thread is joined at the interpreter's exit."""
    import subprocess
    import sys

    from harness import free_port

    path = os.path.join(root, "at-exit")
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, path, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "zerofast checkpoint" in ck.info(path)
