"""The weight iterator on a PEFT model (opt.named_full_tensors(peft="merged" | "adapter"), [Note:
merged weights unit by unit] in zerofast/integrations/peft_weights.py) and TRL's vLLM weight sync
pointed at it ([Note: TRL's vLLM weight sync] in zerofast/integrations/_trl.py), on 2 gloo ranks
with a tiny Hugging Face Llama + LoRA built from a config (random weights, no download). The oracle
is PEFT itself on the same trained weights: an unsharded PeftModel loaded with
opt.full_state_dict(), whose merge_and_unload().state_dict() and get_peft_model_state_dict() the
iterator must give bitwise (the same merge code on the same tensors). One run_ranks call on the
2-rank pool: 3-5 s with the pool warm on a 2-core machine (its first use adds the pool's start)."""

import torch
import torch.nn as nn
from harness import run_ranks
from probes import gathered_bytes, unit_bytes
from tolerances import HYPER

from zerofast import UnitPolicy, ZeroAdam
from zerofast.optim.zero_adam import parts_of

VOCAB = 64


def lora_llama(lora: dict, dtype=torch.float32):
    """A 2-block Llama (untied head) with a LoRA adapter whose B is not zero, in `dtype`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    return get_peft_model(model, LoraConfig(r=2, init_lora_weights=False, **lora)).to(dtype)


def bound(opt, model) -> int:
    """The most unit bytes the iterator may hold at once: one unit, or the units of one LoRA layer
    whose tensors lie in several."""
    from peft.tuners.lora import LoraLayer

    sizes, needs = unit_bytes(opt), parts_of(opt).units.schedule.needs
    spans = [
        {u for m in layer.modules() for u in needs.get(m, ())}
        for layer in model.modules()
        if isinstance(layer, LoraLayer)
    ]
    return max([max(sizes)] + [sum(sizes[u] for u in span) for span in spans])


def train(model, opt, rank):
    model.train()
    for step in range(2):
        g = torch.Generator().manual_seed(100 * rank + step)
        batch = torch.randint(1, VOCAB, (2, 6), generator=g)
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()


def record(iterator, opt, stage):
    """What a receiver gets, and the most unit bytes gathered while it receives."""
    received, peak = [], 0
    for name, tensor in iterator:
        peak = max(peak, gathered_bytes(opt) if stage == 3 else 0)
        received.append((name, tensor))
    return received, peak


def same(received, expected) -> bool | list:
    """Each expected name once (the order is by unit), every tensor bitwise with its dtype; else
    what differs."""
    got = dict(received)
    if len(got) != len(received) or got.keys() != expected.keys():
        return sorted(got.keys() ^ expected.keys())
    wrong = [n for n, t in got.items() if t.dtype != expected[n].dtype or not torch.equal(t, expected[n])]
    return wrong or True


class _Recorder:
    """vLLM's server as VLLMClient.update_named_params reaches it: records what arrives."""

    def __init__(self, opt, stage):
        self.opt, self.stage, self.updates = opt, stage, []

    def update_named_params(self, metadata, named_params):
        self.updates.append((metadata, record(named_params, self.opt, self.stage)))

    def reset_prefix_cache(self):
        pass


class _Trainer:
    """What TRL's trainer holds for the sync: its optimizer and its VLLMGeneration."""


def _vllm_sync(rank, model, opt, stage):
    """TRL 1.16.0's VLLMGeneration.sync_weights() in server mode, its client a recorder (vLLM does
    not run here: VLLMGeneration is made without connecting), adopted as the mixin adopts it."""
    from trl.generation.vllm_generation import VLLMGeneration

    from zerofast.integrations import _trl

    generation = VLLMGeneration.__new__(VLLMGeneration)  # its __init__ starts vLLM
    generation.model, generation.mode, generation.enable_sleep_mode = model, "server", False
    generation._weight_metadata = None
    generation.accelerator = type("Acc", (), {"is_main_process": rank == 0})()
    recorder = generation.vllm_client = _Recorder(opt, stage)
    trainer = _Trainer()
    trainer.optimizer, trainer.vllm_generation = opt, generation
    _trl.adopt(trainer)
    generation.sync_weights()
    generation.sync_weights()  # the second sync streams again (metadata kept from the first)
    return type(generation).__name__, recorder.updates


CASES = {
    # LoRA on q and v, the head trained whole (modules_to_save), one unit per block.
    "stage3": dict(stage=3, lora=dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])),
    # DoRA (its own merge, caching weight norms) in bf16.
    "stage3_dora_bf16": dict(
        stage=3, lora=dict(target_modules=["q_proj", "o_proj"], use_dora=True), dtype=torch.bfloat16
    ),
    # Each Linear its own unit: a LoRA layer's base, A and B lie in three units, gathered together.
    "stage3_split": dict(
        stage=3, lora=dict(target_modules=["q_proj", "v_proj"]), units=lambda m: isinstance(m, nn.Linear)
    ),
    "stage2": dict(stage=2, lora=dict(target_modules=["q_proj", "v_proj"])),
}


