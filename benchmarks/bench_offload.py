"""The optimizer state offloaded (OffloadPolicy, zerofast/offload) against the state in memory, the
disk's own bandwidth and the other libraries' offload. Tables: docs/benchmarks.md#offload.

test_offload_step_interleaved: the step benchmark's setting (2 gloo ranks x 1 thread, the bench GPT
of 6.4M parameters, batch 8 x 64 per rank), ZeroAdam stage 2 with its state in memory against the
same with its state on disk, at the defaults (window 64 MiB, 2 I/O threads, through the page cache),
with O_DIRECT, and with the one-step-delayed update. The rank pools stay alive together and step in
turn, in rotating order (ROUNDS x STEPS_PER_ROUND steps), so that a change in the machine's load hits
every case alike; the summary prints each case's median step as a ratio to the state in memory (the
ratio of the medians, and the median of the rounds' own ratios), and where a disk step's time goes,
from report().offload: opt.step() (phase 3 included), phase 3 (the pass over the state files), the
part of it waiting for reads and writes, and the bytes read and written (rank 0, medians).

test_offload_anchors_interleaved: the same, each library's offload against the same library without
it: torch FSDP2 with CPUOffloadPolicy (on a CPU-only machine only with pin_memory=False: the default
pins memory, which needs a CUDA driver, and fails with the error recorded in the summary),
DeepSpeed ZeRO 2 with offload_optimizer cpu and ZeRO 3 with offload_optimizer nvme (DeepSpeed swaps
optimizer state to NVMe in stage 3 only: stage 2 accepts device "nvme" and keeps the state in host
memory), when deepspeed is installed (DS_ACCELERATOR=cpu; nvme needs its async_io op, built against
libaio). A case that cannot run here is recorded with its error (the summary's "not run" lines).

test_offload_large_state: one process, a GPT whose optimizer state on disk is
ZEROFAST_BENCH_OFFLOAD_PARAMS parameters x 12 bytes per generation (default 25M, 0.3 GB; 200M
gives 2.4 GB: the documented run), with O_DIRECT and through the page cache, the latter timed with
the state in the page cache (back-to-back steps) and cold (the files flushed and dropped from the
page cache before the step), against the same filesystem's own sequential bandwidth measured in the
same run on a file of one generation's size (buffered write, + fsync, cold and cached reads;
O_DIRECT write and read).

test_offload_window_sweep (ZEROFAST_BENCH_OFFLOAD_SWEEP=1 only): window_mb x io_threads x direct_io
on the same large state, phase 3 of each setting in two passes of opposite order.

The state's files go under ZEROFAST_BENCH_OFFLOAD_DIR (default: the temp folder; it must be a real
disk, not tmpfs: the summary names the filesystem) and are removed at the end.

    make bench    # or: pytest benchmarks/bench_offload.py --benchmark-only
    ZEROFAST_BENCH_OFFLOAD_ROUNDS=12 pytest benchmarks/bench_offload.py -k step_interleaved --benchmark-only
    ZEROFAST_BENCH_OFFLOAD_PARAMS=200M pytest benchmarks/bench_offload.py -k large --benchmark-only
    ZEROFAST_BENCH_OFFLOAD_SWEEP=1 ZEROFAST_BENCH_OFFLOAD_PARAMS=200M pytest benchmarks/bench_offload.py -k sweep --benchmark-only
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import shutil
import statistics
import tempfile
import time

import pytest
from bench_step import BATCH, HYPER, SEQ, WORLD
from rankpool import RankPool

# Rounds of the interleaved tests (ZEROFAST_BENCH_OFFLOAD_ROUNDS overrides both: more rounds, a
# steadier median on a busy machine, for a proportionally longer run).
ROUNDS, STEPS_PER_ROUND, WARMUP = int(os.environ.get("ZEROFAST_BENCH_OFFLOAD_ROUNDS", 6)), 2, 2
GROUP = "offload: 2 gloo ranks x 1 thread, GPT 6.4M params, batch 8x64, ZeroAdam stage 2"

# The zerofast cases: "memory", or "disk" followed by OffloadPolicy fields as k=v words.
CASES = [
    "memory",
    "disk",  # the defaults: window_mb=64, io_threads=2, direct_io=False (through the page cache)
    "disk direct_io=1",  # O_DIRECT
    "disk direct_io=1 window_mb=256",  # the best direct setting of the sweep below
    "disk delayed_update=1",  # ZeRO-Offload's one-step-delayed update: a different algorithm
]
ANCHORS = [
    "memory",
    "disk",
    "disk direct_io=1",
    "fsdp2",
    "fsdp2 CPUOffloadPolicy()",
    "fsdp2 CPUOffloadPolicy(pin_memory=False)",
    "deepspeed 2",
    "deepspeed 2 offload_optimizer=cpu",
    "deepspeed 3",
    "deepspeed 3 offload_optimizer=nvme",  # DeepSpeed swaps optimizer state to NVMe in stage 3 only
]
ANCHOR_ROUNDS, ANCHOR_STEPS = int(os.environ.get("ZEROFAST_BENCH_OFFLOAD_ROUNDS", 4)), 2


def _offload_root() -> str:
    base = os.environ.get("ZEROFAST_BENCH_OFFLOAD_DIR") or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="zerofast-bench-offload-", dir=base)


def filesystem(path: str) -> str:
    """The filesystem `path` is on, from /proc/self/mountinfo: "ext4 on /dev/vda (mounted at /)"."""
    path, best = os.path.realpath(path), ("?", "?", "?")
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4]
                fstype, source = right.split()[:2]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[2]):
                    best = (fstype, source, mount)
    except OSError:
        pass
    return f"{best[0]} on {best[1]} (mounted at {best[2]})"


def _policy(words: list[str], root: str):
    from zerofast import OffloadPolicy

    fields = {}
    for k, v in (w.split("=") for w in words):
        fields[k] = bool(int(v)) if k in ("delayed_update", "direct_io") else int(v) if k == "io_threads" else float(v)
    return OffloadPolicy("disk", root, **fields)


def build(case, root, rank, world):
    """Runs in each rank: set up `case`, return a function doing one training step; step.info()
    returns, for every step so far, opt.step()'s seconds and the last step's offload figures."""
    import torch

    from zerofast.tools.models import make_gpt, random_batch

    kind, *words = case.split()
    wide = words[-1:] == ["@wide"]  # the GPT 1024 wide: parameter partitions DeepSpeed swaps (>= 1 MiB)
    words = words[:-1] if wide else words
    model = make_gpt("small", **WIDE) if wide else make_gpt("small")
    records = []
    counter = [0]

    def batch():
        x, y = random_batch(model.cfg, BATCH, SEQ, seed=1000 * (counter[0] % 4) + rank)
        counter[0] += 1
        return x, y

    if kind in ("memory", "disk", "s3"):
        from zerofast import OffloadPolicy, ZeroAdam

        if kind == "s3":  # stage 3: the shards in memory, the state on disk, both on disk (ZeRO-Infinity)
            place = words[0]
            state = "disk" if place in ("state", "infinity") else None
            params = "disk" if place in ("params", "infinity") else None
            path = os.path.join(root, f"rank{rank}") if state or params else None
            opt = ZeroAdam(model, stage=3, offload=OffloadPolicy(state, path, params=params), **HYPER)
        else:
            opt = ZeroAdam(model, stage=2, offload=None if kind == "memory" else _policy(words, root), **HYPER)

        def step():
            x, y = batch()
            _, loss = model(x, y)
            loss.backward()
            t = time.perf_counter()
            opt.step()
            t = time.perf_counter() - t
            opt.zero_grad()
            off = opt.report().offload
            records.append(
                dict(
                    step=t,
                    phase3=off.phase3_seconds,
                    wait=off.io_wait_seconds,
                    read=off.read_bytes,
                    write=off.write_bytes,
                    window=off.window_bytes,
                    disk=off.disk_bytes,
                )
            )

        step.info = lambda: records
        return step

    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        offload = {}
        if words:  # "CPUOffloadPolicy()" or "CPUOffloadPolicy(pin_memory=False)"
            pin = "pin_memory=False" not in words[0]
            offload = dict(offload_policy=CPUOffloadPolicy() if pin else CPUOffloadPolicy(pin_memory=False))
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **offload)
        fully_shard(model, mesh=mesh, **offload)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)

        def step():
            x, y = batch()
            _, loss = model(x, y)
            loss.backward()
            t = time.perf_counter()
            opt.step()
            records.append(dict(step=time.perf_counter() - t))
            opt.zero_grad()

        step.info = lambda: records
        return step

    if kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_RANK", str(rank))
        import deepspeed

        zero = {"stage": int(words[0])}
        device = next((w.split("=")[1] for w in words if w.startswith("offload_optimizer=")), None)
        nvme = os.path.join(root, f"deepspeed-nvme-{'-'.join(words)}")  # its own: the cases run side by side
        swaps = device == "nvme" or "offload_param=nvme" in words
        if device == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        elif device == "nvme":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        if "offload_param=nvme" in words:  # ZeRO-Infinity's parameter offload
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
        cfg = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "weight_decay": HYPER["weight_decay"]}},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step():
            x, y = batch()
            _, loss = engine(x, y)
            engine.backward(loss)
            t = time.perf_counter()
            engine.step()
            records.append(dict(step=time.perf_counter() - t))
            if swaps:  # the swap files DeepSpeed keeps under nvme_path
                records[-1]["disk"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)

        step.info = lambda: records
        return step
    raise ValueError(case)


def _error_line(e: BaseException) -> str:
    """The last line of a rank's traceback: the exception as raised."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(e).__name__


