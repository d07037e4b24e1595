"""One case of benchmarks/bench_accelerate.py: `accelerate launch --multi_gpu --num_processes 2
benchmarks/accelerate_bench_job.py SYSTEM OUT`. One custom Accelerate loop (prepare, accumulate, backward,
clip_grad_norm_, step, schedule, zero_grad) with SYSTEM's two lines: ddp (Accelerator, torch AdamW: DDP) or
zero1-3 (ZeroAccelerator, ZeroAdam at that stage). A GPT-2-small-shaped model (124M parameters, from its
config), fp32, sequences of 128 tokens, 1 per rank, accumulation 2. Rank 0 writes OUT.json: the median
optimizer-step time (two micro-batches) after two warm-up steps, and per rank the parameter storage alive
after a step and the peak RSS.
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
from accelerate import Accelerator  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from zerofast.integrations.accelerate import ZeroAccelerator, ZeroAdam  # noqa: E402

hf_logging.set_verbosity_error()
SYSTEM, OUT = sys.argv[1], sys.argv[2]
STEPS, WARMUP, SEQ, ACCUM = 8, 2, 128, 2


def parameter_bytes(model, optimizer) -> int:
    """Parameter storage alive on this rank now, each storage once."""
    if getattr(getattr(optimizer, "plan", None), "params_sharded", False):
        return optimizer.report().memory.materialized_params  # stage 3: shards + gathered units
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def main():
    zero = SYSTEM.startswith("zero")
    accelerator = (ZeroAccelerator if zero else Accelerator)(cpu=True, gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if zero:
        optimizer = ZeroAdam(model, lr=1e-4, stage=int(SYSTEM[-1]))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world = accelerator.num_processes
    data = torch.randint(0, 50257, (STEPS * ACCUM * world, SEQ), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in data], batch_size=1)
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    times, t0 = [], time.perf_counter()
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
    inner = getattr(optimizer, "optimizer", optimizer)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    mine = {"param_bytes": parameter_bytes(model, inner), "peak_rss": peak}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if accelerator.is_main_process:
        with open(OUT + ".json", "w") as f:
            json.dump(
                {"step_s": statistics.median(times[WARMUP:]), "ranks": everyone, "wrapped": type(model).__name__}, f
            )
    accelerator.end_training()  # the process group destroyed: the job ends cleanly


main()
