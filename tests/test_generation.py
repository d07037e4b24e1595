"""Generation on a stage-3 model ([Note: generation on stage 3] in zerofast/stage3/schedule.py), on 2
gloo ranks with a tiny Hugging Face Llama built from a config (random weights, no download): each
rank generates from its own prompt, max_new_tokens and number of batches, and its tokens equal
single-process generate() on an unsharded copy of the same model, exactly (the same weights, the
same ops on the same shapes). Whole model gathered (opt.gathered_params(): no gather per token) and
unit by unit (generate()'s synced_gpus, set by zerofast: every unit once per forward). Each test
is one run_ranks call on the 2-rank pool, a few seconds."""

import copy

import pytest
import torch
from harness import run_ranks
from probes import gathered_bytes, unit_bytes
from tolerances import HYPER

from zerofast import UnitPolicy, ZeroAdam
from zerofast.optim.zero_adam import parts_of

# Rank r's batches: (prompt length, max_new_tokens). Rank 1 stops first in every batch and, in the
# last test, runs out of prompts one batch early.
PLANS = [[(5, 7), (4, 6), (6, 5)], [(3, 2), (6, 4)]]
VOCAB = 64


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,  # never stop early: the lengths differ by max_new_tokens alone
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=True,  # the head gathers the embedding's unit where it runs
    )
    return LlamaForCausalLM(config).eval()


def prompt(rank: int, batch: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + batch)
    return torch.randint(1, VOCAB, (2, length), generator=g)


def greedy(model, ids, new, **kw) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kw)


def sharded(model):
    """A stage-3 ZeroAdam over `model`, one unit per block (min_unit_mb=0); the model and it. With
    Hugging Face's generate() synced by its integration, as a user asks for it."""
    import zerofast.integrations.hf_generation  # noqa: F401

    opt = ZeroAdam(model, stage=3, units=UnitPolicy(min_unit_mb=0), **HYPER)
    return model, opt


def peak_during(model, opt, run):
    """run()'s result, and the most unit-buffer bytes gathered at the end of any decoder layer's forward."""
    peak = [gathered_bytes(opt)]
    hooks = [layer.register_forward_hook(lambda *_: peak.append(gathered_bytes(opt))) for layer in model.model.layers]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return result, max(peak)


def _both_modes(rank, world, batches, stream=True):
    plan = PLANS[rank][:batches]
    model = tiny_llama()
    oracle = copy.deepcopy(model)
    model, opt = sharded(model)
    units = len(parts_of(opt).units.state)
    expected = [greedy(oracle, prompt(rank, b, n), new) for b, (n, new) in enumerate(plan)]
    out = {"units": units, "gathered": [], "streamed": [], "forwards": []}

    # Whole model gathered: no collective inside the block, whatever each rank runs.
    with opt.gathered_params(), torch.inference_mode():
        before = opt.report().unit_gathers
        for b, (n, new) in enumerate(plan):
            out["gathered"].append(torch.equal(greedy(model, prompt(rank, b, n), new), expected[b]))
        out["gathers_in_block"] = opt.report().unit_gathers - before
        out["gathered_bytes_in_block"] = gathered_bytes(opt)
    out["sharded_after_block"] = (
        all(s.value == "sharded" for s in parts_of(opt).units.state) and gathered_bytes(opt) == 0
    )

    # Unit by unit: zerofast makes generate() sync the ranks (synced_gpus=True).
    if stream:
        out["unit_bytes"] = unit_bytes(opt)
        for b, (n, new) in enumerate(plan):
            before = opt.report().unit_gathers
            with torch.no_grad():
                tokens, peak = peak_during(model, opt, lambda: greedy(model, prompt(rank, b, n), new))
                out["streamed"].append(torch.equal(tokens, expected[b]))
            out["streamed_peak"] = max(out.get("streamed_peak", 0), peak)
            out["forwards"].append((opt.report().unit_gathers - before, new))
    # Both ranks in step again: a collective that needs every rank (the state gathered unit by unit).
    full = opt.full_state_dict()
    out["state_equal"] = all(torch.equal(full[k], v) for k, v in oracle.state_dict().items())
    return out