def _interleaved(cases, root, rounds, steps_per_round, warmup=WARMUP):
    """The cases' rank pools alive together, stepped in turn (the order rotating each round): every
    step's time by case, each case's per-step records from rank 0 (the warm-up steps dropped), and
    the cases that could not be built, with their error."""
    pools, errors = {}, {}
    try:
        for case in cases:
            if case.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
                errors[case] = "deepspeed is not installed (optional: pip install deepspeed)"
                continue
            try:
                pools[case] = RankPool(functools.partial(build, case, root), world=WORLD)
            except RuntimeError as e:
                errors[case] = _error_line(e)
        for pool in pools.values():
            for _ in range(warmup):
                pool.step()
        times = {case: [] for case in pools}
        order = list(pools)
        for _ in range(rounds):
            for case in order:
                for _ in range(steps_per_round):
                    t = time.perf_counter()
                    pools[case].step()
                    times[case].append(time.perf_counter() - t)
            order.append(order.pop(0))
        records = {case: pool.info()[0][warmup:] for case, pool in pools.items()}
    finally:
        for pool in pools.values():
            pool.close()
    return times, records, errors


def _median(records, key):
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def _paired(times, case, base, steps):
    """The median over rounds of the case's mean step in a round / its base's in the same round: the
    rounds interleave the cases, so a change in the machine's load between rounds cancels."""
    per_round = [
        statistics.fmean(times[case][i : i + steps]) / statistics.fmean(times[base][i : i + steps])
        for i in range(0, min(len(times[case]), len(times[base])), steps)
    ]
    return statistics.median(per_round)


