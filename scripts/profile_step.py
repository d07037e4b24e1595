"""Profile ZeroAdam stage-2 steps on one GPU and report the GPU's idle time inside step().

    torchrun --nproc-per-node 1 scripts/profile_step.py [--out DIR] [--steps N] [--model tiny|small]

One rank (NCCL, world size 1: the reduces are copies, the path and its streams are the real ones),
the small GPT in bf16, clipped. For each profiled step: the time between the end of the last
kernel before the first fused Adam kernel and that kernel's start (the gap between backward and the
update, which [Note: host syncs] in zerofast/optim/host_reads.py keeps down to the agreement's one
read), and the GPU's idle time over the whole step(). Writes a Chrome trace to DIR/step_trace.json.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="small")
    p.add_argument("--backend", default="nccl", help="nccl (the GPU), or gloo on the CPU to rehearse the script")
    args = p.parse_args()
    dist.init_process_group(args.backend)
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from zerofast import CommPolicy, ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt(args.model).to(device)
    opt = ZeroAdam(model, stage=2, mixed_precision="bf16", max_grad_norm=1.0, comm=CommPolicy(bucket_mb=4))
    cfg = model.cfg

    def one_step(step: int) -> None:
        x, y = (t.to(device) for t in random_batch(cfg, 8, cfg.block_size, seed=step))
        _, loss = model(x, y)
        loss.backward()
        with record_function("step()"):
            opt.step()
        opt.zero_grad()

    for step in range(2):  # warm-up: the caching allocator, cuBLAS handles, the pools
        one_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(args.steps):
            one_step(2 + step)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    steps = sorted(e.time_range.start for e in events if e.name == "step()")
    for i, called in enumerate(steps):
        first_adam = next((k for k in kernels if k[0] >= called and "adam" in k[2].lower()), None)
        if first_adam is None:
            print(f"step {i}: no Adam kernel found")
            continue
        before = [k[1] for k in kernels if k[0] < first_adam[0]]
        gap = first_adam[0] - max(before) if before else 0.0
        print(f"step {i}: GPU idle between the last kernel before the update and the first Adam kernel: {gap:.0f} us")
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, "step_trace.json"))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
