"""Models sharded for inference only (zerofast.shard_frozen: [Note: models sharded for inference
only] in zerofast/stage3/inference.py), on 2 gloo ranks with tiny Hugging Face Llamas built from a
config (random weights, no download). A reference model's logits and a reward model's scores equal
the whole model's bitwise (the same weights, the same ops on the same shapes, in train and eval
mode); parameter storage per rank is the shard (all/N plus alignment padding) plus at most the root
unit and two block units; in bf16 the reference gives the bf16 ZeroAdam policy's log-probs bitwise
at step 0, beside it on the same process group; generation in both modes equals single-process
generate(); a rank out of prompts one batch early. Two run_ranks calls on the 2-rank pool, about
10 s in all."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from test_generation import PLANS, greedy, prompt, tiny_llama
from tolerances import HYPER

from zerofast import ShardedFrozenModel, UnitPolicy, ZeroAdam, shard_frozen
from zerofast.layout import ALIGN

ONE_UNIT_PER_BLOCK = UnitPolicy(min_unit_mb=0)


def _unit_sizes(ref: ShardedFrozenModel) -> list[int]:
    """Each unit's gathered bytes (test seam: the frozen part's buckets)."""
    fz = ref._frozen
    return [0 if b is None else fz.layout.buckets[b].numel * fz.shard.element_size() for b in fz.bucket_of]


def _peak_gathered(ref: ShardedFrozenModel, layers, run):
    """run()'s result and the most unit-buffer bytes gathered at the end of any layer's forward."""
    peak = [ref.parameter_bytes()["gathered"]]
    hooks = [layer.register_forward_hook(lambda *_: peak.append(ref.parameter_bytes()["gathered"])) for layer in layers]
    try:
        return run(), max(peak)
    finally:
        for h in hooks:
            h.remove()


def token_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each next token's log-probability (what DPO and GRPO compare between policy and reference)."""
    return torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), 2, ids[:, 1:, None]).squeeze(-1)


def _scoring(rank, world):
    from transformers import LlamaForSequenceClassification

    out = {}
    batch = prompt(rank, 3, 7)
    # A reference model, fp32: logits in eval and train mode (the Llama has no dropout), and memory.
    model = tiny_llama()
    oracle = copy.deepcopy(model)
    all_numel = sum(p.numel() for p in model.parameters())
    ref = shard_frozen(model, units=ONE_UNIT_PER_BLOCK)
    out["frozen"] = not any(p.requires_grad for p in model.parameters())
    equal = []
    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(oracle, mode)()
        with torch.no_grad():
            expected = oracle(batch).logits
        got, peak = _peak_gathered(ref, model.model.layers, lambda: model(batch).logits)
        equal.append(torch.equal(got, expected))
    out["logits_equal"] = equal
    layout = ref._frozen.layout
    out["memory"] = dict(
        shard=ref.parameter_bytes()["shard"],
        peak=peak,
        after=ref.parameter_bytes()["gathered"],
        units=_unit_sizes(ref),
        all_bytes=all_numel * 4,
        padded_numel=sum(b.numel for b in layout.buckets),
        all_numel=all_numel,
        tensors=len(list(model.parameters())),
        buckets=len(layout.buckets),
    )

    # A reward model (a sequence-classification head), sharded on a group given.
    torch.manual_seed(1)
    reward = LlamaForSequenceClassification(copy.deepcopy(model.config)).eval()
    reward.config.pad_token_id = 0
    reward_oracle = copy.deepcopy(reward)
    group = dist.new_group([0, 1])
    shard_frozen(reward, process_group=group, units=ONE_UNIT_PER_BLOCK)
    with torch.no_grad():
        out["scores_equal"] = torch.equal(reward(batch).logits, reward_oracle(batch).logits)

    # bf16: the policy under a bf16 ZeroAdam (stage 3) and the reference loaded from the same
    # weights, sharded beside it on the same process group: identical log-probs at step 0, and
    # equal to a whole bf16 copy.
    policy = tiny_llama().train()
    whole_bf16 = tiny_llama().to(torch.bfloat16).train()
    opt = ZeroAdam(policy, stage=3, mixed_precision="bf16", units=ONE_UNIT_PER_BLOCK, **HYPER)
    reference = tiny_llama().train()
    ref16 = shard_frozen(reference, mixed_precision="bf16")
    policy_logps = token_logps(policy(batch).logits, batch)  # with gradients, as a training step runs it
    with torch.no_grad():
        ref_logps = token_logps(reference(batch).logits, batch)
        whole_logps = token_logps(whole_bf16(batch).logits, batch)
    out["bf16"] = dict(
        dtype=ref16.dtype,
        policy_equal=torch.equal(policy_logps.detach(), ref_logps),
        whole_equal=torch.equal(ref_logps, whole_logps),
    )
    # A step of the policy, then the reference again: it still gives what it gave.
    policy_logps.mean().backward()
    opt.step()
    with torch.no_grad():
        out["bf16"]["after_step_equal"] = torch.equal(token_logps(reference(batch).logits, batch), ref_logps)
    # The weights out: state_dict()'s, whole, one unit at a time.
    got = dict(ref16.named_full_tensors())
    out["bf16"]["weights_equal"] = got.keys() == whole_bf16.state_dict().keys() and all(
        torch.equal(got[k], v) for k, v in whole_bf16.state_dict().items()
    )
    return out


