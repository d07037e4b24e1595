"""benchmarks/bench_rl.py's launch: `python -m torch.distributed.run --standalone --nproc-per-node 2
benchmarks/rl_bench_job.py OUT`. Rank 0 writes OUT.json.

A GRPO step (generate, score, reference log-probs, update) with TRL 1.16.0's GRPOTrainer, beta 0.04
(a reference model), sampled completions, on a GPT-2-shaped model small enough for 2 CPU cores
(4 layers, width 256, 4 heads, a vocabulary of 8192: 5.3M parameters, fp32), 4 prompts x 1 per rank,
4 completions per prompt, completions of at most 16 tokens. Systems:
  - zero3_gathered: ZeroGRPOTrainer stage 3, ds3_gather_for_generation=True (the whole model
    gathered for generation, opt.gathered_params());
  - zero3_streamed: stage 3, ds3_gather_for_generation=False (unit by unit, generate() synced);
  - zero2: ZeroGRPOTrainer stage 2 (the reference kept whole);
  - ddp: GRPOTrainer + DDP (the reference kept whole);
  - deepspeed: GRPOTrainer + DeepSpeed ZeRO-3, where deepspeed imports (else its reason).
ROUNDS rounds, each training every system in turn for STEPS steps (side by side, so that the load of
a shared machine falls on all alike); per step after the first of each training: the step's time,
the time of the generation phase (TRL's _generate_single_turn: in zero3_gathered it enters and
leaves opt.gathered_params(), whose gather waits for the other rank), the time inside the policy's
generate() (decoding), the completion tokens each rank generated, and the unit gathers and policy
forwards inside generation; per rank the most parameter storage alive at once (policy and
reference, sampled after every block's forward and at the end of each step).
"""

import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
from transformers import TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
OUT = sys.argv[1]
RANK = int(os.environ.get("RANK", 0))
VOCAB, MAX_NEW, STEPS, ROUNDS = 8192, 16, 4, 3
SYSTEMS = ["zero3_gathered", "zero3_streamed", "zero2", "ddp", "deepspeed"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def saved_policy(tok) -> tuple[str, int]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = os.path.join(OUT + "-work", f"policy-rank{RANK}")
    model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def prompts(n=64):
    g = torch.Generator().manual_seed(0)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (8,), generator=g)) for _ in range(n)]


def reward(completions, completion_ids, **kwargs):
    return [float(len(c) % 3) + 0.01 * i for i, c in enumerate(completion_ids)]


def storage_bytes(*models) -> int:
    """Parameter storage of these models alive now, each storage once."""
    seen = {}
    for m in models:
        for p in m.parameters():
            s = p.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def shard_bytes(trainer) -> int:
    """Stage 3's shards (policy and reference): storage no parameter points at."""
    from zerofast.stage3.inference import sharded_frozen_of

    total = 0
    report = getattr(trainer.optimizer, "report", None)
    if report is not None and trainer.optimizer.plan.params_sharded:
        total += report().memory.materialized_params - storage_bytes(trainer.model)
    ref = sharded_frozen_of(trainer.ref_model) if trainer.ref_model is not None else None
    if ref is not None:
        total += ref.parameter_bytes()["shard"]
    return total


def ref_bytes(trainer) -> int:
    """The reference model's parameter storage on this rank between its forwards: its shard where
    shard_frozen sharded it, else the whole model."""
    from zerofast.stage3.inference import sharded_frozen_of

    ref = sharded_frozen_of(trainer.ref_model)
    return ref.parameter_bytes()["shard"] if ref is not None else storage_bytes(trainer.ref_model)


class Probe(TrainerCallback):
    """Times steps and generation, counts tokens, gathers and forwards, samples parameter storage."""

    def __init__(self, trainer):
        self.trainer, self.rows, self.peak = trainer, [], 0
        self.gen_s = self.decode_s = self.tokens = self.gathers = self.forwards = 0
        models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
        self.models = models
        for m in models:
            for block in m.transformer.h:
                block.register_forward_hook(lambda *a: self.sample())
        trainer.model.register_forward_pre_hook(lambda *a: self.count_forward())
        generate = trainer._generate_single_turn

        def timed(*args, **kwargs):
            before = self.unit_gathers()
            t0 = time.perf_counter()
            self.in_generation = True
            try:
                completion_ids, logprobs = generate(*args, **kwargs)
            finally:
                self.in_generation = False
            self.gen_s += time.perf_counter() - t0
            self.tokens += sum(len(c) for c in completion_ids)
            self.gathers += self.unit_gathers() - before
            return completion_ids, logprobs

        self.in_generation = False
        trainer._generate_single_turn = timed
        decode = trainer.model.generate

        def timed_decode(*args, **kwargs):
            t0 = time.perf_counter()
            result = decode(*args, **kwargs)
            self.decode_s += time.perf_counter() - t0
            return result

        trainer.model.generate = timed_decode  # TRL calls the unwrapped policy's generate()

    def unit_gathers(self) -> int:
        report = getattr(self.trainer.optimizer, "report", None)
        return report().unit_gathers if report is not None else 0

    def count_forward(self):
        if self.in_generation:
            self.forwards += 1

    def sample(self):
        self.peak = max(self.peak, storage_bytes(*self.models))

    def on_step_begin(self, args, state, control, **kw):
        self.gen_s = self.decode_s = self.tokens = self.gathers = self.forwards = 0
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.sample()
        self.rows.append(
            {
                "step_s": time.perf_counter() - self.t0,
                "gen_s": self.gen_s,
                "decode_s": self.decode_s,
                "tokens": self.tokens,
                "gathers": self.gathers,
                "forwards": self.forwards,
            }
        )


