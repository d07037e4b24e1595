"""Sharded checkpoints (zerofast.checkpoint) on real gloo ranks: resume in the same
configuration bitwise; load into another world size, stage, partition or precision with the full
parameters and optimizer state bitwise as saved; a plain model loads the model entry with DCP
alone; incomplete checkpoints are never taken; bad input gets a clear error on every rank."""

import json
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from models import Quirky
from probes import full_master
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import global_batch, rank_batch, train_steps, zero_options

from zerofast import ZeroAdam
from zerofast import checkpoint as ck
from zerofast.tools.models import make_gpt

STEPS = 3  # before the save, and again after it


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-ckpt-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _shapes():
    return {n: tuple(p.shape) for n, p in make_gpt("tiny").named_parameters()}


def _train(model, opt, rank, start, steps):
    train_steps(model, opt, rank, steps, start=start, backward=opt.backward)


def _snapshot(model, opt) -> dict:
    """Everything a resumed run must reproduce: this rank's full parameters, its pieces of the
    master and of Adam's moments, the step counts and the loss scale."""
    with opt.gathered_params():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return dict(
        params=params,
        **{k: opt.checkpoint_view.trainable.state_pieces(k) for k in ("master", "exp_avg", "exp_avg_sq")},
        steps=opt.checkpoint_view.step_counts(),
        scale=opt.loss_scale,
    )


def _make(stage, partition, precision, seed=0, **kw):
    model = make_gpt("tiny", seed=seed)
    group = dist.new_group(list(range(dist.get_world_size())))  # a fresh process group for each optimizer
    scaling = dict(init_scale=2.0**8, growth_interval=2) if precision == "fp16" else {}  # a scale that moves
    opt = ZeroAdam(
        model,
        **zero_options(
            stage, partition=partition, mixed_precision=precision, bucket_mb=kw.pop("bucket_mb", 0.01), **scaling
        ),
        process_group=group,
        **HYPER,
        **kw,
    )
    return model, opt


# --- the same configuration: resume bitwise ------------------------------------------------------

CONFIGS = [(s, p, None) for s in (1, 2, 3) for p in ("flat", "round_robin", "greedy")] + [
    (s, p, mp) for mp in ("bf16", "fp16") for s in (1, 2, 3) for p in ("flat", "round_robin", "greedy")
]


def _resume_matrix(rank, world, root):
    out = {}
    for stage, partition, precision in CONFIGS:
        where = os.path.join(root, f"w{world}-s{stage}-{partition}-{precision}")
        model, opt = _make(stage, partition, precision)
        _train(model, opt, rank, 0, STEPS)
        ck.save(where, model, opt, extra={"step": STEPS, "note": "user object"})
        _train(model, opt, rank, STEPS, STEPS)
        uninterrupted = _snapshot(model, opt)
        model, opt = _make(stage, partition, precision, seed=7)  # other initial values: all must come from the file
        extra = ck.load(where, model, opt)
        _train(model, opt, rank, STEPS, STEPS)
        out[stage, partition, precision] = (uninterrupted, _snapshot(model, opt), extra)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_resume_in_the_same_configuration_is_bitwise(world, root):
    for rank, out in enumerate(run_ranks(_resume_matrix, world, args=(root,), timeout=600)):
        for key, (want, got, extra) in out.items():
            where = f"{key} rank {rank}/{world}"
            assert extra == {"step": STEPS, "note": "user object"}, where
            assert all(torch.equal(got["params"][n], want["params"][n]) for n in want["params"]), where
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(got[kind], want[kind])), (
                    f"{where}: {kind}"
                )
            assert got["steps"] == want["steps"] and got["scale"] == want["scale"], where


# --- another configuration: resharded, bitwise as saved -------------------------------------------


def _save_for_reshard(rank, world, path, stage, partition, precision):
    model, opt = _make(stage, partition, precision)
    _train(model, opt, rank, 0, STEPS)
    ck.save(path, model, opt)
    return _snapshot(model, opt)


def _load_resharded(rank, world, path, stage, partition, precision, bucket_mb):
    model, opt = _make(stage, partition, precision, seed=7, bucket_mb=bucket_mb)
    ck.load(ck.latest(os.path.dirname(path)), model, opt)
    return _snapshot(model, opt)


def _full(snapshots, kind):
    return full_master([s[kind] for s in snapshots], _shapes())


