"""ZeroAccelerator's jobs, run by tests/test_accelerate.py (CPU, gloo):
`accelerate launch --multi_gpu --num_processes 2 tests/jobs/accelerate_job.py train OUT` (which also runs
examples/accelerate_nlp_example.py as a script, last) and
`torchrun --nproc-per-node 1 tests/jobs/accelerate_job.py resume OUT`. Rank 0 writes OUT/<job>.json and the
tensors the test compares (OUT/<run>.pt).

One training loop, `run()`, written as Accelerate documents a custom loop (prepare, accumulate, backward,
clip_grad_norm_ at the sync points, step, schedule, zero_grad, save_state, get_state_dict), run with
Accelerator + DDP + torch AdamW and with ZeroAccelerator + ZeroAdam on the same arguments: only the two lines
that build the accelerator and the optimizer differ. The model: a 2-layer GPT-2 with tied embeddings built from
a config (no download); data: fixed random tokens. split_batches=True: every world size sees the same global
batch of 4 per micro-batch (and the same schedule), so a run resumed on another world size continues the same
run.
"""

import json
import os
import runpy
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared modules
torch.set_num_threads(1)
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from models import hf_gpt2  # noqa: E402
from tolerances import HYPER  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from zerofast import ZeroAdam  # noqa: E402
from zerofast.integrations.accelerate import ZeroAccelerator  # noqa: E402

hf_logging.set_verbosity_error()
JOB, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("RANK", 0))
STEPS, ACCUM, BATCH, SEQ, VOCAB = 4, 2, 4, 12, 48  # optimizer steps, micro-batches per step, global micro-batch
SAVE_AT = 2  # the uninterrupted stage-3 run saves its state after this optimizer step


class TinyLM(torch.utils.data.Dataset):
    def __init__(self, n=STEPS * ACCUM * BATCH, seed=0):
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


