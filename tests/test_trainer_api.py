"""What trainers (transformers.Trainer, Accelerate, Lightning) call on an optimizer, on gloo ranks
in every stage, against single-process torch.optim.AdamW with torch.nn.utils.clip_grad_norm_ on the
global batch: clip_grad_norm_(inf) only measuring, clip_grad_norm_(max_norm) clipping, an external
model.zero_grad() after step() (and before a backward), zero_grad(set_to_none=False),
step_was_skipped on an fp16 overflow, and clip_grad_value_ (3 ranks)."""

import math

import torch
from harness import run_ranks
from oracles import single_process_clipped
from tolerances import HYPER, fp32_tol, max_abs_diff, norm_rel_tol
from training import rank_batch

from zerofast import LossScalePolicy, MixedPrecisionPolicy, ZeroAdam
from zerofast.tools.models import make_gpt

# Per step: the max_norm given to clip_grad_norm_ (inf: measure only), as trainers log the norm
# every step and clip in some.
CLIPS = [math.inf, 0.3, math.inf, 0.3]


def _trainer_loop(rank, world):
    out = {}
    for stage in (1, 2, 3):
        model = make_gpt("tiny")
        opt = ZeroAdam(model, stage=stage, **HYPER)
        norms, skipped = [], []
        for step, max_norm in enumerate(CLIPS):
            if step == 2:  # zeroed in place, then dropped by the model: the next backward starts afresh
                opt.zero_grad(set_to_none=False)
                model.zero_grad()
            _, loss = model(*rank_batch(model, step, rank))
            loss.backward()
            norms.append(float(opt.clip_grad_norm_(max_norm)))
            opt.step()
            skipped.append(opt.step_was_skipped)
            model.zero_grad()  # what Trainer / Accelerate call after step()
            model.zero_grad(set_to_none=False)
            opt.zero_grad()
        with opt.gathered_params():
            out[stage] = ({n: p.detach().clone() for n, p in model.named_parameters()}, norms, skipped)
    return out


def test_trainer_calls_match_adamw_with_clip_grad_norm():
    world = 2
    want, want_norms = single_process_clipped(world, CLIPS)
    assert want_norms[1] > 0.3 and want_norms[3] > 0.3, f"clipping must act in the clipped steps: {want_norms}"
    numel = sum(p.numel() for p in want.values())
    for rank, out in enumerate(run_ranks(_trainer_loop, world)):
        for stage, (params, norms, skipped) in out.items():
            where = f"stage {stage} rank {rank}"
            # ulps of the parameters' scale, accumulated over the steps, as every multi-rank test
            assert max_abs_diff(params, want) <= fp32_tol(len(CLIPS)), where
            for got, n0 in zip(norms, want_norms):  # a norm summed in another order: norm_rel_tol
                assert math.isclose(got, n0, rel_tol=norm_rel_tol(numel)), f"{where}: norm {got} vs torch {n0}"
            assert skipped == [False] * len(CLIPS), where


# Per step: clip_grad_value_'s bound (None: none), then clip_grad_norm_'s max_norm (None: none), as
# Lightning's gradient_clip_algorithm="value" and a user clipping both ways would call them.
VALUE_CLIPS = [(0.002, None), (None, None), (0.002, 0.01), (0.002, None)]


def _value_clip_loop(rank, world):
    out = {}
    for stage in (1, 2, 3):
        model = make_gpt("tiny")
        opt = ZeroAdam(model, stage=stage, **HYPER)
        norms = []
        for step, (value, max_norm) in enumerate(VALUE_CLIPS):
            _, loss = model(*rank_batch(model, step, rank))
            loss.backward()
            if value is not None:
                opt.clip_grad_value_(value)
            if max_norm is not None:  # the norm of the clamped gradient
                norms.append(float(opt.clip_grad_norm_(max_norm)))
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            out[stage] = ({n: p.detach().clone() for n, p in model.named_parameters()}, norms)
    return out


def test_clip_grad_value_matches_adamw_with_clip_grad_value():
    """clip_grad_value_ clamps each rank's reduced shard: on 3 ranks (a bound carried through a
    non-power-of-two average) in every stage, against torch.nn.utils.clip_grad_value_ (and then
    clip_grad_norm_) on the averaged gradient of the global batch."""
    world = 3
    model = make_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    want_norms, clamped = [], []
    for step, (value, max_norm) in enumerate(VALUE_CLIPS):
        total = sum(model(*rank_batch(model, step, r))[1] for r in range(world)) / world
        total.backward()
        if value is not None:
            clamped.append(sum(int((p.grad.abs() > value).sum()) for p in model.parameters()))
            torch.nn.utils.clip_grad_value_(model.parameters(), value)
        if max_norm is not None:
            want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert min(clamped) > 0 and want_norms[0] > 0.01, f"both clips must act: {clamped}, {want_norms}"
    numel = sum(p.numel() for p in want.values())
    for rank, out in enumerate(run_ranks(_value_clip_loop, world)):
        for stage, (params, norms) in out.items():
            where = f"stage {stage} rank {rank}"
            assert max_abs_diff(params, want) <= fp32_tol(len(VALUE_CLIPS)), where  # as every multi-rank test
            assert math.isclose(norms[0], want_norms[0], rel_tol=norm_rel_tol(numel)), where


def _fp16_overflow(rank, world):
    model = make_gpt("tiny")
    # A loss scale of 2^40 makes the fp16 gradients overflow: the first step is skipped on every rank.
    opt = ZeroAdam(
        model,
        stage=2,
        mixed_precision=MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(init_scale=2.0**40)),
        **HYPER,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, loss = model(*rank_batch(model, 0, rank))
    opt.backward(loss)
    opt.step()
    first = opt.step_was_skipped
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return first, unchanged, opt.loss_scale


def test_step_was_skipped_on_fp16_overflow():
    for first, unchanged, scale in run_ranks(_fp16_overflow, 2):
        assert first and unchanged
        assert scale == 2.0**39  # backed off once, GradScaler's rule


def _requires_grad_changed(rank, world):
    out = {}
    for stage in (1, 2, 3):
        for name in ("blocks.0.attn.qkv.weight", "wte.weight"):
            model = make_gpt("tiny")
            opt = ZeroAdam(model, stage=stage, **HYPER)
            param = dict(model.named_parameters())[name]
            param.requires_grad_(False)
            with opt.gathered_params():
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
            _, loss = model(*rank_batch(model, 0, rank))
            loss.backward()
            try:
                opt.step()
                out[stage, name] = None
            except RuntimeError as e:
                out[stage, name] = str(e)
            with opt.gathered_params():
                unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
            out[stage, name, "unchanged"] = unchanged
    return out


def test_requires_grad_changed_after_construction_is_named():
    """A parameter frozen after ZeroAdam was built would silently stop training: step() refuses,
    naming it, on every rank, and applies nothing (the check runs before the step's agreement)."""
    for out in run_ranks(_requires_grad_changed, 2):
        for stage in (1, 2, 3):
            for name in ("blocks.0.attn.qkv.weight", "wte.weight"):
                message = out[stage, name]
                assert message is not None and f"{name}.requires_grad changed from True to False" in message, message
                assert out[stage, name, "unchanged"], (stage, name)
