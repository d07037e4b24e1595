"""benchmarks/bench_lightning.py's launch: `python benchmarks/lightning_bench_job.py OUT` (Lightning's own
launcher starts the second process). On the bench GPT (zerofast.tools.models "small": 6.4M
parameters, batch 8 x 64 per rank, fp32, 2 gloo ranks x 1 thread), in ROUNDS interleaved rounds:
Lightning's DDPStrategy, FSDPStrategy (torch FSDP, fully sharded, each block wrapped) and
ModelParallelStrategy (FSDP2's fully_shard), ZeroStrategy stages 1-3, and ZeroAdam in a hand-written
loop on the same batches (loop1-3: what Lightning adds). Every system: AdamW, STEPS optimizer steps
per fit; a step is timed from on_train_batch_start to on_train_batch_end (forward, backward and
optimizer step). Rank 0 writes OUT.json: each system's step times after WARMUP steps of each round,
or the error that stopped it.
"""

import json
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402

from zerofast import ZeroAdam  # noqa: E402
from zerofast.integrations.lightning import ZeroStrategy  # noqa: E402
from zerofast.tools.models import Block, make_gpt, random_batch  # noqa: E402

OUT = sys.argv[1]
SYSTEMS = (
    sys.argv[2].split(",")
    if len(sys.argv) > 2
    else ["ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3", "loop1", "loop2", "loop3"]
)
STEPS, WARMUP, WORLD = 10, 2, 2
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
BATCH, SEQ = 8, 64
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


class Batches(torch.utils.data.Dataset):
    """STEPS x WORLD fixed batches; the DataLoader's batch_size=None hands each over as it is."""

    def __init__(self, cfg):
        self.items = [random_batch(cfg, BATCH, SEQ, seed=i) for i in range(STEPS * WORLD)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Lit(pl.LightningModule):
    def __init__(self, fsdp2=False):
        super().__init__()
        self.gpt = make_gpt("small")
        self.fsdp2 = fsdp2

    def configure_model(self):
        if self.fsdp2:  # ModelParallelStrategy: the module shards itself, each block then the root
            from torch.distributed.fsdp import fully_shard

            for block in self.gpt.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.gpt, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, index):
        return self.gpt(*batch)[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), **HYPER)


class Clock(pl.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, trainer, module, batch, index):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        self.times.append(time.perf_counter() - self.t0)


def strategy(system):
    if system == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if system == "fsdp":
        return FSDPStrategy(auto_wrap_policy={Block}, process_group_backend="gloo")
    if system == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    return ZeroStrategy(stage=int(system[-1]))


def lightning_run(system):
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy(system),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[clock],
        num_sanity_val_steps=0,
    )
    module = Lit(fsdp2=system == "fsdp2")
    trainer.fit(module, torch.utils.data.DataLoader(Batches(module.gpt.cfg), batch_size=None))
    return clock.times


def own_loop(stage):
    """ZeroAdam at `stage` on the same model and this rank's same batches, no Lightning."""
    rank = dist.get_rank()
    model = make_gpt("small")
    opt = ZeroAdam(model, stage=stage, **HYPER)
    data = Batches(model.cfg)
    times = []
    for step in range(STEPS):
        x, y = data[step * WORLD + rank]  # the DistributedSampler's order (shuffled) does not matter for time
        t0 = time.perf_counter()
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def main():
    results = {s: {"times": []} for s in SYSTEMS}
    for _ in range(ROUNDS):
        for system in SYSTEMS:
            if "error" in results[system]:
                continue
            try:
                times = own_loop(int(system[-1])) if system.startswith("loop") else lightning_run(system)
                results[system]["times"] += times[WARMUP:]
            except Exception as e:  # noqa: BLE001  (a system that cannot run here is reported, with why)
                results[system]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                traceback.print_exc()
    if dist.get_rank() == 0:
        for r in results.values():
            r["step_s"] = statistics.median(r["times"]) if r["times"] else None
        with open(OUT + ".json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
