"""The main job's command line: parse_args (every option, checked, with the job's description from
the package's docstring) and _resolve_nproc (how many local ranks, from the backend and the GPUs)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ...config import offload_policy
from ...partition import PARTITIONS
from ...quant import STATE_BITS
from .. import replica_demo
from ..models import CONFIGS


def parse_args(argv=None) -> argparse.Namespace:
    description = sys.modules[__package__].__doc__.split("\n")[0]  # the package's docstring: the job's
    p = argparse.ArgumentParser(prog="python -m zerofast.train", description=description)
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
        "--offload",
        default=None,
        metavar="host|disk[:PATH]",
        help="where ZeroAdam's optimizer state lives (OffloadPolicy: docs/configuration.md): host (host memory, "
        "stepped by the CPU kernel) or disk (files under PATH, streamed through a bounded window; disk alone: "
        "DIR/offload with --save-dir DIR, else ./offload). Default: with the parameters",
    )
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
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism: train a Llama shaped as torchtitan's under its plan over N ranks (the "
        "innermost of a ('dp', 'tp') mesh), ZeroAdam sharding across the rest (stages 1-3; with "
        "--shard-size K a ('replicate', 'dp', 'tp') mesh, K ranks to a shard)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        metavar="N",
        help="pipeline parallelism: the Llama (as --tp's) cut into N stages as torchtitan cuts it, torch's "
        'Schedule1F1B over --micro-batches, ZeroAdam over each stage\'s data-parallel ranks ("pp" outermost '
        "of the mesh; with --tp and --shard-size as without it)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="--pp: micro-batches a step, at least --pp and dividing --batch (default: --batch)",
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
    if args.tp is not None:
        _check_tp(p, args)
    if args.pp is not None or args.micro_batches is not None:
        _check_pp(p, args)
    args.offload_default = args.offload == "disk"  # the job chose the folder: it removes it once empty
    if args.offload is not None:
        args.offload = _resolve_offload(p, args.offload, args.save_dir)
        if args.replica_groups:
            p.error("--offload applies to the main run; --replica-groups' demo keeps its ZeroAdam's state in memory")
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


def _check_tp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tp N: N divides the ranks and the Llama's heads; what the tensor-parallel run cannot do yet
    (docs/many-machines.md#tensor-parallelism) is named here rather than in a rank."""
    from ..models import LLAMA_CONFIGS

    heads = LLAMA_CONFIGS[args.model]["heads"]
    ranks = _ranks(args)
    if args.tp < 1 or ranks % args.tp or heads % args.tp:
        p.error(
            f"--tp must be at least 1 and divide the ranks ({ranks}) and the {args.model} Llama's "
            f"{heads} heads; got {args.tp}"
        )
    dp = ranks // args.tp
    if args.shard_size is not None and dp % args.shard_size:
        p.error(
            f"--shard-size must divide the data-parallel ranks (--nproc / --tp = {dp}) with --tp; got {args.shard_size}"
        )
    for flag, given in (
        ("--compare", args.compare),
        ("--plot", args.plot),
        ("--replica-groups", args.replica_groups),
    ):
        if given:
            p.error(f"{flag} is not available with --tp yet (docs/many-machines.md#tensor-parallelism)")


def _check_pp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--pp N: N divides the ranks (after --tp) and the Llama's layers; --micro-batches M is at least N
    (1F1B runs one micro-batch per stage in flight) and divides --batch."""
    from ..models import LLAMA_CONFIGS

    if args.pp is None:
        p.error(f"--micro-batches applies to --pp; got --micro-batches {args.micro_batches} without it")
    layers, tp = LLAMA_CONFIGS[args.model]["layers"], args.tp or 1
    ranks = _ranks(args)
    if args.pp < 1 or ranks % (args.pp * tp) or layers % args.pp:
        p.error(
            f"--pp must be at least 1 and divide the ranks ({ranks}{f' / --tp {tp}' if tp > 1 else ''}) and "
            f"the {args.model} Llama's {layers} layers; got {args.pp}"
        )
    dp = ranks // (args.pp * tp)
    if args.shard_size is not None and dp % args.shard_size:
        p.error(f"--shard-size must divide each stage's data-parallel ranks ({dp}) with --pp; got {args.shard_size}")
    if args.micro_batches is None:
        args.micro_batches = args.batch
    if args.micro_batches < args.pp or args.batch % args.micro_batches:
        p.error(
            f"--micro-batches must be at least --pp ({args.pp}) and divide --batch ({args.batch}); "
            f"got {args.micro_batches}"
        )
    for flag, given in (("--compare", args.compare), ("--plot", args.plot), ("--replica-groups", args.replica_groups)):
        if given:
            p.error(f"{flag} is not available with --pp (docs/many-machines.md#pipeline-parallelism)")


def _ranks(args: argparse.Namespace) -> int:
    """Every rank of the job: --nproc's before the launch, torchrun's WORLD_SIZE in a rank (whose
    command line has no --nproc; on several machines the world, not this machine's ranks)."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else args.nproc


def _resolve_offload(p: argparse.ArgumentParser, value: str, save_dir: str | None) -> str:
    """--offload as ZeroAdam's offload= shortcut: "host", or "disk:PATH" with PATH absolute (every rank
    resolves it in the same working directory); "disk" alone: the folder offload/ under --save-dir,
    or under the working directory. The library checks the folder when the optimizer is built."""
    if value == "disk":
        value = "disk:" + os.path.join(save_dir if save_dir is not None else os.curdir, "offload")
    if value.startswith("disk:") and value != "disk:":
        value = "disk:" + os.path.abspath(value[len("disk:") :])
    try:
        offload_policy(value)
    except ValueError:
        p.error(f"--offload must be host, disk or disk:PATH; got {value!r}")
    return value


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
