"""TRL's GRPO, RLOO and DPO with the mixin, run by tests/test_rl.py under torchrun (2 CPU ranks, gloo):
`python tests/jobs/rl_job.py grpo OUT`. Rank 0 writes OUT/grpo.json.

One launch, trainings of a 2-layer Llama (built from a config, saved locally so that TRL
builds its reference model from the path, as it does from a hub name), greedy generation, beta > 0:
  - ZeroGRPOTrainer stage 3, fp32: its reference model sharded (shard_frozen), generating with the
    whole model gathered (ds3_gather_for_generation=True, TRL's default);
  - GRPOTrainer + DDP, fp32, the same arguments: the oracle;
  - ZeroGRPOTrainer stage 3, fp32, generating unit by unit (ds3_gather_for_generation=False);
  - ZeroGRPOTrainer stage 3 and stage 2, bf16 (TRL's default): the reference in the policy's bf16,
    so the KL of the first step is exactly 0;
  - RLOO: ZeroRLOOTrainer stage 3 and RLOOTrainer + DDP in fp32;
  - DPO: ZeroDPOTrainer stage 3 and DPOTrainer + DDP in fp32, ZeroDPOTrainer stage 3 in bf16;
  - vLLM weight sync: ZeroGRPOTrainer stage 3 with LoRA and use_vllm, its vLLM connection replaced by
    a recorder, one sync_weights() against PEFT's merge_and_unload() of the same weights.
The end-of-sequence token is chosen from the untrained model's greedy continuations so that the
ranks' completions end at different lengths (recorded per rank by the reward function): the case
that left a rank waiting in a gather. Greedy completions of one prompt are identical, so the
reward also depends on the completion's place in its batch (parity), for advantages that are not 0.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared modules
from models import WORDS, tiny_llama, word_tokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
JOB, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("RANK", 0))
MAX_NEW = 6
STEPS = 3


def tokenizer():
    return word_tokenizer()


def prompts(n=12):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 6, (n,), generator=g)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(k),), generator=g)) for k in lengths]


def saved_policy(tok) -> str:
    """The policy, saved where TRL will load its reference from; its generation config's
    end-of-sequence token chosen so that greedy completions end at different lengths."""
    model = tiny_llama(
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    ).eval()
    model.generation_config.eos_token_id = [tok.eos_token_id, _varied_stop(model, tok)]
    path = os.path.join(OUT, f"policy-rank{RANK}")  # each rank its own copy: no file shared while written
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _varied_stop(model, tok) -> int:
    """The word whose first appearance in the prompts' greedy continuations is spread over the most
    different steps (never: MAX_NEW)."""
    firsts = {t: [] for t in range(4, 4 + len(WORDS))}
    with torch.no_grad():
        for text in prompts():
            ids = tok(text, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            new = out[0, ids.shape[1] :].tolist()
            for t in firsts:
                firsts[t].append(new.index(t) if t in new else MAX_NEW)
    return max(firsts, key=lambda t: (len(set(firsts[t])), -t))


LENGTHS = []  # per reward call on this rank: the longest completion of the rank's batch


def reward(completions, completion_ids, **kwargs):
    LENGTHS.append(max(len(c) for c in completion_ids))
    return [0.1 * len(c) + (i % 2) for i, c in enumerate(completion_ids)]


def common_args(name) -> dict:
    """What every trainer here runs with: CPU, gloo, fp32 unless told, STEPS steps, seed 0, quiet."""
    return dict(
        output_dir=os.path.join(OUT, name),
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        beta=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        bf16=False,
        ddp_backend="gloo",
        dataloader_num_workers=0,
    )


def rl_config(config_cls, name, **kw):
    base = common_args(name) | dict(
        num_generations=2, max_completion_length=MAX_NEW, generation_kwargs={"do_sample": False}
    )
    base.update(kw)
    return config_cls(**base)


def run(cls, name, path, tok, **kw):
    """Train `cls` (GRPO or RLOO, with or without the mixin) from the saved policy."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    LENGTHS.clear()
    zero = kw.pop("zero", {"stage": 3})
    trainer_kw = {} if cls.__module__.startswith("trl") else {"zero": zero}
    config_cls = trl.RLOOConfig if "RLOO" in cls.__name__ else trl.GRPOConfig
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=rl_config(config_cls, name, **kw),
        train_dataset=Dataset.from_dict({"prompt": prompts()}),
        processing_class=tok,
        **trainer_kw,
    )
    ref = trainer.ref_model
    generate_gathers = _count_generate_gathers(model, trainer)
    trainer.train()
    logs = [{k: e[k] for k in ("loss", "kl", "reward") if k in e} for e in trainer.state.log_history if "loss" in e]
    lengths = [None] * dist.get_world_size()
    dist.all_gather_object(lengths, list(LENGTHS))
    out = {"logs": logs, "lengths": lengths, "ref_dtype": str(next(ref.parameters()).dtype)}
    out["ref_sharded"] = _ref_storage(ref)
    out["generate_gathers"] = generate_gathers
    if hasattr(trainer.optimizer, "full_state_dict"):
        out["policy_units"] = len(trainer.optimizer.report().units)
        params = trainer.optimizer.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return out, params


