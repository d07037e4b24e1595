"""A model cut into pipeline stages, trained with torch's own schedule and ZeroAdam: the loop torch's
pipelining docs write, with `ZeroPipelineStage` for `PipelineStage` (the line marked `# zerofast`).
Runs on the CPU (gloo) or on GPUs (NCCL); pp x dp ranks, "pp" outermost:

    torchrun --nproc-per-node 4 examples/pipeline_example.py --pp 2 --stage 3     # pp 2 x dp 2
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B

from zerofast import ZeroAdam
from zerofast.pipelining import ZeroPipelineStage
from zerofast.tools.models import TitanLlama, titan_cut


def loss_fn(logits, ids):
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (divides the ranks and the layers)")
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage across each pipeline stage's dp ranks")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=4)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    torch.manual_seed(0)  # every rank builds the same model and keeps its stage's layers
    part = titan_cut(TitanLlama(vocab=256, dim=64, heads=4, hidden=128, layers=4).to(device), s, args.pp)
    opt = ZeroAdam(part, stage=args.stage, process_group=mesh, lr=3e-3, max_grad_norm=1.0)
    # zerofast (torch's line: stage = PipelineStage(part, s, args.pp, device, group=...))
    stage = ZeroPipelineStage(part, s, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=loss_fn)

    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (64, 32), generator=g)  # a fixed set of sequences: the loss falls
    for step in range(args.steps):
        ids = data[(step * 8) % 64 : (step * 8) % 64 + 8].roll(d, 0).to(device)  # each dp rank its rows
        losses = []
        if s == 0:
            schedule.step(ids)
        elif s == args.pp - 1:
            schedule.step(target=ids, losses=losses)
        else:
            schedule.step()
        norm = opt.clip_grad_norm_(float("inf"))  # the global norm, over every stage
        opt.step()
        opt.zero_grad()
        if s == args.pp - 1 and d == 0 and step % 5 == 4:
            print(
                f"step {step + 1}: loss {torch.stack(losses).mean().item():.3f}, grad norm {norm.item():.3f}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
