"""Mixed precision on real gloo ranks: bf16 and fp16 against single-process mixed-precision
AdamW with an fp32 master copy, fp16 dynamic loss scaling against torch.amp.GradScaler, global
gradient clipping against torch.nn.utils.clip_grad_norm_, gradient accumulation under no_sync()
against single-process AdamW on the combined batch; every stage, 2 and 3 ranks."""

import math

import pytest
import torch
from harness import run_ranks
from models import Quirky
from oracles import single_process_adamw, single_process_clipped, single_process_mixed
from probes import full_master
from tolerances import HYPER, ULP_REL, fp32_tol, low_precision_tol, lp_param_tol, max_abs_diff, norm_rel_tol
from training import rank_batch, train_steps, zero_options

from zerofast import ZeroAdam
from zerofast.optim.zero_adam import parts_of
from zerofast.tools.models import make_gpt

STEPS = 6
STAGES = (1, 2, 3)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _shapes():
    return {n: tuple(p.shape) for n, p in make_gpt("tiny").named_parameters()}


def _train_mixed(rank, world, stage, precision, reduce_dtype, scaler, max_norm, clip_call, steps):
    model = make_gpt("tiny")
    opt = ZeroAdam(
        model,
        **zero_options(stage, bucket_mb=0.01, mixed_precision=precision, reduce_dtype=reduce_dtype, **(scaler or {})),
        max_grad_norm=None if clip_call else max_norm,
        **HYPER,
    )
    assert all(p.dtype == DTYPES[precision] for p in model.parameters())
    history = []

    def before_step(step):  # the scale this step's backward used (step() changes it), the norm clipped
        history.append([opt.loss_scale, None, float(opt.clip_grad_norm_(max_norm)) if clip_call else None])

    def after_step(step):
        history[-1][1] = opt.step_was_skipped

    train_steps(model, opt, rank, steps, backward=opt.backward, before_step=before_step, after_step=after_step)
    history = [tuple(h) for h in history]
    with opt.gathered_params():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return params, opt.checkpoint_view.trainable.state_pieces("master"), history


def _run_matrix(rank, world, configs):
    return {key: _train_mixed(rank, world, *cfg) for key, cfg in configs.items()}


def _check(results, key, world, oracle, dtype, steps, where):
    """ZeroAdam's parameters, fp32 master, loss-scale decisions and norms against the mixed-precision
    oracle, within the low-precision tolerances of tests/tolerances.py."""
    params0, master_oracle, history_oracle = oracle
    param_tol, master_tol = lp_param_tol(dtype, steps, params0), low_precision_tol(dtype, steps)
    master = full_master([out[key][1] for out in results], _shapes())
    d_master = max_abs_diff(master, master_oracle)
    assert d_master <= master_tol, f"{where}: fp32 master differs from the oracle's by {d_master:.3g}"
    for rank, out in enumerate(results):
        params, _, history = out[key]
        d = max_abs_diff(params, params0)
        assert d <= param_tol, f"{where} rank {rank}/{world}: parameters differ by {d:.3g}"
        # The same decisions and the same scale sequence as GradScaler, and the same norms.
        assert [h[:2] for h in history] == [h[:2] for h in history_oracle], (
            f"{where}: (scale, skipped) per step {[h[:2] for h in history]} != oracle's {[h[:2] for h in history_oracle]}"
        )
        for (_, _, n), (_, skipped, n0) in zip(history, history_oracle):
            if n0 is not None and not skipped:
                assert n is None or math.isclose(n, n0, rel_tol=ULP_REL[dtype]), f"{where}: norm {n} != torch's {n0}"
    # Every rank holds the same parameters.
    for out in results[1:]:
        assert all(torch.equal(out[key][0][k], results[0][key][0][k]) for k in params0)


