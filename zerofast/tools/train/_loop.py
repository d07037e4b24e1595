"""The main job's training loop: run (a fresh model trained with ZeroAdam, DDP or the reference stage, measuring
each step's time and each rank's bytes, saving and resuming checkpoints), the model, device and optimizer it
builds from the arguments, and _job_fault (the one-line error of a failed collective of the job's own)."""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import checkpoint  # its names import DCP (and DTensor: ~2.5 s a process) when first used
from ...comm import CollectiveError
from ...config import CommPolicy, MixedPrecisionPolicy, precision_policy
from ...optim.base import ZeroOptimizer
from ...optim.zero_adam import ZeroAdam
from ...reference import ReferenceZero
from ..data import corpus_tokens, text_batch
from ..models import LLAMA_CONFIGS, TitanLlama, make_gpt, titan_cut, titan_loss, titan_plan
from ..quantities import format_bytes
from ._progress import Progress

log = logging.getLogger("zerofast.train")

TP_SEQ = 64  # --tp, --pp: the Llama's sequence length (it has no position table to bound it)


def _llama(args) -> bool:
    """--tp and --pp train the Llama (shaped as torchtitan's, whose plan and cut they use)."""
    return bool(getattr(args, "tp", None) or getattr(args, "pp", None))


def _model(args):
    """The GPT of the chosen size, over byte tokens (vocabulary 256) of the shipped text; with --tp or
    --pp the Llama of that size (LLAMA_CONFIGS), whole (run cuts it and parallelizes it)."""
    if _llama(args):
        return TitanLlama(**LLAMA_CONFIGS[args.model])
    return make_gpt(args.model, vocab_size=256)


def mesh_layout(args, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh of --tp N and --pp P over `world` ranks, its shape and dim names: "pp" outermost (each
    stage's ranks consecutive), "tp" innermost (a machine's consecutive ranks), "dp" between; with
    --shard-size K below the data-parallel ranks, "replicate" before "dp", "dp" of size K."""
    pp, tp = getattr(args, "pp", None), getattr(args, "tp", None)
    dp = world // ((pp or 1) * (tp or 1))
    shape, names = ((pp,), ("pp",)) if pp else ((), ())
    if args.shard_size not in (None, dp):
        shape, names = shape + (dp // args.shard_size,), names + ("replicate",)
        dp = args.shard_size
    shape, names = shape + (dp,), names + ("dp",)
    return (shape + (tp,), names + ("tp",)) if tp else (shape, names)


def _mesh(args, device):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = mesh_layout(args, dist.get_world_size())
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def _pipeline_loss(logits, ids):
    """The schedule's loss_fn on the last stage: titan_loss's, from the logits (gathered under --tp)."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
    )


class _Pipeline:
    """--pp: this rank's stage of the cut Llama under torch's Schedule1F1B over --micro-batches
    (zerofast.pipelining.ZeroPipelineStage: [Note: pipeline accumulation]). step(ids) runs the step's
    forwards and backwards and returns the mean loss of its micro-batches on the last stage, else None."""

    def __init__(self, part, mesh, args, device):
        from torch.distributed.pipelining import Schedule1F1B

        from ...pipelining import ZeroPipelineStage

        self.index, self.stages = mesh["pp"].get_local_rank(), args.pp
        stage = ZeroPipelineStage(part, self.index, self.stages, device, group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=_pipeline_loss)

    def step(self, ids):
        first, last = self.index == 0, self.index == self.stages - 1
        losses: list = []
        self.schedule.step(*((ids,) if first else ()), **(dict(target=ids, losses=losses) if last else {}))
        return torch.stack(losses).mean().detach() if last else None


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _make_optimizer(kind: str, model, args, stage: int, mesh=None):
    """kind: "zero" (ZeroAdam at `stage`), "ddp", or "reference" (the reference stage `stage`); mesh:
    --tp's and --pp's, the model already cut to this rank's stage and parallelized over its "tp" dim."""
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
        # With --tp or --pp the mesh's "dp" dim is the shard group (_mesh), which ZeroAdam takes from it.
        comm=CommPolicy(partition=args.partition, shard_size=None if mesh is not None else args.shard_size),
        offload=args.offload,
        process_group=mesh,
    )


def _precision(args):
    """ZeroAdam's mixed_precision= from --mixed-precision and --state-bits."""
    if args.state_bits == 32:
        return args.mixed_precision
    return MixedPrecisionPolicy(precision_policy(args.mixed_precision).param_dtype, state_bits=args.state_bits)


def _offloaded(opt):
    """The optimizer's OffloadReport (where its state lives, the last step's I/O) when --offload placed
    the state away from the parameters' memory; else None."""
    if not (isinstance(opt, ZeroOptimizer) and opt.plan.offload.active):
        return None
    return opt.report().offload


