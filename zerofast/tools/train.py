"""The main job: train a small GPT with ZeroAdam on N local ranks and show ZeRO's memory at work.

    python -m zerofast.train --nproc 2 --stage 3 [--partition flat] [--steps N] [--model tiny|small]
                             [--backend gloo|nccl] [--compare] [--plot memory.png]

Without torchrun's environment it launches itself on --nproc local ranks through
torch.distributed.run (the mechanism behind torchrun), so a multi-machine run is
`torchrun --nnodes ... -m zerofast.train`. Faults: every collective waits at most --timeout seconds;
a dead or stuck rank makes the others exit with one line naming the step, the phase and the
collective; with --max-restarts R and --save-dir, torchrun restarts the workers after a failure and
they resume from the newest checkpoint. Trains on text shipped inside the package (zerofast/tools/data.py),
shows a progress bar on rank 0, and ends with a table per rank: parameter, gradient and optimizer
bytes measured next to the ZeRO paper's memory table (Rajbhandari et al., 2020), and the
communication per step next to the paper's 2Φ (stages 1 and 2) / 3Φ (stage 3).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.rendezvous import rendezvous
from torch.distributed.run import main as torchrun_main
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checkpoint import latest, load, save
from ..comm import CollectiveError, OutOfStepError
from ..config import CommPolicy, MixedPrecisionPolicy, precision_policy
from ..estimate import estimate_memory
from ..optim.grads import StepNotAppliedError
from ..optim.zero_adam import ZeroAdam
from ..partition import PARTITIONS
from ..quant import STATE_BITS
from ..reference import ReferenceZero
from . import replica_demo
from .data import corpus_tokens, text_batch
from .models import CONFIGS, make_gpt
from .quantities import format_bytes

log = logging.getLogger("zerofast.train")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerofast.train", description=__doc__.split("\n")[0])
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to launch (default: one per GPU under NCCL, else 2)",
    )
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage 1, 2 or 3 (default 3)")
    p.add_argument("--partition", default="flat", help=f"{', '.join(PARTITIONS)} (default flat)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--model", default="small", help=f"model size: {', '.join(CONFIGS)} (default small)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with GPUs, else gloo)")
    p.add_argument(
        "--mixed-precision", default=None, help="bf16 or fp16 (fp16 with dynamic loss scaling); default fp32"
    )
    p.add_argument(
        "--state-bits",
        type=int,
        default=32,
        help="Adam's moments in 32 bits or 8 (one byte per element plus a scale per block: docs/8bit-state.md)",
    )
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm to this")
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="K",
        help="hybrid sharding: shard within groups of K consecutive ranks (a machine), replicate "
        "across them (default: every rank, flat ZeRO)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the same steps under DDP and the reference stage; print loss differences and step-time ratios",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw measured memory per rank (DDP and stages 1-3) as stacked bars into PNG",
    )
    p.add_argument(
        "--save-dir",
        default=None,
        metavar="DIR",
        help="write a sharded checkpoint (zerofast.checkpoint) into DIR/step-NNNNNN every --save-every "
        "steps and after the last step",
    )
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (default: only at the end)")
    p.add_argument("--keep", type=int, default=None, help="keep only the newest K checkpoints (K >= 2)")
    p.add_argument(
        "--save-async",
        action="store_true",
        help="save in the background: each rank copies its shard and training goes on while a thread "
        "writes it (zerofast.checkpoint.save(blocking=False)); the job waits for the last one",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --save-dir (model, optimizer, step, data "
        "position, RNG), at any world size or stage; start afresh if there is none",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any collective may wait for the other ranks (default 60; the process groups' "
        "timeout): a stuck rank ends the job after this, a dead one at once",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts the workers up to this many times after a failure; with --save-dir they "
        "resume from the newest checkpoint (default 0)",
    )
    replica_demo.add_arguments(p)
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"--timeout must be positive; got {args.timeout}")
    if args.max_restarts < 0:
        p.error(f"--max-restarts must be 0 or more; got {args.max_restarts}")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be at least 1; got {args.nproc}")
    if args.stage not in (1, 2, 3):
        p.error(f"--stage must be 1, 2 or 3; got {args.stage}")
    if args.partition not in PARTITIONS:
        p.error(f"--partition must be one of {', '.join(PARTITIONS)}; got {args.partition!r}")
    if args.steps < 0:
        p.error(f"--steps must be 0 or more; got {args.steps}")
    if args.model not in CONFIGS:
        p.error(f"--model must be one of {', '.join(CONFIGS)}; got {args.model!r}")
    if args.batch < 1:
        p.error(f"--batch must be at least 1; got {args.batch}")
    if not args.lr > 0:
        p.error(f"--lr must be positive; got {args.lr}")
    if args.backend not in (None, "gloo", "nccl"):
        p.error(f"--backend must be gloo or nccl; got {args.backend!r}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        p.error("--backend nccl needs CUDA GPUs; none is visible")
    args.nproc = _resolve_nproc(p, args.nproc, args.backend)
    if args.mixed_precision not in (None, "bf16", "fp16"):
        p.error(f"--mixed-precision must be bf16 or fp16; got {args.mixed_precision!r}")
    if args.state_bits not in STATE_BITS:
        p.error(f"--state-bits must be 32 or 8; got {args.state_bits}")
    if args.shard_size is not None and args.shard_size < 1:
        p.error(f"--shard-size must be at least 1; got {args.shard_size}")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        p.error(f"--max-grad-norm must be positive; got {args.max_grad_norm}")
    if args.resume and args.compare:
        p.error("--compare trains DDP and the reference stage from step 0 beside this run; use it without --resume")
    if args.save_every < 0:
        p.error(f"--save-every must be 0 or more; got {args.save_every}")
    if (args.save_every or args.resume or args.keep is not None or args.save_async) and args.save_dir is None:
        p.error("--save-every, --keep, --save-async and --resume need --save-dir")
    if args.keep is not None and args.keep < 2:
        p.error(f"--keep must be at least 2; got {args.keep}")
    if args.plot is not None:
        try:  # matplotlib is optional: --plot alone needs it
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    replica_demo.check_arguments(p, args)
    return args


def _resolve_nproc(p: argparse.ArgumentParser, nproc: int | None, backend: str | None) -> int:
    """NCCL (asked for, or the default with GPUs) puts each local rank on its own GPU,
    cuda:LOCAL_RANK, and refuses two ranks on one: one rank per visible GPU by default, and more
    is an error here rather than an "invalid device ordinal" in a rank."""
    if backend == "gloo" or (backend is None and not torch.cuda.is_available()):
        return 2 if nproc is None else nproc
    gpus = torch.cuda.device_count()
    if nproc is None:
        return gpus
    if nproc > gpus:
        p.error(
            f"--nproc {nproc} needs {nproc} GPUs under NCCL (one per rank); {gpus} visible. "
            f"Use --nproc {gpus}, or --backend gloo to run the ranks on the CPU"
        )
    return nproc


def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Start `nproc` local ranks running this module, through torch.distributed.run; its agent
    restarts them up to max_restarts times after a failure (they resume: see _resuming)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun_main(
            [
                "--standalone",
                f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}",
                "-m",
                "zerofast.train",
                *_without_nproc(argv),
            ]
        )
    except ChildFailedError:  # the workers said why on stderr; torchrun printed its summary
        return 1
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    """The ranks don't need --nproc, and torchrun's own parser would take it for an abbreviation of
    its --nproc-per-node even after the module name."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


