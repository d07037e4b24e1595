"""Stage 3's parameters and gradients on disk (OffloadPolicy(params="disk"), ZeRO-Infinity's
offload_param: [Note: parameters on disk] in zerofast/offload/__init__.py), on real gloo ranks:
- bitwise the same run with the shards in memory, 1 and 2 ranks, fp32 / bf16 / fp16 with clipping and
  accumulation, flat and owner partitions, the state in memory, on the host or on disk, the delayed
  update, frozen parameters (their shard on disk too); the model's writes outside a step and inside
  gathered_params() reach the files;
- what stays resident is the units in flight, not the shards (sampled at every unit's forward and
  backward, from /proc/self/smaps; the same run without the releases holds the whole files);
- report() and estimate_memory() agree on the bytes on disk; the files go with the optimizer;
- checkpoints move between runs with the shards on disk and in memory, across world sizes, bitwise;
- bad input is named at construction: stages 1 and 2, a CUDA model, tensor parallelism, a disk
  without room (both numbers);
- a failed read or write in the step applies it on no rank, the state on disk or in memory (the two
  passes), 8-bit state in memory in several chunks bitwise; files kept on purpose hold the last
  state; gathers reuse the unit pool's memory.
The comparisons are bitwise because both runs do the same arithmetic on the same elements in the same
order: only where the shards' bytes live differs (in-memory stage 3 is itself checked against
torch.optim.AdamW in tests/test_zero_adam.py).
Cost: about 25 s on 2 cores."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from models import Nested, model_loss
from probes import snapshot_differs, state_snapshot
from tolerances import HYPER
from training import rank_batch, train_accumulated, zero_options

from zerofast import OffloadError, OffloadPolicy, StepNotAppliedError, UnitPolicy, ZeroAdam, estimate_memory
from zerofast import checkpoint as ck
from zerofast.config import resolve_plan
from zerofast.offload import ShardFiles, open_shard_files, shard_specs
from zerofast.optim.zero_adam import parts_of

STEPS = 3


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-params-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _nested(frozen: bool = False):
    model = Nested(width=48, layers=4)
    if frozen:  # a frozen block: stage 3's frozen part ([Note: frozen parameters in stage 3])
        model.backbone.layers[1].requires_grad_(False)
    return model


def _options(precision, clip, **comm):
    """One unit per block (min_unit_mb=0: none merged), so units are released and gathered again between
    forward and backward."""
    scaling = dict(init_scale=2.0**8, growth_interval=2) if precision == "fp16" else {}
    kw = zero_options(3, mixed_precision=precision, min_unit_mb=0, **scaling, **comm)
    return dict(kw, max_grad_norm=clip, **HYPER)


def _writes(model, opt):
    """What users do between steps: a write outside forward (the guard's path into the shard) and one
    inside gathered_params() (kept at its end); the delayed update's in flight applied first, as its
    error asks."""
    opt.flush()
    with torch.no_grad():
        model.backbone.layers[2][1].weight.mul_(0.5)
    with opt.gathered_params(), torch.no_grad():
        model.backbone.layers[0][3].bias.add_(0.25)


# --- bitwise the shards in memory ----------------------------------------------------------------------

CASES = [  # (world, precision, max_grad_norm, state, delayed, frozen, CommPolicy fields)
    (2, None, 1.0, None, False, False, {}),
    (2, "bf16", 0.5, "disk", False, True, {}),
    (2, "fp16", 1.0, "host", False, False, {"partition": "greedy"}),
    (2, None, None, "host", True, False, {}),  # the delayed update's thread writes the mapped shard
    (2, "bf16", None, None, False, False, {"partition": "round_robin"}),
    (2, None, 1.0, "disk", False, False, {"shard_size": 1}),  # hybrid: two replicas of one shard
    (1, "bf16", 1.0, None, False, True, {}),
    (1, None, None, "disk", False, False, {}),
]


def _bitwise_cases(rank, world, root, cases):
    out = {}
    for case in cases:
        _, precision, clip, state, delayed, frozen, comm = case
        path = os.path.join(root, "state")
        in_memory = OffloadPolicy(state, path if state == "disk" else None, delayed_update=delayed)
        on_disk = OffloadPolicy(state, path, delayed_update=delayed, params="disk")
        runs = []
        for policy in (in_memory, on_disk):
            model = _nested(frozen)
            group = dist.new_group(list(range(world)))
            opt = ZeroAdam(model, **_options(precision, clip, **comm), process_group=group, offload=policy)
            train_accumulated(model, opt, rank, 0, STEPS)
            _writes(model, opt)
            train_accumulated(model, opt, rank, STEPS, 1)
            runs.append((model, opt))
        (a, oa), (b, ob) = runs
        x, _ = rank_batch(a, 99, rank)
        with torch.no_grad():  # inference outside gathered_params(): gathered unit by unit from the files
            logits = [model(x, x)[0] for model in (a, b)]
        report = ob.report()
        opts = _options(precision, None, **comm)
        estimate = estimate_memory(
            _nested(frozen),
            world,
            3,
            mixed_precision=opts.get("mixed_precision"),
            comm=opts["comm"],
            offload=on_disk,
            device="cpu",
            rank=rank,
        )
        parts = parts_of(ob)
        out[str(case)] = dict(
            differs=snapshot_differs(state_snapshot(a, oa), state_snapshot(b, ob)),
            same_logits=torch.equal(*logits),
            frozen=frozen,
            offload=report.offload,
            memory=report.memory,
            memory_in_ram=oa.report().memory,
            estimate=estimate,
            files=sorted(os.listdir(report.offload.params_folder)),
            frozen_in_files=parts.frozen is not None and parts.frozen.in_files,
            state=state,
            delayed=delayed,
        )
        # "host" on a CPU model: the shards are in host memory already; the same optimizer, reported so
        host_policy = OffloadPolicy(state, path if state == "disk" else None, delayed_update=delayed, params="host")
        model = _nested(frozen)
        opt = ZeroAdam(model, **_options(precision, clip, **comm), offload=host_policy)
        train_accumulated(model, opt, rank, 0, STEPS)
        _writes(model, opt)
        train_accumulated(model, opt, rank, STEPS, 1)
        host = opt.report()
        out[str(case)]["host"] = (
            snapshot_differs(state_snapshot(a, oa), state_snapshot(model, opt)),
            host.offload.params,
            host.memory,
        )
        folder = report.offload.params_folder
        del oa, ob, parts, runs, a, b, model, opt
        gc.collect()
        out[str(case)]["removed"] = not os.path.exists(folder)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_on_disk_are_bitwise_the_shards_in_memory(world, root):
    cases = [c for c in CASES if c[0] == world]
    for rank, out in enumerate(run_ranks(_bitwise_cases, world, args=(root, cases), timeout=300)):
        for case, got in out.items():
            where = f"{case} rank {rank}"
            assert got["differs"] == [], f"{where}: {got['differs']} differ from the run with the shards in memory"
            assert got["same_logits"], f"{where}: a forward without gradients differs"
            host_differs, host_placement, host_memory = got["host"]
            assert host_differs == [] and host_placement == "host", (where, got["host"])
            assert host_memory.params == got["memory_in_ram"].params > 0, where  # nothing moved
            off, mem, ram = got["offload"], got["memory"], got["memory_in_ram"]
            assert off.params == "disk" and off.params_folder is not None, where
            # The shards are counted on disk, not in memory: what the in-memory run holds as its
            # parameter and gradient shards (no unit is gathered after a step) is on disk here.
            assert mem.params == 0 and mem.grad_shard == 0 and mem.frozen_params == 0, (where, mem)
            assert ram.params > 0 and ram.grad_shard > 0, (where, ram)
            shards = ram.params + ram.grad_shard + ram.frozen_params
            assert 0 <= off.params_disk_bytes - shards < 3 * 4096, (where, off, shards)  # each file: whole pages
            assert off.params_disk_bytes == got["estimate"].params_disk_bytes, (where, got["estimate"])
            assert got["estimate"].params == got["estimate"].grads == 0, where
            if got["state"] is None:  # a master of its own in fp32 too, estimated: m, v and it, 12 bytes
                trainable = sum(p.numel() for p in _nested(got["frozen"]).parameters() if p.requires_grad)
                assert mem.master_copy > 0 and 2 * mem.master_copy == mem.optimizer, (where, mem)
                assert got["estimate"].optimizer == 12 * -(-trainable // world), (where, got["estimate"])
            assert off.params_resident_bytes <= 3 * 4096, f"{where}: pages left resident after the step: {off}"
            # The shards' explicit I/O: every step's forward gathers every unit from the file (and the
            # no-grad forward once more); each step writes the parameter shard once, by explicit writes
            # (the delayed update's thread writes it through the mapping: no write counted).
            assert off.params_read_bytes >= (STEPS + 2) * ram.params and off.params_read_seconds > 0, (where, off)
            writes = (STEPS + 1) * ram.params if not got["delayed"] else 0
            assert off.params_write_bytes == writes and (off.params_write_seconds > 0) == (writes > 0), (where, off)
            want = ["grad_shard", "lock", "param_shard"] + (["frozen_shard"] if got["frozen"] else [])
            assert got["files"] == sorted(want), where
            assert got["frozen_in_files"] == got["frozen"], where
            assert got["removed"], f"{where}: the shards' folder outlived its optimizer"


def _eight_bit(rank, world, root):
    """8-bit state in memory, the shards on disk, the step in chunks of 4096 elements (window_mb=0.15:
    the two passes cut the shard at multiples of the chunk, each a whole number of 8-bit blocks),
    against the same run with the shards in memory."""
    from zerofast import MixedPrecisionPolicy

    snapshots = []
    for policy in (None, OffloadPolicy(path=root, window_mb=0.15, params="disk")):
        model = _nested()
        precision = MixedPrecisionPolicy(torch.bfloat16, state_bits=8, state_block=64)
        options = dict(zero_options(3, min_unit_mb=0, mixed_precision=precision), max_grad_norm=1.0, **HYPER)
        opt = ZeroAdam(model, **options, process_group=dist.new_group(list(range(world))), offload=policy)
        train_accumulated(model, opt, rank, 0, STEPS)
        snapshots.append(state_snapshot(model, opt))
    return snapshot_differs(*snapshots), parts_of(opt).offload.chunk, parts_of(opt).shard.param_shard.numel()


def test_eight_bit_state_in_memory_with_the_shards_on_disk_is_bitwise(root):
    for rank, (differs, chunk, shard) in enumerate(run_ranks(_eight_bit, 2, args=(root,))):
        assert differs == [], f"rank {rank}: {differs} differ from the run with the shards in memory"
        assert chunk == 4096 and shard > 2 * chunk, (chunk, shard)  # several chunks a step


# --- what stays resident --------------------------------------------------------------------------------


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _resident(rank, world, root, where):
    """A 16-block model, one unit per block (16 x 2 x 4 MiB of parameter and gradient shards on one
    rank, fp32; the state on disk in every run, so that the shards are most of what training holds),
    two steps; where: "disk", "kept" (on disk, the pages never let go: the control) or
    "memory". The shards' files' resident bytes at every block's forward and backward and after each
    step (/proc/self/smaps), and the process's peak resident memory in training (VmHWM, restarted
    through /proc/self/clear_refs once the optimizer is built; fresh processes alike up to then)."""
    # Every allocation over 64 KiB its own mapping, returned at free: the peak then counts what was
    # alive, not what glibc's heap kept after a free (M_MMAP_THRESHOLD, fixed: no dynamic threshold).
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh()) for _ in range(16)]
    model = torch.nn.Sequential(*blocks)
    x = torch.randn(4, 1024)
    policy = OffloadPolicy("disk", root, window_mb=4, params=None if where == "memory" else "disk")
    opt = ZeroAdam(model, stage=3, offload=policy, **HYPER)
    files = parts_of(opt).files
    if where == "kept":
        files.let_go = lambda *a, **k: None
        files.let_go_all = lambda: None
    samples = []

    def sample(*_):
        if files is not None:
            samples.append(files.resident_bytes())

    def after_block(module, args, output):
        sample()  # forward
        output.register_hook(sample)  # backward

    for block in blocks:
        block.register_forward_hook(after_block)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        sample()
        opt.zero_grad()
    unit = 2 * (1024 * 1024 + 1024) * 4  # a unit's parameter and gradient shards
    return samples, files.disk_bytes if files else 0, unit, _rss("VmHWM:")


def test_what_stays_resident_is_the_units_in_flight(root):
    [(samples, disk, unit, peak)] = run_ranks(_resident, 1, args=(root, "disk"), fresh=True)
    [(held, _, _, kept_peak)] = run_ranks(_resident, 1, args=(root, "kept"), fresh=True)
    [(_, _, _, memory_peak)] = run_ranks(_resident, 1, args=(root, "memory"), fresh=True)
    assert disk >= 16 * unit and len(samples) == 2 * (2 * 16 + 1), (disk, len(samples))
    # At every hook: what the last unit's gather read and the reduces wrote since the last release,
    # at most two units' shards; at the end of a step, nothing but the pages at the ranges' ends.
    assert max(samples) <= 2 * unit, [s // 1024 for s in samples]
    assert samples[-1] <= 3 * 4096, samples[-1]
    # The control: without the releases every page of the gradient shard (half the files: the reduces
    # write it through the mapping) ends resident, so the check can fail. (The parameter shard's are
    # read and written by explicit I/O, the state being on disk too: never mapped in.)
    assert max(held) >= disk // 2 - 3 * 4096 > 2 * unit, (max(held), disk)
    # The process's peak: the shards (128 MiB) are what the in-memory run holds beyond the run on disk
    # (measured 125 MiB: 471 against 596 MiB), the gradient shard what the control holds (59 MiB); a
    # quarter is slack for the page tables and the allocator's own mappings.
    assert memory_peak - peak >= 0.75 * disk, (peak, memory_peak, disk)
    assert kept_peak - peak >= 0.75 * disk // 2, (peak, kept_peak, disk)


# --- the unit buffer pool -------------------------------------------------------------------------------


def _pooled(rank, world, root):
    """Units read from the files: the unit pool's counts after each of 4 steps (16 units, one per block
    and the root's, released and gathered again between forward and backward)."""
    from zerofast import _ops

    model = _nested()
    opt = ZeroAdam(model, **_options(None, None), offload=OffloadPolicy(path=root, params="disk"))
    counts = []
    for step in range(4):
        train_accumulated(model, opt, rank, step, 1)
        counts.append(_ops.unit_pool_stats())
    return counts, len(parts_of(opt).units.buffers.parts[0].buffers)