def test_different_prompts_and_lengths_equal_single_process_generate():
    """Ranks with different prompts and max_new_tokens (one rank stops first in each batch): the
    same tokens as single-process generate(), whole model gathered and unit by unit. Gathers per
    generated token: 0 inside gathered_params(); outside, every unit once per forward, and every
    rank runs as many forwards as the longest rank's max_new_tokens (synced_gpus)."""
    results = run_ranks(_both_modes, world_size=2, args=(2,), timeout=180)
    for rank, out in enumerate(results):
        assert out["gathered"] == [True, True], f"{rank=}"
        assert out["gathers_in_block"] == 0, f"{rank=}"
        assert out["sharded_after_block"], f"{rank=}"
        assert out["streamed"] == [True, True], f"{rank=}"
        assert out["state_equal"], f"{rank=}"
        # Parameter memory: the whole model inside the block; unit by unit, the root's unit plus at
        # most two block units (the running one and the prefetched one).
        sizes = out["unit_bytes"]
        assert out["gathered_bytes_in_block"] == sum(sizes), f"{rank=}"
        assert out["streamed_peak"] <= sizes[0] + sum(sorted(sizes[1:])[-2:]), (
            f"{rank=} {out['streamed_peak']=} {sizes=}"
        )
    for b in range(2):
        longest = max(PLANS[r][b][1] for r in range(2))
        for rank, out in enumerate(results):
            gathers, _ = out["forwards"][b]
            assert gathers == longest * out["units"], (
                f"{rank=} batch {b}: {gathers=}, {longest=} x {out['units']} units"
            )


def test_a_rank_out_of_prompts_a_batch_early_inside_gathered_params():
    """Rank 1 has one batch fewer than rank 0: inside gathered_params() it leaves the block while
    rank 0 still generates, and both meet again at the next collective."""
    results = run_ranks(_uneven_batches, world_size=2, timeout=180)
    assert results[0]["gathered"] == [True] * 3
    assert results[1]["gathered"] == [True] * 2
    for rank, out in enumerate(results):
        assert out["gathers_in_block"] == 0 and out["state_equal"], f"{rank=}"


def _uneven_batches(rank, world):
    return _both_modes(rank, world, len(PLANS[rank]), stream=False)


def _no_sync(rank, world):
    from zerofast.integrations.hf_generation import GenerationSyncError

    model, opt = sharded(tiny_llama())
    ids = prompt(rank, 0, 4)
    try:
        greedy(model, ids, 3, synced_gpus=False)
    except GenerationSyncError as e:
        message = str(e)
    else:
        message = None
    with opt.gathered_params():
        alone = greedy(model, ids, 2 + rank, synced_gpus=False)  # no collective: allowed
    return message, alone.shape[1] == 4 + 2 + rank


def test_synced_gpus_false_outside_the_block_raises_at_once_on_every_rank():
    for message, ran in run_ranks(_no_sync, world_size=2, timeout=60):
        assert message is not None and "synced_gpus=False" in message and "gathered_params" in message
        assert ran


def _manual_loop_and_grads(rank, world):
    """A plain forward loop (no cache, no generate()) of a different length per rank inside the
    block; then one training step whose forward (and backward) ran inside the block, or whose
    forward did and backward ran after it, against the same step run the usual way."""
    out = {}
    model, opt = sharded(tiny_llama())
    ids = prompt(rank, 0, 3)
    with opt.gathered_params(), torch.no_grad():
        before = opt.report().unit_gathers
        for _ in range(3 + 2 * rank):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        out["loop_gathers"] = opt.report().unit_gathers - before

    batch = prompt(rank, 7, 6)
    states = []
    for where in ("usual", "inside", "backward after"):
        model, opt = sharded(tiny_llama())
        model.train()
        if where == "usual":
            model(batch, labels=batch).loss.backward()
        elif where == "inside":
            with opt.gathered_params():
                model(batch, labels=batch).loss.backward()
        else:
            with opt.gathered_params():
                loss = model(batch, labels=batch).loss
            loss.backward()
        opt.step()
        states.append(opt.full_state_dict())
        opt.remove_hooks()
    out["equal"] = [all(torch.equal(s[k], states[0][k]) for k in s) for s in states[1:]]
    return out


def test_forwards_with_and_without_gradients_inside_the_block():
    """No gather in a forward loop of its own inside the block, each rank a different number of
    forwards; a forward with gradients inside the block trains as the usual step does, bitwise
    (the same math in the same order), whether its backward runs inside the block or after it."""
    for rank, out in enumerate(run_ranks(_manual_loop_and_grads, world_size=2, timeout=180)):
        assert out["loop_gathers"] == 0, f"{rank=}"
        assert out["equal"] == [True, True], f"{rank=}"


@pytest.mark.parametrize("passed, expected", [(None, None), (False, False), (True, True)])
def test_models_zerofast_does_not_gather_are_left_alone(passed, expected):
    from zerofast.integrations.hf_generation import synced_gpus_for

    assert synced_gpus_for(tiny_llama(), passed) is expected


def _weights_out(rank, world):
    """Train two steps on stage 3 (each rank its own batch), then send the weights out."""
    model, opt = sharded(tiny_llama())
    model.train()
    for step in range(2):
        batch = prompt(rank, 100 + step, 6)
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    parts = parts_of(opt).units.buffers.parts
    largest_unit = max(b.numel() * b.element_size() for part in parts for b in part.buffers)

    received, peak = [], 0
    for name, tensor in opt.named_full_tensors():  # a receiver that records what arrives
        peak = max(peak, gathered_bytes(opt))
        received.append((name, tensor))
    with opt.gathered_params():
        expected = [(k, v.clone()) for k, v in model.state_dict().items()]
    got, want = dict(received), dict(expected)
    return {
        "names": len(got) == len(received) and got.keys() == want.keys(),  # each name once, grouped by unit
        "bitwise": all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items()),
        "peak": peak,
        "largest_unit": largest_unit,
        "units": len(parts_of(opt).units.state),
        "sharded_after": gathered_bytes(opt) == 0,
    }