def train(system, path, tok) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from zerofast.integrations.hf import ZeroGRPOTrainer

    args = dict(
        output_dir=os.path.join(OUT + "-work", system),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=MAX_NEW,
        max_steps=STEPS,
        learning_rate=1e-5,
        beta=0.04,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        bf16=False,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        ds3_gather_for_generation=system != "zero3_streamed",
    )
    kw = {}
    cls = trl.GRPOTrainer
    if system.startswith("zero"):
        cls, kw = ZeroGRPOTrainer, {"zero": {"stage": int(system[4])}}
    trainer = cls(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=reward,
        args=trl.GRPOConfig(**args),
        train_dataset=Dataset.from_dict({"prompt": prompts()}),
        processing_class=tok,
        **kw,
    )
    probe = Probe(trainer)
    trainer.add_callback(probe)
    trainer.train()
    sharded = system.startswith("zero3")
    return {
        "rows": probe.rows[1:],
        "peak_param_bytes": probe.peak + shard_bytes(trainer),
        "ref_bytes": ref_bytes(trainer),
        "units": len(trainer.optimizer.report().units) if sharded else 0,
        "all_bytes": storage_bytes(trainer.ref_model) if not sharded else None,
    }


def interleaved_decode(path, reps=9) -> dict:
    """The policy's generate() alone, call by call in turn (finer than the trainings' rounds, so a
    shared machine's load falls on each alike): the model whole (DDP's and stage 2's generation),
    under a stage-3 ZeroAdam inside opt.gathered_params() (entered before the clock starts), and
    unit by unit, each first in turn; 16 prompts of 8 tokens, 16 greedy tokens each; the median
    and the best seconds per call."""
    from transformers import AutoModelForCausalLM

    from zerofast import ZeroAdam

    whole = AutoModelForCausalLM.from_pretrained(path).eval()
    sharded = AutoModelForCausalLM.from_pretrained(path).eval()
    opt = ZeroAdam(sharded, stage=3, lr=1e-5)
    g = torch.Generator().manual_seed(RANK)
    ids = torch.randint(4, VOCAB, (16, 8), generator=g)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    times = {"whole": [], "gathered": [], "streamed": []}

    def call(mode):
        model = whole if mode == "whole" else sharded
        with opt.gathered_params() if mode == "gathered" else contextlib.nullcontext():
            dist.barrier()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            times[mode].append(time.perf_counter() - t0)

    order = list(times)
    with torch.no_grad():
        for rep in range(reps):
            for mode in order[rep % 3 :] + order[: rep % 3]:  # each mode first in turn
                call(mode)
    opt.remove_hooks()
    return {k: {"median": statistics.median(v), "best": min(v)} for k, v in times.items()}


def deepspeed_reason() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001  (its import fails in several ways where it cannot run)
        return f"deepspeed is not installed here ({type(e).__name__}: {e})"
    return "deepspeed imports, but this job has no DeepSpeed configuration for CPU yet"


def main():
    tok = tokenizer()
    path, params = saved_policy(tok)
    runs = {s: [] for s in SYSTEMS}
    errors = {"deepspeed": deepspeed_reason()}
    for _ in range(ROUNDS):
        for system in SYSTEMS:
            if errors.get(system):
                continue
            runs[system].append(train(system, path, tok))
    mine = {s: r for s, r in runs.items() if r}
    mine["interleaved"] = interleaved_decode(path)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if RANK != 0:
        return
    summary = {}
    for system in SYSTEMS:
        if errors.get(system):
            summary[system] = {"error": errors[system]}
            continue
        steps = [  # (rank 0's row, rank 1's row) per step, every round
            rows for r in range(ROUNDS) for rows in zip(*(ranks[system][r]["rows"] for ranks in everyone))
        ]
        summary[system] = {
            "step_s": statistics.median(max(row["step_s"] for row in rows) for rows in steps),
            "gen_s": statistics.median(max(row["gen_s"] for row in rows) for rows in steps),
            "decode_s": statistics.median(max(row["decode_s"] for row in rows) for rows in steps),
            # both ranks' completion tokens over the slower rank's time inside generate()
            "tokens_per_s": statistics.median(
                sum(row["tokens"] for row in rows) / max(row["decode_s"] for row in rows) for rows in steps
            ),
            "best_tokens_per_s": max(
                sum(row["tokens"] for row in rows) / max(row["decode_s"] for row in rows) for rows in steps
            ),
            "tokens": statistics.median(sum(row["tokens"] for row in rows) for rows in steps),
            "train_s": statistics.median(max(row["step_s"] - row["gen_s"] for row in rows) for rows in steps),
            # rank 0's unit gathers and policy forwards inside generation, per step
            "gathers": statistics.median(rows[0]["gathers"] for rows in steps),
            "forwards": statistics.median(rows[0]["forwards"] for rows in steps),
            "peak_param_mib": [max(run["peak_param_bytes"] for run in ranks[system]) / 2**20 for ranks in everyone],
            "units": everyone[0][system][0]["units"],
            "ref_mib": [max(run["ref_bytes"] for run in ranks[system]) / 2**20 for ranks in everyone],
            "steps": len(steps),
        }
    interleaved = {  # the slower rank's
        mode: {stat: max(ranks["interleaved"][mode][stat] for ranks in everyone) for stat in ("median", "best")}
        for mode in everyone[0]["interleaved"]
    }
    with open(OUT + ".json", "w") as f:
        json.dump({"systems": summary, "interleaved": interleaved, "params": params, "world": len(everyone)}, f)


main()
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
