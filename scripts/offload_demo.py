"""A training job whose optimizer state on disk is several times the process's peak resident memory.

    python scripts/offload_demo.py --path DIR [--params 1B] [--steps 3] [--stage 2|3] [--compare]
    python scripts/offload_demo.py --path DIR --infinity --params 2B --state-bits 8   # ZeRO-Infinity
    torchrun --nproc-per-node 2 scripts/offload_demo.py --path DIR ...

--infinity (ZeRO-Infinity): stage 3 with the parameter and gradient shards on disk too
(OffloadPolicy("disk", DIR, params="disk")), the GPT built on the meta device and initialized once
ZeroAdam has sharded it (GPT.init_weights through the guard: [Note: models built on the meta device]
in zerofast/model_setup.py), so no rank ever holds the model: what stays resident is the units in
flight, the window and torch's own. At 2B parameters, bf16 and --state-bits 8 the files take about 32
GB (2 + 2 bytes of shards and 2 x 6 of state per parameter).

At the default 1B parameters the files take 24 GB (DIR needs that much free) and the process about
6 GiB of memory at its peak; on a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX) bf16
matmuls are two orders of magnitude slower than fp32 ones, so the default batch is one sequence of 4
tokens. Measured: docs/benchmarks.md#offload.

A GPT (zerofast.tools.models.make_gpt, width 1024 from 50M parameters up, 256 below) built directly
in bf16 (torch's default dtype set to bf16 while it is built, so that no fp32 copy of the model ever
exists), trained by ZeroAdam (stage 2 by default: building stage 3 holds more at once) with bf16
mixed precision and OffloadPolicy("disk", DIR): the fp32 master and Adam's two moments (12 bytes per
parameter per generation; two generations of files, 24 bytes per parameter, for the all-or-none
step) live in files under DIR, streamed through a window of --window-mb MiB. What stays resident:
the bf16 parameters and gradients (2 + 2 bytes per parameter), the window, activations, and torch's
own half GiB. One fixed batch per rank, so the loss falls within a few steps.

Printed: each step's loss and time (and phase 3's, the pass over the files), the state's bytes on
disk (one generation, and both: the files' total, as the report gives it and as the filesystem
holds it), the process's peak resident memory (VmHWM from /proc/self/status): the whole run's, and
the training's alone (VmHWM restarted through /proc/self/clear_refs once ZeroAdam is built; at
stage 2 building holds no more than training: a parameter's own storage is freed as it moves into
the flat buffers, and the gradient shard is allocated after that), and the ratios of the state on disk to both. The process asks glibc to serve blocks of 1 MiB and more by
mmap (--mmap-threshold-mb; see mmap_threshold()), so that what backward frees goes back to the
system. With --compare, after those figures are taken, the same model is trained again with its
state in memory and the losses are compared (they are bitwise the same: the offloaded step runs the
same kernel on the same elements; the state in memory costs 12 bytes per parameter of RAM, so use it
at a small --params).

Without torchrun the script initialises a gloo group of one process itself. The optimizer's files
are removed when it is (at exit at the latest); DIR itself is left.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import time

import torch
import torch.distributed as dist

from zerofast import MixedPrecisionPolicy, OffloadPolicy, ZeroAdam
from zerofast.tools.models import make_gpt, random_batch

HYPER = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def count(text: str) -> int:
    """'400M', '1.5B', '25000000' -> an integer."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    last = text[-1].upper()
    return int(float(text[:-1]) * scale[last]) if last in scale else int(text)


def shape(params: int) -> dict:
    """GPT dimensions for about `params` parameters: width 1024 (16 heads) from 50M up, else 256
    (8 heads); as many blocks (12 x width^2 parameters each) as that takes."""
    width, heads = (1024, 16) if params >= 50_000_000 else (256, 8)
    return dict(n_embd=width, n_head=heads, n_layer=max(1, round(params / (12 * width**2))))