def _peft_weights(rank, world):
    from peft import get_peft_model_state_dict

    import zerofast.integrations.peft_weights  # noqa: F401 (registers the "merged" and "adapter" views)

    out = {}
    for case, c in CASES.items():
        dtype = c.get("dtype", torch.float32)
        model = lora_llama(c["lora"])
        precision = "bf16" if dtype == torch.bfloat16 else None
        units = UnitPolicy(modules=c["units"]) if "units" in c else UnitPolicy(min_unit_mb=0)
        units = units if c["stage"] == 3 else None
        opt = ZeroAdam(model, stage=c["stage"], units=units, mixed_precision=precision, **HYPER)
        train(model, opt, rank)
        before = opt.full_state_dict()
        merged, merged_peak = record(opt.named_full_tensors(peft="merged"), opt, c["stage"])
        adapter, adapter_peak = record(opt.named_full_tensors(peft="adapter"), opt, c["stage"])
        after = opt.full_state_dict()

        oracle = lora_llama(c["lora"], dtype)
        oracle.load_state_dict(before)
        want_adapter = get_peft_model_state_dict(oracle)
        want_merged = oracle.merge_and_unload().state_dict()
        res = {
            "merged": same(merged, want_merged),
            "adapter": same(adapter, want_adapter),
            "untouched": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
            # the adapter changes the weights it merges into (init_lora_weights=False: B is not 0)
            "delta": not torch.equal(
                dict(merged)["model.layers.0.self_attn.q_proj.weight"],
                before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
            ),
        }
        if c["stage"] == 3:
            res.update(
                peak=max(merged_peak, adapter_peak),
                bound=bound(opt, model),
                largest_unit=max(unit_bytes(opt)),
                sharded_after=gathered_bytes(opt) == 0,
            )
        if case == "stage3":
            cls, updates = _vllm_sync(rank, model, opt, c["stage"])
            res["sync_class"] = cls
            if rank == 0:
                res["sync"] = [
                    same(got, want_merged) is True
                    and metadata == [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in got]
                    for metadata, (got, _) in updates
                ]
                res["sync_peak"] = max(peak for _, (_, peak) in updates)
        out[case] = res
        opt.remove_hooks()
    return out


def test_peft_merged_and_adapter_weights_bitwise_peft_one_unit_at_a_time():
    """After two steps: peft="merged" is merge_and_unload().state_dict() and peft="adapter"
    get_peft_model_state_dict(), names in order, dtypes and values bitwise (LoRA with a head in
    modules_to_save at stage 3; DoRA in bf16; each layer split over three units; stage 2); the
    model is left as it was; at stage 3 at most one unit (or one split layer's units) is gathered
    while the receiver reads, nothing after. TRL's VLLMGeneration.sync_weights(), adopted as the
    mixin does, sends exactly the merged weights (twice: the metadata pass and the stream agree)."""
    for rank, results in enumerate(run_ranks(_peft_weights, world_size=2, timeout=240)):
        for case, out in results.items():
            assert out["merged"] is True and out["adapter"] is True, f"{rank=} {case=} {out}"
            assert out["untouched"] and out["delta"], f"{rank=} {case=} {out}"
            if "peak" in out:
                assert 0 < out["peak"] <= out["bound"], f"{rank=} {case=} {out}"
                assert out["sharded_after"], f"{rank=} {case=}"
        assert results["stage3"]["peak"] <= results["stage3"]["largest_unit"], f"{rank=}"
        assert results["stage3"]["sync_class"] == "_ZeroWeightSync"
        if rank == 0:
            assert results["stage3"]["sync"] == [True, True], results["stage3"]
            assert 0 < results["stage3"]["sync_peak"] <= results["stage3"]["largest_unit"]


def test_a_bad_peft_choice_is_a_named_error(monkeypatch):
    """peft= other than None or a registered view ('merged' and 'adapter', once PEFT's integration is
    imported), or given for a model that is not a PeftModel: a ValueError naming the argument and the
    value, when the iterator is asked for (before any gather)."""
    import pytest
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerofast.integrations.peft_weights  # noqa: F401
    from zerofast.stage3 import extensions
    from zerofast.stage3.weights import entries_for

    with pytest.raises(
        ValueError, match=r"named_full_tensors: peft='merge' is not a registered weight view \('adapter', 'merged'\)"
    ):
        entries_for(lora_llama(dict(target_modules=["q_proj"])), "merge", "named_full_tensors")
    plain = LlamaForCausalLM(
        LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match="peft='merged' needs a peft.PeftModel; the model is a LlamaForCausalLM"):
        entries_for(plain, "merged", "named_full_tensors")
    monkeypatch.setattr(extensions, "_VIEWS", {})  # as before PEFT's integration is imported
    with pytest.raises(ValueError, match="registered by `import zerofast.integrations.peft_weights`"):
        entries_for(plain, "merged", "named_full_tensors")