def test_gathers_from_the_files_reuse_the_unit_buffers_memory(root):
    """[Note: unit buffer pool] in csrc/unit_pool.cpp: after the first step no gather takes memory from
    the system (each takes what a release kept, its pages faulted in already), and what is kept stays
    within the limit (the three largest units)."""
    for rank, (counts, units) in enumerate(run_ranks(_pooled, 2, args=(root,), fresh=True)):
        first, last = counts[0], counts[-1]
        assert first["allocated"] <= units, (rank, counts)  # at most one allocation per unit buffer
        assert last["allocated"] == first["allocated"], f"rank {rank}: gathers after the first step allocated: {counts}"
        gathers = last["reused"] - first["reused"]
        assert gathers >= 3 * 2 * units, (rank, counts)  # 3 steps, each unit gathered in forward and backward
        assert 0 < last["kept_bytes"] <= last["limit"], (rank, counts)


# --- checkpoints ----------------------------------------------------------------------------------------


def _stage_options(stage, precision):
    if stage == 3:
        return _options(precision, 1.0)
    return dict(zero_options(stage, mixed_precision=precision), max_grad_norm=1.0, **HYPER)


def _save(rank, world, path, offload, precision, stage=3):
    model = _nested(frozen=True)
    opt = ZeroAdam(model, **_stage_options(stage, precision), offload=offload)
    train_accumulated(model, opt, rank, 0, STEPS)
    ck.save(path, model, opt)
    return state_snapshot(model, opt)