def mmap_threshold(mib: float) -> bool:
    """glibc only: serve every allocation of `mib` MiB or more by its own mmap (M_MMAP_THRESHOLD), so
    that a freed one goes back to the system at once. Without it, glibc raises the threshold to the
    size of the first large block freed and serves later ones from its heap, which keeps what backward
    freed (each parameter's gradient before its bucket copy): measured at 1B parameters, 0.9 GiB
    more resident memory in training. False where it could not be set (another C library)."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, int(mib * 2**20)) == 1  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmHWM: the peak resident set, VmRSS: the current)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> bool:
    """Restart VmHWM at the current resident set (Linux: /proc/self/clear_refs); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def files_on_disk(folder: str) -> tuple[int, int]:
    """(apparent size, allocated bytes) of the files under `folder`."""
    size = allocated = 0
    for d, _, names in os.walk(folder):
        for n in names:
            st = os.stat(os.path.join(d, n))
            size += st.st_size
            allocated += st.st_blocks * 512
    return size, allocated


def init_group() -> tuple[int, int]:
    if "RANK" not in os.environ:  # one process, no launcher
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def build(args, offload):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters created and initialised in bf16: no fp32 model
    meta = args.infinity and offload is not None
    try:
        with torch.device("meta" if meta else "cpu"):  # meta: no values until ZeroAdam has sharded it
            model = make_gpt("small", seed=0, **shape(count(args.params)))
    finally:
        torch.set_default_dtype(previous)
    precision = MixedPrecisionPolicy(torch.bfloat16, state_bits=args.state_bits)
    opt = ZeroAdam(model, stage=args.stage, mixed_precision=precision, offload=offload, lr=args.lr, **HYPER)
    if meta:
        torch.manual_seed(0)
        model.init_weights()  # each rank writes its pieces of the shards and the master, unit by unit
    return model, opt