RESHARD = [  # (saved world, stage, partition, precision) -> (loaded world, stage, partition, precision, bucket_mb)
    ((2, 2, "flat", None), (3, 3, "round_robin", None, 0.01)),
    ((2, 2, "flat", None), (1, 1, "greedy", None, 0.01)),
    ((2, 2, "flat", None), (4, 2, "flat", None, 0.001)),
    ((3, 3, "greedy", None), (2, 1, "round_robin", None, 0.01)),
    ((2, 1, "flat", None), (2, 3, "flat", "bf16", 0.01)),
    ((3, 2, "round_robin", "bf16"), (2, 2, "flat", None, 0.01)),
]


@pytest.mark.parametrize("saved, loaded", RESHARD, ids=[f"{a}->{b[:4]}" for a, b in RESHARD])
def test_load_into_another_configuration_equals_what_was_saved(saved, loaded, root):
    path = os.path.join(root, "step-3")
    before = run_ranks(_save_for_reshard, saved[0], args=(path, *saved[1:]))
    after = run_ranks(_load_resharded, loaded[0], args=(path, *loaded[1:]))
    for kind in ("master", "exp_avg", "exp_avg_sq"):  # every element, gathered from every rank's pieces
        want, got = _full(before, kind), _full(after, kind)
        assert all(torch.equal(got[n], want[n]) for n in want), f"{kind} differs after {saved} -> {loaded}"
    for snap in after:
        assert snap["steps"] == before[0]["steps"]
        if loaded[3] is None:  # fp32: the parameters are the master itself
            assert all(torch.equal(snap["params"][n], _full(before, "master")[n]) for n in snap["params"])
        else:  # the parameters are the master's rounding
            master = _full(before, "master")
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[loaded[3]]
            assert all(torch.equal(snap["params"][n], master[n].to(dtype).float()) for n in snap["params"])


def _continue_after_load(rank, world, path, stage, partition):
    model, opt = _make(stage, partition, None, seed=7)
    ck.load(path, model, opt)
    _train(model, opt, rank, STEPS, STEPS)
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_training_continues_on_another_world_size_as_single_process_adamw(root):
    """Saved on 2 ranks after 3 steps, continued on 3 ranks (stage 3) for 3 more: as one process
    running AdamW on the 2-rank global batch, then on the 3-rank one."""
    path = os.path.join(root, "step-3")
    run_ranks(_save_for_reshard, 2, args=(path, 2, "flat", None))
    results = run_ranks(_continue_after_load, 3, args=(path, 3, "round_robin"))
    model = make_gpt("tiny")
    adamw = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(2 * STEPS):
        x, y = global_batch(model, step, 2 if step < STEPS else 3)
        model(x, y)[1].backward()
        adamw.step()
        adamw.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for rank, got in enumerate(results):
        d = max_abs_diff(got, want)
        assert d <= fp32_tol(2 * STEPS), f"rank {rank}/3: {d:.3g} from single-process AdamW"


def test_a_plain_model_loads_the_model_entry_with_dcp_alone(root):
    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, "step-3")
    before = run_ranks(_save_for_reshard, 2, args=(path, 3, "greedy", None))
    model = make_gpt("tiny", seed=9)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    model.load_state_dict(sd["model"])
    master = _full(before, "master")
    assert all(torch.equal(p.detach(), master[n]) for n, p in model.named_parameters())
    assert torch.equal(model.lm_head.weight, model.wte.weight)  # the tied weight, under both names


# --- what is never taken, and bad input -----------------------------------------------------------


def _errors(rank, world, root):
    model, opt = _make(2, "flat", None)
    _train(model, opt, rank, 0, 1)
    first = ck.save(os.path.join(root, "step-1"), model, opt)
    if rank == 0:  # what a save killed while writing leaves behind
        os.makedirs(os.path.join(root, "step-2" + ck.INCOMPLETE))
    dist.barrier()
    out = {"latest": ck.latest(root) == first, "messages": []}
    wide = make_gpt("tiny", n_embd=24)
    attempts = [
        lambda: ck.save(first, model, opt),
        lambda: ck.load(os.path.join(root, "step-2"), model, opt),
        lambda: ck.load(os.path.join(root, "nowhere"), model, opt),
        lambda: ck.load(first, wide, ZeroAdam(wide, stage=2, **HYPER)),
    ]
    for attempt in attempts:
        try:
            attempt()
            out["messages"].append(None)
        except (FileExistsError, FileNotFoundError, ValueError) as e:
            out["messages"].append(f"{type(e).__name__}: {e}")
    return out


