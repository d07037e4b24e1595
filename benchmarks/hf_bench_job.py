"""One case of benchmarks/bench_hf.py, under torchrun: `python -m torch.distributed.run --standalone
--nproc-per-node 2 benchmarks/hf_bench_job.py SYSTEM TUNING OUT`. SYSTEM: ddp (transformers.Trainer,
which wraps the model in DDP), fsdp2 (Trainer with Accelerate's FSDP plugin, version 2), zero1,
zero2, zero3 (ZeroTrainer), loop1-3 (a hand-written loop with
ZeroAdam at that stage, no Trainer). TUNING: full or lora (peft, r=8 on the attention projections).
A GPT-2-small-shaped model (124M parameters, from its config, random weights), fp32, sequences of
128 tokens, 1 per rank, accumulation 1. Rank 0 writes OUT.json: the median step time after two
warm-up steps, and per rank the parameter storage alive after a step and the peak RSS.
"""

import json
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
SYSTEM, TUNING, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS, WARMUP, SEQ = 8, 2, 128


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        self.x = torch.randint(0, 50257, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


class Clock(TrainerCallback):
    def __init__(self):
        self.times, self.param_bytes = [], 0

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.times.append(time.perf_counter() - self.t0)
        self.param_bytes = parameter_bytes(model, optimizer)


def parameter_bytes(model, optimizer) -> int:
    """Parameter storage alive on this rank now, trainable and frozen, each storage once."""
    if getattr(getattr(optimizer, "plan", None), "params_sharded", False):
        return optimizer.report().memory.materialized_params  # stage 3: shards (frozen too) + gathered units
    seen = {}
    for p in model.parameters():  # DDP, stages 1-2 (their flat buffers), FSDP2 (DTensor locals)
        local = p.to_local() if hasattr(p, "to_local") else p
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def model():
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if TUNING == "lora":
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(
            m,
            LoraConfig(
                r=8,
                lora_alpha=16,
                target_modules=["c_attn", "c_proj"],
                lora_dropout=0.0,
                fan_in_fan_out=True,
                task_type="CAUSAL_LM",
            ),
        )
    return m


def own_loop(stage: int, clock: Clock) -> None:
    """The same model, data and batch in a hand-written loop with ZeroAdam: what ZeroTrainer adds."""
    from zerofast import ZeroAdam

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = model()
    opt = ZeroAdam(m, stage=stage, lr=1e-4, weight_decay=0.0)
    data = Tokens()
    for step in range(STEPS):
        x = data.x[step * world + rank : step * world + rank + 1]
        clock.t0 = time.perf_counter()
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        clock.times.append(time.perf_counter() - clock.t0)
    clock.param_bytes = parameter_bytes(m, opt)


def main():
    clock = Clock()
    if SYSTEM.startswith("loop"):
        own_loop(int(SYSTEM[-1]), clock)
        wrapped, sharded_by_fsdp = "none", False
    else:
        wrapped, sharded_by_fsdp = trainer_run(clock)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    mine = {"param_bytes": clock.param_bytes, "peak_rss": peak}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(OUT + ".json", "w") as f:
            json.dump(
                {
                    "step_s": statistics.median(clock.times[WARMUP:]),
                    "ranks": everyone,
                    "wrapped": wrapped,
                    "fsdp_dtensors": sharded_by_fsdp,
                    "params": sum(p.numel() for p in model().parameters()),
                },
                f,
            )


def trainer_run(clock: Clock):
    with tempfile.TemporaryDirectory() as out:
        kw = dict(
            output_dir=out,
            use_cpu=True,
            ddp_backend="gloo",
            per_device_train_batch_size=1,
            max_steps=STEPS,
            learning_rate=1e-4,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1000,
            dataloader_num_workers=0,
        )
        if SYSTEM == "fsdp2":
            kw.update(
                fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
            )
        args = TrainingArguments(**kw)
        if SYSTEM.startswith("zero"):
            from zerofast.integrations.hf import ZeroTrainer

            trainer = ZeroTrainer(
                model=model(), args=args, train_dataset=Tokens(), zero={"stage": int(SYSTEM[-1])}, callbacks=[clock]
            )
        else:
            trainer = Trainer(model=model(), args=args, train_dataset=Tokens(), callbacks=[clock])
        trainer.train()
        return type(trainer.model_wrapped).__name__, any(hasattr(p, "to_local") for p in trainer.model.parameters())


main()
dist.barrier()
dist.destroy_process_group()