def fresh_state():
    """Each run its own accelerator settings in this one process (Accelerate keeps them process-wide)."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def make_model(peft=False):
    model = hf_gpt2(2)
    if peft:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
        torch.manual_seed(1)
        model = get_peft_model(model, config)
    return model


def groups(model):
    """Decay and no-decay groups, as Accelerate's examples build them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = ("bias", "ln_", "wte", "wpe")
    return [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": HYPER["weight_decay"]},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]


def run(zero, stage=None, precision="no", peft=False, save_at=None, resume=None, save_model=None):
    """The user's loop. zero=False: Accelerator, DDP, torch AdamW; zero=True: ZeroAccelerator, ZeroAdam."""
    fresh_state()
    kind = ZeroAccelerator if zero else Accelerator
    accelerator = kind(
        cpu=True,
        mixed_precision=precision,
        gradient_accumulation_steps=ACCUM,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    model = make_model(peft)
    hyper = dict(lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    if zero:
        optimizer = ZeroAdam(
            model, **hyper, param_groups=groups(model), stage=stage, mixed_precision=accelerator.mixed_precision
        )
    else:
        optimizer = torch.optim.AdamW(groups(model), **hyper)
    loader = torch.utils.data.DataLoader(TinyLM(), batch_size=BATCH, shuffle=False)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    done = 0
    if resume is not None:
        accelerator.load_state(resume)
        done = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT * ACCUM)
    logs, step_loss = [], 0.0
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            step_loss += accelerator.reduce(loss.detach(), "mean").item() / ACCUM
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            logs.append([step_loss, float(norm), scheduler.get_last_lr()[0]])
            step_loss = 0.0
            if done == save_at:
                accelerator.save_state(os.path.join(OUT, "state"))
    state = accelerator.get_state_dict(model)
    out = {
        "logs": logs,
        "model": type(model).__name__,
        "optimizer": type(optimizer).__name__,
        "inner": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "mixed_precision": accelerator.mixed_precision,
        "dtype": str(next(accelerator.unwrap_model(model).parameters()).dtype),
        "keys": len(state),
    }
    if peft:
        state = {k: v for k, v in state.items() if "lora_" in k}
    if save_model is not None:
        accelerator.save_model(model, save_model)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).config.save_pretrained(save_model)
        out["saved"] = sorted(os.listdir(save_model)) if accelerator.is_main_process else None
    if zero:
        out["report_units"] = len(optimizer.report().units)  # ZeroAdam's own methods through the wrapper
        out["loss_scale"] = optimizer.loss_scale
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return out, {k: v.detach().float().clone() for k, v in state.items()}


def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def plain_accelerator_with_zero_adam(stage):
    """A plain Accelerator given a ZeroAdam: prepare fails, naming ZeroAccelerator."""
    fresh_state()
    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = ZeroAdam(model, lr=1e-3, stage=stage)
    try:
        return error_of(lambda: accelerator.prepare(model, optimizer))
    finally:
        optimizer.remove_hooks()


def errors_on_ranks():
    """The named errors that need more than one process."""
    out = {}
    fresh_state()
    accelerator = ZeroAccelerator(cpu=True)
    model = make_model()
    out["torch optimizer"] = error_of(lambda: accelerator.prepare(model, torch.optim.AdamW(model.parameters())))
    prepared = accelerator.prepare(make_model())
    batch = TinyLM()[0]
    loss = prepared(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
    out["backward without ZeroAdam"] = error_of(lambda: accelerator.backward(loss))
    model = make_model()
    first = ZeroAdam(model, lr=1e-3, stage=2)
    accelerator.prepare(model, first)
    other = make_model()
    second = ZeroAdam(other, lr=1e-3, stage=2)
    out["second ZeroAdam"] = error_of(lambda: accelerator.prepare(other, second))
    first.remove_hooks()
    second.remove_hooks()
    for stage in (1, 2, 3):
        out[f"plain Accelerator, stage {stage}"] = plain_accelerator_with_zero_adam(stage)
    return out


def dump(name, value):
    if RANK == 0:
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(value, f)


def save(name, tensors):
    if RANK == 0:
        torch.save(tensors, os.path.join(OUT, f"{name}.pt"))


def train():
    """On 2 ranks: Accelerator + DDP, then ZeroAccelerator at stages 1-3 (stage 3 saves its state after step
    SAVE_AT and the whole model at the end); bf16 both ways; LoRA both ways at stage 3; the errors."""
    runs = {
        "ddp": dict(zero=False),
        "zero1": dict(zero=True, stage=1),
        "zero2": dict(zero=True, stage=2),
        "zero3": dict(zero=True, stage=3, save_at=SAVE_AT, save_model=os.path.join(OUT, "saved")),
        "ddp-bf16": dict(zero=False, precision="bf16"),
        "zero3-bf16": dict(zero=True, stage=3, precision="bf16"),
        "zero2-fp16": dict(zero=True, stage=2, precision="fp16"),
        "ddp-lora": dict(zero=False, peft=True),
        "zero3-lora": dict(zero=True, stage=3, peft=True),
    }
    res = {}
    for name, how in runs.items():
        res[name], tensors = run(**how)
        save(name, tensors)
    res["world"] = dist.get_world_size()
    res["errors"] = errors_on_ranks()
    dump("train", res)
    example()


def example():
    """examples/accelerate_nlp_example.py run as a script in this launch (2 epochs), last: it ends with
    accelerator.end_training(), which destroys the process group."""
    fresh_state()
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    argv = sys.argv
    sys.argv = ["accelerate_nlp_example.py", "--cpu", "--epochs", "2", "--out", os.path.join(OUT, "example.json")]
    try:
        runpy.run_path(os.path.join(path, "accelerate_nlp_example.py"), run_name="__main__")
    finally:
        sys.argv = argv


def resume():
    """On 1 rank: stage 3's state saved after step SAVE_AT on 2 ranks, loaded at stage 3 and at stage 2, run to
    the end; the single-process errors; the mixed precision `accelerate config` sets (its variable)."""
    res = {}
    for stage in (3, 2):
        res[f"stage{stage}"], tensors = run(zero=True, stage=stage, resume=os.path.join(OUT, "state"))
        save(f"resumed{stage}", tensors)
    errors = {}
    fresh_state()
    from accelerate.utils import FullyShardedDataParallelPlugin

    errors["fsdp plugin"] = error_of(lambda: ZeroAccelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin()))
    errors["fp8"] = error_of(lambda: ZeroAccelerator(cpu=True, mixed_precision="fp8"))
    fresh_state()
    accelerator = ZeroAccelerator(cpu=True, mixed_precision="bf16")
    model = make_model()
    optimizer = ZeroAdam(model, lr=1e-3, stage=2)
    errors["precision"] = error_of(lambda: accelerator.prepare(model, optimizer))
    optimizer.remove_hooks()
    fresh_state()
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
    res["from the environment"] = ZeroAccelerator(cpu=True).mixed_precision
    del os.environ["ACCELERATE_MIXED_PRECISION"]
    res["errors"] = errors
    res["world"] = dist.get_world_size()
    dump("resume", res)


if __name__ == "__main__":
    {"train": train, "resume": resume}[JOB]()
    if dist.is_initialized():
        dist.destroy_process_group()