class Progress:
    """A one-line progress bar on rank 0 (stderr), with loss and tokens/s."""

    line_open = False  # the bar's line is drawn and not yet ended: exit_on_fault starts a new one

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.start = total, enabled, time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * (step + 1) / max(1, self.total))
        bar = "#" * done + "." * (width - done)
        sys.stderr.write(f"\r[{bar}] {step + 1}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s")
        Progress.line_open = step + 1 != self.total
        if not Progress.line_open:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _model(args):
    """The GPT of the chosen size, over byte tokens (vocabulary 256) of the shipped text."""
    return make_gpt(args.model, vocab_size=256)


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _make_optimizer(kind: str, model, args, stage: int):
    """kind: "zero" (ZeroAdam at `stage`), "ddp", or "reference" (the reference stage `stage`)."""
    if kind == "ddp":
        wrapped = DDP(model)
        return wrapped, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if kind == "reference":
        return model, ReferenceZero(model, stage=stage, lr=args.lr, weight_decay=0.1)
    return model, ZeroAdam(
        model,
        stage=stage,
        lr=args.lr,
        weight_decay=0.1,
        mixed_precision=_precision(args),
        max_grad_norm=args.max_grad_norm,
        comm=CommPolicy(partition=args.partition, shard_size=args.shard_size),
    )


