"""The hybrid-sharding job of tests/test_hybrid.py, launched by torchrun on two "machines" of 2 ranks
each (--nnodes 2, c10d rendezvous on loopback): every case trains the nested model (blocks at
model.backbone.layers[i], tied embedding) 3 steps with ZeroAdam(comm=CommPolicy(shard_size=2)) and with the flat
ZeroAdam, and rank 0 writes what the test compares: every rank's parameters, each step's
report().comm, and a checkpoint saved at (4 ranks, shard_size=2).

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ... tests/jobs/hybrid_job.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared modules
from models import Nested, model_loss  # noqa: E402
from tolerances import HYPER  # noqa: E402
from training import rank_batch, zero_options  # noqa: E402

from zerofast import ZeroAdam  # noqa: E402
from zerofast import checkpoint as ck  # noqa: E402

STEPS = 3
MICRO = 2  # micro-batches per step in the accumulation cases


def train(opt, model, rank, micro: int = 1) -> list[dict]:
    """STEPS steps, each over `micro` micro-batches of this rank's data (the first micro - 1 under
    no_sync); each step's report().comm."""
    stats = []
    for step in range(STEPS):
        for m in range(micro):
            x, y = rank_batch(model, step * micro + m, rank)
            if m < micro - 1:
                with opt.no_sync():
                    (model_loss(model, x, y) / micro).backward()
            else:
                (model_loss(model, x, y) / micro).backward()
        opt.step()
        opt.zero_grad()
        stats.append(opt.report().comm)
    return stats


def run_case(rank, stage, partition, shard_size, micro=1, save=None):
    model = Nested()
    opt = ZeroAdam(model, **zero_options(stage, partition=partition, shard_size=shard_size), **HYPER)
    stats = train(opt, model, rank, micro)
    if save is not None:
        ck.save(save, model, opt)
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    view = opt.checkpoint_view
    layout = view.trainable.layout
    owned = layout.shard_numel(view.facts.shard_rank) * 4  # fp32 gradient shard bytes, padding included
    opt.remove_hooks()
    return dict(params=params, stats=stats, owned=owned, buckets=len(layout.buckets))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {}
    for stage in (1, 2, 3):
        for partition in ("flat", "round_robin"):
            results[stage, partition, 2] = run_case(rank, stage, partition, 2)
            results[stage, partition, None] = run_case(rank, stage, partition, None)
        results[stage, "flat", 4] = run_case(rank, stage, "flat", 4)  # shard_size=W: the flat run, bitwise
        results[stage, "flat", 2, "accumulate"] = run_case(rank, stage, "flat", 2, micro=MICRO)
    results["saved"] = run_case(rank, 2, "round_robin", 2, save=os.path.join(out, "ckpt"))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if rank == 0:
        torch.save(everyone, os.path.join(out, "results.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