def test_sharded_reference_and_reward_models_score_as_the_whole_ones():
    for rank, out in enumerate(run_ranks(_scoring, world_size=2, timeout=180)):
        assert out["frozen"], f"{rank=}"
        assert out["logits_equal"] == [True, True], f"{rank=}"
        assert out["scores_equal"], f"{rank=}"
        bf16 = out["bf16"]
        assert bf16["dtype"] == torch.bfloat16 and bf16["policy_equal"] and bf16["whole_equal"], f"{rank=} {bf16}"
        assert bf16["after_step_equal"] and bf16["weights_equal"], f"{rank=} {bf16}"
        m = out["memory"]
        # The shard: 1/N of every bucket ("flat": equal slices), whose padding is at most ALIGN - 1
        # elements per tensor (each slot starts aligned) plus world * ALIGN - 1 per bucket (its
        # length a multiple of both).
        assert m["shard"] * 2 == m["padded_numel"] * 4, f"{rank=} {m}"
        assert m["padded_numel"] - m["all_numel"] <= m["tensors"] * (ALIGN - 1) + m["buckets"] * (2 * ALIGN - 1)
        # Gathered during a forward: the root's unit (embedding, final norm) and at most two block
        # units (the running one and the prefetched one); nothing after it.
        units = m["units"]
        assert 0 < m["peak"] <= units[0] + sum(sorted(units[1:])[-2:]), f"{rank=} {m}"
        assert m["after"] == 0, f"{rank=} {m}"
        assert m["shard"] + m["peak"] < m["all_bytes"], f"{rank=} {m}"  # less than a whole copy


class _OwnReplicas:
    """A process_group that brings its own Replication (zerofast.topology.ReplicaSource), as torchft's
    replica groups do: for training only."""

    group = None

    def topology(self, group, plan):
        raise AssertionError("shard_frozen must refuse it before asking for a topology")


def _generation(rank, world):
    from zerofast.integrations.hf_generation import GenerationSyncError

    out = {"gathered": [], "streamed": [], "gathers": []}
    model = tiny_llama()
    oracle = copy.deepcopy(model)
    ref = shard_frozen(model, units=ONE_UNIT_PER_BLOCK)
    units = len(ref._frozen.bucket_of)
    plan = PLANS[rank]  # rank 1 has one batch fewer
    expected = [greedy(oracle, prompt(rank, b, n), new) for b, (n, new) in enumerate(plan)]

    # Whole model gathered: each rank its own number of batches, no collective inside.
    with ref.gathered_params(), torch.inference_mode():
        before = ref.unit_gathers
        for b, (n, new) in enumerate(plan):
            out["gathered"].append(torch.equal(greedy(model, prompt(rank, b, n), new), expected[b]))
        out["gathers_in_block"] = ref.unit_gathers - before

    # Unit by unit (generate() synced by zerofast): every rank calls generate() as many times as
    # the rank with the most batches; a rank out of prompts generates from a placeholder whose
    # tokens it drops (docs/rl.md: "a rank out of prompts").
    count = torch.tensor([len(plan)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        for b in range(int(count)):
            before = ref.unit_gathers
            if b < len(plan):
                n, new = plan[b]
                out["streamed"].append(torch.equal(greedy(model, prompt(rank, b, n), new), expected[b]))
            else:
                greedy(model, torch.ones(1, 1, dtype=torch.long), 1)
            out["gathers"].append(ref.unit_gathers - before)
    try:
        greedy(model, prompt(rank, 0, 4), 2, synced_gpus=False)
    except GenerationSyncError as e:
        out["named_error"] = "synced_gpus=False" in str(e) and "gathered_params" in str(e)
    out["units"] = units
    out["bad_input"] = []
    for call in (
        lambda: shard_frozen("model"),
        lambda: shard_frozen(tiny_llama(), mixed_precision="fp8"),
        lambda: shard_frozen(model),  # sharded above
        lambda: shard_frozen(tiny_llama(), process_group=_OwnReplicas()),
    ):
        try:
            call()
        except (TypeError, ValueError) as e:
            out["bad_input"].append(str(e))
    return out


def test_generation_from_a_sharded_frozen_model_in_both_modes():
    """Different prompts, max_new_tokens and numbers of batches per rank: the tokens equal
    single-process generate(); no gather inside gathered_params(); unit by unit each rank runs as
    many forwards as the longest rank, every unit once per forward; synced_gpus=False is a named
    error on every rank at once; bad input is named."""
    results = run_ranks(_generation, world_size=2, timeout=180)
    assert results[0]["gathered"] == [True] * 3 and results[1]["gathered"] == [True] * 2
    assert results[0]["streamed"] == [True] * 3 and results[1]["streamed"] == [True] * 2
    for rank, out in enumerate(results):
        assert out["gathers_in_block"] == 0 and out["named_error"], f"{rank=}"
        bad = out["bad_input"]
        assert len(bad) == 4 and "shard_frozen: model must be an nn.Module" in bad[0], bad
        assert "shard_frozen: mixed_precision" in bad[1] and "fp8" in bad[1], bad
        assert "sharded already" in bad[2], bad
        assert "shard_frozen: process_group must be" in bad[3] and "_OwnReplicas" in bad[3], bad
        for b in range(3):
            longest = max(PLANS[r][b][1] if b < len(PLANS[r]) else 1 for r in range(2))
            assert out["gathers"][b] == longest * out["units"], f"{rank=} batch {b}: {out['gathers']}"