def test_incomplete_checkpoints_are_never_taken_and_bad_input_is_named(root):
    for out in run_ranks(_errors, 2, args=(root,)):
        assert out["latest"]
        exists, incomplete, missing, mismatch = out["messages"]
        assert exists and exists.startswith("FileExistsError") and "never overwritten" in exists
        assert incomplete and incomplete.startswith("FileNotFoundError") and "was never completed" in incomplete
        assert missing and missing.startswith("FileNotFoundError") and "no checkpoint at" in missing
        assert (
            mismatch
            and mismatch.startswith("ValueError")
            and "wte.weight of shape (64, 16)" in mismatch
            and "(64, 24)" in mismatch
        )


def test_boxes_cover_a_flat_range_exactly():
    """Every range of every shape: at most 2 * ndim - 1 boxes, in flat order, covering it once."""
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (1, 1)]:
        numel = int(torch.tensor(shape).prod())
        flat = torch.arange(numel).view(shape)
        for lo in range(numel):
            for hi in range(lo + 1, numel + 1):
                got = ck.boxes(shape, lo, hi)
                assert len(got) <= 2 * len(shape) - 1
                values = torch.cat(
                    [flat[tuple(slice(o, o + z) for o, z in zip(off, size))].reshape(-1) for off, size, _ in got]
                )
                assert torch.equal(values, torch.arange(lo, hi)), (shape, lo, hi, got)
                assert [start for _, _, start in got] == sorted(start for _, _, start in got)


# --- plain torch both ways, export, info, keep ------------------------------------------------------


def _continue(rank, world, path, steps_from):
    model, opt = _make(2, "flat", None, seed=7)
    ck.load(path, model, opt)
    _train(model, opt, rank, steps_from, STEPS)
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_to_torch_continues_in_adamw_as_zeroadam_continues(root):
    path = os.path.join(root, "step-3")
    run_ranks(_save_for_reshard, 2, args=(path, 3, "greedy", None))
    zero = run_ranks(_continue, 2, args=(path, STEPS))[0]
    model_sd, optim_sd = ck.to_torch(path)
    model = make_gpt("tiny", seed=9)
    model.load_state_dict(model_sd)
    adamw = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    adamw.load_state_dict(optim_sd)
    for step in range(STEPS, 2 * STEPS):
        model(*global_batch(model, step, 2))[1].backward()
        adamw.step()
        adamw.zero_grad()
    d = max_abs_diff({n: p.detach() for n, p in model.named_parameters()}, zero)
    assert d <= fp32_tol(STEPS), f"AdamW from to_torch vs ZeroAdam from load: {d:.3g}"


def _from_torch(rank, world, model_sd, optim_sd, stage, partition):
    model, opt = _make(stage, partition, None, seed=7)
    ck.from_torch(model_sd, optim_sd, model, opt)
    _train(model, opt, rank, STEPS, STEPS)
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_from_torch_continues_a_plain_torch_run_in_zeroadam():
    model = make_gpt("tiny")
    adamw = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(2 * STEPS):
        if step == STEPS:
            model_sd = {k: v.clone() for k, v in model.state_dict().items()}
            optim_sd = __import__("copy").deepcopy(adamw.state_dict())
        model(*global_batch(model, step, 3))[1].backward()
        adamw.step()
        adamw.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for stage, partition in ((1, "round_robin"), (3, "flat")):
        for rank, got in enumerate(run_ranks(_from_torch, 3, args=(model_sd, optim_sd, stage, partition))):
            d = max_abs_diff(got, want)
            assert d <= fp32_tol(STEPS), f"stage {stage} {partition} rank {rank}: {d:.3g} from AdamW continuing"


def test_export_streams_a_safetensors_file_a_plain_model_loads(root):
    from safetensors.torch import load_file

    path = os.path.join(root, "step-3")
    before = run_ranks(_save_for_reshard, 3, args=(path, 2, "flat", None))  # ranges cut across rows: boxes
    master = _full(before, "master")
    out = os.path.join(root, "model.safetensors")
    ck.export(path, out)
    model = make_gpt("tiny", seed=9)
    model.load_state_dict(load_file(out))
    assert all(torch.equal(p.detach(), master[n]) for n, p in model.named_parameters())
    ck.export(path, out + ".bf16", dtype="bf16")
    loaded = load_file(out + ".bf16")
    assert all(torch.equal(loaded[n], master[n].to(torch.bfloat16)) for n in master)
    text = ck.info(path)
    assert "saved by 3 ranks, stage 2, flat partition, fp32" in text and f"{len(master)} trainable" in text
    with pytest.raises(ValueError, match="dtype must be fp32 or bf16; got 'fp8'"):
        ck.export(path, out, dtype="fp8")