def train(model, opt, args, rank, log):
    x, y = random_batch(model.cfg, args.batch, args.seq, seed=rank)  # one fixed batch per rank
    losses = []
    for step in range(args.steps):
        t = time.perf_counter()
        _, loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        off = opt.report().offload
        phase3 = f", phase 3 {off.phase3_seconds:.2f} s" if off.state == "disk" else ""
        log(f"step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - t:.2f} s{phase3})")
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="folder for the optimizer state's files (a local disk)")
    parser.add_argument("--params", default="1B", help="about how many parameters (default 1B)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stage", type=int, default=2, choices=(2, 3))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-6, help="AdamW's learning rate (default 5e-6)")
    parser.add_argument("--window-mb", type=float, default=OffloadPolicy.window_mb)
    parser.add_argument("--io-threads", type=int, default=OffloadPolicy.io_threads)
    parser.add_argument(
        "--direct-io",
        type=int,
        choices=(0, 1),
        default=int(OffloadPolicy.direct_io),
        help=f"OffloadPolicy.direct_io: 1 O_DIRECT, 0 the page cache (default {int(OffloadPolicy.direct_io)})",
    )
    parser.add_argument(
        "--mmap-threshold-mb",
        type=float,
        default=1.0,
        help="glibc's M_MMAP_THRESHOLD in MiB, so that freed blocks return to the system (0: glibc's default)",
    )
    parser.add_argument("--compare", action="store_true", help="then train again in memory, compare the losses")
    parser.add_argument(
        "--infinity", action="store_true", help="stage 3, the parameter and gradient shards on disk, built on meta"
    )
    parser.add_argument("--state-bits", type=int, default=32, choices=(32, 8), help="Adam's moments (default 32)")
    args = parser.parse_args()
    if args.infinity:
        args.stage = 3

    tuned = args.mmap_threshold_mb > 0 and mmap_threshold(args.mmap_threshold_mb)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    rank, world = init_group()

    def log(text):
        if rank == 0:
            print(text, flush=True)

    start_rss = status("VmRSS")
    policy = OffloadPolicy(
        "disk",
        args.path,
        window_mb=args.window_mb,
        io_threads=args.io_threads,
        direct_io=bool(args.direct_io),
        params="disk" if args.infinity else None,
    )
    model, opt = build(args, policy)
    n = sum(p.numel() for p in model.parameters())
    cfg = model.cfg
    log(
        f"GPT {n / 1e6:.1f}M parameters (width {cfg.n_embd}, {cfg.n_layer} blocks), bf16 mixed precision, "
        f"ZeroAdam stage {args.stage}, {world} rank(s), {args.state_bits}-bit state, state "
        + ("and stage 3's parameter and gradient shards " if args.infinity else "")
        + f"on disk under {args.path} "
        f"(window {args.window_mb:g} MiB, {args.io_threads} I/O threads, direct_io={bool(args.direct_io)}); "
        "glibc's mmap threshold " + (f"{args.mmap_threshold_mb:g} MiB" if tuned else "its default")
    )
    built_peak, built = status("VmHWM"), status("VmRSS")
    training_peak = reset_peak()  # from here VmHWM is the training's peak (the whole run's is kept above)
    losses = train(model, opt, args, rank, log)

    report = opt.report()
    off, mem = report.offload, report.memory
    size, allocated = files_on_disk(off.folder)
    # VmHWM since reset_peak(): the training's peak (ru_maxrss restarts with it on Linux, so the whole
    # run's peak is the larger of the two VmHWM readings)
    train_peak = status("VmHWM") if training_peak else None
    peak = max(built_peak, status("VmHWM"))
    one = off.disk_bytes // 2
    shards = (off.params_disk_bytes, *files_on_disk(off.params_folder)) if off.params_folder else None
    figures = dict(
        shards=shards,
        resident_shards=off.params_resident_bytes,
        one=one,
        files=off.disk_bytes,
        size=size,
        allocated=allocated,
        peak=peak,
        built_peak=built_peak,
        built=built,
        train_peak=train_peak,
        start=start_rss,
        window=off.window_bytes,
        params=mem.params,
        grads=mem.grads + mem.grad_shard,
        io=(off.read_bytes, off.write_bytes, off.phase3_seconds),
    )
    every = [None] * world
    dist.all_gather_object(every, figures)
    gib = 2**30
    if rank == 0:
        print()
        for r, f in enumerate(every):
            read, write, p3 = f["io"]
            print(
                f"rank {r}: optimizer state on disk: {f['one'] / gib:.2f} GiB per generation, {f['files'] / gib:.2f} GiB "
                f"in both (files: {f['size'] / gib:.2f} GiB apparent, {f['allocated'] / gib:.2f} GiB allocated)"
            )
            if f["shards"] is not None:
                nbytes, size, allocated = f["shards"]
                total = f["files"] + nbytes
                print(
                    f"rank {r}: parameter and gradient shards on disk: {nbytes / gib:.2f} GiB (files: {size / gib:.2f} "
                    f"GiB apparent, {allocated / gib:.2f} GiB allocated; {f['resident_shards'] / 2**20:.1f} MiB of them "
                    f"resident now); with the state {total / gib:.2f} GiB on disk, "
                    f"{total / f['peak']:.1f}x the process's peak resident memory"
                )
            print(
                f"rank {r}: peak resident memory of the whole process {f['peak'] / gib:.2f} GiB (VmHWM): "
                f"{f['start'] / gib:.2f} GiB before the model was built, "
                f"{f['built_peak'] / gib:.2f} GiB at its peak while the model and ZeroAdam were built "
                f"({f['built'] / gib:.2f} GiB once built)"
            )
            if f["train_peak"] is not None:
                print(
                    f"rank {r}: peak resident memory while training (VmHWM restarted after ZeroAdam was built) "
                    f"{f['train_peak'] / gib:.2f} GiB; of it bf16 parameters {f['params'] / gib:.2f} GiB, gradients "
                    f"{f['grads'] / gib:.2f} GiB, the window {f['window'] / gib:.3f} GiB"
                )
            for what, value in (("the whole process", f["peak"]), ("training", f["train_peak"])):
                if value is not None:
                    print(
                        f"rank {r}: state on disk / peak resident memory of {what}: {f['one'] / value:.2f}x "
                        f"(one generation), {f['files'] / value:.2f}x (both generations, the files' total)"
                    )
            print(
                f"rank {r}: last step's phase 3: read {read / 1e9:.2f} GB, wrote {write / 1e9:.2f} GB in {p3:.2f} s "
                f"({(read + write) / p3 / 1e9:.2f} GB/s)"
            )
        print(f"losses: {' '.join(f'{v:.4f}' for v in losses)}")

    if args.compare:
        del opt, model  # its files removed
        model, opt = build(args, None)
        log("the same model, its state in memory:")
        again = train(model, opt, args, rank, log)
        same = again == losses
        diff = max(abs(a - b) for a, b in zip(again, losses))
        log(f"losses {'bitwise equal' if same else f'differ (max {diff:.3g})'} to the offloaded run's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