def _lines(times, records, bases, steps):
    """The summary's table: each case's median step, its ratio to its base (`bases[case]`: the same
    library without offload) as the ratio of the medians and as the median of per-round ratios,
    and rank 0's opt.step() and offload figures."""
    medians = {case: statistics.median(ts) for case, ts in times.items()}
    header = (
        f"{'case':44s} {'step ms':>8s} {'x base':>7s} {'paired':>7s} {'opt.step':>8s} {'phase 3':>8s} "
        f"{'io wait':>8s} {'read MB':>8s} {'write MB':>8s} {'window MiB':>10s} {'files MB':>8s}"
    )
    lines = [header]
    for case, m in medians.items():
        rec, base = records[case], bases.get(case)
        cols = [_median(rec, k) for k in ("step", "phase3", "wait")]
        cols = [f"{1e3 * c:8.1f}" if c else f"{'':>8s}" for c in cols]
        rb, wb, win, disk = (_median(rec, k) for k in ("read", "write", "window", "disk"))
        io = f"{rb / 1e6:8.1f} {wb / 1e6:8.1f} {win / 2**20:10.1f}" if rb else f"{'':>8s} {'':>8s} {'':>10s}"
        io += f" {disk / 1e6:8.1f}" if disk else ""
        if base in medians and base != case:
            ratio = f"{m / medians[base]:6.2f}x {_paired(times, case, base, steps):6.2f}x"
        else:
            ratio = f"{'(base)':>7s} {'':>7s}"
        lines.append(f"{case:44s} {1e3 * m:8.1f} {ratio} {cols[0]} {cols[1]} {cols[2]} {io}")
    return medians, lines


def _base(case: str) -> str:
    """The same library without offload: ZeroAdam's state in memory, FSDP2, DeepSpeed's stage."""
    words = case.split()
    return {"disk": "memory", "fsdp2": "fsdp2", "deepspeed": " ".join(words[:2])}.get(words[0], case)