def _keep(rank, world, root):
    model, opt = _make(1, "flat", None)
    for k in range(4):
        _train(model, opt, rank, k, 1)
        ck.save(os.path.join(root, f"step-{k}"), model, opt, keep=2)
    errors = []
    for bad in (1, 0, "2", True):
        try:
            ck.save(os.path.join(root, "never"), model, opt, keep=bad)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return sorted(os.listdir(root)), ck.latest(root), errors


def test_keep_purges_all_but_the_newest(root):
    for names, newest, errors in run_ranks(_keep, 2, args=(root,)):
        assert names == ["step-2", "step-3"] and newest == os.path.join(root, "step-3")
        assert all(e and "keep must be None or an integer >= 2" in e for e in errors), errors


def _saves_out_of_name_order(rank, world, root):
    """z-1 at step 1; b-2 and a-2 at step 2 (a-2 saved last); then, from a fresh optimizer at step
    1, c-1 with keep=2."""
    model, opt = _make(1, "flat", None)
    _train(model, opt, rank, 0, 1)
    ck.save(os.path.join(root, "z-1"), model, opt)
    _train(model, opt, rank, 1, 1)
    ck.save(os.path.join(root, "b-2"), model, opt)
    ck.save(os.path.join(root, "a-2"), model, opt)
    dist.barrier()
    if rank == 0:  # wall-clock time says otherwise: the step-1 checkpoint is the newest by `created`
        for name, created in (("z-1", 3e9), ("b-2", 2e9), ("a-2", 1e9)):
            with open(os.path.join(root, name, ck.MANIFEST)) as f:
                manifest = json.load(f)
            with open(os.path.join(root, name, ck.MANIFEST), "w") as f:
                json.dump({**manifest, "created": created}, f)
    dist.barrier()
    picked = [ck.latest(root)]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "a-2"))
    dist.barrier()
    picked.append(ck.latest(root))
    model, opt = _make(1, "flat", None)
    _train(model, opt, rank, 0, 1)
    ck.save(os.path.join(root, "c-1"), model, opt, keep=2)
    return picked, sorted(os.listdir(root))


def test_latest_orders_by_the_step_in_the_manifest_not_the_clock(root):
    for picked, left in run_ranks(_saves_out_of_name_order, 2, args=(root,)):
        assert picked == [os.path.join(root, "a-2"), os.path.join(root, "b-2")]  # the same step: saved later
        assert left == ["b-2", "c-1"]  # keep=2: the latest two, and never the one just written
    manifests = {}
    for name in ("b-2", "c-1"):
        with open(os.path.join(root, name, ck.MANIFEST)) as f:
            manifests[name] = json.load(f)
    assert (manifests["b-2"]["step"], manifests["b-2"]["save_counter"]) == (2, 2)
    assert (manifests["c-1"]["step"], manifests["c-1"]["save_counter"]) == (1, 3)  # after b-2's, a-2 deleted
    assert ck.latest(root) == os.path.join(root, "b-2")
    assert "optimizer step 2 (save 2 in its folder)" in ck.info(os.path.join(root, "b-2"))


# --- a save killed half-way; a damaged file -------------------------------------------------------


