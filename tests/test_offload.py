"""The optimizer state offloaded (OffloadPolicy, zerofast/offload) on real gloo ranks:
- on disk, through a window of a few chunks, bitwise equal to the same ZeroAdam with its state in
  memory (parameters, master, moments, step counts, loss scale) at 1 and 2 ranks, stages 1-3, fp32 /
  bf16 / fp16 with clipping and accumulation, 8-bit state, hybrid sharding; "host" on the CPU too;
- the step is all or none: a write that fails on one rank applies the step on no rank, names the
  file, and training goes on from the state before it;
- the state resident in memory is the window, not the state (a fresh process, its peak RSS);
- checkpoints from an offloaded run load into one without offload, at another world size, and back,
  bitwise; files of a killed job are removed, never read;
- bad input is named at construction: the policy's fields, a path that cannot be created or
  written, a disk without room; ZeroMuon says why it does not offload.
The in-memory ZeroAdam is itself checked against torch.optim.AdamW (tests/test_zero_adam.py); the
comparisons here are bitwise because both run the same kernel on the same elements in the same
order (the kernel is elementwise: [Note: one kernel per range]).
Cost: about 30 s on 2 cores."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from harness import free_port, run_ranks
from models import Nested, model_loss
from oracles import single_process, single_process_delayed
from probes import full_master, snapshot_differs, state_snapshot
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import rank_batch, train_accumulated, zero_options

from zerofast import MixedPrecisionPolicy, OffloadError, OffloadPolicy, StepNotAppliedError, ZeroAdam, ZeroMuon
from zerofast import checkpoint as ck
from zerofast.config import OFFLOAD_STATES
from zerofast.optim.zero_adam import parts_of

STEPS = 3
WINDOW_MB = 0.15  # ~157 KB: chunks of 4096 elements (the least), so the Nested model's shard spans several


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="zerofast-offload-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _nested():
    return Nested(width=48, layers=4)  # ~40K elements: a rank's shard spans several chunks of the window


def _options(stage, precision, bits, clip, **comm):
    scaling = dict(init_scale=2.0**8, growth_interval=2) if precision == "fp16" else {}  # steps apply, the scale moves
    kw = zero_options(stage, mixed_precision=precision, bucket_mb=0.002, **scaling, **comm)
    if bits == 8:
        dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        loss_scale = kw["mixed_precision"].loss_scale if precision == "fp16" else None
        kw["mixed_precision"] = MixedPrecisionPolicy(dtype, loss_scale=loss_scale, state_bits=8, state_block=64)
    return dict(kw, max_grad_norm=clip, **HYPER)


def _pair(stage, precision, bits, clip, offload, **comm):
    """Two equal Nested models: one with its state in memory, one offloaded; each its own group."""
    out = []
    for where in (None, offload):
        model = _nested()
        group = dist.new_group(list(range(dist.get_world_size())))
        out.append(
            (
                model,
                ZeroAdam(model, **_options(stage, precision, bits, clip, **comm), process_group=group, offload=where),
            )
        )
    return out


# --- bitwise equal to the state in memory ------------------------------------------------------------

CASES = [  # (world, stage, precision, state bits, max_grad_norm, CommPolicy fields)
    (2, 1, None, 32, None, {}),
    (2, 2, "bf16", 32, 1.0, {}),
    (2, 3, "fp16", 32, 1.0, {}),
    (2, 2, "bf16", 8, 0.5, {}),
    (2, 3, None, 8, None, {"partition": "greedy"}),
    (2, 2, None, 32, 1.0, {"shard_size": 1}),  # hybrid: two replicas of one shard
    (2, 1, "bf16", 32, None, {"partition": "greedy"}),
    (1, 3, "bf16", 32, 1.0, {}),
    (1, 1, "fp16", 8, None, {}),
]


def _bitwise_cases(rank, world, root, cases):
    out = {}
    for case in cases:
        _, stage, precision, bits, clip, comm = case
        disk = OffloadPolicy("disk", root, window_mb=WINDOW_MB, direct_io=True)  # the page cache: below
        (a, oa), (b, ob) = _pair(stage, precision, bits, clip, disk, **comm)
        for model, opt in ((a, oa), (b, ob)):
            train_accumulated(model, opt, rank, 0, STEPS)
        report = ob.report()
        out[str(case)] = dict(
            differs=snapshot_differs(state_snapshot(a, oa), state_snapshot(b, ob)),
            offload=report.offload,
            memory=report.memory,
            shard=parts_of(ob).shard.exp_avg.numel(),
            chunk=parts_of(ob).store.chunk,
            logical=sum(spec.nbytes for spec in parts_of(ob).store.specs),
            files=sorted(os.listdir(report.offload.folder)),
        )
        # "host" on the CPU: the state is in host memory already; the same optimizer
        (c, oc) = _pair(stage, precision, bits, clip, "host", **comm)[1]
        train_accumulated(c, oc, rank, 0, STEPS)
        out[str(case)]["host"] = (
            snapshot_differs(state_snapshot(a, oa), state_snapshot(c, oc)),
            oc.report().offload.state,
        )
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_disk_offload_is_bitwise_the_state_in_memory(world, root):
    cases = [c for c in CASES if c[0] == world]
    for rank, out in enumerate(run_ranks(_bitwise_cases, world, args=(root, cases), timeout=300)):
        for case, got in out.items():
            where = f"{case} rank {rank}"
            assert got["differs"] == [], f"{where}: {got['differs']} differ from the state in memory"
            assert got["host"] == ([], "host"), where
            off, mem = got["offload"], got["memory"]
            assert off.state == "disk" and mem.optimizer == 0 and mem.master_copy == 0, where
            assert got["shard"] > 2 * got["chunk"], f"{where}: the shard must span several chunks of the window"
            # every element read and written once; the files are each rounded up to a page (direct I/O)
            assert off.read_bytes == off.write_bytes == got["logical"] > 0, where
            assert 0 <= off.disk_bytes // 2 - got["logical"] < 5 * 4096, where
            assert off.direct_io, f"{where}: {root} is on a disk that takes O_DIRECT"
            assert off.window_bytes <= WINDOW_MB * 2**20, where
            assert off.host_bytes == off.window_bytes, where
            assert "lock" in got["files"] and sum(f.endswith((".0", ".1")) for f in got["files"]) >= 6, where


def _through_the_page_cache(rank, world, roots):
    out = []
    for root, direct in roots:
        (a, oa), (b, ob) = _pair(2, "bf16", 8, 1.0, OffloadPolicy("disk", root, window_mb=WINDOW_MB, direct_io=direct))
        for model, opt in ((a, oa), (b, ob)):
            train_accumulated(model, opt, rank, 0, STEPS)
        out.append((snapshot_differs(state_snapshot(a, oa), state_snapshot(b, ob)), ob.report().offload.direct_io))
    return out


def test_without_direct_io_the_step_is_the_same(root):
    """direct_io=False (the default) reads and writes through the page cache: the same state, bitwise."""
    out = run_ranks(_through_the_page_cache, 1, args=([(root, False)],))[0]
    assert out == [([], False)], out


# --- all or none -------------------------------------------------------------------------------------


def _failed_write(rank, world, root, stage, precision):
    (a, oa), (b, ob) = _pair(stage, precision, 32, 1.0, OffloadPolicy("disk", root, window_mb=WINDOW_MB))
    train_accumulated(a, oa, rank, 0, STEPS)
    train_accumulated(b, ob, rank, 0, 1)
    before = state_snapshot(b, ob)
    store = parts_of(ob).store

    def full_disk(path, chunk):
        if rank == world - 1 and chunk == 1:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", path)

    store.fail_write = full_disk
    try:
        train_accumulated(b, ob, rank, 1, 1)
        raised = None
    except (OffloadError, StepNotAppliedError) as e:
        raised = (type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", [])))
    after = state_snapshot(b, ob)
    store.fail_write = None
    train_accumulated(b, ob, rank, 1, STEPS - 1)  # the same batches again: the failed step never happened
    return (
        raised,
        snapshot_differs(before, after),
        snapshot_differs(state_snapshot(a, oa), state_snapshot(b, ob)),
        ob.report().offload.folder,
    )


@pytest.mark.parametrize("stage, precision", [(2, "bf16"), (3, None)])
def test_a_failed_write_applies_the_step_on_no_rank(stage, precision, root):
    results = run_ranks(_failed_write, 2, args=(root, stage, precision))
    for rank, (raised, changed, differs, folder) in enumerate(results):
        assert raised is not None, f"rank {rank} did not raise"
        kind, message, notes = raised
        if rank == 1:
            assert kind == "OffloadError" and "No space left" in message and "chunk 1" in message, message
            assert folder in message, message  # names the file
            assert "not applied on any rank" in notes, notes
        else:
            assert kind == "StepNotAppliedError" and "rank 1 could not write" in message, message
        assert changed == [], f"rank {rank}: the failed step changed {changed}"
        assert differs == [], f"rank {rank}: after the failure, training differs from the state in memory: {differs}"


# --- the delayed update: AdamW one step late --------------------------------------------------------

DELAYED_STEPS = 4


def _delayed(rank, world, root):
    out = {}
    for stage in (1, 2, 3):
        for state in ("host", "disk"):
            model = _nested()
            policy = OffloadPolicy(state, root if state == "disk" else None, window_mb=WINDOW_MB, delayed_update=True)
            group = dist.new_group(list(range(world)))
            opt = ZeroAdam(model, stage=stage, offload=policy, process_group=group, **HYPER)
            for step in range(DELAYED_STEPS):
                model_loss(model, *rank_batch(model, step, rank)).backward()
                opt.step()
                opt.zero_grad()
            in_flight = parts_of(opt).offload.update_in_flight
            parts = parts_of(opt)
            owned = sum(r.numel for r in parts.shard.runs([True] * len(parts.params), parts.group_of))
            # fp32: a 4-byte gradient copy and a 4-byte staged parameter per element the update steps
            assert opt.report().offload.delayed_bytes == 8 * owned > 0
            opt.flush()
            assert opt.report().offload.delayed_bytes == 0
            with opt.gathered_params():
                out[stage, state] = (in_flight, {n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_the_delayed_update_is_adamw_one_step_late(root):
    late = single_process_delayed(_nested, 2, DELAYED_STEPS)
    on_time = single_process(_nested, 2, DELAYED_STEPS)
    tol = fp32_tol(DELAYED_STEPS)
    assert max_abs_diff(late, on_time) > 100 * tol, "the oracle must tell the two algorithms apart"
    for rank, out in enumerate(run_ranks(_delayed, 2, args=(root,))):
        for (stage, state), (in_flight, params) in out.items():
            assert in_flight, f"stage {stage} {state}: the last step's update runs after step() returns"
            err = max_abs_diff(params, late)
            assert err <= tol, f"stage {stage} {state} rank {rank}: {err} from AdamW one step late (tol {tol})"


# --- the window, not the state, in memory -------------------------------------------------------------


def _growth(rank, world, root, offload):
    """A 17M-parameter model: how far the resident memory grows while the optimizer is built, and
    how far its peak grows in a step (the second: the first allocates the buckets and the window)
    over the resident memory right before it (/proc/self/status's VmRSS and VmHWM, the peak restarted
    at the current RSS through /proc/self/clear_refs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    x = torch.randn(4, 2048)

    def rss(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss("VmRSS:")
    opt = ZeroAdam(model, stage=2, offload=offload, **HYPER)
    built, built_peak = rss("VmRSS:") - start, rss("VmHWM:") - start
    for _ in range(2):
        model(x).square().mean().backward()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = rss("VmRSS:")
        opt.step()
        step_peak = rss("VmHWM:") - before
        opt.zero_grad()
    return built, built_peak, step_peak, opt.report().offload


def test_the_resident_state_is_the_window(root):
    window = 1.0
    policy = OffloadPolicy("disk", root, window_mb=window)
    [(disk_built, disk_built_peak, disk_step, off)] = run_ranks(_growth, 1, args=(root, policy), fresh=True)
    [(memory_built, memory_built_peak, _, _)] = run_ranks(_growth, 1, args=(root, None), fresh=True)
    state = off.disk_bytes // 2  # one generation: the master and both moments, 12 bytes per element
    assert off.window_bytes <= window * 2**20 and state >= 10 * off.window_bytes, off
    # Built, both optimizers allocate the flat parameter buffers and the gradient shard; in memory
    # also the moments (8 of the 12 bytes per element: fp32 parameters are their own master; 134 MB
    # here), filled with zeros; on disk no state (10% slack: what the allocator keeps differs).
    moments = 2 * state // 3
    assert memory_built - disk_built >= 0.9 * moments, (memory_built, disk_built, moments)
    # Building never holds the model's parameters twice: each one's storage is freed as it moves
    # into the flat buffers, before the gradient shard exists (a second copy would be 67 MB here,
    # half the moments; a quarter of that is slack for what the allocator keeps).
    for peak, built in ((disk_built_peak, disk_built), (memory_built_peak, memory_built)):
        assert peak - built <= moments / 8, (peak, built, moments)
    # A step on disk holds the window and the kernel's and I/O threads' small scratch (8 MiB of slack:
    # the allocator's and the threads' own), never the state.
    assert disk_step <= off.window_bytes + 8 * 2**20, (disk_step, off)


# --- checkpoints ----------------------------------------------------------------------------------------


def _save(rank, world, path, offload, stage, precision):
    model = _nested()
    opt = ZeroAdam(model, **_options(stage, precision, 32, 1.0), offload=offload)
    train_accumulated(model, opt, rank, 0, STEPS)
    ck.save(path, model, opt)
    return state_snapshot(model, opt)


def _load(rank, world, path, offload, stage, precision):
    torch.manual_seed(5)
    model = _nested()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # other values: everything must come from the checkpoint
    opt = ZeroAdam(model, **_options(stage, precision, 32, 1.0), offload=offload)
    ck.load(path, model, opt)
    return state_snapshot(model, opt)


def _full(snapshots, kind):
    return full_master([s[kind] for s in snapshots], {n: tuple(p.shape) for n, p in _nested().named_parameters()})


def test_checkpoints_move_between_offloaded_and_in_memory_runs_bitwise(root):
    disk = OffloadPolicy("disk", os.path.join(root, "state"), window_mb=WINDOW_MB)
    trips = [  # (saved: world, offload, stage, precision) -> (loaded)
        ((2, disk, 2, "bf16"), (1, None, 3, "bf16")),
        ((1, None, 1, None), (2, disk, 3, None)),
        ((2, disk, 3, None), (2, disk, 1, None)),
    ]
    for i, (saved, loaded) in enumerate(trips):
        path = os.path.join(root, f"ckpt-{i}")
        before = run_ranks(_save, saved[0], args=(path, *saved[1:]))
        after = run_ranks(_load, loaded[0], args=(path, *loaded[1:]))
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            want, got = _full(before, kind), _full(after, kind)
            assert all(torch.equal(got[n], want[n]) for n in want), f"{kind} differs after {saved} -> {loaded}"
        for snap in after:
            assert snap["steps"] == before[0]["steps"]
            assert all(torch.equal(snap["params"][n], before[0]["params"][n]) for n in snap["params"]), (saved, loaded)


# --- the files of a killed job, and of a finished optimizer ---------------------------------------------


def _folders(rank, world, root):
    host = socket.gethostname()
    dead = os.path.join(root, f"zerofast-{host}-999999999-deadbeef0000")  # no such pid: a killed job's
    os.makedirs(dead)
    open(os.path.join(dead, "lock"), "w").close()
    open(os.path.join(dead, "exp_avg.0"), "wb").write(b"\x7f" * 4096)
    foreign = os.path.join(root, "zerofast-notes")  # not ours: no lock file
    os.makedirs(foreign)
    first = ZeroAdam(_nested(), stage=2, offload=OffloadPolicy("disk", root, window_mb=WINDOW_MB))
    live = first.report().offload.folder
    second = ZeroAdam(_nested(), stage=2, offload=OffloadPolicy("disk", root, window_mb=WINDOW_MB))
    listed = sorted(os.listdir(root))
    fresh_state = parts_of(second).shard.exp_avg.abs().max().item()  # zeros, never the dead job's bytes
    del first
    gc.collect()
    return listed, os.path.basename(live), os.path.exists(live), os.path.basename(dead), fresh_state


def test_files_of_a_killed_job_are_removed_and_never_read(root):
    [(listed, live, live_after, dead, fresh_state)] = run_ranks(_folders, 1, args=(root,), fresh=True)
    assert dead not in listed and "zerofast-notes" in listed and live in listed, listed
    assert len([d for d in listed if d.startswith("zerofast-") and d != "zerofast-notes"]) == 2, listed
    assert fresh_state == 0.0
    assert not live_after, "a collected optimizer's folder is removed"
    # The harness's ranks end with os._exit, as a killed job would: the next optimizer removes it.
    # A process that ends normally removes its own (weakref.finalize runs at exit).
    port = free_port()
    script = (
        "import torch, torch.distributed as dist, zerofast\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        f"opt = zerofast.ZeroAdam(torch.nn.Linear(8, 8), offload='disk:{root}')\n"
        "print(opt.report().offload.folder)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    folder = done.stdout.strip().splitlines()[-1]
    assert folder.startswith(root) and not os.path.exists(folder), folder


# --- bad input, named at construction ---------------------------------------------------------------------


def _construction_errors(rank, world, root):
    import shutil as sh

    from zerofast.offload import stores

    out = {}

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError, OffloadError) as e:
            return type(e).__name__, str(e)
        return None

    blocker = os.path.join(root, "a-file")
    open(blocker, "w").close()
    out["under a file"] = error(lambda: ZeroAdam(_nested(), offload=f"disk:{blocker}/state"))
    out["proc"] = error(lambda: ZeroAdam(_nested(), offload="disk:/proc/zerofast-state"))
    real = sh.disk_usage
    stores.shutil.disk_usage = lambda p: real(p)._replace(free=1000)
    try:
        out["full"] = error(lambda: ZeroAdam(_nested(), offload=OffloadPolicy("disk", os.path.join(root, "full"))))
    finally:
        stores.shutil.disk_usage = real
    out["full, nothing left"] = [d for d in os.listdir(os.path.join(root, "full"))]
    out["muon"] = error(lambda: ZeroMuon(_nested(), offload="host"))
    out["shortcut"] = error(lambda: ZeroAdam(_nested(), offload="nvme"))
    return out


def _one_rank_cannot_place(rank, world, root):
    blocker = os.path.join(root, "a-file")
    if rank == 1:
        open(blocker, "w").close()
    dist.barrier()
    path = f"{blocker}/state" if rank == 1 else os.path.join(root, "fine")
    try:
        ZeroAdam(_nested(), offload=f"disk:{path}")
    except OffloadError as e:
        return str(e), os.listdir(os.path.join(root, "fine")) if rank == 0 else None
    return None


def test_a_rank_that_cannot_place_its_state_is_named_on_every_rank(root):
    (zero, left), (one, _) = run_ranks(_one_rank_cannot_place, 2, args=(root,))
    assert "cannot be created or written" in one and "a-file/state" in one, one
    assert "rank 1 could not place its files" in zero and "no rank built its optimizer" in zero, zero
    assert left == [], "rank 0's files are removed with its optimizer"


def test_bad_input_is_named_at_construction(root):
    for field, value, words in [
        ("state", "nvme", "state must be None, 'host' or 'disk'; got 'nvme'"),
        ("window_mb", 0, "window_mb must be a number > 0; got 0"),
        ("io_threads", 0, "io_threads must be an integer >= 1; got 0"),
        ("pin_memory", "yes", "pin_memory"),
    ]:
        kw = {"state": "disk", "path": root, field: value}
        with pytest.raises((ValueError, TypeError), match=words.replace("(", r"\(").replace(")", r"\)")):
            OffloadPolicy(**kw)
    with pytest.raises(ValueError, match="state='disk' needs path="):
        OffloadPolicy("disk")
    with pytest.raises(ValueError, match="delayed_update=True needs state='host' or 'disk'; got state=None"):
        OffloadPolicy(delayed_update=True)
    with pytest.raises(ValueError, match="path applies to state='disk'"):
        OffloadPolicy("host", root)
    assert OffloadPolicy() == OffloadPolicy(None) and not OffloadPolicy().active and None in OFFLOAD_STATES
    [out] = run_ranks(_construction_errors, 1, args=(root,))
    for case in ("under a file", "proc"):
        kind, message = out[case]
        assert kind == "OffloadError" and "cannot be created or written" in message and "path=" in message, (
            case,
            message,
        )
    kind, message = out["full"]
    assert kind == "OffloadError" and "needs" in message and "1000 free" in message and root in message, message
    assert out["full, nothing left"] == [], "a refused optimizer leaves no files"
    kind, message = out["muon"]
    assert (
        kind == "ValueError" and "ZeroMuon: offload='host' is not supported" in message and "Newton-Schulz" in message
    )
    kind, message = out["shortcut"]
    assert (
        kind == "ValueError"
        and "offload must be None, 'host', 'disk:PATH', 'infinity:PATH' or an OffloadPolicy; got 'nvme'" in message
    )