def _count_generate_gathers(model, trainer) -> list:
    """The unit gathers each generate() call of the policy starts (filled during training)."""
    counts, generate = [], model.generate

    def counting(*args, **kwargs):
        report = getattr(trainer.optimizer, "report", None)
        before = report().unit_gathers if report else 0
        result = generate(*args, **kwargs)
        counts.append((report().unit_gathers if report else 0) - before)
        return result

    model.generate = counting
    return counts


def _ref_storage(ref):
    """The reference model's parameter storage on this rank, if shard_frozen sharded it."""
    from zerofast.stage3.inference import sharded_frozen_of

    handle = sharded_frozen_of(ref)
    if handle is None:
        return None
    layout = handle._frozen.layout
    return {
        "shard_numel": handle._frozen.shard.numel(),
        "padded_numel": sum(b.numel for b in layout.buckets),
        "all_numel": sum(p.numel() for p in ref.parameters()),
        "tensors": len(list(ref.parameters())),
        "buckets": len(layout.buckets),
    }


def grpo():
    from trl import GRPOTrainer, RLOOTrainer

    from zerofast.integrations.hf import ZeroGRPOTrainer, ZeroRLOOTrainer

    tok = tokenizer()
    path = saved_policy(tok)
    results, params = {}, {}
    results["zero3"], params["zero3"] = run(ZeroGRPOTrainer, "zero3", path, tok)
    results["ddp"], params["ddp"] = run(GRPOTrainer, "ddp", path, tok)
    results["zero3_streamed"], params["zero3_streamed"] = run(
        ZeroGRPOTrainer, "zero3_streamed", path, tok, ds3_gather_for_generation=False
    )
    results["zero3_bf16"], _ = run(ZeroGRPOTrainer, "zero3_bf16", path, tok, bf16=True)
    diff = {
        name: max((params[name][k].float() - params["ddp"][k].float()).abs().max().item() for k in params["ddp"])
        for name in ("zero3", "zero3_streamed")
    }
    moved = max(
        (params["ddp"][k].float() - v.float()).abs().max().item()
        for k, v in _initial(path).items()
        if k in params["ddp"]
    )
    results["zero2_bf16"], _ = run(ZeroGRPOTrainer, "zero2_bf16", path, tok, bf16=True, zero={"stage": 2})
    rloo, rloo_params = {}, {}
    rloo["zero3"], rloo_params["zero3"] = run(ZeroRLOOTrainer, "rloo_zero3", path, tok)
    rloo["ddp"], rloo_params["ddp"] = run(RLOOTrainer, "rloo_ddp", path, tok)
    rloo["max_param_diff"] = max(
        (rloo_params["zero3"][k].float() - rloo_params["ddp"][k].float()).abs().max().item() for k in rloo_params["ddp"]
    )
    results["rloo"] = rloo
    results["dpo"] = dpo(path, tok)
    results["vllm_sync"] = vllm_sync(path, tok)
    if RANK == 0:
        with open(os.path.join(OUT, "rl.json"), "w") as f:
            json.dump({**results, "max_param_diff": diff, "moved": moved}, f)


