"""`python -m zerofast.estimate`: the estimator's command line. Per-rank memory of DDP and ZeRO
stages 1-3 (the ZeRO paper's table), the bytes each step moves on each link, and (--time) the
step-time model; the arithmetic is the library's (zerofast/estimate/)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..config import CommPolicy, MixedPrecisionPolicy, OffloadPolicy, precision_policy
from ..estimate.memory import MemoryEstimate, estimate_memory
from ..estimate.timemodel import Cluster, Link, link_of, step_time
from ..estimate.traffic import traffic_ops
from ..quant import STATE_BITS
from .quantities import format_bytes, format_seconds, parse_count, parse_rate, parse_seconds


def format_table(rows: list[MemoryEstimate]) -> str:
    """Bytes per rank by kind; a column for the models sharded for inference only when any are.
    With the optimizer state offloaded the total is the device's, and host and disk follow it."""
    frozen = any(r.frozen_models for r in rows)
    offload = any(r.placement != "device" or r.params_placement != "device" for r in rows)
    head = f"{'':10s} {'params':>12s} {'grads':>12s} {'optimizer':>12s} {'zerofast+':>12s}"
    head += f" {'frozen models':>14s}" if frozen else ""
    head += f" {'device':>12s} {'host':>12s} {'disk':>12s}" if offload else f" {'total':>12s}"
    lines = [head]
    for r in rows:
        name = "DDP" if r.stage == 0 else f"stage {r.stage}"
        lines.append(
            f"{name:10s} {format_bytes(r.params):>12s} {format_bytes(r.grads):>12s} {format_bytes(r.optimizer):>12s} "
            f"{format_bytes(r.zerofast_extra):>12s}"
            + (f" {format_bytes(r.frozen_models):>14s}" if frozen else "")
            + f" {format_bytes(r.total):>12s}"
            + (f" {format_bytes(r.host_bytes):>12s} {format_bytes(r.disk_total):>12s}" if offload else "")
        )
    return "\n".join(lines)


def _link_table(
    params: int, world: int, stages, shard_size, precision, backend: str, gpus_per_node: int, offload=None, pp=1
) -> str:
    """Bytes per GPU per step of each collective, and the link it crosses (ranks numbered node by node).
    params: a stage's part (a tp rank's); world: a stage's data-parallel ranks; pp: the stages, "pp"
    outermost (the step's all_reduces over "pp" cross nodes unless the whole world fits one)."""
    cluster = Cluster(gpus_per_node=gpus_per_node)
    k = world if shard_size is None else shard_size
    lines = [f"{'':10s} {'collective':28s} {'bytes/GPU/step':>15s}  link"]
    for s in stages:
        if s == 0:
            continue
        totals: dict[str, list] = {}  # stage 3's forward and backward gathers: one row
        for op in traffic_ops(
            params,
            world * pp,
            s,
            mixed_precision=precision,
            backend=backend,
            offload=offload if s == 3 else _without_params(offload),
            comm=CommPolicy(shard_size=shard_size),
            pp=pp,
        ):
            link = link_of(op.group, world * pp if op.group == "pp" else world, k, cluster)
            row = totals.setdefault(op.key, [0, link.name])
            row[0] += op.nbytes
        for key, (nbytes, link) in totals.items():
            lines.append(f"{'stage ' + str(s):10s} {key:28s} {format_bytes(nbytes):>15s}  {link}")
    return "\n".join(lines)


