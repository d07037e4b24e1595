"""TRL's GRPO (beta > 0), RLOO and DPO with ZeroTrainerMixin at stage 3, in one torchrun launch of 2 CPU
ranks (tests/jobs/rl_job.py; about 15-20 s on a 2-core machine), against the same TRL trainer + DDP:
greedy generation (deterministic), so both runs see the same completions, which end at different
lengths on the two ranks. TRL's reference model is sharded by zerofast.shard_frozen and runs in the
policy's precision: under bf16 GRPO's KL and DPO's implicit rewards are exactly 0 at the first step
([Note: frozen models in the Trainer] in zerofast/integrations/hf.py)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from harness import launch_env
from tolerances import fp32_tol

from zerofast.layout import ALIGN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "rl_job.py")
STEPS = 3  # rl_job.STEPS
# Parameters: fp32_tol (tests/tolerances.py), the argument of every multi-rank test: the two runs
# differ only in the order gradients are summed and in the Adam kernel's rounding. The parameters'
# scale is 1 (layer norm weights), the largest here.
PARAM_TOL = fp32_tol(STEPS)
# Logged values: computed from parameters within PARAM_TOL relative of each other; in a 2-layer
# model a relative parameter change reaches a log-probability through at most 8 chained products
# (2 layers x (attention: 2, MLP: 2)), each carrying it once, and loss, KL and DPO's rewards are
# sums of log-probability differences of at most 16 tokens (16 x that).
LOG_REL = 16 * 8 * PARAM_TOL


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (the Makefile pins it; it installs from the registry)")
    out = str(tmp_path_factory.mktemp("rl"))
    env = launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", JOB, "grpo", out]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    with open(os.path.join(out, "rl.json")) as f:
        return json.load(f)


def _close(mine: list[dict], ddp: list[dict]) -> None:
    assert len(mine) == len(ddp) == STEPS
    for step, (a, b) in enumerate(zip(mine, ddp)):
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= LOG_REL * max(1.0, abs(b[key])), (step, key, a[key], b[key])


def _sharded_reference(storage: dict) -> None:
    """Half the reference per rank: the shard is half the padded buckets, whose padding is at most
    ALIGN - 1 elements per tensor and 2 * ALIGN - 1 per bucket (see tests/test_shard_frozen.py)."""
    assert storage is not None
    assert storage["shard_numel"] * 2 == storage["padded_numel"], storage
    slack = storage["tensors"] * (ALIGN - 1) + storage["buckets"] * (2 * ALIGN - 1)
    assert storage["padded_numel"] - storage["all_numel"] <= slack, storage


@pytest.mark.parametrize("run", ["zero3", "zero3_streamed"])
def test_grpo_with_a_reference_model_at_stage_3_equals_trl_with_ddp(results, run):
    """GRPO, beta 0.1: completions end at different lengths on the two ranks in some step, and
    training finishes with the logged loss, KL and reward and the final parameters of TRL + DDP;
    the reference model is sharded, half per rank. Generation with the whole model gathered
    (ds3_gather_for_generation=True: no unit gather inside generate()) or unit by unit (False:
    generate() synced across the ranks, every unit gathered once per forward)."""
    zero, ddp = results[run], results["ddp"]
    assert any(a != b for a, b in zip(*zero["lengths"])), zero["lengths"]
    assert zero["lengths"] == ddp["lengths"]
    _close(zero["logs"], ddp["logs"])
    assert results["max_param_diff"][run] <= PARAM_TOL
    assert results["moved"] > 100 * PARAM_TOL  # the parameters did move: the comparison is not vacuous
    assert zero["ref_dtype"] == ddp["ref_dtype"] == "torch.float32"
    _sharded_reference(zero["ref_sharded"])
    assert ddp["ref_sharded"] is None
    counts, longest = zero["generate_gathers"], [max(step) for step in zip(*zero["lengths"])]
    units = zero["policy_units"]
    if run == "zero3":
        assert counts == [0] * STEPS, counts
    else:  # every rank runs one forward per token of the longest rank's completions (synced_gpus)
        # The very first forward after the optimizer is built knows no call order yet, so its merged
        # unit (both blocks) is gathered once per block instead of carried: one more gather.
        expected = [units * n for n in longest]
        expected[0] += 1
        assert counts == expected, (counts, units, longest)


def test_the_reference_model_runs_in_the_policys_bf16(results):
    """TRL's default bf16=True: the policy in ZeroAdam's bf16 and the reference converted to bf16
    too, so the KL of the first step is exactly 0 (both are the same weights rounded alike; an fp32
    reference gave 1e-7); at stage 3 the reference is sharded, at stage 2 kept whole."""
    for name, sharded in (("zero3_bf16", True), ("zero2_bf16", False)):
        run = results[name]
        assert run["ref_dtype"] == "torch.bfloat16", name
        assert run["logs"][0]["kl"] == 0.0, (name, run["logs"][0])
        assert (run["ref_sharded"] is not None) == sharded, name


def test_rloo_with_a_reference_model_at_stage_3_equals_trl_with_ddp(results):
    rloo = results["rloo"]
    zero, ddp = rloo["zero3"], rloo["ddp"]
    assert zero["lengths"] == ddp["lengths"] and any(a != b for a, b in zip(*zero["lengths"])), zero["lengths"]
    _close(zero["logs"], ddp["logs"])
    assert rloo["max_param_diff"] <= PARAM_TOL
    _sharded_reference(zero["ref_sharded"])
    assert zero["generate_gathers"] == [0] * STEPS  # ds3_gather_for_generation=True: the whole model gathered


def test_dpo_at_stage_3_equals_trl_with_ddp_and_starts_at_zero_rewards_in_bf16(results):
    dpo = results["dpo"]
    _close(dpo["zero3"]["logs"], dpo["ddp"]["logs"])
    assert dpo["max_param_diff"] <= PARAM_TOL
    _sharded_reference(dpo["zero3"]["ref_sharded"])
    first = dpo["zero3_bf16"]["logs"][0]
    assert dpo["zero3_bf16"]["ref_dtype"] == "torch.bfloat16"
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0, first


def test_a_reference_model_that_skipped_the_hook_is_a_named_error():
    """A reference model the host built without passing it through prepare_model(evaluation_mode=
    True) (a TRL that changed how it prepares one) is an error when the trainer is built, not a
    whole copy kept silently in another precision. No launch: the check alone, on a stand-in."""
    pytest.importorskip("accelerate")
    import types
    import weakref

    import torch.nn as nn

    from zerofast.integrations.hf import ZeroTrainerMixin
    from zerofast.integrations.hosts import IncompatibleHostError

    prepared = nn.Linear(2, 2)
    trainer = types.SimpleNamespace(
        ref_model=nn.Linear(2, 2), reward_funcs=[], _prepared_for_inference=weakref.WeakSet()
    )
    with pytest.raises(IncompatibleHostError, match="never passed through accelerator.prepare_model"):
        ZeroTrainerMixin._check_frozen_models(trainer)
    trainer._prepared_for_inference.add(trainer.ref_model)
    trainer.reward_funcs = [
        prepared,
        lambda completions, **kw: [0.0],
    ]  # a plain module or function: not TRL's to prepare
    ZeroTrainerMixin._check_frozen_models(trainer)


def test_trls_vllm_sync_sends_the_merged_weights_unit_by_unit(results):
    """ZeroGRPOTrainer(use_vllm=True, peft_config=LoRA) at stage 3, vLLM's server replaced by a
    recorder (vLLM does not run here): the trainer's VLLMGeneration reads opt.named_full_tensors
    (peft="merged") ([Note: TRL's vLLM weight sync]), and TRL's sync_weights() delivers PEFT's
    merge_and_unload().state_dict() of the same weights, bitwise, with matching metadata."""
    sync = results["vllm_sync"]
    assert sync["class"] == "_ZeroWeightSync", sync
    assert sync["updates"] == 1 and sync["equal"] and sync["metadata"], sync