def _initial(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def preferences(n=8):
    g = torch.Generator().manual_seed(1)

    def text(k):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))

    return {
        "prompt": [text(3) for _ in range(n)],
        "chosen": [text(3) for _ in range(n)],
        "rejected": [text(2) for _ in range(n)],
    }


def run_dpo(cls, name, path, tok, **kw):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig

    extra = {} if cls.__name__ == "DPOTrainer" else {"zero": {"stage": 3}}
    args = common_args(name) | dict(max_length=16, dataset_num_proc=None)
    args.update(kw)
    trainer = cls(
        model=AutoModelForCausalLM.from_pretrained(path),
        args=DPOConfig(**args),
        train_dataset=Dataset.from_dict(preferences()),
        processing_class=tok,
        **extra,
    )
    ref = trainer.ref_model
    trainer.train()
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")
    logs = [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]
    out = {"logs": logs, "ref_dtype": str(next(ref.parameters()).dtype), "ref_sharded": _ref_storage(ref)}
    if hasattr(trainer.optimizer, "full_state_dict"):
        params = trainer.optimizer.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return out, params


def dpo(path, tok):
    from trl import DPOTrainer

    from zerofast.integrations.hf import ZeroDPOTrainer

    results, params = {}, {}
    results["zero3"], params["zero3"] = run_dpo(ZeroDPOTrainer, "dpo_zero3", path, tok)
    results["ddp"], params["ddp"] = run_dpo(DPOTrainer, "dpo_ddp", path, tok)
    results["zero3_bf16"], _ = run_dpo(ZeroDPOTrainer, "dpo_zero3_bf16", path, tok, bf16=True)
    results["max_param_diff"] = max(
        (params["zero3"][k].float() - params["ddp"][k].float()).abs().max().item() for k in params["ddp"]
    )
    return results


class _VLLMServer:
    """vLLM's server as TRL's VLLMClient reaches it (vLLM does not run here): records what arrives."""

    def __init__(self):
        self.updates = []

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, named_params):
        self.updates.append((metadata, [(n, t.clone()) for n, t in named_params]))

    def reset_prefix_cache(self):
        pass


def vllm_sync(path, tok):
    """ZeroGRPOTrainer stage 3 with LoRA and use_vllm (server mode), VLLMGeneration's connection to
    vLLM replaced by a recorder: TRL's sync_weights() sends, as the mixin set it up, PEFT's
    merge_and_unload().state_dict() of the same weights, bitwise."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.generation.vllm_generation import VLLMGeneration

    from zerofast.integrations.hf import ZeroGRPOTrainer

    server = _VLLMServer()

    def connect(self):  # what _init_vllm does in server mode, without a server
        if self.accelerator.is_main_process:
            self.vllm_client = server

    lora = dict(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    original, VLLMGeneration._init_vllm = VLLMGeneration._init_vllm, connect
    try:
        trainer = ZeroGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=rl_config(trl.GRPOConfig, "vllm", beta=0.0, use_vllm=True, vllm_mode="server"),
            train_dataset=Dataset.from_dict({"prompt": prompts()}),
            processing_class=tok,
            peft_config=LoraConfig(**lora),
            zero={"stage": 3},
        )
    finally:
        VLLMGeneration._init_vllm = original
    opt = trainer.create_optimizer()
    trainer.vllm_generation.sync_weights()
    oracle = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**lora))
    oracle.load_state_dict(opt.full_state_dict())
    want = oracle.merge_and_unload().state_dict()
    out = {"class": type(trainer.vllm_generation).__name__, "updates": len(server.updates)}
    if server.updates:
        metadata, got = server.updates[0]
        got = dict(got)
        out["equal"] = got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        out["metadata"] = metadata == [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in got.items()]
    return out


{"grpo": grpo}[JOB]()
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