def _precision(args):
    """ZeroAdam's mixed_precision= from --mixed-precision and --state-bits."""
    if args.state_bits == 32:
        return args.mixed_precision
    return MixedPrecisionPolicy(precision_policy(args.mixed_precision).param_dtype, state_bits=args.state_bits)


def _measure(kind: str, model, opt) -> dict[str, int]:
    """Bytes this rank holds now, counted from the tensors."""
    if isinstance(opt, ZeroAdam):
        r = opt.report().memory
        return {
            "params": r.materialized_params,
            "grads": r.grads + r.grad_shard,
            "optimizer": r.optimizer + r.master_copy,
            "buckets": r.bucket_buffers + r.bucket_pool,
        }
    if hasattr(opt, "memory_held"):  # the reference stage counts its own
        return {**opt.memory_held(), "buckets": 0}
    state = list(opt.state.values())
    return {
        "params": sum(p.nbytes for p in model.parameters()),
        "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "optimizer": sum(s[k].nbytes for s in state for k in ("exp_avg", "exp_avg_sq") if k in s),
        "buckets": 0,
    }


def run(kind: str, args, device, steps: int, progress: bool, stage: int | None = None):
    """Train a fresh model `steps` steps (the main run: from the newest checkpoint with --resume,
    writing checkpoints with --save-dir) with `kind` at `stage` (None: --stage); return losses,
    seconds per step, measured bytes, comm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args).to(device)
    module, opt = _make_optimizer(kind, model, args, args.stage if stage is None else stage)
    tokens = corpus_tokens()
    seq = model.cfg.block_size
    losses, times, measured = [], [], {}
    checkpoints = kind == "zero" and args.save_dir is not None
    start = _resume(args, model, opt, rank) if checkpoints and _resuming(args) else 0
    bar = Progress(steps, progress and rank == 0)
    if progress and rank == 0 and isinstance(opt, ZeroAdam) and opt.plan.params_sharded:
        units = opt.report().units
        largest = max(units, key=lambda u: u.bytes)
        sys.stderr.write(
            f"stage 3: {len(units)} units ({', '.join(u.module or '(root)' for u in units[:3])}"
            f"{', ...' if len(units) > 3 else ''}); the largest, {largest.module or '(root)'}, "
            f"holds {format_bytes(largest.bytes)}\n"
        )
    for step in range(start, steps):
        x, y = text_batch(tokens, args.batch, seq, seed=step * world + rank)  # the data position is the step
        t0 = time.perf_counter()
        _, loss = module(x.to(device), y.to(device))
        if isinstance(opt, ZeroAdam):
            opt.backward(loss)  # scales the loss under fp16
        else:
            loss.backward()
        opt.step()
        if step == steps - 1:
            measured = _measure(kind, model, opt)  # after step(), before zero_grad()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        mean_loss = loss.detach().float()
        try:
            dist.all_reduce(mean_loss)
        except RuntimeError as e:
            raise _job_fault("the loss average", step + 1, args, e) from e
        losses.append(mean_loss.item() / world)
        bar.update(step, losses[-1], args.batch * seq * world / times[-1])
        if checkpoints and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == steps):
            try:
                written = save(
                    os.path.join(args.save_dir, f"step-{step + 1:06d}"),
                    model,
                    opt,
                    keep=args.keep,
                    extra={"step": step + 1, "rng": torch.get_rng_state(), "losses": losses},
                    blocking=not args.save_async,
                )
            except RuntimeError as e:  # its collectives (DCP's, the outcome's broadcast); a disk error is an OSError
                raise _job_fault("saving the checkpoint", step + 1, args, e) from e
            if step + 1 == steps and args.save_async:
                written.wait()  # the last one: complete before the job reports and exits
    comm = opt.report().comm if isinstance(opt, ZeroAdam) else {}
    numel = sum(p.numel() for p in model.parameters())
    if isinstance(opt, ZeroAdam):
        opt.remove_hooks()
    return losses, times, measured, comm, numel


def _job_fault(what: str, step: int, args, error: BaseException) -> CollectiveError:
    """A collective of the job's own (the loss average, a checkpoint's) that failed, in the one-line
    form of ZeroAdam's own (comm.py's BucketComm.failed), which the worker prints before it leaves."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CollectiveError(
        f"zerofast.train (rank {dist.get_rank()} of {dist.get_world_size()}): {what} failed at step {step}: "
        f"another rank died, is stuck or is out of step (the wait is bounded by the process group's timeout, "
        f"{args.timeout:g} s). Backend: {first}"
    )


