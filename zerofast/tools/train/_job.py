"""One rank of the main job and its entry point: worker (train, report, compare, plot; a fault ends
it through exit_on_fault, one line on stderr) and main (launch the ranks, or be one of them, or hand
over to torchft's replica groups)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ...comm import CollectiveError, OutOfStepError
from ...offload import OffloadError
from ...optim.grads import StepNotAppliedError
from .. import replica_demo
from ._args import parse_args
from ._launch import _init_process_group, _without_nproc, launch
from ._loop import _device, _llama, _model, mesh_layout, run
from ._plot import plot
from ._progress import Progress
from ._report import _median, report

log = logging.getLogger("zerofast.train")


def exit_on_fault(error: BaseException) -> None:
    """A collective failed (a rank died or is stuck), the ranks are out of step, or --offload's files
    failed: print the one line that says where (with the error's notes: an offloaded step applied on
    no rank says so in one), and leave at once. os._exit, because an orderly interpreter exit can block
    on the process group's threads while a peer is stuck; torchrun then ends (or restarts) the rest."""
    newline = "\n" if Progress.line_open else ""  # not glued to the progress bar's line
    notes = "".join(f" {note}" for note in getattr(error, "__notes__", ()))
    sys.stderr.write(f"{newline}zerofast.train rank {os.environ.get('RANK', '?')}: {error}{notes}\n")
    sys.stderr.flush()
    os._exit(1)


def worker(args: argparse.Namespace) -> None:
    try:
        _worker(args)
    except (CollectiveError, OutOfStepError, StepNotAppliedError, OffloadError, dist.DistError) as e:
        # dist.DistError: a fault in a checkpoint's collectives (DCP, barriers); OffloadError: --offload's
        # folder or files (the other ranks then raise StepNotAppliedError or wait on the first collective)
        exit_on_fault(e)


def _worker(args: argparse.Namespace) -> None:
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _init_process_group(backend, timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(backend)
    if rank == 0:
        n = sum(p.numel() for p in _model(args).parameters())
        log.info(
            "training a %s %s (%.2fM parameters) on %d ranks (%s): ZeroAdam stage %d, %s partition%s%s%s%s%s",
            args.model,
            "Llama" if _llama(args) else "GPT",
            n / 1e6,
            world,
            backend,
            args.stage,
            args.partition,
            f", sharded in groups of {args.shard_size}"
            if args.shard_size not in (None, world // ((args.tp or 1) * (args.pp or 1)))
            else "",
            f", optimizer state {_where(args.offload)}" if args.offload else "",
            f", tensor parallel over {args.tp} ranks" if args.tp else "",
            f", {args.pp} pipeline stages x {args.micro_batches} micro-batches (1F1B)" if args.pp else "",
            f" ({_mesh_words(args, world)})" if _llama(args) else "",
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
            report(args, everyone, comm, numel, world, device.type)
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
            precision = args.mixed_precision or "fp32"
            if args.offload:  # the bars count the optimizer state that stays with the parameters
                precision += ", its state in host memory" if args.offload == "host" else ", its state on disk"
            plot(args.plot, rows, numel, precision)
            log.info("wrote %s", args.plot)
    if args.offload_default:  # --offload disk: the folder the job chose goes once no rank's files are in it
        gc.collect()  # each optimizer removes its own folder when collected
        with contextlib.suppress(OSError):  # not empty yet: the rank that empties it removes it
            os.rmdir(args.offload[len("disk:") :])
    dist.destroy_process_group()


def _where(offload: str) -> str:
    """Where --offload (resolved: "host" or "disk:PATH") puts the optimizer state, in words."""
    return "in host memory" if offload == "host" else f"on disk under {offload[len('disk:') :]}"


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


def _mesh_words(args, world: int) -> str:
    """--tp's and --pp's mesh in words, innermost first: "tp 2 x dp 2", "tp 2 x dp 1 x replicate 2",
    "dp 2 x pp 2"."""
    shape, names = mesh_layout(args, world)
    return " x ".join(f"{name} {size}" for size, name in reversed(list(zip(shape, names))))