def _load(rank, world, path, offload, precision, stage=3):
    torch.manual_seed(5)
    model = _nested(frozen=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # other values: everything must come from the checkpoint
    opt = ZeroAdam(model, **_stage_options(stage, precision), offload=offload)
    ck.load(path, model, opt)
    return state_snapshot(model, opt)


def test_checkpoints_move_between_shards_on_disk_and_in_memory(root):
    disk = OffloadPolicy(path=os.path.join(root, "shards"), params="disk")
    trips = [  # (world, offload, precision, stage)
        ((2, disk, "bf16", 3), (1, None, "bf16", 3)),
        ((1, None, None, 3), (2, disk, None, 3)),
        ((2, disk, None, 3), (2, None, None, 2)),
        ((2, None, "bf16", 1), (1, disk, "bf16", 3)),
    ]
    for i, (saved, loaded) in enumerate(trips):
        path = os.path.join(root, f"ckpt-{i}")
        before = run_ranks(_save, saved[0], args=(path, *saved[1:]))
        after = run_ranks(_load, loaded[0], args=(path, *loaded[1:]))
        for snap in after:
            assert snap["steps"] == before[0]["steps"], (saved, loaded)
            for n, want in before[0]["params"].items():  # frozen ones included
                assert torch.equal(snap["params"][n], want), f"{n} differs after {saved} -> {loaded}"


# --- bad input ------------------------------------------------------------------------------------------


def test_bad_input_is_named_at_construction(root, monkeypatch):
    for stage in (1, 2):
        with pytest.raises(ValueError, match=rf"params=\.\.\.\) applies to stage 3.*params='host' with stage={stage}"):
            resolve_plan(stage, offload=OffloadPolicy(params="host"))
    with pytest.raises(ValueError, match="params must be None, 'host' or 'disk'; got 'nvme'"):
        OffloadPolicy(params="nvme")
    with pytest.raises(ValueError, match="params='disk' needs path="):
        OffloadPolicy(params="disk")
    assert resolve_plan(3, offload=f"infinity:{root}").offload == OffloadPolicy("disk", root, params="disk")
    plan = resolve_plan(3, offload=OffloadPolicy(path=root, params="disk"))
    with pytest.raises(NotImplementedError, match=r"params='disk'\) is built for models on the CPU; on cuda:0"):
        open_shard_files(plan, 10, 0, torch.device("cuda", 0), 0, False)
    with pytest.raises(ValueError, match="does not apply to tensor parallelism"):
        open_shard_files(plan, 10, 0, torch.device("cpu"), 0, True)
    assert (
        open_shard_files(resolve_plan(3, offload=OffloadPolicy(params="host")), 10, 0, torch.device("cpu"), 0, False)
        is None
    )
    with pytest.raises(NotImplementedError, match="built for models on the CPU"):
        estimate_memory(1000, 2, 3, offload=OffloadPolicy(params="host"))
    # A disk without room: both numbers, nothing left behind.
    specs = shard_specs(plan, 10_000, 0)
    need = sum(-(-s.nbytes // 4096) * 4096 for s in specs if s.numel)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, need - 1))
    with pytest.raises(
        OffloadError,
        match=rf"rank 3's parameter and gradient shards need {need} bytes on disk and the filesystem has {need - 1} free",
    ):
        ShardFiles(specs, root, 3)
    assert os.listdir(root) == []
    monkeypatch.undo()
    files = ShardFiles(specs, root, 0)
    assert files.disk_bytes == need and sorted(files.tensors) == ["frozen_shard", "grad_shard", "param_shard"]
    files.tensors["param_shard"].fill_(1.0)
    assert files.resident_bytes() >= 40_000 - 4096
    files.let_go_all()
    assert files.resident_bytes() == 0 and bool((files.tensors["param_shard"] == 1.0).all())  # kept in the file
    folder = files.folder
    files.close()
    assert not os.path.exists(folder)


def _kept_files(rank, world, root):
    """OffloadPolicy(keep_files=True), state and shards on disk, after 2 steps: the tensors the
    optimizer held, then what its folders hold once it is collected; a later optimizer under the same
    path, then the same without keep_files."""
    model = _nested()
    policy = OffloadPolicy("disk", root, params="disk", keep_files=True)
    opt = ZeroAdam(model, **_options("bf16", 1.0), offload=policy)
    train_accumulated(model, opt, rank, 0, 2)
    parts = parts_of(opt)
    held = {n: t.clone() for n, t in parts.store.views().items() if t.numel()}
    held.update({n: t.clone() for n, t in parts.files.tensors.items() if t.numel()})
    folders = sorted({parts.store.folder, parts.files.folder})
    del parts, opt, model
    gc.collect()
    kept = {}
    for folder in folders:
        with open(os.path.join(folder, "kept.json")) as f:
            kept[folder] = json.load(f)
    read = {}
    for folder, manifest in kept.items():
        for name, what in manifest["files"].items():
            dtype = getattr(torch, what["dtype"])
            read[what["tensor"]] = torch.from_file(os.path.join(folder, name), size=what["numel"], dtype=dtype)
    listed = {folder: sorted(os.listdir(folder)) for folder in folders}
    model = _nested()  # a later optimizer under the same path removes stale folders, never kept ones
    opt = ZeroAdam(model, **_options("bf16", 1.0), offload=OffloadPolicy("disk", root, params="disk"))
    train_accumulated(model, opt, rank, 0, 1)
    still = all(os.path.exists(f) for f in folders)
    mine = sorted({parts_of(opt).store.folder, parts_of(opt).files.folder})
    del opt, model
    gc.collect()
    return held, read, kept, listed, still, [os.path.exists(f) for f in mine]


def test_files_kept_on_purpose_stay_and_hold_the_last_state(root):
    [(held, read, kept, listed, still, removed_later)] = run_ranks(_kept_files, 1, args=(root,))
    assert sorted(read) == sorted(held), (sorted(read), sorted(held))
    for name, want in held.items():  # the live generation's state and the shards, bitwise
        assert torch.equal(read[name], want), f"{name}: the kept file differs from the optimizer's tensor"
    for folder, manifest in kept.items():
        assert manifest["errors"] == {}, manifest
        files = sorted(manifest["files"])
        assert listed[folder] == sorted([*files, "kept.json", "lock"]), (listed[folder], files)  # one generation
    assert still, "a later optimizer removed a folder kept on purpose"
    assert removed_later == [False, False], "without keep_files the files go with the optimizer"
    with pytest.raises(ValueError, match="keep_files applies to state='disk' or params='disk'.*state='host'"):
        OffloadPolicy("host", keep_files=True)
    with pytest.raises(TypeError, match="keep_files must be True or False; got 'yes'"):
        OffloadPolicy("disk", root, keep_files="yes")


def test_the_estimators_cli_counts_the_shards_on_disk(capsys):
    from zerofast.tools.estimate import main
    from zerofast.tools.quantities import format_bytes

    argv = ["--params", "2B", "--world", "2", "--stage", "3", "--offload", "disk", "--device", "cpu"]
    assert main([*argv, "--offload-params", "disk"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("stage 3"))
    policy = OffloadPolicy("disk", ".", params="disk")
    want = estimate_memory(2 * 10**9, 2, 3, mixed_precision="bf16", offload=policy, device="cpu")  # the CLI's "mixed"
    # the row: params, grads, optimizer, zerofast+, device, host, disk (the state's files and the shards')
    assert want.params == want.grads == 0 and row.endswith(f" {format_bytes(want.disk_total)}"), row
    assert want.disk_total == want.disk_bytes + want.params_disk_bytes > want.disk_bytes > 0
    shard_bytes = 10**9 * 2  # a rank's half of 2B elements, bf16; each file rounded up to a page
    assert want.params_disk_bytes == 2 * -(-shard_bytes // 4096) * 4096  # the parameter and gradient shards
    for extra, named in (
        (["--offload-params", "disk", "--stage", "2"], "--offload-params applies to stage 3"),
        (["--offload-params", "disk", "--time"], "--offload-params' disk I/O is not modelled"),
        (["--offload-params", "nvme"], "--offload-params: invalid choice: 'nvme'"),
    ):
        with pytest.raises(SystemExit):
            main(["--params", "2B", "--world", "2", *extra])
        assert named in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        main(["--params", "2B", "--world", "2", "--stage", "3", "--offload-params", "host"])
    assert "built for models on the CPU" in capsys.readouterr().err


# --- a model built on the meta device ----------------------------------------------------------------


def _init(module):
    """An init as a model's own _init_weights: random weights, constant norms and biases."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    elif isinstance(module, torch.nn.Embedding):
        torch.nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, torch.nn.LayerNorm):
        torch.nn.init.ones_(module.weight)
        torch.nn.init.constant_(module.bias, 0.1)


def _meta_cases(rank, world, root, cases):
    out = {}
    for precision, on_disk, frozen in cases:
        policy = OffloadPolicy(path=os.path.join(root, "shards"), params="disk") if on_disk else None
        runs = []
        for meta in (True, False):  # the meta model first: nothing built before it in the process helps it
            group = dist.new_group(list(range(world)))
            options = _options(precision, 1.0)
            torch.manual_seed(7)
            if meta:  # initialized through the guard, after ZeroAdam: each rank's pieces and the master
                with torch.device("meta"):
                    model = _nested(frozen)
                opt = ZeroAdam(model, **options, process_group=group, offload=policy)
                torch.manual_seed(7)
                model.apply(_init)
            else:  # built whole, in the training dtype, initialized, then given to ZeroAdam
                model = _nested(frozen).to(torch.bfloat16 if precision else torch.float32)
                torch.manual_seed(7)
                model.apply(_init)
                opt = ZeroAdam(model, **options, process_group=group)
            runs.append((model, opt))
        (b, ob), (a, oa) = runs
        # The initial fp32 masters, read without gathering (a gather before the first forward would
        # rebind the parameters: the first forward and backward must run as built).
        pieces = [o.checkpoint_view.trainable.state_pieces("master") for o in (oa, ob)]
        initial = all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(*pieces))
        for model, opt in runs:
            train_accumulated(model, opt, rank, 0, STEPS)
        out[str((precision, on_disk, frozen))] = dict(
            initial=initial,
            trained=snapshot_differs(state_snapshot(a, oa), state_snapshot(b, ob)),
            devices={p.device.type for p in b.parameters()},
        )
    return out


def test_a_model_built_on_the_meta_device_trains_as_the_model_built_whole(root):
    """Built under torch.device("meta"), sharded, initialized through the guard: bitwise the model built
    whole in the training dtype, initialized the same way and trained by ZeroAdam in memory ([Note:
    models built on the meta device] in zerofast/model_setup.py). (Initialized after ZeroAdam, the
    model built whole would keep its fp32 master where the init's bf16 value equals the value held:
    [Note: the master follows the copy].)"""
    cases = [(None, True, False), ("bf16", True, True), ("bf16", False, False)]
    for rank, out in enumerate(run_ranks(_meta_cases, 2, args=(root, cases), timeout=300)):
        for case, got in out.items():
            assert got["initial"] and got["trained"] == [], (case, rank, got)
            assert got["devices"] == {"cpu"}, (case, got)


def test_a_meta_model_is_a_named_error_where_it_cannot_be_built():
    from zerofast.model_setup import meta_device

    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    real = torch.nn.Linear(4, 4)
    for stage in (1, 2):
        with pytest.raises(
            ValueError, match=rf"ZeroAdam: a model on the meta device is built at stage 3.*stage={stage}"
        ):
            meta_device(list(meta.parameters()), None, stage, "ZeroAdam")
    with pytest.raises(ValueError, match="some trainable parameters are on the meta device and some are not"):
        meta_device([meta.weight, real.weight], None, 3, "ZeroAdam")
    with pytest.raises(ValueError, match="tensor parallelism's DTensors"):
        meta_device(list(meta.parameters()), None, 3, "ZeroAdam", tensor_parallel=True)
    assert meta_device(list(real.parameters()), None, 3, "ZeroAdam") is None


# --- a model sharded for inference only (shard_frozen), its shard on disk ----------------------------


def _frozen_reference(rank, world, root):
    from zerofast import shard_frozen

    x, y = rank_batch(_nested(), 5, rank)
    out = []
    for offload in (None, OffloadPolicy(path=root, params="disk")):
        model = _nested().eval()
        handle = shard_frozen(model, mixed_precision="bf16", units=UnitPolicy(min_unit_mb=0), offload=offload)
        with torch.no_grad():
            logits = [model(x, y)[0] for _ in range(2)]  # unit by unit, twice
        with handle.gathered_params():
            whole = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append((logits, whole, handle.parameter_bytes()))
    return out


def test_a_reference_model_sharded_for_inference_keeps_its_shard_on_disk(root):
    for rank, (memory, disk) in enumerate(run_ranks(_frozen_reference, 2, args=(root,))):
        assert all(torch.equal(a, b) for a, b in zip(memory[0], disk[0])), f"rank {rank}: logits differ"
        assert all(torch.equal(memory[1][n], disk[1][n]) for n in memory[1]), f"rank {rank}: parameters differ"
        in_memory, on_disk = memory[2], disk[2]
        assert on_disk["shard"] == 0 and 0 <= on_disk["disk"] - in_memory["shard"] < 4096, (in_memory, on_disk)
        assert on_disk["resident"] <= 2 * 4096, on_disk  # the pages at the ends of the last ranges read
    from zerofast import shard_frozen

    with pytest.raises(ValueError, match="it has no optimizer state to offload"):
        shard_frozen(torch.nn.Linear(2, 2), offload="disk:/x")


def _failed_read(rank, world, root):
    model = _nested()
    opt = ZeroAdam(model, **_options(None, 1.0), offload=OffloadPolicy(path=root, params="disk"))
    train_accumulated(model, opt, rank, 0, 1)
    files = parts_of(opt).files
    before = [p[2].clone() for p in opt.checkpoint_view.trainable.state_pieces("master")]

    def fail(path):
        raise OSError(5, "Input/output error")

    files.fail_read = fail
    x, y = rank_batch(model, 1, rank)
    try:
        model_loss(model, x, y)
        error = None
    except OffloadError as e:
        error = str(e)
    after = [p[2] for p in opt.checkpoint_view.trainable.state_pieces("master")]
    return error, files.folder, all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_failed_read_names_the_file_and_the_rank(root):
    [(error, folder, unchanged)] = run_ranks(_failed_read, 1, args=(root,), fresh=True)
    assert error is not None and "rank 0 could not read" in error and "Input/output error" in error, error
    assert os.path.join(folder, "param_shard") in error, error
    assert unchanged  # nothing was applied


def _failed_step_io(rank, world, root, which, state):
    """Shards on disk, the state on disk or in memory (state=None: the step's two passes); at the second
    step the last rank fails to read its gradient shard (which="read") or to write its parameter shard
    (which="write"). window_mb=0.15: the step in several chunks, so a failure comes after some were
    stepped."""
    runs = []
    for policy in (None, OffloadPolicy(state, os.path.join(root, "io"), window_mb=0.15, params="disk")):
        model = _nested()
        group = dist.new_group(list(range(world)))
        runs.append((model, ZeroAdam(model, **_options("bf16", 1.0), process_group=group, offload=policy)))
    (a, oa), (b, ob) = runs
    train_accumulated(a, oa, rank, 0, STEPS)
    train_accumulated(b, ob, rank, 0, 1)
    before = state_snapshot(b, ob)
    files = parts_of(ob).files
    calls = []

    def fault(path):  # the last rank's second chunk: after one was stepped and written
        if rank == world - 1 and os.path.basename(path) == ("grad_shard" if which == "read" else "param_shard"):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(5, "Input/output error (simulated)", path)

    setattr(files, f"fail_{which}", fault)
    try:
        train_accumulated(b, ob, rank, 1, 1)
        raised = None
    except (OffloadError, StepNotAppliedError) as e:
        raised = (type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", [])))
    after = state_snapshot(b, ob)
    setattr(files, f"fail_{which}", None)
    train_accumulated(b, ob, rank, 1, STEPS - 1)  # the same batches again: the failed step never happened
    return (
        raised,
        snapshot_differs(before, after),
        snapshot_differs(state_snapshot(a, oa), state_snapshot(b, ob)),
        files.folder,
    )


@pytest.mark.parametrize("state", ["disk", None])
@pytest.mark.parametrize("which", ["read", "write"])
def test_a_failed_read_or_write_in_the_step_applies_it_on_no_rank(which, state, root):
    out = run_ranks(_failed_step_io, 2, args=(root, which, state))
    for rank, (raised, changed, differs, folder) in enumerate(out):
        assert raised is not None, f"rank {rank} did not raise"
        kind, message, notes = raised
        if rank == 1:
            assert kind == "OffloadError" and f"rank 1 could not {which}" in message, message
            assert os.path.join(folder, "grad_shard" if which == "read" else "param_shard") in message, message
            assert "not applied on any rank" in notes, notes
        else:
            assert kind == "StepNotAppliedError" and "rank 1 could not write" in message, message
        assert changed == [], f"rank {rank}: the failed step changed {changed}"
        assert differs == [], f"rank {rank}: after the failure, training differs from the run in memory: {differs}"


# --- a Hugging Face model from its config: training, then generation of another length per rank -------


def _hf_llama(rank, world, root):
    from models import tiny_llama

    runs = []
    for policy in (None, OffloadPolicy("disk", os.path.join(root, "hf"), params="disk")):
        model = tiny_llama()
        group = dist.new_group(list(range(world)))
        opt = ZeroAdam(
            model, stage=3, mixed_precision="bf16", max_grad_norm=1.0, process_group=group, offload=policy, **HYPER
        )
        for step in range(2):
            ids = torch.randint(4, 32, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))
            opt.backward(model(ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
        model.eval()
        prompt = torch.randint(4, 32, (1, 4), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():  # outside the block, unit by unit; each rank its own length (synced_gpus)
            generated = model.generate(prompt, max_new_tokens=2 + 2 * rank, do_sample=False, synced_gpus=True)
            with opt.gathered_params():  # inside: a plain loop, another number of forwards per rank
                ids = prompt
                for _ in range(1 + rank):
                    ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        runs.append((state_snapshot(model, opt), generated, ids))
    (a, gen_a, loop_a), (b, gen_b, loop_b) = runs
    return snapshot_differs(a, b), torch.equal(gen_a, gen_b), gen_b.shape[1], torch.equal(loop_a, loop_b)


def test_a_hugging_face_model_trains_and_generates_with_its_shards_on_disk(root):
    """tiny_llama built from its config (random weights, no download), bf16 with clipping: bitwise the
    run with the shards in memory; then generate() of a different length per rank outside
    gathered_params() and a plain loop of a different number of forwards inside it, the same tokens."""
    for rank, (differs, same_generated, length, same_loop) in enumerate(run_ranks(_hf_llama, 2, args=(root,))):
        assert differs == [], (rank, differs)
        assert same_generated and length == 4 + 2 + 2 * rank, (rank, length)
        assert same_loop, rank
