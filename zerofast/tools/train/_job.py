"""One rank of the main job and its entry point: worker (train, report, compare, plot; a fault ends
it through exit_on_fault, one line on stderr) and main (launch the ranks, or be one of them, or hand
over to torchft's replica groups)."""

from __future__ import annotations

import argparse
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
from ._loop import _device, _model, run
from ._plot import plot
from ._progress import Progress
from ._report import _median, report

log = logging.getLogger("zerofast.train")


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
            "training a %s GPT (%.2fM parameters) on %d ranks (%s): ZeroAdam stage %d, %s partition%s%s",
            args.model,
            n / 1e6,
            world,
            backend,
            args.stage,
            args.partition,
            f", sharded in groups of {args.shard_size}" if args.shard_size not in (None, world) else "",
            _offload_words(args.offload),
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
            precision = (args.mixed_precision or "fp32") + (
                f", its optimizer state {_offload_words(args.offload)[len(', optimizer state ') :]}"
                if args.offload
                else ""
            )
            plot(args.plot, rows, numel, precision)
            log.info("wrote %s", args.plot)
    dist.destroy_process_group()


def _offload_words(offload: str | None) -> str:
    """--offload in the job's first line: where the optimizer state lives."""
    if offload is None:
        return ""
    if offload == "host":
        return ", optimizer state in host memory"
    return f", optimizer state on disk under {offload[len('disk:') :]}"


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