# Tolerances: low_precision_tol and lp_param_tol (tests/tolerances.py). The ranks and the oracle
# compute per-rank gradients with the same ops, but a shard-wise norm, gloo's order on 3 ranks, or
# another processor's matmul blocking can round one low-precision parameter to its neighbour, after
# which every gradient differs by up to one ulp of that dtype. Norms: relative one ulp of the dtype
# (the gradients they sum are computed from parameters that may differ by one).


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_matches_single_process_mixed_precision(world):
    """Reduced in fp32 (2 and 3 ranks) and in bf16 (2 ranks: a sum of two is the same in any order).
    A bf16 sum of three rounds differently in each order, and gloo's order is its own (measured:
    37% of master elements then differ by more than 1e-5 after 6 steps, stage 1 and 2 alike), so no
    single-process oracle reproduces it; stages 1-3 are checked on 3 ranks with fp32 reduces."""
    reduces = {"fp32-reduce": torch.float32, "bf16-reduce": torch.bfloat16}
    if world == 3:
        del reduces["bf16-reduce"]
    configs = {
        (name, stage): (stage, "bf16", dtype, None, None, False, STEPS)
        for name, dtype in reduces.items()
        for stage in STAGES
    }
    results = run_ranks(_run_matrix, world, args=(configs,), timeout=400)
    for name, reduce_dtype in reduces.items():
        oracle = single_process_mixed(world, STEPS, torch.bfloat16, reduce_dtype=reduce_dtype)
        for stage in STAGES:
            _check(
                results, (name, stage), world, oracle, torch.bfloat16, STEPS, f"bf16 {name} stage {stage} world {world}"
            )


# init_scale 2^16 overflows fp16 at once (d(scaled loss)/d(loss) = 65536 rounds to inf in fp16);
# growth_interval 2 grows it back within the run, and the next growth overflows again: a run with
# several skipped steps, halvings and growths.
SCALER = dict(init_scale=2.0**16, growth_interval=2)


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_loss_scaling_and_clipping_match_gradscaler(world):
    steps = 8
    configs = {}
    for stage in STAGES:
        configs[("scale", stage)] = (stage, "fp16", torch.float32, SCALER, None, False, steps)
        configs[("scale+clip", stage)] = (stage, "fp16", torch.float32, SCALER, 0.5, stage == 2, steps)
    results = run_ranks(_run_matrix, world, args=(configs,), timeout=400)
    plain = single_process_mixed(world, steps, torch.float16, scaler=SCALER)
    clipped = single_process_mixed(world, steps, torch.float16, scaler=SCALER, max_norm=0.5)
    skipped = [h[1] for h in plain[2]]
    assert skipped[0] and not all(skipped), f"the run should overflow at first and then train: {skipped}"
    assert any(h[2] is not None and h[2] > 0.5 for h in clipped[2]), "clipping never acted"
    for stage in STAGES:
        _check(results, ("scale", stage), world, plain, torch.float16, steps, f"fp16 stage {stage}")
        _check(results, ("scale+clip", stage), world, clipped, torch.float16, steps, f"fp16+clip stage {stage}")


# --- global gradient clipping in fp32, against clip_grad_norm_ on the single-process model ---------


def _train_clipped(rank, world, max_norm, steps):
    out = {}
    for stage in STAGES:
        for partition in ("flat", "round_robin"):
            for clip_call in (False, True):
                model = make_gpt("tiny")
                opt = ZeroAdam(
                    model,
                    **zero_options(stage, partition=partition, bucket_mb=0.01),
                    max_grad_norm=None if clip_call else max_norm,
                    **HYPER,
                )
                norms = []
                clip = (lambda _: norms.append(float(opt.clip_grad_norm_(max_norm)))) if clip_call else None
                train_steps(model, opt, rank, steps, before_step=clip)
                with opt.gathered_params():
                    out[(stage, partition, clip_call)] = (
                        {n: p.detach().clone() for n, p in model.named_parameters()},
                        norms,
                    )
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_matches_clip_grad_norm(world):
    max_norm = 0.3
    results = run_ranks(_train_clipped, world, args=(max_norm, STEPS), timeout=400)
    want, want_norms = single_process_clipped(world, [max_norm] * STEPS)
    assert all(n > max_norm for n in want_norms), f"clipping should act in every step: {want_norms}"
    unclipped = single_process_adamw(world, STEPS)
    assert max_abs_diff(unclipped, want) > 1e-4, "clipping made no visible difference: the test would prove nothing"
    for rank, out in enumerate(results):
        for key, (params, norms) in out.items():
            d = max_abs_diff(params, want)
            assert d <= fp32_tol(STEPS), f"{key} rank {rank}/{world}: {d:.3g} from AdamW with clip_grad_norm_"
            numel = sum(p.numel() for p in params.values())
            for n, n0 in zip(norms, want_norms):
                assert math.isclose(n, n0, rel_tol=norm_rel_tol(numel)), (
                    f"{key}: clip_grad_norm_ returned {n}, torch {n0}"
                )


# --- gradient accumulation under no_sync(), against AdamW on the combined batch ---------------------

MICRO = 3


def _micro_batch(model, step, rank, k):
    return rank_batch(model, 100 * k + step, rank)


