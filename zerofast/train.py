"""The main job: train a small GPT on N local ranks and print the loss per step.

    python -m zerofast.train [--nproc 2] [--stage 2] [--steps 30] [--model small|tiny]

Without torchrun's environment it launches itself on --nproc local ranks through
torch.distributed.run (the mechanism behind torchrun), so a multi-machine run is
`torchrun --nnodes ... -m zerofast.train`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from .data import corpus_tokens, text_batch
from .models import CONFIGS, make_gpt
from .reference import ReferenceZero

log = logging.getLogger("zerofast.train")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerofast.train", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage 1, 2 or 3 (default 2)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--model", default="small", help=f"model size: {', '.join(CONFIGS)} (default small)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with GPUs, else gloo)")
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error(f"--nproc must be at least 1; got {args.nproc}")
    if args.stage not in (1, 2, 3):
        p.error(f"--stage must be 1, 2 or 3; got {args.stage}")
    if args.steps < 0:
        p.error(f"--steps must be 0 or more; got {args.steps}")
    if args.model not in CONFIGS:
        p.error(f"--model must be one of {', '.join(CONFIGS)}; got {args.model!r}")
    if args.batch < 1:
        p.error(f"--batch must be at least 1; got {args.batch}")
    if args.backend not in (None, "gloo", "nccl"):
        p.error(f"--backend must be gloo or nccl; got {args.backend!r}")
    return args


def launch(argv: list[str], nproc: int) -> int:
    """Start `nproc` local ranks running this module, through torch.distributed.run."""
    from torch.distributed.run import main as torchrun_main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun_main(["--standalone", f"--nproc-per-node={nproc}", "-m", "zerofast.train", *argv])
    return 0


def worker(args: argparse.Namespace) -> None:
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = make_gpt(args.model).to(device)
    opt = ReferenceZero(model, stage=args.stage, lr=args.lr, weight_decay=0.1)
    tokens = corpus_tokens()
    seq = model.cfg.block_size
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        log.info("training a %s GPT (%.2fM parameters) on %d ranks (%s), reference stage %d",
                 args.model, n / 1e6, world, backend, args.stage)
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = text_batch(tokens, args.batch, seq, seed=step * world + rank)
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            dt = time.perf_counter() - t0
            log.info("step %3d  loss %.4f  %.0f tok/s", step, mean_loss.item() / world,
                     args.batch * seq * world / dt)
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "RANK" not in os.environ:
        return launch(argv, args.nproc)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
