"""The Hugging Face integration's jobs, run by tests/test_hf.py under torchrun (CPU, gloo) or plain
python: `python tests/jobs/hf_job.py train|resume|sft OUT [STAGE]`. Rank 0 writes OUT/<job>.json and the
tensors the test compares (OUT/<job>-*.pt); the test asserts on them with the suite's tolerances.

Models are built from a config (no download): a 2-layer GPT-2 with tied embeddings for the plain
Trainer, a 2-layer Llama with a word-level tokenizer made here for TRL. Data: fixed random tokens.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared modules
torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from zerofast import CommPolicy  # noqa: E402
from zerofast.integrations.hf import ZeroTrainer  # noqa: E402

hf_logging.set_verbosity_error()
JOB, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("RANK", 0))
STEPS = 4


class TinyLM(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=16, vocab=96, seed=0):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=96,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def arguments(out, **kw):
    """Accumulation 2, clipping 1.0, warmup + linear schedule, weight decay (the Trainer's decay groups)."""
    base = dict(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        dataloader_num_workers=0,
    )
    if "WORLD_SIZE" in os.environ:  # accelerate 1.15 needs a launcher for ddp_backend
        base["ddp_backend"] = "gloo"
    base.update(kw)
    return TrainingArguments(**base)


def logs(trainer):
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def params(trainer, only_trainable=False):
    opt = trainer.optimizer
    gathered = opt.gathered_params() if hasattr(opt, "gathered_params") else torch.no_grad()
    with gathered:
        return {
            n: p.detach().float().clone()
            for n, p in trainer.model.named_parameters()
            if p.requires_grad or not only_trainable
        }


def save(name, value):
    if RANK == 0:
        torch.save(value, os.path.join(OUT, f"{JOB}-{name}.pt"))


def train():
    """Trainer + DDP, then ZeroTrainer stages 1-3 on the same arguments; stage 3 also saves
    checkpoint-2, evaluates, predicts and save_model()s; stage 2 again with its state on disk. Then
    LoRA (peft) with gradient checkpointing, Trainer + DDP against ZeroTrainer stage 3, and the
    adapter it saves."""
    res = {}
    trainer = Trainer(model=gpt2(), args=arguments(os.path.join(OUT, "ddp")), train_dataset=TinyLM())
    trainer.train()
    res["ddp"] = {"logs": logs(trainer), "wrapped": type(trainer.model_wrapped).__name__}
    save("ddp", params(trainer))
    for stage in (1, 2, 3):
        # Stage 3 saves checkpoint-2 and checkpoint-4, in the background (save_async), with the
        # Trainer's rotation (save_total_limit) run after each is complete.
        extra = dict(save_strategy="steps", save_steps=2, save_total_limit=2) if stage == 3 else {}
        # Stage 1 replicates across the 2 ranks (hybrid sharding with shard_size=1): the logged
        # grad_norm must still count each gradient element once, as DDP's does.
        hybrid = {"comm": CommPolicy(shard_size=1)} if stage == 1 else {}
        trainer = ZeroTrainer(
            model=gpt2(),
            args=arguments(os.path.join(OUT, f"stage{stage}"), **extra),
            train_dataset=TinyLM(),
            zero={"stage": stage, **hybrid},
            save_async=stage == 3,
        )
        trainer.train()
        last = os.path.join(OUT, "stage3", f"checkpoint-{STEPS}", "zerofast", "manifest.json")
        complete_at_return = os.path.isfile(last)
        res[stage] = {
            "logs": logs(trainer),
            "wrapped": type(trainer.model_wrapped).__name__,
            "optimizer": type(trainer.optimizer).__name__,
            "eval_loss": trainer.evaluate(TinyLM(n=8, seed=1))["eval_loss"],
            "last checkpoint complete when train() returned": complete_at_return,
        }
        save(f"stage{stage}", params(trainer))
        if stage == 3:
            predictions = trainer.predict(TinyLM(n=4, seed=2)).predictions  # the logits, or a tuple with them
            res[stage]["predictions"] = list((predictions[0] if isinstance(predictions, tuple) else predictions).shape)
            trainer.save_model(os.path.join(OUT, "final"))
            if RANK == 0:
                res[stage]["checkpoint"] = sorted(os.listdir(os.path.join(OUT, "stage3", "checkpoint-2")))
    res["stage2-disk"] = offloaded()
    res["lora"] = lora()
    res["precision"] = precision()
    if RANK == 0:
        with open(os.path.join(OUT, "train.json"), "w") as f:
            json.dump(res, f)


def offloaded():
    """The stage-2 run again with ZeroAdam's optimizer state on disk: zero={"offload": "disk:PATH"}
    passes through to ZeroAdam as every other option does; the test compares it with the run in memory."""
    folder = os.path.join(OUT, "offload")
    trainer = ZeroTrainer(
        model=gpt2(),
        args=arguments(os.path.join(OUT, "stage2-disk")),
        train_dataset=TinyLM(),
        zero={"stage": 2, "offload": f"disk:{folder}"},
    )
    trainer.train()
    offload = trainer.optimizer.report().offload
    save("stage2-disk", params(trainer))
    return {"logs": logs(trainer), "offload": [offload.state, offload.folder.startswith(folder), offload.read_bytes]}


def lora():
    from peft import LoraConfig, get_peft_model

    def peft_model():
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True, task_type="CAUSAL_LM"
        )
        torch.manual_seed(1)
        return get_peft_model(gpt2(), config)

    out = {}
    trainer = Trainer(
        model=peft_model(),
        args=arguments(os.path.join(OUT, "lora-ddp"), gradient_checkpointing=True),
        train_dataset=TinyLM(),
    )
    trainer.train()
    out["ddp"] = logs(trainer)
    save("lora-ddp", params(trainer, only_trainable=True))
    trainer = ZeroTrainer(
        model=peft_model(),
        args=arguments(os.path.join(OUT, "lora"), gradient_checkpointing=True),
        train_dataset=TinyLM(),
        zero={"stage": 3},
    )
    trainer.train()
    out["zero"] = logs(trainer)
    # Stage 3 shards the frozen base too: the parameter storage alive on this rank after training.
    out["param_bytes"] = trainer.optimizer.report().memory.materialized_params
    out["all_bytes"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    out["units"] = len(trainer.optimizer.report().units)
    save("lora-zero", params(trainer, only_trainable=True))
    trainer.save_model(os.path.join(OUT, "lora-adapter"))
    return out


def precision():
    """bf16=True and fp16=True map to ZeroAdam's mixed precision (stage 2): the model in that dtype,
    no autocast and no GradScaler from Accelerate, fp16 with ZeroAdam's loss scale."""
    out = {}
    for flag in ("bf16", "fp16"):
        trainer = ZeroTrainer(
            model=gpt2(),
            args=arguments(os.path.join(OUT, flag), **{flag: True}),
            train_dataset=TinyLM(),
            zero={"stage": 2},
        )
        trainer.train()
        out[flag] = {
            "logs": logs(trainer),
            "dtype": str(next(trainer.model.parameters()).dtype),
            "accelerate": [trainer.accelerator.mixed_precision, trainer.accelerator.native_amp],
            "mixed_precision": trainer.optimizer.plan.mixed_precision,
            "loss_scale": trainer.optimizer.loss_scale,
        }
    return out


def resume():
    """A fresh launch: resume stage 3's checkpoint-2 with the stage given, run to the end."""
    stage = int(sys.argv[3])
    # The same global batch at any world size: 4 samples per micro-batch (2 ranks x 2, or 1 x 4).
    batch = 4 // int(os.environ.get("WORLD_SIZE", 1))
    trainer = ZeroTrainer(
        model=gpt2(),
        args=arguments(os.path.join(OUT, f"resumed{stage}"), per_device_train_batch_size=batch),
        train_dataset=TinyLM(),
        zero={"stage": stage},
    )
    trainer.train(resume_from_checkpoint=os.path.join(OUT, "stage3", "checkpoint-2"))
    save(f"stage{stage}-world{dist.get_world_size()}", params(trainer))
    if RANK == 0:
        with open(os.path.join(OUT, f"resume-{stage}-{dist.get_world_size()}.json"), "w") as f:
            json.dump({"logs": logs(trainer)}, f)


def sft():
    """TRL's SFTTrainer with the mixin (ZeroSFTTrainer), LoRA, stage 3: a few steps."""
    from datasets import Dataset
    from models import WORDS as words
    from models import tiny_llama, word_tokenizer
    from peft import LoraConfig
    from trl import SFTConfig

    from zerofast.integrations.hf import ZeroSFTTrainer

    tokenizer = word_tokenizer()
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (8,), generator=g)) for _ in range(32)]
    model = tiny_llama()
    config = SFTConfig(
        output_dir=os.path.join(OUT, "sft"),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        max_length=16,
        dataset_num_proc=None,
        **({"ddp_backend": "gloo"} if "WORLD_SIZE" in os.environ else {}),
    )
    trainer = ZeroSFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": rows}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"
        ),
        zero={"stage": 3},
    )
    trainer.train()
    if RANK == 0:
        with open(os.path.join(OUT, "sft.json"), "w") as f:
            json.dump({"logs": logs(trainer), "optimizer": type(trainer.optimizer).__name__}, f)


{"train": train, "resume": resume, "sft": sft}[JOB]()
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