def _killed_while_saving(rank, world, root):
    import signal

    from torch.distributed.checkpoint import filesystem

    model, opt = _make(2, "flat", None)
    _train(model, opt, rank, 0, 1)
    ck.save(os.path.join(root, "step-1"), model, opt)
    _train(model, opt, rank, 1, 1)
    if rank == 1:  # die in the middle of writing this rank's data
        real = filesystem._write_item

        def write_then_die(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        filesystem._write_item = write_then_die
    ck.save(os.path.join(root, "step-2"), model, opt)


def _load_latest(rank, world, root):
    model, opt = _make(2, "flat", None, seed=7)
    path = ck.latest(root)
    ck.load(path, model, opt)
    return path, opt.checkpoint_view.step_counts()


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(root):
    from harness import RankFailed

    with pytest.raises(RankFailed, match="rank 1 exited with code -9"):
        run_ranks(_killed_while_saving, 2, args=(root,), timeout=120)
    assert not os.path.exists(os.path.join(root, "step-2"))
    for path, steps in run_ranks(_load_latest, 2, args=(root,)):
        assert path == os.path.join(root, "step-1") and set(steps.values()) == {1}


def _load_damaged(rank, world, path):
    model, opt = _make(2, "flat", None, seed=7)
    try:
        ck.load(path, model, opt)
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        return f"{type(e).__name__}: {e}"
    return None


def test_a_truncated_file_is_an_error_naming_it(root):
    path = os.path.join(root, "step-3")
    run_ranks(_save_for_reshard, 2, args=(path, 2, "flat", None))
    data = os.path.join(path, "__1_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    for message in run_ranks(_load_damaged, 2, args=(path,)):
        assert message is not None and "__1_0.distcp" in message, message


# --- export's memory --------------------------------------------------------------------------------


class _Wide(torch.nn.Module):
    """64 MiB of fp32 in seven matrices, the largest 16 MiB (25% of the model)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.big = torch.nn.Parameter(torch.randn(4096, 1024))
        self.rest = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(2048, 1024)) for _ in range(6))


def _save_wide(rank, world, path):
    """Whole tensors to each rank ("greedy"), so each tensor is one chunk: an export that read a chunk
    whole would hold a tensor whole."""
    model = _Wide()
    opt = ZeroAdam(model, **zero_options(2, partition="greedy"), **HYPER)
    ck.save(path, model, opt)


# The peak RSS during export (Linux's VmHWM, reset through /proc/self/clear_refs) less the RSS just
# before it, as benchmarks/bench_checkpoint.py measures: ru_maxrss would hide export's growth under
# whatever peak the imports reached before it.
_EXPORT_RSS = """
import sys
from zerofast import checkpoint as ck
if len(sys.argv) > 3:  # the module (the package's `export` is the function)
    sys.modules["zerofast.checkpoint.export"]._BLOCK = int(sys.argv[3])
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
ck.info(sys.argv[1])  # imports and the metadata read, before the measurement
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (the peak) to the current RSS
base = status("VmRSS")
ck.export(sys.argv[1], sys.argv[2])
print(base, status("VmHWM"))
"""


def test_export_memory_is_a_constant_not_a_tensor(root):
    import subprocess
    import sys

    path = os.path.join(root, "wide")
    run_ranks(_save_wide, 2, args=(path,))

    def grew(out, *block):
        text = subprocess.run(
            [sys.executable, "-c", _EXPORT_RSS, path, out, *map(str, block)], capture_output=True, text=True, check=True
        ).stdout
        base, peak = map(int, text.split())
        return peak - base

    # Chunks are copied a block of at most 4 MiB at a time ([Note: streaming export]): export holds
    # that block and a few MiB of file buffers, whatever the tensors' sizes (7.9 MiB measured);
    # holding the largest tensor whole would be 16 MiB alone, the model 64 MiB.
    largest = 4096 * 1024 * 4
    streaming = grew(os.path.join(root, "wide.safetensors"))
    # The control: with blocks larger than any chunk, each tensor is read whole, and the measurement
    # must see that (15.9-19.9 MiB measured), or it could not see the property break either. It is
    # held to three quarters of the tensor, not all of it: the allocator may refill pages freed before
    # the baseline (the metadata read's), which then never show as growth.
    whole = grew(os.path.join(root, "whole.safetensors"), 64 << 20)
    print(
        f"export: {streaming / 2**20:.1f} MiB over the RSS before it ({whole / 2**20:.1f} MiB reading each "
        f"tensor whole); largest tensor {largest / 2**20:.0f} MiB"
    )
    assert whole >= 3 * largest // 4, f"the control grew by {whole / 2**20:.1f} MiB only: the measurement is blind"
    assert streaming < largest, (
        f"export grew by {streaming / 2**20:.1f} MiB, as much as the largest tensor "
        f"({largest / 2**20:.0f} MiB): it no longer streams"
    )
    from safetensors.torch import load_file

    exported, want = load_file(os.path.join(root, "wide.safetensors")), _Wide().state_dict()
    assert exported.keys() == want.keys() and all(torch.equal(exported[k], want[k]) for k in want)


def _dcp_by_hand(rank, world, path, stage, partition, precision):
    import torch.distributed.checkpoint as dcp

    model, opt = _make(stage, partition, precision)
    _train(model, opt, rank, 0, STEPS)
    dcp.save(opt.state_dict(), checkpoint_id=path, process_group=opt.checkpoint_view.facts.group)
    saved = _snapshot(model, opt)
    model, opt = _make(stage, partition, precision, seed=7)
    sd = opt.state_dict()
    dcp.load(sd, checkpoint_id=path, process_group=opt.checkpoint_view.facts.group)
    opt.load_state_dict(sd)
    errors = []
    try:
        opt.load_state_dict({"optim": {}})
    except ValueError as e:
        errors.append(str(e))
    return saved, _snapshot(model, opt), errors


@pytest.mark.parametrize("stage, precision", [(2, None), (3, "bf16")])
def test_state_dict_and_load_state_dict_with_dcp_by_hand(stage, precision, root):
    for saved, loaded, errors in run_ranks(_dcp_by_hand, 2, args=(os.path.join(root, "x"), stage, "flat", precision)):
        assert all(torch.equal(loaded["params"][n], saved["params"][n]) for n in saved["params"])
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(a[2], b[2]) for a, b in zip(loaded[kind], saved[kind])), kind
        assert loaded["steps"] == saved["steps"]
        assert errors and "pass the dict from this optimizer's state_dict()" in errors[0]


def _quirky_save_and_load(rank, world, path):
    model = Quirky()
    opt = ZeroAdam(model, stage=3, **HYPER)
    model(*rank_batch(model, 0, rank), 0, rank).backward()
    opt.step()
    opt.zero_grad()
    ck.save(path, model, opt)
    other = Quirky()
    with torch.no_grad():  # what the checkpoint must overwrite: the buffer and the frozen parameter
        other.probe.fill_(7.0)
        other.frozen.fill_(7.0)
    other_opt = ZeroAdam(other, **zero_options(1, partition="greedy"), **HYPER)
    ck.load(path, other, other_opt)
    return other.probe.clone(), other.frozen.detach().clone()


def test_buffers_and_frozen_parameters_travel_too(root):
    """Quirky: a buffer, a frozen parameter and the tied GPT inside; saved from stage 3, loaded into
    stage 1 and by a plain model through DCP alone."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, "quirky")
    want = Quirky()
    for probe, frozen in run_ranks(_quirky_save_and_load, 2, args=(path,)):
        assert torch.equal(probe, want.probe) and torch.equal(frozen, want.frozen)
    plain = Quirky()
    sd = {"model": plain.state_dict()}
    assert {"probe", "frozen", "gpt.wte.weight", "gpt.lm_head.weight"} <= set(sd["model"])
    with torch.no_grad():
        plain.probe.zero_()
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(sd["model"])
    assert torch.equal(plain.probe, want.probe) and torch.equal(plain.frozen, want.frozen)
    assert torch.equal(plain.gpt.lm_head.weight, plain.gpt.wte.weight)


def test_command_line_info_and_export(root, capsys):
    import subprocess
    import sys

    from safetensors.torch import load_file

    path = os.path.join(root, "step-3")
    before = run_ranks(_save_for_reshard, 2, args=(path, 1, "flat", None))
    out = subprocess.run([sys.executable, "-m", "zerofast.checkpoint", "info", root], capture_output=True, text=True)
    assert out.returncode == 0 and "saved by 2 ranks, stage 1, flat partition, fp32" in out.stdout, out.stderr
    assert ck.main(["export", root, os.path.join(root, "m.safetensors"), "--dtype", "bf16"]) == 0
    exported, master = load_file(os.path.join(root, "m.safetensors")), _full(before, "master")
    assert all(torch.equal(exported[n], master[n].to(torch.bfloat16)) for n in master)
    assert ck.main(["info", os.path.join(root, "nowhere")]) == 1
    assert "no checkpoint at" in capsys.readouterr().err


def _from_torch_bad(rank, world):
    model, opt = _make(2, "flat", None)
    good = make_gpt("tiny").state_dict()
    adamw = torch.optim.AdamW(make_gpt("tiny").parameters(), **HYPER).state_dict()
    attempts = [
        ({k: v for k, v in good.items() if k != "wte.weight"}, None),
        ({**good, "wpe.weight": torch.zeros(3, 16)}, None),
        (good, {"state": {}, "param_groups": [{**adamw["param_groups"][0], "params": [0, 1]}]}),
    ]
    messages = []
    for model_sd, optim_sd in attempts:
        try:
            ck.from_torch(model_sd, optim_sd, model, opt)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_from_torch_bad_input_is_named():
    for missing, shape, count in run_ranks(_from_torch_bad, 2):
        assert missing and "model_state_dict has no" in missing and "wte.weight" in missing
        assert shape and "wpe.weight has shape (3, 16), the model (16, 16)" in shape
        assert count and "the optimizer state dict holds 2 parameters" in count