def test_offload_step_interleaved(benchmark, record_ratios, record_not_run):
    root = _offload_root()
    try:
        times, records, errors = benchmark.pedantic(
            _interleaved, args=(CASES, root, ROUNDS, STEPS_PER_ROUND), rounds=1, iterations=1
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians, lines = _lines(times, records, {case: "memory" for case in times}, STEPS_PER_ROUND)
    memory_step = _median(records["memory"], "step")
    for case in records:
        if case != "memory":
            extra = _median(records[case], "step") - memory_step
            lines.append(
                f"  {case:42s} opt.step() {1e3 * extra:+7.1f} ms against memory's: "
                f"{(medians['memory'] + extra) / medians['memory']:5.2f}x memory's whole step"
            )
    lines.append(
        f"state files on {filesystem(root)}; step ms: medians over {ROUNDS} rounds x {STEPS_PER_ROUND} steps; "
        "x base: the ratio of the medians; paired: the median of the rounds' ratios"
    )
    lines.append(
        "opt.step, phase 3, io wait, bytes: rank 0's medians per step (delayed_update: phase 3 runs on a thread, "
        "not shown); files MB: rank 0's two generations"
    )
    record_ratios(f"{GROUP}, interleaved", lines)
    for case, reason in errors.items():
        record_not_run(GROUP, case, reason)
    benchmark.extra_info.update({f"{case} ms": 1e3 * m for case, m in medians.items()})


# Stage 3 with the parameter and gradient shards on disk too (OffloadPolicy(params="disk"), ZeRO-Infinity):
# the whole step (forward's and backward's gathers read the shards' files, the reduces write them).
PARAMS_CASES = [
    "s3 memory",
    "s3 state",  # the state on disk
    "s3 params",  # the shards on disk, the state in memory
    "s3 infinity",  # both
    "deepspeed 3",
    "deepspeed 3 offload_optimizer=nvme offload_param=nvme",
]
PARAMS_GROUP = "offload: 2 gloo ranks x 1 thread, GPT 6.4M params, batch 8x64, stage 3"
# 1024 wide, 2 blocks (25.5M parameters, its MLP matrices 16 MiB in fp32): DeepSpeed's parameter
# swapper takes partitions of 1 MiB and more only (MIN_AIO_BYTES), which the 256-wide GPT has none of.
WIDE = dict(n_embd=1024, n_head=16, n_layer=2)
WIDE_CASES = [f"{case} @wide" for case in ("s3 memory", "s3 infinity", "deepspeed 3", PARAMS_CASES[-1])]
WIDE_GROUP = "offload: 2 gloo ranks x 1 thread, GPT 1024 wide x 2 blocks (25.5M), batch 8x64, stage 3"


def _params_base(case: str) -> str:
    wide = " @wide" if case.endswith("@wide") else ""
    return ("s3 memory" if case.startswith("s3") else "deepspeed 3") + wide


@pytest.mark.parametrize("cases, group", [(PARAMS_CASES, PARAMS_GROUP), (WIDE_CASES, WIDE_GROUP)], ids=["", "wide"])
def test_offload_params_interleaved(cases, group, benchmark, record_ratios, record_not_run):
    """ZeRO-Infinity: the step with stage 3's shards and state on disk against the same in memory,
    DeepSpeed ZeRO 3 with offload_param and offload_optimizer on nvme against itself without; "wide":
    a model whose parameter partitions DeepSpeed swaps too."""
    root = _offload_root()
    try:
        times, records, errors = benchmark.pedantic(
            _interleaved, args=(cases, root, ROUNDS, STEPS_PER_ROUND), rounds=1, iterations=1
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians, lines = _lines(times, records, {case: _params_base(case) for case in times}, STEPS_PER_ROUND)
    lines.append(
        f"files on {filesystem(root)}; step ms: the whole step (forward, backward, opt.step()), medians over "
        f"{ROUNDS} rounds x {STEPS_PER_ROUND} steps; x base: against the same library in memory"
    )
    record_ratios(f"{group}, interleaved", lines)
    for case, reason in errors.items():
        record_not_run(group, case, reason)
    benchmark.extra_info.update({f"{case} ms": 1e3 * m for case, m in medians.items()})


def test_offload_anchors_interleaved(benchmark, record_ratios, record_not_run):
    root = _offload_root()
    try:
        times, records, errors = benchmark.pedantic(
            _interleaved, args=(ANCHORS, root, ANCHOR_ROUNDS, ANCHOR_STEPS), rounds=1, iterations=1
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians, lines = _lines(times, records, {case: _base(case) for case in times}, ANCHOR_STEPS)
    lines.append(
        f"x base, paired: against the same library without offload (memory, fsdp2, deepspeed N); medians over "
        f"{ANCHOR_ROUNDS} rounds x {ANCHOR_STEPS} steps; torch optimizers: AdamW(fused=True)"
    )
    record_ratios("offload anchors (each library against itself), interleaved: " + GROUP, lines)
    for case, reason in errors.items():
        record_not_run("offload anchors", case, reason)
    benchmark.extra_info.update({f"{case} ms": 1e3 * m for case, m in medians.items()})


# --- a large state: the step against the disk's own bandwidth -------------------------------------

LARGE_EMBD = 1024  # a block: 12 x 1024^2 = 12.6M parameters
LARGE_STEPS = 2  # timed steps of each kind (warm, cold)


def _count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def large_layers() -> int:
    params = _count(os.environ.get("ZEROFAST_BENCH_OFFLOAD_PARAMS", "25M"))
    return max(1, round(params / (12 * LARGE_EMBD**2)))


def build_large(root, layers, direct, rank, world):
    """One rank: the GPT of `layers` blocks of width 1024, ZeroAdam stage 2 (fp32) with its state on
    disk, read and written with O_DIRECT or through the page cache (`direct`); a step is forward +
    backward on 1 x 16 tokens + opt.step(); info() gives every step's record."""
    from zerofast import OffloadPolicy, ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt("small", n_embd=LARGE_EMBD, n_head=16, n_layer=layers)
    opt = ZeroAdam(model, stage=2, offload=OffloadPolicy("disk", root, direct_io=direct), **HYPER)
    records = []

    def step():
        x, y = random_batch(model.cfg, 1, 16, seed=len(records))
        _, loss = model(x, y)
        loss.backward()
        t = time.perf_counter()
        opt.step()
        t = time.perf_counter() - t
        opt.zero_grad()
        off = opt.report().offload
        records.append(
            dict(
                step=t,
                phase3=off.phase3_seconds,
                wait=off.io_wait_seconds,
                read=off.read_bytes,
                write=off.write_bytes,
                folder=off.folder,
                disk=off.disk_bytes,
                window=off.window_bytes,
                direct=getattr(off, "direct_io", None),  # whether O_DIRECT was in effect
                params=sum(p.numel() for p in model.parameters()),
            )
        )

    step.info = lambda: records
    return step


def _state_files(folder: str) -> list[str]:
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n != "lock"]


def _flush(paths: list[str], drop: bool = False) -> float:
    """fsync every file (its dirty pages to the disk) and, with `drop`, then drop its pages from the
    page cache (POSIX_FADV_DONTNEED), so that the next read of it comes from the disk. The seconds
    the fsyncs took."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        t = time.perf_counter()
        for fd in fds:
            os.fsync(fd)
        flushed = time.perf_counter() - t
        for fd in fds if drop else []:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        for fd in fds:
            os.close(fd)
    return flushed


def disk_bandwidth(folder: str, nbytes: int, block: int = 64 << 20) -> dict:
    """The filesystem's own sequential bandwidth on one file of `nbytes` in `folder`, bytes per
    second, one thread, `block`-sized calls: written through the page cache (until the last write
    returns; and until fsync returns: the disk), read cold (after fsync and POSIX_FADV_DONTNEED) and
    again (page cache); then written and read with O_DIRECT (no page cache, no fsync), as the
    offload's direct I/O does."""
    path = os.path.join(folder, "bandwidth-probe")
    nbytes = -(-nbytes // 4096) * 4096
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(block))
    view = memoryview(buf)
    out = {}

    def write(fd) -> float:
        t, done = time.perf_counter(), 0
        while done < nbytes:
            done += os.pwrite(fd, view[: min(block, nbytes - done)], done)
        return time.perf_counter() - t

    def read(fd) -> float:
        t, done = time.perf_counter(), 0
        while done < nbytes:
            done += os.preadv(fd, [view[: min(block, nbytes - done)]], done)
        return time.perf_counter() - t

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = write(fd)
        t = time.perf_counter()
        os.fsync(fd)
        out["write_cache"], out["write_disk"] = nbytes / written, nbytes / (written + time.perf_counter() - t)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out["read_cold"] = nbytes / read(fd)
        out["read_cache"] = nbytes / read(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
    except OSError:  # no direct I/O on this filesystem
        fd = None
    if fd is not None:
        try:
            out["write_direct"] = nbytes / write(fd)
            out["read_direct"] = nbytes / read(fd)
        finally:
            os.close(fd)
    os.unlink(path)
    view.release()
    buf.close()
    return out


def concurrent_cold_read(folder: str, nbytes: int, readers: int, block: int = 64 << 20) -> float:
    """Bytes per second each of `readers` threads reads cold at once, each its own file of `nbytes`
    (written, fsynced and dropped from the page cache first), `block`-sized calls: the disk's share
    of one reader when `readers` processes read together, as the ranks of one machine do."""
    import threading

    nbytes = -(-nbytes // 4096) * 4096
    paths = [os.path.join(folder, f"concurrent-probe-{i}") for i in range(readers)]
    chunk = os.urandom(min(block, nbytes))
    for path in paths:
        with open(path, "wb") as f:
            for done in range(0, nbytes, len(chunk)):
                f.write(chunk[: min(len(chunk), nbytes - done)])
    _flush(paths, drop=True)
    seconds = [0.0] * readers

    def read(i):
        buf = bytearray(min(block, nbytes))
        view = memoryview(buf)
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            t, done = time.perf_counter(), 0
            while done < nbytes:
                done += os.preadv(fd, [view[: min(len(buf), nbytes - done)]], done)
            seconds[i] = time.perf_counter() - t
        finally:
            os.close(fd)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for path in paths:
        os.unlink(path)
    return nbytes / max(seconds)


def _large(root, layers, direct):
    """The state read and written with O_DIRECT (`direct`): three steps after two warm-up steps.
    Through the page cache: two steps with the state in the page cache (back to back), then two
    with the files flushed and dropped from it before each step ("cold"), each followed by an
    fsync of the files (how long its writes took to reach the disk)."""
    pool = RankPool(functools.partial(build_large, root, layers, direct), world=1, timeout=1800)
    out = dict(warm=[], cold=[], flush_before=[], flush_after=[])
    try:
        pool.step()  # the first step reads generation 0 as preallocated (never written: no disk read)
        pool.step()  # the first step that reads what a step wrote
        files = _state_files(pool.info()[0][-1]["folder"])
        for _ in range(LARGE_STEPS if not direct else LARGE_STEPS + 1):
            pool.step()
            out["warm"].append(pool.info()[0][-1])
        for _ in range(0 if direct else LARGE_STEPS):
            out["flush_before"].append(_flush(files, drop=True))
            pool.step()
            out["cold"].append(pool.info()[0][-1])
            out["flush_after"].append(_flush(files))
    finally:
        pool.close()
    return out


def _large_lines(runs, disk, root):
    r = (runs.get(False) or runs[True])["warm"][-1]
    gen = r["disk"] // 2
    lines = [
        f"model {r['params'] / 1e6:.1f}M fp32 parameters; state on disk {gen / 1e9:.2f} GB per generation "
        f"({gen / 2**30:.2f} GiB), {r['disk'] / 1e9:.2f} GB in both; window {r['window'] / 2**20:.1f} MiB; "
        f"files on {filesystem(root)}",
        f"{'the filesystem, one file of one generation, sequential, one thread, 64 MiB calls':78s} {'GB/s':>6s}",
    ]
    names = {
        "write_cache": "buffered write, until the last os.pwrite returned (page cache)",
        "write_disk": "buffered write + fsync (disk)",
        "read_cold": "buffered read after fsync + POSIX_FADV_DONTNEED (cold: disk)",
        "read_cache": "buffered read again (page cache)",
        "write_direct": "O_DIRECT write (no fsync)",
        "read_direct": "O_DIRECT read",
    }
    for key, name in names.items():
        if key in disk:
            lines.append(f"  {name:76s} {disk[key] / 1e9:6.2f}")
    lines.append(
        f"{'offload step':42s} {'opt.step s':>10s} {'phase 3 s':>9s} {'io wait s':>9s} {'read GB':>8s} "
        f"{'write GB':>8s} {'GB/s':>6s} {'plain s':>8s} {'% plain':>7s}"
    )

    def row(name, rec, read_bw, write_bw, extra=0.0):
        rb, wb = rec["read"], rec["write"]
        seconds = rec["phase3"] + extra
        plain = rb / read_bw + wb / write_bw  # the same bytes at the filesystem's sequential rates
        lines.append(
            f"  {name:40s} {rec['step']:10.2f} {seconds:9.2f} {rec['wait']:9.2f} {rb / 1e9:8.2f} {wb / 1e9:8.2f} "
            f"{(rb + wb) / seconds / 1e9:6.2f} {plain:8.2f} {100 * plain / seconds:6.0f}%"
        )

    if True in runs and "read_direct" in disk:
        for i, rec in enumerate(runs[True]["warm"]):
            row(f"direct_io=True, step {i + 1}", rec, disk["read_direct"], disk["write_direct"])
        lines.append(f"  report().offload.direct_io of those steps: {runs[True]['warm'][-1]['direct']}")
    if False in runs:
        out = runs[False]
        for i, rec in enumerate(out["warm"]):
            row(f"direct_io=False, warm {i + 1} (page cache)", rec, disk["read_cache"], disk["write_cache"])
        for i, rec in enumerate(out["cold"]):
            row(f"direct_io=False, cold {i + 1} (reads: disk)", rec, disk["read_cold"], disk["write_cache"])
        for i, rec in enumerate(out["cold"]):
            row(
                f"direct_io=False, cold {i + 1} + fsync after",
                rec,
                disk["read_cold"],
                disk["write_disk"],
                out["flush_after"][i],
            )
        lines.append(
            f"  fsync of the state before each cold step (the previous step's writes): "
            f"{', '.join(f'{s:.2f}' for s in out['flush_before'])} s; after it: "
            f"{', '.join(f'{s:.2f}' for s in out['flush_after'])} s"
        )
    lines.append(
        "plain s: the same bytes read and written at the filesystem's sequential rates above, in the same mode "
        "(direct: O_DIRECT read and write; warm: page-cache read and write; cold: cold read, page-cache write; "
        "+ fsync: cold read, write + fsync); % plain = that time / the offload's (phase 3, plus the fsync after "
        "the step in the + fsync rows): the goal is >= 80%"
    )
    return lines


def test_offload_large_state(benchmark, record_ratios):
    layers = large_layers()
    root = _offload_root()

    def run():
        runs = {direct: _large(root, layers, direct) for direct in (True, False)}
        generation = runs[False]["warm"][-1]["disk"] // 2
        return runs, disk_bandwidth(root, generation)

    try:
        runs, disk = benchmark.pedantic(run, rounds=1, iterations=1)
        lines = _large_lines(runs, disk, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record_ratios("offload: a large state on disk, one process (ZeroAdam stage 2, fp32, world 1)", lines)
    benchmark.extra_info.update({k: v / 1e9 for k, v in disk.items()})


# --- stage 3's shards on disk, cold: their I/O against the disk's own bandwidth ---------------------------

COLD_STEPS = 2  # timed steps of each kind (warm, cold)


def build_cold(root, rank, world):
    """One rank: the GPT 1024 wide x 2 blocks (25.5M) at stage 3 with its state and its shards on disk
    (ZeRO-Infinity, fp32); a step is forward + backward + opt.step() on the bench batch; info() gives
    every step's seconds and the shards' explicit I/O in each phase (bytes and seconds by file:
    forward's and backward's gathers read the parameter shard, the step reads the gradient shard and
    writes the parameters), and the folders' files."""
    from zerofast import OffloadPolicy, ZeroAdam
    from zerofast.optim.zero_adam import parts_of
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt("small", **WIDE)
    path = os.path.join(root, f"rank{rank}")
    opt = ZeroAdam(model, stage=3, offload=OffloadPolicy("disk", path, params="disk"), **HYPER)
    shards = parts_of(opt).files
    records = []

    def io():
        return {key: tuple(v) for key, v in shards.io.items()}

    def step():
        x, y = random_batch(model.cfg, BATCH, SEQ, seed=1000 * (len(records) % 4) + rank)
        before = io()
        t = time.perf_counter()
        _, loss = model(x, y)
        forward = io()
        loss.backward()
        backward = io()
        opt.step()
        opt.zero_grad()
        t = time.perf_counter() - t
        off = opt.report().offload
        phases = {}
        for phase, (a, b) in dict(
            forward=(before, forward), backward=(forward, backward), step=(backward, io())
        ).items():
            for key, (nbytes, seconds) in b.items():
                was = a.get(key, (0, 0.0))
                if nbytes > was[0]:
                    phases[(phase, *key)] = (nbytes - was[0], seconds - was[1])
        records.append(
            dict(
                step=t,
                phases=phases,
                files=_state_files(off.params_folder) + _state_files(off.folder),
                shard_file=max(os.path.getsize(f) for f in _state_files(off.params_folder)),
            )
        )

    step.info = lambda: records
    return step


def _cold(root):
    """Two steps back to back (the files in the page cache), then two with every rank's files of state
    and shards flushed and dropped from it before the step (cold: each unit's first gather reads its
    shard from the disk); each rank's records."""
    pool = RankPool(functools.partial(build_cold, root), world=WORLD, timeout=1800)
    kinds = []
    try:
        for _ in range(2):  # warm-up: the files written once
            pool.step()
        for kind in ["warm"] * COLD_STEPS + ["cold"] * COLD_STEPS:
            if kind == "cold":
                _flush([f for rank in pool.info() for f in rank[-1]["files"]], drop=True)
            pool.step()
            kinds.append(kind)
        return kinds, pool.info()
    finally:
        pool.close()


def _cold_lines(kinds, info, disk) -> list[str]:
    lines = [
        f"shard files {info[0][-1]['shard_file'] / 2**20:.1f} MiB per rank and kind (parameters, gradients); "
        f"the filesystem, one file, sequential, 64 MiB calls: read cold {disk['read_cold'] / 1e9:.2f} GB/s "
        f"(each of {len(info)} readers at once, as the ranks read: {disk['read_cold_each'] / 1e9:.2f}), "
        f"read from the page cache {disk['read_cache'] / 1e9:.2f}, write to it {disk['write_cache'] / 1e9:.2f}",
        f"{'step':8s} {'rank':>4s} {'step s':>7s}  "
        + "  ".join(f"{name:>27s}" for name in ("forward: params read", "backward: params read", "step: grads read"))
        + f"  {'step: params written':>20s}",
        f"{'':8s} {'':4s} {'':7s}  "
        + "  ".join(f"{'MB':>6s} {'s':>6s} {'GB/s':>5s} {'%':>5s}" for _ in range(3))
        + f"  {'MB':>6s} {'s':>6s} {'GB/s':>5s}",
    ]
    for rank, records in enumerate(info):
        for i, (kind, rec) in enumerate(zip(kinds, records[len(records) - len(kinds) :])):
            cells = []
            for key in (
                ("forward", "read", "param_shard"),
                ("backward", "read", "param_shard"),
                ("step", "read", "grad_shard"),
            ):
                nbytes, seconds = rec["phases"].get(key, (0, 0.0))
                # forward's reads come from the disk in a cold step; the rest from the page cache (the
                # forward read the parameters, backward wrote the gradients)
                bw = disk["read_cold_each"] if kind == "cold" and key[0] == "forward" else disk["read_cache"]
                rate = nbytes / seconds if seconds else 0.0
                cells.append(f"{nbytes / 1e6:6.1f} {seconds:6.3f} {rate / 1e9:5.2f} {100 * rate / bw:4.0f}%")
            nbytes, seconds = rec["phases"].get(("step", "write", "param_shard"), (0, 0.0))
            cells.append(f"{nbytes / 1e6:6.1f} {seconds:6.3f} {nbytes / seconds / 1e9 if seconds else 0:5.2f}")
            lines.append(f"{kind + ' ' + str(i % COLD_STEPS + 1):8s} {rank:4d} {rec['step']:7.2f}  " + "  ".join(cells))
    lines.append(
        "the shards' explicit I/O by phase (report().offload.params_* sums them): each unit's gather reads its "
        "parameter shard in forward and again in backward, the step reads the gradient shard and writes the "
        "parameter shard. %: the read rate over the filesystem's, read cold with one reader a rank at once for "
        "forward in the cold steps (the files dropped from the page cache before the step: the only reads "
        "from the disk), from the page cache otherwise. The goal: >= 80% cold"
    )
    return lines


def test_offload_params_cold(benchmark, record_ratios):
    root = _offload_root()

    def run():
        kinds, info = _cold(root)
        disk = disk_bandwidth(root, info[0][-1]["shard_file"])
        disk["read_cold_each"] = concurrent_cold_read(root, info[0][-1]["shard_file"], WORLD)
        return kinds, info, disk

    try:
        kinds, info, disk = benchmark.pedantic(run, rounds=1, iterations=1)
        lines = _cold_lines(kinds, info, disk)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record_ratios(f"{WIDE_GROUP}: the shards and the state on disk, warm and cold", lines)


# --- window, threads and direct I/O on the large state (ZEROFAST_BENCH_OFFLOAD_SWEEP=1) ----------------

SWEEP = [(w, t, d) for d in (True, False) for w in (16, 64, 256) for t in (2, 8)]  # window_mb, io_threads, direct


def build_sweep(root, layers, rank, world):
    """One rank, one model; step() runs every SWEEP setting in turn, then again in reverse order (so
    that a drift in the disk's speed shows as a difference between the two passes): a ZeroAdam with
    that OffloadPolicy, three steps, phase 3 of the last two recorded; info() returns the records."""
    import gc

    from zerofast import OffloadPolicy, ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt("small", n_embd=LARGE_EMBD, n_head=16, n_layer=layers)
    x, y = random_batch(model.cfg, 1, 16, seed=0)
    results = []

    def step():
        for order in (SWEEP, SWEEP[::-1]):
            for window, threads, direct in order:
                policy = OffloadPolicy("disk", root, window_mb=window, io_threads=threads, direct_io=direct)
                opt = ZeroAdam(model, stage=2, offload=policy, **HYPER)
                for i in range(3):
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    off = opt.report().offload
                    if i:  # the first step reads generation 0 as preallocated (no disk read)
                        results.append(((window, threads, direct), off.phase3_seconds, off.io_wait_seconds, off))
                del opt
                gc.collect()

    step.info = lambda: [(key, p3, wait, off.read_bytes + off.write_bytes) for key, p3, wait, off in results]
    return step


def test_offload_window_sweep(benchmark, record_ratios):
    if os.environ.get("ZEROFAST_BENCH_OFFLOAD_SWEEP") != "1":
        pytest.skip("the window / io_threads / direct_io sweep runs with ZEROFAST_BENCH_OFFLOAD_SWEEP=1")
    layers = large_layers()
    root = _offload_root()

    def run():
        pool = RankPool(functools.partial(build_sweep, root, layers), world=1, timeout=3600)
        try:
            pool.step()
            return pool.info()[0]
        finally:
            pool.close()

    try:
        results = benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        f"{'direct_io':>9s} {'window MiB':>10s} {'io_threads':>10s}   phase 3 s (io wait s), 2 steps x 2 passes   GB/s (median)"
    ]
    for key in SWEEP:
        rows = [(p3, wait, nbytes) for k, p3, wait, nbytes in results if tuple(k) == key]
        gbs = statistics.median(n / p3 for p3, _, n in rows) / 1e9
        times = "  ".join(f"{p3:5.2f} ({wait:4.2f})" for p3, wait, _ in rows)
        lines.append(f"{key[2]!s:>9s} {key[0]:10d} {key[1]:10d}   {times}   {gbs:6.2f}")
    record_ratios(
        f"offload: window, threads and direct I/O, {results[0][3] / 2e9:.2f} GB per generation, one process", lines
    )


# --- host offload from a GPU (the GPU check) --------------------------------------------------------

# What the GPU check runs: one rank on cuda:0 (gloo world 1), a GPT of HOST_LAYERS blocks of width
# 1024 (12.6M parameters each; ZEROFAST_BENCH_OFFLOAD_HOST_LAYERS, default 16: 201M parameters),
# bf16 mixed precision, batch 4 x 256.
HOST_LAYERS = int(os.environ.get("ZEROFAST_BENCH_OFFLOAD_HOST_LAYERS", 16))
HOST_CASES = [
    "device",  # ZeroAdam, the state on the GPU
    "host",  # ZeroAdam, OffloadPolicy("host"): the state in pinned host memory, the fused CPU kernel
    "torch-cpu",  # FSDP2's CPU offload's step: fp32 params on the CPU, torch.optim.AdamW (its CPU default)
    "torch-cpu-fused",  # the same with AdamW(fused=True)
]
HOST_ROUNDS, HOST_STEPS = 4, 2


def build_host(case, device, rank, world):
    """One rank: `case` on `device` ("cuda" in the GPU check; "cpu" runs the same code for a look on a
    machine without one). A step is forward + backward + the optimizer; info() gives every step's
    optimizer seconds (opt.step(); torch-cpu: the gradients' copy to the host, AdamW's step and the
    parameters' copy back, what FSDP2's CPU offload does) and the offload's phase 3."""
    import torch

    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    torch.set_num_threads(os.cpu_count() or 1)  # the CPU steps (both kinds) get the machine's cores
    model = make_gpt("small", n_embd=LARGE_EMBD, n_head=16, n_layer=HOST_LAYERS, block_size=256).to(device)
    records = []

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    if case in ("device", "host"):
        opt = ZeroAdam(model, stage=2, mixed_precision="bf16", offload=case if case == "host" else None, **HYPER)

        def update():
            opt.step()
            opt.zero_grad()

        def offload_info():
            off = opt.report().offload
            return {"phase3": off.phase3_seconds} if off is not None else {}
    else:
        # The fp32 master on the CPU (as FSDP2's CPUOffloadPolicy keeps the sharded parameters), the
        # model computing in bf16 on the device.
        master = [p.detach().to("cpu", torch.float32).requires_grad_() for p in model.parameters()]
        model.to(torch.bfloat16)
        opt = torch.optim.AdamW(master, fused=case == "torch-cpu-fused", **HYPER)

        def update():
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.to("cpu", torch.float32)
                p.grad = None
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)

        def offload_info():
            return {}

    def step():
        x, y = random_batch(model.cfg, 4, 256, seed=len(records))
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        sync()
        t = time.perf_counter()
        update()
        sync()
        records.append({"step": time.perf_counter() - t, **offload_info()})

    step.info = lambda: records
    return step


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (the GPU check runs it)")
def test_offload_host_from_gpu(benchmark, record_ratios):
    pools = {}

    def run():
        for case in HOST_CASES:
            pools[case] = RankPool(functools.partial(build_host, case, "cuda"), world=1, timeout=900)
        for pool in pools.values():
            pool.step()  # warm-up: the buckets, the kernels
        times = {case: [] for case in pools}
        order = list(pools)
        for _ in range(HOST_ROUNDS):
            for case in order:
                for _ in range(HOST_STEPS):
                    t = time.perf_counter()
                    pools[case].step()
                    times[case].append(time.perf_counter() - t)
            order.append(order.pop(0))
        return times, {case: pool.info()[0][1:] for case, pool in pools.items()}

    try:
        times, records = benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        for pool in pools.values():
            pool.close()
    params = 12 * LARGE_EMBD**2 * HOST_LAYERS
    lines = [f"{'case':18s} {'step ms':>8s} {'x device':>8s} {'optimizer ms':>12s} {'x host':>7s} {'phase 3 ms':>10s}"]
    step = {case: statistics.median(ts) for case, ts in times.items()}
    optim = {case: _median(rec, "step") for case, rec in records.items()}
    for case in times:
        phase3 = _median(records[case], "phase3")
        lines.append(
            f"{case:18s} {1e3 * step[case]:8.1f} {step[case] / step['device']:7.2f}x {1e3 * optim[case]:12.1f} "
            f"{optim[case] / optim['host']:6.2f}x {1e3 * phase3 if phase3 else 0:10.1f}"
        )
    lines.append(
        f"one rank on cuda:0, GPT {params / 1e6:.0f}M params (~{HOST_LAYERS} blocks x 1024), bf16, batch 4 x 256; "
        f"medians over {HOST_ROUNDS} rounds x {HOST_STEPS} steps; optimizer: the update alone (torch-cpu: "
        "gradients to the host, AdamW on the CPU, parameters back)"
    )
    record_ratios(
        "offload: host from a GPU (ZeroAdam's host offload against the state on the GPU and torch on the CPU)", lines
    )
    benchmark.extra_info.update({f"{case} ms": 1e3 * m for case, m in step.items()})