def _time_table(args, p) -> str:
    cluster = Cluster(
        gpus_per_node=args.gpus_per_node,
        intra=Link("intra-node", args.intra_bw, args.intra_latency),
        inter=Link("inter-node", args.inter_bw, args.inter_latency),
        flops=args.tflops * 1e12,
    )
    if args.global_tokens is not None:
        tokens = args.global_tokens // args.world
    else:
        tokens = args.tokens_per_rank
    sizes = [args.shard_size] if args.shard_size is not None else [None]
    g = args.gpus_per_node
    dp, node = args.world // args.tp // args.pp, g // args.tp  # with --tp, K counts the data-parallel ranks: a node's
    if args.shard_size is None and args.world > g and g % args.tp == 0 and dp % node == 0:
        sizes.append(node)  # flat against hybrid with a node per shard group
    stages = [args.stage] if args.stage is not None else [1, 2, 3]
    head = (
        f"{'':8s} {'K':>5s} {'intra B':>10s} {'inter B':>10s} {'intra t':>9s} {'inter t':>9s} "
        f"{'compute':>9s} {'exposed':>9s} {'step':>9s} {'mem/GPU':>10s}"
    )
    lines = [
        f"Φ = {args.params:,}, W = {args.world} GPUs ({g} per node), {tokens:,} tokens/GPU/step, "
        f"{args.tflops:g} TFLOP/s, intra {args.intra_bw / 1e9:g} GB/s {args.intra_latency * 1e6:g} us, "
        f"inter {args.inter_bw / 1e9:g} GB/s {args.inter_latency * 1e6:g} us, "
        f"{'overlapped' if args.overlap else 'no overlap'}",
    ]
    if args.tp > 1:
        lines.append(
            f"tp {args.tp} x dp {dp}: ZeRO over the dp ranks (K) on 1/{args.tp} of Φ; each of "
            f"{args.layers} layers all_reduces {args.tp} GPUs' tokens x {args.hidden} activations twice in forward "
            f"and twice in backward on the tp group's link, exposed"
        )
    if args.pp > 1:
        lines.append(
            f"pp {args.pp} x {args.micro_batches} micro-batches ({args.stages_per_rank} stage(s) a rank): each stage "
            f"1/{args.pp} of Φ, its gradients reduced once a step; the bubble (P-1)/(V*M) of the compute; each "
            f"micro-batch's tokens x {args.hidden} activations across the stage boundaries (the pp column)"
        )
        head += f" {'pp t':>9s} {'bubble':>9s}"
    lines.append(head)
    tp = {} if args.tp == 1 else {"tp": args.tp, "layers": args.layers, "hidden": args.hidden}
    if args.pp > 1:
        tp.update(pp=args.pp, stages_per_rank=args.stages_per_rank, hidden=args.hidden)
    for s in stages:
        for k in sizes:
            kk = dp if k is None else k
            try:
                t = step_time(
                    args.params,
                    args.world,
                    s,
                    tokens,
                    k,
                    cluster,
                    _PRECISIONS[args.precision],
                    args.backend,
                    args.micro_batches,
                    args.overlap,
                    **tp,
                )
                mem = estimate_memory(
                    -(-args.params // args.pp),  # a stage's part: an even cut
                    args.world,
                    s,
                    mixed_precision=_state_policy(args),
                    frozen_models=args.frozen_models,
                    tp=args.tp,
                    pp=args.pp,
                    comm=CommPolicy(shard_size=k),
                )
            except ValueError as e:
                p.error(str(e))
            lines.append(
                f"{'stage ' + str(s):8s} {kk:>5d} {format_bytes(t.bytes.get('intra-node', 0)):>10s} "
                f"{format_bytes(t.bytes.get('inter-node', 0)):>10s} "
                f"{format_seconds(t.comm.get('intra-node', 0.0)):>9s} "
                f"{format_seconds(t.comm.get('inter-node', 0.0)):>9s} {format_seconds(t.compute):>9s} "
                f"{format_seconds(t.exposed):>9s} {format_seconds(t.step):>9s} {format_bytes(mem.total):>10s}"
                + (f" {format_seconds(t.phases['pp']):>9s} {format_seconds(t.bubble):>9s}" if args.pp > 1 else "")
            )
    return "\n".join(lines)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


_PRECISIONS = {"mixed": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": None}


def _state_policy(args):
    """--precision with --state-bits, as ZeroAdam takes it (the main job builds the same policy):
    8-bit state changes what the optimizer holds, never what a step communicates."""
    name = _PRECISIONS[args.precision]
    if args.state_bits == 32:
        return name
    return MixedPrecisionPolicy(precision_policy(name).param_dtype, state_bits=args.state_bits)


def _offload_policy(args):
    """--offload (and --window-mb) as ZeroAdam's OffloadPolicy. The estimate never touches the files,
    so the policy's path, which "disk" requires, is a placeholder."""
    params = args.offload_params
    if args.offload is None and params is None:
        return None
    window = OffloadPolicy.window_mb if args.window_mb is None else args.window_mb
    path = "." if "disk" in (args.offload, params) else None
    return OffloadPolicy(args.offload, path, window_mb=window, params=params)


def _without_params(offload):
    """The policy for a stage 1 or 2 row of the table: the state's placement only."""
    if offload is None or offload.params is None:
        return offload
    return OffloadPolicy(offload.state, offload.path if offload.state == "disk" else None, offload.window_mb)


def _offload_words(args) -> tuple[str, str]:
    """What the title says of --offload, and the line under the table that says where each column is."""
    params = {
        None: ("", ""),
        "host": (", --offload-params host on a CPU model", "; stage 3's shards: nothing moves (host memory already)"),
        "disk": (", stage 3's shards on disk", "; stage 3's parameter, gradient and frozen shards: files on disk"),
    }[args.offload_params]
    title, line = _state_words(args)
    return title + params[0], (line + params[1]).lstrip("; ")


def _state_words(args) -> tuple[str, str]:
    if args.offload is None:
        return "", ""
    if args.offload == "host" and args.device == "cpu":
        return ", --offload host on a CPU model", "host: nothing moves (a CPU model's state is in host memory already)"
    if args.offload == "host":
        return ", state offloaded to host", "host: the optimizer state (fp32 master, moments), pinned"
    window = OffloadPolicy.window_mb if args.window_mb is None else args.window_mb
    return ", state offloaded to disk", (
        f"host: the window (three chunks of every kind of state, in {window:g} MiB); "
        f"disk: the state's files, two generations"
    )


def main(argv=None) -> int:
    def typed(parse, what):
        def f(text):
            try:
                return parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        f.__name__ = what
        return f

    p = argparse.ArgumentParser(
        prog="python -m zerofast.estimate",
        description="Per-rank memory of DDP and ZeRO stages 1-3 by the ZeRO paper's formulas, "
        "the bytes each step moves on each link, and (--time) a step-time model.",
    )
    p.add_argument(
        "--params",
        type=parse_count,
        required=True,
        help="trainable parameters (Φ): 7000000, 7e9, 7.5B, 350M, 1.2T, 125K",
    )
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks (N); with --tp, every rank")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: each rank holds 1/tp of the model and ZeRO shards it over world/tp "
        "ranks; with --time, --layers and --hidden give the activations' traffic on the tp links",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: each rank holds one stage's part, 1/pp of Φ (an even cut), and ZeRO shards it over "
        "world/pp/tp ranks; with --time, --micro-batches (at least pp) and --hidden give the bubble and the "
        "activations between the stages",
    )
    p.add_argument("--stage", type=int, default=None, help="one stage (0 = DDP, 1, 2, 3); default: all")
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="hybrid sharding: the state is sharded over K consecutive ranks and replicated world/K "
        "times (ZeroAdam's shard_size; default: world, flat ZeRO); with --tp K counts the data-parallel "
        "ranks (the mesh's 'dp' dim) of world/tp",
    )
    p.add_argument(
        "--precision",
        default="mixed",
        help="mixed or bf16 (2+2+12 bytes), fp16 (the same), or fp32 (4+4+8); default mixed",
    )
    p.add_argument(
        "--state-bits",
        type=int,
        default=32,
        help="Adam's moments in 32 bits (default) or 8 (one byte per element plus a scale per block: "
        "MixedPrecisionPolicy(state_bits=8), the main job's --state-bits)",
    )
    p.add_argument(
        "--frozen-models",
        type=parse_count,
        nargs="+",
        default=[],
        metavar="COUNT",
        help="models sharded for inference only beside the trained one (zerofast.shard_frozen: a reference "
        "or reward model), each by its parameter count, e.g. --frozen-models 7B 7B",
    )
    p.add_argument(
        "--offload",
        choices=("host", "disk"),
        default=None,
        help="where the optimizer state (fp32 master, moments, 8-bit scales) lives: pinned host memory or files "
        "on disk (ZeroAdam's offload=); default: on the device, with the parameters",
    )
    p.add_argument(
        "--offload-params",
        choices=("host", "disk"),
        default=None,
        help="stage 3: where the parameter and gradient shards live (OffloadPolicy(params=...), ZeRO-Infinity; a "
        "CPU model: --device cpu); the table's disk column counts their files",
    )
    p.add_argument(
        "--window-mb",
        type=float,
        default=None,
        help=f"--offload disk: MiB of state in host memory at once per rank (OffloadPolicy.window_mb, "
        f"default {OffloadPolicy.window_mb:g})",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="what the model trains on (default cuda): --offload host on a CPU model moves nothing",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="ZeroAdam's CommPolicy.bucket_mb, stages 1 and 2 (default 25 for stage 1, 8 for stage 2)",
    )
    p.add_argument(
        "--bucket-buffers",
        type=int,
        default=CommPolicy.bucket_buffers,
        help=f"ZeroAdam's CommPolicy.bucket_buffers (default {CommPolicy.bucket_buffers}; 0: no bound)",
    )
    p.add_argument("--backend", default="nccl", help="nccl (default) or gloo: which collectives each layout uses")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: which groups stay on one node (8)")
    t = p.add_argument_group("step time (--time): see [Note: the time model] in zerofast/estimate/timemodel.py")
    t.add_argument("--time", action="store_true", help="predict communication and step time, flat against hybrid")
    t.add_argument("--tokens-per-rank", type=int, default=16384, help="tokens per GPU per step (default 16384)")
    t.add_argument(
        "--global-tokens",
        type=parse_count,
        default=None,
        help="tokens per step over all GPUs instead (a fixed global batch: 4M, 2e6)",
    )
    t.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="backwards per step (default 1; with --pp, pp: the fewest 1F1B takes)",
    )
    t.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        help="--time --pp: pipeline stages on each rank (interleaved schedules: the bubble shrinks as many times)",
    )
    t.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU (default 400)")
    t.add_argument(
        "--intra-bw",
        type=typed(parse_rate, "bandwidth"),
        default=parse_rate("300GB/s"),
        help="intra-node bus bandwidth per GPU (default 300GB/s, NVLink)",
    )
    t.add_argument(
        "--intra-latency",
        type=typed(parse_seconds, "latency"),
        default=parse_seconds("5us"),
        help="intra-node latency per hop (default 5us)",
    )
    t.add_argument(
        "--inter-bw",
        type=typed(parse_rate, "bandwidth"),
        default=parse_rate("400Gb/s"),
        help="inter-node bandwidth per GPU (default 400Gb/s = 50 GB/s)",
    )
    t.add_argument(
        "--inter-latency",
        type=typed(parse_seconds, "latency"),
        default=parse_seconds("10us"),
        help="inter-node latency per hop (default 10us)",
    )
    t.add_argument("--layers", type=int, default=None, help="--time --tp: the model's transformer layers")
    t.add_argument("--hidden", type=int, default=None, help="--time --tp or --pp: the model's hidden size")
    t.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="every collective exposed (communication and compute share the same cores)",
    )
    args = p.parse_args(argv)
    if args.params < 0:
        p.error(f"--params must be 0 or more; got {args.params}")
    if args.world < 1:
        p.error(f"--world must be at least 1; got {args.world}")
    if args.stage is not None and args.stage not in (0, 1, 2, 3):
        p.error(f"--stage must be 0 (DDP), 1, 2 or 3; got {args.stage}")
    if args.shard_size is not None and args.shard_size < 1:
        p.error(f"--shard-size must be at least 1; got {args.shard_size}")
    if args.tp < 1 or args.world % args.tp:
        p.error(f"--tp must be at least 1 and divide --world ({args.world}); got {args.tp}")
    if args.pp < 1 or (args.world // args.tp) % args.pp:
        p.error(f"--pp must be at least 1 and divide --world / --tp ({args.world // args.tp}); got {args.pp}")
    dp = args.world // args.tp // args.pp  # the ranks --shard-size groups: with --tp or --pp, the data-parallel ones
    if args.shard_size is not None and (args.shard_size > dp or dp % args.shard_size):
        over = "".join(f" / {flag}" for flag, n in (("--tp", args.tp), ("--pp", args.pp)) if n > 1)
        with_ = " or ".join(flag for flag, n in (("--tp", args.tp), ("--pp", args.pp)) if n > 1)
        ranks = f"the data-parallel ranks (--world{over} = {dp}) with {with_}" if over else f"--world {dp}"
        p.error(
            f"--shard-size {args.shard_size} must divide {ranks} (the ranks form groups of shard_size "
            f"consecutive ranks)"
        )
    if args.precision not in _PRECISIONS:
        p.error(f"--precision must be mixed, bf16, fp16 or fp32; got {args.precision!r}")
    if args.state_bits not in STATE_BITS:
        p.error(f"--state-bits must be 32 or 8; got {args.state_bits}")
    if args.backend not in ("nccl", "gloo"):
        p.error(f"--backend must be nccl or gloo; got {args.backend!r}")
    if args.gpus_per_node < 1:
        p.error(f"--gpus-per-node must be at least 1; got {args.gpus_per_node}")
    if args.micro_batches is None:
        args.micro_batches = args.pp
    if args.micro_batches < args.pp:
        p.error(
            f"--micro-batches must be at least {args.pp} (with --pp {args.pp}: one a stage in flight); "
            f"got {args.micro_batches}"
            if args.pp > 1
            else f"--micro-batches must be at least 1; got {args.micro_batches}"
        )
    if args.stages_per_rank < 1 or (args.stages_per_rank > 1 and args.pp == 1):
        p.error(f"--stages-per-rank must be at least 1, and more only with --pp; got {args.stages_per_rank}")
    if not args.tflops > 0:
        p.error(f"--tflops must be > 0; got {args.tflops}")
    if args.global_tokens is not None and args.global_tokens < args.world:
        p.error(f"--global-tokens must be at least --world ({args.world}); got {args.global_tokens}")
    if args.tokens_per_rank < 1:
        p.error(f"--tokens-per-rank must be at least 1; got {args.tokens_per_rank}")
    if args.offload_params is not None and args.stage not in (None, 3):
        p.error(f"--offload-params applies to stage 3 (its parameters are sharded); got --stage {args.stage}")
    if args.window_mb is not None and args.offload != "disk":
        p.error(f"--window-mb applies to --offload disk; got --window-mb {args.window_mb:g} without it")
    try:
        offload = _offload_policy(args)
    except ValueError as e:
        p.error(str(e).replace("OffloadPolicy: window_mb", "--window-mb"))
    try:
        comm = CommPolicy(bucket_mb=args.bucket_mb, bucket_buffers=args.bucket_buffers)
    except ValueError as e:
        p.error(
            str(e)
            .replace("CommPolicy: bucket_mb", "--bucket-mb")
            .replace("CommPolicy: bucket_buffers", "--bucket-buffers")
        )
    if args.tp > 1 and args.time:
        for flag, value in (("--layers", args.layers), ("--hidden", args.hidden)):
            if value is None or value < 1:
                p.error(
                    f"--time --tp needs the model's --layers and --hidden (each layer's tokens x hidden activations "
                    f"cross the tp links); got {flag} {value}"
                )
    if args.pp > 1 and args.time and (args.hidden is None or args.hidden < 1):
        p.error(
            f"--time --pp needs the model's --hidden (each micro-batch's tokens x hidden activations cross the "
            f"stage boundaries); got --hidden {args.hidden}"
        )
    if not args.time or (args.tp == 1 and args.pp == 1):
        if args.layers is not None or args.hidden is not None:
            p.error("--layers and --hidden apply to --time with --tp (the tp links' traffic) or --pp")
    elif args.tp == 1 and args.layers is not None:
        p.error("--layers applies to --time with --tp (the tp links' traffic)")
    if args.time:
        if args.stage == 0:
            p.error("--time models ZeRO stages 1-3; got --stage 0")
        if args.params < 1:
            p.error("--time needs --params of 1 or more")
        if args.offload is not None:
            p.error("--time models the update on the device; --offload's CPU update and disk I/O are not modelled")
        if args.offload_params is not None:
            p.error("--time models the shards on the device; --offload-params' disk I/O is not modelled")
        print(_time_table(args, p))
        return 0
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    rows = []
    for s in stages:
        # Stage 3 takes no bucket size (its buckets are its units): in the table of every stage the
        # option applies to the others; asked for stage 3 alone, it is ZeroAdam's error.
        stage_comm = CommPolicy(bucket_buffers=comm.bucket_buffers) if s == 3 and args.stage is None else comm
        try:
            rows.append(
                estimate_memory(
                    -(-args.params // args.pp),  # a stage's part: an even cut
                    args.world,
                    s,
                    mixed_precision=_state_policy(args),
                    comm=dataclasses.replace(stage_comm or CommPolicy(), shard_size=args.shard_size),
                    # DDP keeps its state with the parameters; stages 1 and 2 their parameters whole
                    offload=None if s == 0 else offload if s == 3 else _without_params(offload),
                    tp=args.tp,
                    pp=args.pp,
                    frozen_models=args.frozen_models,
                    device=args.device,
                )
            )
        except (ValueError, NotImplementedError) as e:
            p.error(str(e))
    k = f", sharded over K = {args.shard_size} (x{dp // args.shard_size} replicas)" if args.shard_size else ""
    if args.tp > 1:
        k += f", tensor parallel: tp {args.tp} x dp {dp} (each rank 1/{args.tp} of Φ)"
    if args.pp > 1:
        k += f", pipeline: pp {args.pp} (each stage 1/{args.pp} of Φ, an even cut)"
    state = ", 8-bit Adam state" if args.state_bits == 8 else ""
    frozen = f", {len(args.frozen_models)} model(s) sharded for inference only" if args.frozen_models else ""
    where, columns = _offload_words(args)
    print(
        f"Φ = {args.params:,} parameters, N = {args.world} ranks{k}, {args.precision} Adam{state}{frozen}{where}; "
        f"bytes per rank"
    )
    print(format_table(rows))
    if columns:
        print(columns)
    if args.params > 0 and any(s > 0 for s in stages):
        print(f"\nCommunication per step ({args.backend}, {args.gpus_per_node} GPUs per node; a count: no padding)")
        print(
            _link_table(
                _ceil(_ceil(args.params, args.pp), args.tp),  # the dp links move a tp rank's part of a stage
                dp,
                stages,
                args.shard_size,
                _PRECISIONS[args.precision],
                args.backend,
                max(1, args.gpus_per_node // args.tp),  # a node's dp ranks: tp innermost
                offload,
                args.pp,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