def _measure(kind: str, model, opt) -> dict:
    """Bytes this rank holds now, counted from the tensors; with --offload also "offload", the
    optimizer's OffloadReport (its state is then not in "optimizer")."""
    if isinstance(opt, ZeroOptimizer):
        report = opt.report()
        r = report.memory
        measured = {
            "params": r.materialized_params,
            "grads": r.grads + r.grad_shard,
            "optimizer": r.optimizer + r.master_copy,
            "buckets": r.bucket_buffers + r.bucket_pool,
        }
        if opt.plan.offload.active:
            measured["offload"] = report.offload
        return measured
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
    mesh = _mesh(args, device) if _llama(args) else None
    pp, tp = getattr(args, "pp", None) or 1, getattr(args, "tp", None) or 1
    if mesh is not None and "pp" in mesh.mesh_dim_names:  # this rank's stage, the original names kept
        model = titan_cut(model, mesh["pp"].get_local_rank(), pp)
    if mesh is not None and "tp" in mesh.mesh_dim_names:
        model = titan_plan(model, mesh["tp"])
    module, opt = _make_optimizer(kind, model, args, args.stage if stage is None else stage, mesh)
    pipeline = _Pipeline(model, mesh, args, device) if pp > 1 or getattr(args, "pp", None) else None
    tokens = corpus_tokens()
    seq = TP_SEQ if mesh is not None else model.cfg.block_size
    # The data's rank: a "tp" group's ranks read the same batch ([Note: tensor parallelism]), and so do
    # a pipeline's stages (the first reads the ids, the last the targets); "pp" is outermost and "tp"
    # innermost, so a rank's place among the data-parallel ranks (replicas included) is its place in
    # its stage's ranks over tp.
    data_world = world // (pp * tp)
    data_rank = (rank % (world // pp)) // tp
    losses, times, measured = [], [], {}
    checkpoints = kind == "zero" and args.save_dir is not None
    start = _resume(args, model, opt, rank) if checkpoints and _resuming(args) else 0
    bar = Progress(steps, progress and rank == 0)
    if progress and rank == 0 and isinstance(opt, ZeroOptimizer) and opt.plan.params_sharded:
        units = opt.report().units
        largest = max(units, key=lambda u: u.bytes)
        sys.stderr.write(
            f"stage 3: {len(units)} units ({', '.join(u.module or '(root)' for u in units[:3])}"
            f"{', ...' if len(units) > 3 else ''}); the largest, {largest.module or '(root)'}, "
            f"holds {format_bytes(largest.bytes)}\n"
        )
    for step in range(start, steps):
        x, y = text_batch(tokens, args.batch, seq, seed=step * data_world + data_rank)  # the data position is the step
        t0 = time.perf_counter()
        if pipeline is not None:  # the schedule runs the backwards (scaled under fp16 by the stage)
            loss = pipeline.step(x.to(device))
        elif mesh is not None:
            loss = titan_loss(module, x.to(device))
        else:
            _, loss = module(x.to(device), y.to(device))
        if pipeline is None and isinstance(opt, ZeroOptimizer):
            opt.backward(loss)  # scales the loss under fp16
        elif pipeline is None:
            loss.backward()
        opt.step()
        if step == steps - 1:
            measured = _measure(kind, model, opt)  # after step(), before zero_grad()
            measured["numel"] = sum(p.numel() for p in model.parameters())  # this rank's (its stage's part)
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        # The mean over every rank that computed a loss: all of them, or the last stage's under --pp.
        mean_loss = loss.detach().float() if loss is not None else torch.zeros((), device=device)
        try:
            dist.all_reduce(mean_loss)
        except RuntimeError as e:
            raise _job_fault("the loss average", step + 1, args, e) from e
        losses.append(mean_loss.item() / (world // pp))
        bar.update(
            step, losses[-1], args.batch * seq * data_world / times[-1], _offloaded(opt) if bar.enabled else None
        )
        if checkpoints and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == steps):
            try:
                written = checkpoint.save(
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
    comm = opt.report().comm if isinstance(opt, ZeroOptimizer) else {}
    numel = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
    if isinstance(opt, ZeroOptimizer):
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
    path = checkpoint.latest(args.save_dir)
    if path is None:
        if rank == 0:
            log.info("no checkpoint in %s: starting from step 0", args.save_dir)
        return 0
    extra = checkpoint.load(path, model, opt)
    torch.set_rng_state(extra["rng"])
    if rank == 0:
        log.info("resumed from %s at step %d", path, extra["step"])
    return extra["step"]
