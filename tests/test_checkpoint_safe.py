"""Opening a checkpoint runs no code from it ([Note: safe checkpoints], zerofast/checkpoint/safe.py).
For every file of a checkpoint that is parsed (manifest.json, zerofast.json, DCP's .metadata), a
crafted replacement (a pickle whose __reduce__ would write a marker file, truncated bytes, the wrong
JSON or the wrong pickled object): load (on 2 gloo ranks), info, export, to_torch, latest and the
command line each raise an error naming the file, the marker is never written, and the untouched
checkpoint still loads. Also: DCP byte records read with weights_only; the small state's JSON
round trip; `extra` that JSON cannot hold refused at save on every rank; a format-1 checkpoint
(pickled small state) refused, and converted by upgrade only when trusted."""

import json
import os
import pickle
import random
import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import run_ranks
from tolerances import HYPER
from training import train_steps

from zerofast import ZeroAdam
from zerofast import checkpoint as ck
from zerofast.checkpoint import io as ck_io
from zerofast.checkpoint import safe
from zerofast.tools.models import make_gpt


class _Payload:
    """Unpickled, it writes `marker`: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def _train_and_save(rank, world, path, extra=None):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=2, **HYPER)
    train_steps(model, opt, rank, 2)
    ck.save(path, model, opt, extra=extra)


@pytest.fixture(scope="module")
def saved():
    root = tempfile.mkdtemp(prefix="zerofast-safe-")
    path = os.path.join(root, "good", "step-2")
    run_ranks(_train_and_save, 2, args=(path, {"step": 2, "rng": torch.get_rng_state()}))
    yield root, path
    shutil.rmtree(root, ignore_errors=True)


def _crafted(path: str, marker: str) -> dict[str, tuple[str, bytes]]:
    """{case: (file name, replacement bytes)} for every parsed file of the checkpoint at `path`."""
    evil = pickle.dumps(_Payload(marker))
    meta = safe.read_metadata(os.path.join(path, ".metadata"))
    meta.planner_data = {"model.x": _Payload(marker)}  # real DCP metadata with a payload inside
    with open(os.path.join(path, ck.MANIFEST), "rb") as f:
        manifest = f.read()
    with open(os.path.join(path, ck.SMALL), "rb") as f:
        small = f.read()
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = f.read()
    return {
        "manifest, pickle": (ck.MANIFEST, evil),
        "manifest, truncated": (ck.MANIFEST, manifest[: len(manifest) // 2]),
        "manifest, wrong JSON": (ck.MANIFEST, json.dumps({"format": "zerofast-checkpoint-2", "params": 3}).encode()),
        "manifest, shard_size 0": (ck.MANIFEST, json.dumps({**json.loads(manifest), "shard_size": 0}).encode()),
        "small state, pickle": (ck.SMALL, evil),
        "small state, truncated": (ck.SMALL, small[: len(small) // 2]),
        "small state, wrong JSON": (ck.SMALL, json.dumps({"steps": [1, 2]}).encode()),
        "small state, a bad tag": (ck.SMALL, small.replace(b'"$zf":"tensor"', b'"$zf":"pickle"')),
        "metadata, pickle": (".metadata", evil),
        "metadata, payload inside": (".metadata", pickle.dumps(meta)),
        "metadata, truncated": (".metadata", metadata[: len(metadata) // 2]),
        "metadata, garbage": (".metadata", b"\x00not a pickle at all" * 8),
        "metadata, wrong object": (".metadata", pickle.dumps({"state_dict_metadata": {}})),
        # No code named, but BUILD on an allowed class: Path.exists replaced for the whole process
        "metadata, BUILD on a class": (
            ".metadata",
            b"\x80\x04cpathlib\nPosixPath\nN}X\x06\x00\x00\x00existsctorch\nSize\ns\x86b.",
        ),
    }


@pytest.fixture(scope="module")
def damaged(saved):
    """{case: (checkpoint folder, the file replaced)}, each case a copy of the good checkpoint
    alone in a folder of its own (so latest() of that folder meets it)."""
    root, good = saved
    marker = os.path.join(root, "MARKER")
    out = {}
    for k, (case, (name, data)) in enumerate(_crafted(good, marker).items()):
        path = os.path.join(root, f"case{k}", "step-2")
        shutil.copytree(good, path)
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
        out[case] = (path, name)
    return out, marker


def _one_process_entry_points(path):
    """Each reader of a checkpoint in one process: (entry point, the error message or None)."""
    out = []
    for name, call in [
        ("info", lambda: ck.info(path)),
        ("to_torch", lambda: ck.to_torch(path)),
        ("export", lambda: ck.export(path, path + ".safetensors")),
        ("latest", lambda: ck.latest(os.path.dirname(path))),
    ]:
        try:
            call()
            out.append((name, None))
        except (ValueError, FileNotFoundError) as err:
            out.append((name, str(err)))
    return out


def test_a_crafted_file_runs_no_code_in_one_process(damaged, saved, capsys):
    cases, marker = damaged
    for case, (path, name) in cases.items():
        for entry, message in _one_process_entry_points(path):
            if entry == "latest" and name != ck.MANIFEST:
                assert message is None, (case, message)  # latest() reads manifests only
                continue
            assert message is not None and os.path.join(path, name) in message, (case, entry, message)
        assert ck.main(["info", path]) == 1 and os.path.join(path, name) in capsys.readouterr().err, case
        assert ck.main(["export", path, path + ".st"]) == 1, case
        assert not os.path.exists(marker), f"{case}: code from the checkpoint ran"
        assert os.path.exists(path), f"{case}: pathlib was altered"
    # Named in the message: what the allowlist refused.
    path, _ = cases["metadata, pickle"]
    with pytest.raises(ck.UnsafeCheckpoint, match="refusing to load builtins.exec"):
        ck.info(path)
    # The untouched checkpoint still reads.
    _, good = saved
    assert "zerofast checkpoint" in ck.info(good) and ck.to_torch(good)[0]


def _load_each(rank, world, paths):
    """ck.load of every path in turn on every rank: the message each raised (None: loaded)."""
    model = make_gpt("tiny", seed=3)
    opt = ZeroAdam(model, stage=3, **HYPER)
    out = []
    for path in paths:
        try:
            ck.load(path, model, opt)
            out.append(None)
        except (ValueError, FileNotFoundError) as err:
            out.append(f"{type(err).__name__}: {err}")
    # After all of them, training goes on from the good one (the last path).
    train_steps(model, opt, rank, 1, start=2)
    return out, opt.checkpoint_view.step_counts()


def test_a_crafted_file_runs_no_code_when_loading_on_every_rank(damaged, saved):
    cases, marker = damaged
    _, good = saved
    names = list(cases)
    for rank, (messages, steps) in enumerate(run_ranks(_load_each, 2, args=([cases[c][0] for c in names] + [good],))):
        for case, message in zip(names, messages):
            path, name = cases[case]
            assert message is not None and os.path.join(path, name) in message, (rank, case, message)
        assert messages[-1] is None and set(steps.values()) == {3}, (rank, messages[-1], steps)
    assert not os.path.exists(marker)


def test_dcp_byte_records_are_read_with_weights_only(tmp_path):
    """A non-tensor state_dict entry is a pickled byte record in DCP's files; DCP's own planner
    unpickles it with weights_only=False, ours with True."""
    marker = str(tmp_path / "MARKER")
    dcp.save({"x": torch.ones(2), "extra_state": _Payload(marker)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    target = {"x": torch.zeros(2), "extra_state": None}
    from torch.distributed.checkpoint.api import CheckpointException  # DCP wraps every rank's error in it

    with pytest.raises(CheckpointException, match="refusing to load the checkpoint's entry 'extra_state'"):
        dcp.load(target, storage_reader=ck.SafeReader(str(tmp_path / "c")), planner=ck.SafeLoadPlanner(), no_dist=True)
    assert not os.path.exists(marker)
    ok = {"x": torch.zeros(2), "extra_state": None}
    dcp.save({"x": torch.ones(2), "extra_state": "plain data"}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    dcp.load(ok, storage_reader=ck.SafeReader(str(tmp_path / "d")), planner=ck.SafeLoadPlanner(), no_dist=True)
    assert ok["extra_state"] == "plain data" and torch.equal(ok["x"], torch.ones(2))


def test_the_small_state_round_trips_through_json():
    sched = torch.optim.lr_scheduler.OneCycleLR(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), 1.0, 10)
    # numpy is no dependency of torch's: a machine with torch alone skips this test, not the module.
    np = pytest.importorskip("numpy", reason="the round trip of numpy values needs numpy")
    np_rng = np.random.RandomState(3).get_state()
    value = {
        "step": 7,
        "big": 2**70,
        "f": 0.1,
        "nan": float("nan"),
        "inf": -float("inf"),
        "t": (1, (2, "x")),
        "keys": {1: "a", (2, 3): "b", "$zf": "a user key"},
        "raw": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "rng": torch.get_rng_state(),
        "bf16": torch.randn(3, 2).bfloat16(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_rng": np_rng,
        "py_rng": random.Random(5).getstate(),
        "sched": sched.state_dict(),
        "np_scalar": np.float64(0.25),
    }
    back = safe.loads(safe.dumps(value), "here")
    for k, v in value.items():
        got = back[k]
        if isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and torch.equal(got, v), k
        elif k == "np":
            assert got.dtype == v.dtype and (got == v).all(), k
        elif k == "np_rng":
            assert got[0] == v[0] and (got[1] == v[1]).all() and got[2:] == v[2:], k
        elif k == "nan":
            assert got != got
        else:
            assert got == v and type(got) is type(v) or k == "np_scalar" and got == 0.25, (k, got, v)
    random.Random().setstate(back["py_rng"])
    np.random.RandomState().set_state(back["np_rng"])
    torch.set_rng_state(back["rng"])
    with pytest.raises(TypeError, match=r"extra\['opt'\]\[0\] is a builtins.object"):
        safe.dumps({"opt": [object()]})


def _save_bad_extra(rank, world, path):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=1, **HYPER)
    messages = []
    for kwargs in ({"extra": {"fn": lambda: 0}}, {"blocking": "no"}):
        try:
            ck.save(path, model, opt, **kwargs)
            messages.append(None)
        except TypeError as err:
            messages.append(str(err))
    return messages


def test_extra_that_json_cannot_hold_is_refused_on_every_rank(tmp_path):
    """And a `blocking` that is not a bool: named too."""
    path = str(tmp_path / "c")
    for extra, blocking in run_ranks(_save_bad_extra, 2, args=(path,)):
        assert extra is not None and "extra['fn'] is a builtins.function" in extra, extra
        assert blocking is not None and "blocking must be True or False; got 'no'" in blocking, blocking
    assert not os.path.exists(path) and not os.path.exists(path + ck.INCOMPLETE)


def test_a_format_1_checkpoint_is_refused_until_upgraded_on_trust(saved, tmp_path):
    """A checkpoint of the previous format (its small state a pickle, zerofast.pt) is an error that
    says how to convert it; upgrade() converts it only with trust_pickle, and then it reads as
    written."""
    _, good = saved
    old = str(tmp_path / "old")
    shutil.copytree(good, old)
    small = ck_io.read_small(old)
    torch.save(small, os.path.join(old, "zerofast.pt"))
    os.remove(os.path.join(old, ck.SMALL))
    manifest = json.load(open(os.path.join(old, ck.MANIFEST)))
    json.dump({**manifest, "format": "zerofast-checkpoint-1"}, open(os.path.join(old, ck.MANIFEST), "w"))
    with pytest.raises(ValueError, match="upgrade .*--trust-pickle"):
        ck.info(old)
    with pytest.raises(ValueError, match="trust_pickle=True"):
        ck.upgrade(old)
    assert ck.main(["upgrade", old, "--trust-pickle"]) == 0
    assert not os.path.exists(os.path.join(old, "zerofast.pt"))
    again = ck_io.read_small(old)
    assert again["steps"] == small["steps"] and torch.equal(again["extra"]["rng"], small["extra"]["rng"])
    a, b = ck.to_torch(old)[0], ck.to_torch(good)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
