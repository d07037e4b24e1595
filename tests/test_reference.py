"""The reference stages (zerofast.reference: the ZeRO paper's stages in plain PyTorch, round-robin
owners) against single-process AdamW, and their memory."""

import pytest
import torch
from harness import run_ranks
from oracles import single_process_adamw
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import train_steps

from zerofast.reference import ReferenceZero, round_robin_owners
from zerofast.tools.models import make_gpt

STEPS = 5


def _train_reference(rank, world, stages, steps):
    """For each stage: train a fresh tiny GPT under the plain loop; return params and memory held."""
    out = {}
    for stage in stages:
        model = make_gpt("tiny")
        opt = ReferenceZero(model, stage=stage, **HYPER)
        held = []
        train_steps(model, opt, rank, steps, after_step=lambda _: held.append(opt.memory_held()))
        if stage == 3:  # gather once more to read the full parameters
            with torch.no_grad():
                opt.gather_params()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[stage] = {"params": params, "held": held[-1]}  # after the last step(), before zero_grad()
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reference_equals_single_process_adamw(world):
    results = run_ranks(_train_reference, world, args=((1, 2, 3), STEPS), timeout=240)
    expected = single_process_adamw(world, STEPS)
    model = make_gpt("tiny")
    names = [n for n, _ in model.named_parameters()]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    owners = round_robin_owners(names, world)
    total = sum(numel.values())
    for stage in (1, 2, 3):
        for rank, out in enumerate(results):
            got = out[stage]
            diff = max_abs_diff(got["params"], expected)
            assert diff <= fp32_tol(STEPS), f"stage {stage} rank {rank}/{world}: max abs diff {diff:.3g}"
            # The ZeRO paper's memory table in fp32 form: 4 B parameter, 4 B gradient, 8 B Adam moments per
            # element, each times the part the stage keeps on this rank.
            owned = sum(numel[n] for n in names if owners[n] == rank)
            want = {
                "params": 4 * (owned if stage == 3 else total),
                "grads": 4 * (total if stage == 1 else owned),
                "optimizer": 8 * owned,
            }
            assert got["held"] == want, f"stage {stage} rank {rank}/{world}: held {got['held']} != {want}"


def _bad_stage(rank, world):
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3; got 4"):
        ReferenceZero(make_gpt("tiny"), stage=4)
    return True


def test_reference_rejects_bad_stage():
    assert run_ranks(_bad_stage, 1) == [True]


def test_round_robin_owners():
    assert round_robin_owners("abcde", 2) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