def single_process_accumulated(world, steps):
    """AdamW on one process, each step over every rank's every micro-batch."""
    model = make_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(steps):
        losses = [model(*_micro_batch(model, step, r, k))[1] for r in range(world) for k in range(MICRO)]
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_accumulated(rank, world, steps):
    out = {}
    variants = [(1, False), (2, False), (2, True), (3, False), (3, True)]
    for stage, local in variants:
        for partition in ("flat", "greedy"):
            model = make_gpt("tiny")
            opt = ZeroAdam(
                model, **zero_options(stage, partition=partition, bucket_mb=0.01, accumulate_locally=local), **HYPER
            )
            reduced = []
            for step in range(steps):
                with opt.no_sync():
                    for k in range(MICRO - 1):
                        _, loss = model(*_micro_batch(model, step, rank, k))
                        (loss / MICRO).backward()
                _, loss = model(*_micro_batch(model, step, rank, MICRO - 1))
                (loss / MICRO).backward()
                opt.step()
                opt.zero_grad()
                stats = opt.report().comm
                reduced.append(
                    sum(
                        v for k, v in stats.items() if k in ("shard/all_reduce", "shard/reduce", "shard/reduce_scatter")
                    )
                )
            with opt.gathered_params():
                out[(stage, local, partition)] = (
                    {n: p.detach().clone() for n, p in model.named_parameters()},
                    reduced,
                    sum(b.numel for b in opt.checkpoint_view.trainable.layout.buckets) * 4,
                )
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_accumulation_matches_the_combined_batch(world):
    results = run_ranks(_train_accumulated, world, args=(STEPS,), timeout=400)
    want = single_process_accumulated(world, STEPS)
    for rank, out in enumerate(results):
        for (stage, local, partition), (params, reduced, bucket_bytes) in out.items():
            where = f"stage {stage} accumulate_locally={local} {partition} rank {rank}/{world}"
            d = max_abs_diff(params, want)
            assert d <= fp32_tol(STEPS), f"{where}: {d:.3g} from AdamW on the combined batch"
            # Stage 1 and accumulate_locally reduce once per step; stages 2 and 3 every micro-batch.
            times = 1 if (stage == 1 or local) else MICRO
            assert reduced == [times * bucket_bytes] * STEPS, (
                f"{where}: reduced {reduced}, want {times} x {bucket_bytes}"
            )


# --- an inf in one rank's gradient: skipped on every rank, nothing changes -------------------------


def _snapshot(opt, model):
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    shard = parts_of(opt).shard  # the test seam: every buffer of the state, padding included
    return dict(
        params=params,
        master=shard.master.clone(),
        exp_avg=shard.exp_avg.clone(),
        exp_avg_sq=shard.exp_avg_sq.clone(),
        param_shard=shard.param_shard.clone(),
        buffers=[b.clone() for b in shard.param_buffers if b.untyped_storage().nbytes()],
        steps=opt.checkpoint_view.step_counts(),
    )


def _inf_on_one_rank(rank, world, stage, bad_rank):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.01, mixed_precision="fp16", init_scale=1024.0), **HYPER)
    out = []
    for step in range(4):
        _, loss = model(*rank_batch(model, step, rank))
        handle = None
        if step == 2 and rank == bad_rank:  # inf and nan in this rank's gradient of one parameter only
            handle = model.wpe.weight.register_hook(lambda g: g * float("inf"))
        scale = opt.loss_scale
        opt.backward(loss)
        if handle is not None:
            handle.remove()
        before = _snapshot(opt, model)
        opt.step()
        after = _snapshot(opt, model)
        opt.zero_grad()
        same = all(
            torch.equal(a, b)
            for k in ("master", "exp_avg", "exp_avg_sq", "param_shard")
            for a, b in [(before[k], after[k])]
        )
        same = same and all(torch.equal(a, b) for a, b in zip(before["params"], after["params"]))
        same = same and before["steps"] == after["steps"]
        out.append((opt.step_was_skipped, same, scale, opt.loss_scale))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_inf_in_one_ranks_gradient_skips_the_step_everywhere(world, stage):
    for rank, steps in enumerate(run_ranks(_inf_on_one_rank, world, args=(stage, world - 1))):
        for step, (skipped, same, scale, new_scale) in enumerate(steps):
            if step == 2:
                assert skipped and same, f"rank {rank}/{world} stage {stage}: the bad step was not skipped bit for bit"
                assert new_scale == scale * 0.5
            else:
                assert not skipped and not same, (
                    f"rank {rank}/{world} stage {stage} step {step}: a clean step did not update"
                )
                assert new_scale == scale