def _resuming(args) -> bool:
    """--resume, or a restart by torchrun's agent after a failure (TORCHELASTIC_RESTART_COUNT > 0)."""
    return args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _resume(args, model, opt, rank: int) -> int:
    """Load the newest complete checkpoint in --save-dir, if any; the step to continue from."""
    path = latest(args.save_dir)
    if path is None:
        if rank == 0:
            log.info("no checkpoint in %s: starting from step 0", args.save_dir)
        return 0
    extra = load(path, model, opt)
    torch.set_rng_state(extra["rng"])
    if rank == 0:
        log.info("resumed from %s at step %d", path, extra["step"])
    return extra["step"]


def _median(xs):
    xs = sorted(xs[1:] or xs)  # the first step pays for warm-up
    return xs[len(xs) // 2] if xs else float("nan")


def report(args, measured_all, comm, numel, world) -> None:
    est = estimate_memory(numel, world, args.stage, _precision(args), shard_size=args.shard_size)
    p_bytes = 2 if args.mixed_precision else 4
    phi = p_bytes * numel
    moments = "8" if args.state_bits == 32 else "2 + scales"
    table = f"2 + 2 + 4 + {moments}" if args.mixed_precision else f"4 + 4 + {moments}"
    print(
        f"\nper rank, bytes after step() ({args.mixed_precision or 'fp32'}: {table} per parameter; "
        f"estimate = the ZeRO paper's memory table)"
    )
    print(
        f"{'rank':>4s} {'params':>12s} {'(est)':>12s} {'grads':>12s} {'(est)':>12s} "
        f"{'optimizer':>12s} {'(est)':>12s} {'buckets':>10s}"
    )
    for r, m in enumerate(measured_all):
        print(
            f"{r:4d} {m['params']:12,d} {est.params:12,d} {m['grads']:12,d} {est.grads:12,d} "
            f"{m['optimizer']:12,d} {est.optimizer:12,d} {m['buckets']:10,d}"
        )
    paper = 3 if args.stage == 3 else 2
    k = args.shard_size or world
    for group, formula, f_bytes in (("shard", f"{paper}Φ", paper * phi), ("replicate", f"Φ/K = Φ/{k}", phi // k)):
        mine = {name: v for name, v in comm.items() if name.startswith(group + "/")}
        if not mine:
            continue
        moved = sum(v for name, v in mine.items() if not name.split("/")[-1].startswith("all_reduce_"))
        where = (
            ("within each group of K ranks" if group == "shard" else "across machines, between the replicas")
            if k != world
            else "between all ranks"
        )
        print(
            f"communication per step, {group} ({where}): {moved:,d} bytes = {moved / phi:.2f} Φ (formula: "
            f"{formula} = {f_bytes:,d}; Φ = {phi:,d} bytes of {args.mixed_precision or 'fp32'} parameters)  "
            f"by collective: {mine}"
        )


def plot(path: str, rows: dict[str, list[dict]], numel: int, precision: str) -> None:
    import matplotlib  # optional: --plot alone needs it (parse_args checked that it is there)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    world = len(next(iter(rows.values())))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 4), sharey=True)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "buckets": "#8172b3"}
    for ax, name in zip(axes, names):
        bottom = [0.0] * world
        for kind in ("params", "grads", "optimizer", "buckets"):  # buckets: ZeroAdam's buffers and pool
            vals = [m[kind] / 2**20 for m in rows[name]]
            ax.bar(range(world), vals, bottom=bottom, color=colors[kind], label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(name)
        ax.set_xticks(range(world), [f"rank {r}" for r in range(world)])
    axes[0].set_ylabel("MiB per rank (measured)")
    axes[-1].legend(loc="upper right")
    fig.suptitle(f"Memory per rank, measured, Adam (ZeroAdam in {precision}; DDP fp32), Φ = {numel:,} parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """init_process_group from torchrun's environment. After a restart by torchrun's agent
    (TORCHELASTIC_RESTART_COUNT > 0) the rendezvous store can still hold the previous attempt's keys,
    among them the addresses of workers that are gone, and gloo then fails to connect to them
    (measured: "connectFullMesh failed ... Connection refused" on every restart); each attempt gets
    keys of its own under a prefix."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"zerofast/attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def exit_on_fault(error: BaseException) -> None:
    """A collective failed (a rank died or is stuck) or the ranks are out of step: print the one
    line that says where, and leave at once. os._exit, because an orderly interpreter exit can block
    on the process group's threads while a peer is stuck; torchrun then ends (or restarts) the rest."""
    newline = "\n" if Progress.line_open else ""  # not glued to the progress bar's line
    sys.stderr.write(f"{newline}zerofast.train rank {os.environ.get('RANK', '?')}: {error}\n")
    sys.stderr.flush()
    os._exit(1)


def worker(args: argparse.Namespace) -> None:
    try:
        _worker(args)
    except (CollectiveError, OutOfStepError, StepNotAppliedError, dist.DistError) as e:
        exit_on_fault(e)  # dist.DistError: a fault in a checkpoint's collectives (DCP, barriers)


def _worker(args: argparse.Namespace) -> None:
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _init_process_group(backend, timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(backend)
    if rank == 0:
        n = sum(p.numel() for p in _model(args).parameters())
        log.info(
            "training a %s GPT (%.2fM parameters) on %d ranks (%s): ZeroAdam stage %d, %s partition%s",
            args.model,
            n / 1e6,
            world,
            backend,
            args.stage,
            args.partition,
            f", sharded in groups of {args.shard_size}" if args.shard_size not in (None, world) else "",
        )
    losses, times, measured, comm, numel = run("zero", args, device, args.steps, progress=True)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, measured)
    if rank == 0 and losses:
        log.info(
            "loss %.4f -> %.4f over %d steps, %.0f ms per step",
            losses[0],
            losses[-1],
            len(losses),
            1e3 * _median(times),
        )
        if all(everyone):
            report(args, everyone, comm, numel, world)
    if args.compare and args.steps > 0:
        results = {kind: run(kind, args, device, args.steps, progress=False) for kind in ("ddp", "reference")}
        if rank == 0:
            for kind, (other, other_times, *_rest) in results.items():
                diff = max(abs(a - b) for a, b in zip(losses, other))
                log.info(
                    "vs %-9s largest loss difference %.2e; step time ZeroAdam / %s = %.2f%s",
                    kind,
                    diff,
                    kind,
                    _median(times) / _median(other_times),
                    f" ({kind} trains in fp32, ZeroAdam in {args.mixed_precision})" if args.mixed_precision else "",
                )
    if args.plot:
        rows = {}
        for kind, stage, label in (
            ("ddp", None, "DDP"),
            ("zero", 1, "stage 1"),
            ("zero", 2, "stage 2"),
            ("zero", 3, "stage 3"),
        ):
            _, _, m, _, _ = run(kind, args, device, 2, progress=False, stage=stage)
            per_rank: list = [None] * world
            dist.all_gather_object(per_rank, m)
            rows[label] = per_rank
        if rank == 0:
            plot(args.plot, rows, numel, args.mixed_precision or "fp32")
            log.info("wrote %s", args.plot)
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.replica_groups:  # torchft's replica groups: docs/surviving-failures.md
        if "RANK" not in os.environ:
            return replica_demo.run(args, _without_nproc(argv))
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        replica_demo.worker(args)
        return 0
    if "RANK" not in os.environ:
        return launch(argv, args.nproc, args.max_restarts)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