def test_named_full_tensors_are_state_dict_bitwise_one_unit_at_a_time():
    """The weight iterator after training: state_dict()'s names, dtypes and values, bitwise, with at
    most one unit gathered at any time (of 4), and nothing gathered after it."""
    for rank, out in enumerate(run_ranks(_weights_out, world_size=2, timeout=180)):
        assert out["names"] and out["bitwise"], f"{rank=}"
        assert 0 < out["peak"] <= out["largest_unit"], f"{rank=} {out}"
        assert out["sharded_after"], f"{rank=}"


def _peft(rank, world):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    oracle = copy.deepcopy(model)
    model, opt = sharded(model)
    n, new = PLANS[rank][0]
    ids = prompt(rank, 0, n)
    with torch.no_grad():
        streamed = greedy(model, ids, new)  # PeftModel.generate reaches the inner model's generate()
    with opt.gathered_params(), torch.no_grad():
        gathered = greedy(model, ids, new)
    expected = greedy(oracle, ids, new)
    return torch.equal(streamed, expected), torch.equal(gathered, expected)


def test_a_peft_model_generates_in_both_modes():
    """LoRA (peft) over the Llama, its frozen base sharded with the rest: PeftModel.generate()
    calls the inner model's, which zerofast syncs; the tokens equal the unsharded PeftModel's."""
    for rank, out in enumerate(run_ranks(_peft, world_size=2, timeout=180)):
        assert out == (True, True), f"{rank=}"


class _Looping(torch.nn.Module):
    """A model of no library zerofast knows, with a generate() of its own: a forward per token until
    a per-rank length."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))

    def forward(self, x):
        return self.blocks(x)

    def generate(self, x, steps):
        for _ in range(steps):
            x = self.forward(x)
        return x


def _unsynced_generate(rank, world):
    """generate() of a model no integration serves: unit by unit it raises on every rank at once
    (ranks asking for different lengths would otherwise wait in a gather); inside gathered_params()
    it runs, each rank its own length, and equals the unsharded model's; remove_hooks() restores the
    class's generate()."""
    model = _Looping()
    oracle = copy.deepcopy(model)
    opt = ZeroAdam(model, stage=3, units=UnitPolicy(modules=torch.nn.Linear), **HYPER)
    x = torch.ones(2, 8)
    out = {}
    try:
        model.generate(x, steps=2 + rank)
    except RuntimeError as e:
        out["error"] = str(e)
    with opt.gathered_params(), torch.no_grad():
        out["in_block"] = torch.equal(model.generate(x, steps=2 + rank), oracle.generate(x, steps=2 + rank))
    opt.remove_hooks()
    out["restored"] = "generate" not in model.__dict__
    return out


def test_generate_that_no_integration_syncs_raises_at_once_on_every_rank():
    for r in run_ranks(_unsynced_generate, 2):
        assert "_Looping.generate() on a ZeRO stage-3 model across 2 ranks" in r["error"]
        assert "gathered_params()" in r["error"]
        assert r["in_block"] and r["restored"]


def _synced_by_the_caller(rank, world):
    """Hugging Face's generate(synced_gpus=True), transformers' own way for ZeRO-3, with no zerofast
    integration imported: the call keeps the ranks' forwards matched, so the guard lets it through
    (each rank its own length, equal to the unsharded model's); without synced_gpus it raises."""
    import sys

    imported = "zerofast.integrations.hf_generation" in sys.modules
    model = tiny_llama()
    oracle = copy.deepcopy(model)
    opt = ZeroAdam(model, stage=3, units=UnitPolicy(min_unit_mb=0), **HYPER)
    ids = prompt(rank, 0, 4)
    with torch.no_grad():
        equal = torch.equal(greedy(model, ids, 2 + 2 * rank, synced_gpus=True), greedy(oracle, ids, 2 + 2 * rank))
        try:
            greedy(model, ids, 2)
            error = None
        except RuntimeError as e:
            error = str(e)
    return imported, equal, error, opt.report().unit_gathers > 0


def test_generate_with_synced_gpus_works_without_the_integration():
    for imported, equal, error, gathered in run_ranks(_synced_by_the_caller, 2, fresh=True, timeout=180):
        assert not imported, "a fresh process must not have imported zerofast.integrations.hf_generation"
        assert equal and gathered
        assert error is not None and "synced_gpus=True" in error and "gathered_params()" in error