# --- memory follows the ZeRO paper's mixed-precision table ----------------------------------------


def _memory_mixed(rank, world, stage):
    model = make_gpt("tiny")
    numel = sum(p.numel() for p in model.parameters())
    opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.01), mixed_precision="bf16", **HYPER)
    _, loss = model(*rank_batch(model, 0, rank))
    opt.backward(loss)
    opt.step()
    r = opt.report().memory
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    layout = opt.checkpoint_view.trainable.layout
    return dict(
        report=r,
        grads=grads,
        numel=numel,
        shard=layout.shard_numel(rank),
        padded=sum(b.numel for b in layout.buckets),
        padding=layout.shard_numel(rank) - layout.owned_numel(rank),
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_memory_follows_the_papers_table(world, stage):
    """2Φ parameters, 2Φ gradients, 12Φ optimizer state (fp32 master, m, v), each sharded as the
    stage says; a shard is this rank's owned elements plus padding ([Note: padding])."""
    for rank, m in enumerate(run_ranks(_memory_mixed, world, args=(stage,))):
        r, numel, shard = m["report"], m["numel"], m["shard"]
        where = f"stage {stage} rank {rank}/{world}"
        assert r.optimizer + r.master_copy == 12 * shard, where
        assert r.master_copy == 4 * shard, where
        # Stage 1: the full gradients, in its flat gradient buckets (padding included), which .grad
        # were views of until step(); stages 2 and 3: the reduced shard.
        assert m["grads"] == 0, where
        assert (r.grads, r.grad_shard) == ((2 * m["padded"], 0) if stage == 1 else (0, 2 * shard)), where
        if stage < 3:
            assert r.params - r.param_padding == 2 * numel, where
        else:  # after step(): the bf16 shard only, nothing gathered
            assert r.params == 2 * shard, where
        assert m["padding"] <= 4 * world * 8, where


# --- bad arguments and misuse -----------------------------------------------------------------------


def _mp(*args, **kwargs):
    from zerofast import MixedPrecisionPolicy

    return MixedPrecisionPolicy(*args, **kwargs)


def _fp16_scaling(**kwargs):
    from zerofast import LossScalePolicy, MixedPrecisionPolicy

    return MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(**kwargs))


# (a name, the keywords, built inside the check since a policy checks its fields when built; the message)
BAD = [
    (
        "fp8",
        lambda: dict(mixed_precision="fp8"),
        "mixed_precision must be None, 'no', 'bf16', 'fp16' or a MixedPrecisionPolicy; got 'fp8'",
    ),
    (
        "int8 param",
        lambda: dict(mixed_precision=_mp(torch.int8)),
        "param_dtype must be torch.float32, torch.bfloat16 or torch.float16; got torch.int8",
    ),
    ("int8 reduce", lambda: dict(mixed_precision=_mp(torch.bfloat16, torch.int8)), "reduce_dtype must be"),
    (
        "bf16 reduce in fp32",
        lambda: dict(mixed_precision=_mp(torch.float32, torch.bfloat16)),
        "reduce_dtype=torch.bfloat16 needs a low-precision param_dtype",
    ),
    (
        "fp16 reduce of bf16",
        lambda: dict(mixed_precision=_mp(torch.bfloat16, torch.float16)),
        "reduce_dtype=torch.float16 needs param_dtype=torch.float16",
    ),
    (
        "bf16 scaling",
        lambda: dict(mixed_precision=_mp(torch.bfloat16, loss_scale=_fp16_scaling().loss_scale)),
        "loss_scale applies to float16 parameters only",
    ),
    ("max_grad_norm 0", lambda: dict(max_grad_norm=0.0), "max_grad_norm must be None or a number > 0; got 0.0"),
    ("max_grad_norm -1", lambda: dict(max_grad_norm=-1), "max_grad_norm must be None or a number > 0; got -1"),
    ("init_scale", lambda: dict(mixed_precision=_fp16_scaling(init_scale=0)), "init_scale must be a number > 0; got 0"),
    (
        "growth_factor",
        lambda: dict(mixed_precision=_fp16_scaling(growth_factor=0.5)),
        "growth_factor must be a number > 1; got 0.5",
    ),
    (
        "backoff_factor",
        lambda: dict(mixed_precision=_fp16_scaling(backoff_factor=1.5)),
        "backoff_factor must be a number in (0, 1); got 1.5",
    ),
    (
        "growth_interval",
        lambda: dict(mixed_precision=_fp16_scaling(growth_interval=0)),
        "growth_interval must be an integer >= 1; got 0",
    ),
    (
        "accumulate_locally",
        lambda: dict(comm=__import__("zerofast").CommPolicy(accumulate_locally="yes")),
        "accumulate_locally must be True or False; got 'yes'",
    ),
]


def _misuse(rank, world):
    errors = {}
    for name, make_kwargs, _ in BAD:
        try:
            ZeroAdam(make_gpt("tiny"), **make_kwargs())
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = str(e)

    def catch(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            return str(e)
        return None

    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=2, **HYPER)
    x, y = rank_batch(model, 0, rank)

    def nested():
        with opt.no_sync():
            with opt.no_sync():
                pass

    def step_inside():
        with opt.no_sync():
            model(x, y)[1].backward()
            opt.step()

    errors["nested"] = catch(nested)
    errors["step_inside"] = catch(step_inside)
    opt.step()  # the accumulated gradient from step_inside: a normal step
    errors["clip_zero"] = catch(lambda: opt.clip_grad_norm_(0))
    model(x, y)[1].backward()
    errors["zero_grad_mid_step"] = catch(opt.zero_grad)
    opt.step()
    errors["zero_grad_after_step"] = catch(opt.zero_grad)
    fp16_model = make_gpt("tiny")
    fp16 = ZeroAdam(fp16_model, stage=1, mixed_precision="fp16", **HYPER)

    def unscaled():
        fp16_model(x, y)[1].backward()
        fp16.step()

    errors["unscaled"] = catch(unscaled)
    empty = ZeroAdam(make_gpt("tiny"), **zero_options(2, mixed_precision="fp16", growth_interval=1), **HYPER)
    scale = empty.loss_scale
    for _ in range(3):  # steps without any gradient: no evidence, the scale stays
        empty.step()
    errors["empty_steps_keep_scale"] = empty.loss_scale == scale
    bf16_model = make_gpt("tiny").to(torch.bfloat16)
    errors["bf16_without_mixed"] = catch(lambda: ZeroAdam(bf16_model, **HYPER))
    return errors


def test_bad_arguments_and_misuse_get_named_errors():
    (errors,) = run_ranks(_misuse, 1)
    for name, _, message in BAD:
        got = errors[name]
        assert got is not None and message in got, f"{name}: {got!r} lacks {message!r}"
    assert "cannot be nested" in errors["nested"]
    assert "step() was called inside `with opt.no_sync():`" in errors["step_inside"]
    assert "max_norm must be a number > 0; got 0" in errors["clip_zero"]
    assert "call opt.backward(loss)" in errors["unscaled"]
    assert "zero_grad() was called between backward and step()" in errors["zero_grad_mid_step"]
    assert errors["zero_grad_after_step"] is None
    assert errors["empty_steps_keep_scale"] is True
    assert "mixed_precision='bf16'" in errors["bf16_without_mixed"]


def _train_accumulated_quirky(rank, world, steps):
    """Quirky under no_sync: `sometimes` gets a gradient only in the middle one of three
    micro-batches (never in the last), `rank0_only` only on rank 0, `frozen` never."""
    out = {}
    for stage, local in [(1, False), (2, False), (2, True), (3, False), (3, True)]:
        model = Quirky()
        opt = ZeroAdam(model, **zero_options(stage, bucket_mb=0.001, accumulate_locally=local), **HYPER)
        for step in range(steps):
            with opt.no_sync():
                for k in range(MICRO - 1):
                    (model(*_micro_batch(model, step, rank, k), k + 1, rank) / MICRO).backward()
            (model(*_micro_batch(model, step, rank, MICRO - 1), MICRO, rank) / MICRO).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            out[(stage, local)] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def single_process_accumulated_quirky(world, steps):
    model = Quirky()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False, **HYPER)
    for step in range(steps):
        losses = [model(*_micro_batch(model, step, r, k), k + 1, r) for r in range(world) for k in range(MICRO)]
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_with_parameters_missing_from_some_micro_batches(world):
    results = run_ranks(_train_accumulated_quirky, world, args=(STEPS,), timeout=400)
    want = single_process_accumulated_quirky(world, STEPS)
    for rank, out in enumerate(results):
        for (stage, local), params in out.items():
            d = max_abs_diff(params, want)
            assert d <= fp32_tol(STEPS), f"stage {stage} accumulate_locally={local} rank {rank}/{world}: {d:.3g}"
