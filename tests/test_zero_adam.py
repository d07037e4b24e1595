"""ZeroAdam stages 1 and 2 on real gloo ranks, against both oracles: single-process
torch.optim.AdamW on the global batch, and the reference stage (zerofast.reference: the ZeRO
paper's stages in plain PyTorch, round-robin owners)."""

import pytest
import torch
from harness import run_ranks
from models import Quirky
from oracles import single_process_adamw, single_process_quirky
from probes import held_tensor_bytes
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import make_scheduler, rank_batch, train_steps, two_groups, zero_options

from zerofast import ZeroAdam
from zerofast.partition import imbalance
from zerofast.reference import ReferenceZero, round_robin_owners
from zerofast.tools.models import make_gpt

STEPS = 10
PARTITIONS = ("flat", "round_robin", "greedy")
TOL = fp32_tol(STEPS)  # see the tolerances in tests/tolerances.py


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_gpt(rank, engine, stage, partition="flat", bucket_mb=0.01, steps=STEPS, overlap=True):
    model = make_gpt("tiny")
    if engine == "zero":
        opt = ZeroAdam(model, **zero_options(stage, partition=partition, bucket_mb=bucket_mb, overlap=overlap), **HYPER)
    else:
        opt = ReferenceZero(model, stage=stage, **HYPER)
    train_steps(model, opt, rank, steps)
    return _params(model)


def _matrix(rank, world):
    out = {}
    for stage in (1, 2):
        out[("reference", stage)] = _train_gpt(rank, "reference", stage)
        for partition in PARTITIONS:
            out[("zero", stage, partition)] = _train_gpt(rank, "zero", stage, partition)
    out["repeat"] = _train_gpt(rank, "zero", 2, "flat")
    out["no_overlap"] = _train_gpt(rank, "zero", 2, "flat", overlap=False)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stages_1_2_match_both_oracles(world):
    results = run_ranks(_matrix, world, timeout=300)
    single = single_process_adamw(world, STEPS)
    for rank, out in enumerate(results):
        for stage in (1, 2):
            reference = out[("reference", stage)]
            for partition in PARTITIONS:
                got = out[("zero", stage, partition)]
                where = f"stage {stage} {partition} rank {rank}/{world}"
                assert max_abs_diff(got, single) <= TOL, f"{where} vs AdamW: {max_abs_diff(got, single):.3g}"
                assert max_abs_diff(got, reference) <= TOL, f"{where} vs reference: {max_abs_diff(got, reference):.3g}"
        # Bitwise repeatable: the same run twice gives the same bits. See [Note: determinism].
        first = out[("zero", 2, "flat")]
        assert all(torch.equal(first[k], out["repeat"][k]) for k in first)
        # Launching every bucket at step() instead of during backward changes nothing.
        assert all(torch.equal(first[k], out["no_overlap"][k]) for k in first)
    # Every rank ends with the same parameters.
    for out in results[1:]:
        assert all(
            torch.equal(out[("zero", 2, "flat")][k], results[0][("zero", 2, "flat")][k])
            for k in out[("zero", 2, "flat")]
        )


def _train_quirky(rank, world, stage, partition, groups, scheduler, bucket_mb, steps):
    model = Quirky()
    params = dict(param_groups=two_groups(model)) if groups else {}
    opt = ZeroAdam(model, **zero_options(stage, partition=partition, bucket_mb=bucket_mb), **HYPER, **params)
    sched = make_scheduler(opt) if scheduler else None
    frozen_before = model.frozen.detach().clone()
    train_steps(
        model,
        opt,
        rank,
        steps,
        forward=lambda m, x, y, step: m(x, y, step, rank),
        after_step=lambda _: sched.step() if sched else None,
    )
    assert torch.equal(model.frozen, frozen_before), "a frozen parameter must never change"
    return _params(model)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("partition", PARTITIONS)
def test_awkward_models(world, stage, partition):
    """Tied weights, a frozen parameter, a parameter unused in odd steps, one used only on rank 0,
    odd parameter counts, two groups with their own lr and weight decay, an LR scheduler, and
    buckets (1 KiB) smaller than the largest parameter."""
    results = run_ranks(_train_quirky, world, args=(stage, partition, True, True, 0.001, STEPS), timeout=180)
    expected = single_process_quirky(world, STEPS, groups=True, scheduler=True)
    for rank, got in enumerate(results):
        diff = max_abs_diff(got, expected)
        assert diff <= TOL, f"stage {stage} {partition} rank {rank}/{world}: {diff:.3g}"


def _unused_everywhere(rank, world):
    """A parameter with no gradient on any rank keeps its value and its step count."""
    model = Quirky()
    opt = ZeroAdam(model, stage=2, **HYPER)
    before = model.sometimes.weight.detach().clone()
    # Step 1 alone: odd, so `sometimes` is unused.
    train_steps(model, opt, rank, 1, start=1, forward=lambda m, x, y, step: m(x, y, step, rank))
    counts = opt.checkpoint_view.step_counts()
    return torch.equal(before, model.sometimes.weight), counts["sometimes.weight"], counts["gpt.wte.weight"]


def test_unused_parameter_is_left_untouched():
    for same, steps, other in run_ranks(_unused_everywhere, 2):
        assert same and steps == 0 and other == 1


def _memory(rank, world, stage, partition):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, **zero_options(stage, partition=partition, bucket_mb=0.01), **HYPER)
    _, loss = model(*rank_batch(model, 0, rank))
    loss.backward()
    opt.step()
    report = opt.report().memory
    measured = {
        "grads": sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None),
        "held": held_tensor_bytes(opt),
    }
    numel = sum(p.numel() for p in model.parameters())
    layout = opt.checkpoint_view.trainable.layout
    return dict(
        report=report,
        measured=measured,
        numel=numel,
        owned=layout.owned_numel(rank),
        shard=layout.shard_numel(rank),
        buckets=len(layout.buckets),
        padded=sum(b.numel for b in layout.buckets),
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("partition", ["flat", "round_robin"])
def test_memory_follows_the_papers_table(world, stage, partition):
    for m in run_ranks(_memory, world, args=(stage, partition)):
        owned, shard, numel = m["owned"], m["shard"], m["numel"]
        # The ZeRO paper's memory table, fp32 form: what the optimizer holds is the parameters (4
        # bytes per element, in the flat buffers, padding included), the gradients (stage 1: in
        # full, in its flat gradient buckets; stage 2: the reduced shard, 4 per owned element) and
        # Adam's moments (8 per owned element); in fp32 there is no separate master. The shard adds
        # only padding: see [Note: padding]. After step() no .grad is left (stage 1's were views of
        # its buckets).
        grads = 4 * m["padded"] if stage == 1 else 4 * shard
        assert m["measured"]["held"] == 4 * m["padded"] + grads + 8 * shard
        assert shard - owned <= (m["buckets"] * 4 * world if partition == "flat" else 0)
        assert m["measured"]["grads"] == 0
        r = m["report"]
        assert r.grads + r.grad_shard == grads
        assert r.params + r.grads + r.grad_shard + r.optimizer + r.master_copy == m["measured"]["held"]
        assert (r.optimizer, r.master_copy) == (8 * shard, 0)
        # After step() no bucket buffer is alive; the peak is what backward needed at most (stage
        # 1 needs none: its gradients are the buckets).
        assert m["report"].bucket_buffers == 0
        if stage == 1:
            assert m["report"].bucket_buffers_peak == 0
        else:
            assert 0 < m["report"].bucket_buffers_peak <= 4 * (numel + m["buckets"] * 4 * world)


def _different_models(rank, world):
    model = make_gpt("tiny", n_embd=16 if rank == 0 else 24)
    try:
        ZeroAdam(model, stage=2)
    except ValueError as e:
        return str(e)
    return None


def test_different_models_fail_clearly_on_every_rank():
    messages = run_ranks(_different_models, 2, timeout=60)
    for m in messages:
        assert m is not None and "ranks hold different models" in m and "rank 1 has param" in m, m


def _bad_arguments(rank, world):
    model = make_gpt("tiny")
    from zerofast import CommPolicy, UnitPolicy

    # Each case builds its keywords inside the check: a policy checks its own fields when built.
    cases = [
        (lambda: dict(stage=4), "stage must be 1, 2 or 3; got 4"),
        (lambda: dict(stage=True), "stage must be 1, 2 or 3; got True"),
        (
            lambda: dict(comm=CommPolicy(partition="zigzag")),
            "CommPolicy: partition must be one of flat, round_robin, greedy; got 'zigzag'",
        ),
        (lambda: dict(comm=CommPolicy(bucket_mb=0)), "CommPolicy: bucket_mb must be None or a number > 0; got 0"),
        (lambda: dict(comm=CommPolicy(bucket_mb=True)), "CommPolicy: bucket_mb must be None or a number > 0; got True"),
        (
            lambda: dict(comm=CommPolicy(bucket_buffers=-1)),
            r"bucket_buffers must be an integer >= 0 \(0: no bound\); got -1",
        ),
        (
            lambda: dict(comm=CommPolicy(bucket_buffers=1.5)),
            r"bucket_buffers must be an integer >= 0 \(0: no bound\); got 1.5",
        ),
        (lambda: dict(comm=dict(partition="flat")), "comm must be a CommPolicy or None; got dict"),
        (lambda: dict(stage=3, comm=CommPolicy(bucket_mb=8)), "bucket_mb sets stages 1 and 2's buckets.*stage=3"),
        (
            lambda: dict(stage=3, comm=CommPolicy(overlap_param_gather=True)),
            "overlap_param_gather applies to stages 1 and 2",
        ),
        (lambda: dict(lr=-1.0), "lr must be a number >= 0; got -1.0"),
        (lambda: dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\); got \(0.9, 1.0\)"),
        (lambda: dict(eps=-1e-8), "eps must be a number >= 0; got -1e-08"),
        (lambda: dict(stage=3, units=UnitPolicy(min_unit_mb=-1)), "min_unit_mb must be None or a number >= 0; got -1"),
        (
            lambda: dict(stage=3, units=UnitPolicy(min_unit_mb="2")),
            "min_unit_mb must be None or a number >= 0; got '2'",
        ),
        (
            lambda: dict(stage=3, units=UnitPolicy(modules=[model.blocks[0]], min_unit_mb=1)),
            "min_unit_mb=1 merges the default units.*pass one or the other",
        ),
        (lambda: dict(stage=2, units=UnitPolicy(min_unit_mb=1)), "units apply to stage 3 only"),
        (lambda: dict(weight_decay=-0.1), "weight_decay must be a number >= 0; got -0.1"),
        (lambda: dict(param_groups=[{"params": [model.wte.weight]}]), "is in no param group"),
        (
            lambda: dict(param_groups=[{"params": [model.wte.weight]}, {"params": list(model.parameters())}]),
            r"wte.weight is in param_groups\[0\] and param_groups\[1\]",
        ),
        (
            lambda: dict(param_groups=[{"params": [torch.nn.Parameter(torch.zeros(3))]}]),
            "not one of the model's trainable parameters",
        ),
        (
            lambda: dict(param_groups=[{"params": list(model.parameters()), "momentum": 0.9}]),
            "unknown keys \\['momentum'\\]",
        ),
        (
            lambda: dict(param_groups=[{"params": list(model.parameters()), "lr": -2}]),
            r"param_groups\[0\]: lr must be a number >= 0; got -2",
        ),
        (lambda: dict(adamw="yes"), "adamw must be True or False; got 'yes'"),
        (lambda: dict(comm=CommPolicy(overlap=1)), "overlap must be True or False; got 1"),
        (
            lambda: dict(comm=CommPolicy(overlap_param_gather=None)),
            "overlap_param_gather must be True or False; got None",
        ),
        (lambda: dict(comm=CommPolicy(check_collectives="yes")), "check_collectives must be True or False; got 'yes'"),
        (
            lambda: dict(process_group="world"),
            "process_group must be a torch.distributed ProcessGroup, a 2-D DeviceMesh",
        ),
        # A keyword of before the policies names where it lives now; an unknown one is named.
        (
            lambda: dict(bucket_mb=25),
            r"the keyword bucket_mb= moved into a policy: pass comm=CommPolicy\(bucket_mb=...\)",
        ),
        (lambda: dict(partition="greedy"), r"pass comm=CommPolicy\(partition=...\)"),
        (
            lambda: dict(shard_size=2),
            r"the keyword shard_size= moved into a policy: pass comm=CommPolicy\(shard_size=...\)",
        ),
        (lambda: dict(min_unit_mb=1), r"pass units=UnitPolicy\(min_unit_mb=...\)"),
        (lambda: dict(init_scale=8.0), r"loss_scale=LossScalePolicy\(init_scale=...\)"),
        (lambda: dict(reduce_dtype=torch.float32), r"MixedPrecisionPolicy\(param_dtype, reduce_dtype=...\)"),
        (lambda: dict(bucket_size=3), "unexpected keyword argument 'bucket_size'"),
    ]
    import re

    failures = []
    for make_kwargs, pattern in cases:
        try:
            kwargs = make_kwargs()
            ZeroAdam(make_gpt("tiny") if "param_groups" not in kwargs else model, **kwargs)
            failures.append(f"{pattern}: no error")
        except (ValueError, TypeError) as e:
            if not re.search(pattern, str(e)):
                failures.append(f"{pattern}: {e}")
    try:
        ZeroAdam(torch.zeros(3))
        failures.append("tensor as model: no error")
    except TypeError as e:
        if "model must be an nn.Module; got Tensor" not in str(e):
            failures.append(str(e))
    return failures


def test_bad_arguments_are_named():
    assert run_ranks(_bad_arguments, 1) == [[]]


def _second_backward(rank, world):
    model = make_gpt("tiny")
    _opt = ZeroAdam(model, stage=2)  # its hooks stay installed
    for _ in range(2):
        _, loss = model(*rank_batch(model, 0, rank))
        try:
            loss.backward()
        except RuntimeError as e:
            return str(e)
    return None


def test_second_backward_before_step_is_an_error():
    msg = run_ranks(_second_backward, 1)[0]
    assert msg is not None and "got a second gradient before step()" in msg


def _reports(rank, world):
    opts = {p: ZeroAdam(make_gpt("tiny"), **zero_options(1, partition=p)).report().partition for p in PARTITIONS}
    return opts


def test_partition_report():
    reports = run_ranks(_reports, 3)[0]
    named = list(make_gpt("tiny").named_parameters())
    numel = sum(p.numel() for _, p in named)
    # Each partition's owned elements, counted here without the library's partition code.
    # Round-robin owners, from the reference stage: parameter i to rank i % 3.
    owners = round_robin_owners([n for n, _ in named], 3)
    expected = {"round_robin": [sum(p.numel() for n, p in named if owners[n] == r) for r in range(3)]}
    # Greedy: whole tensors, largest first (a stable sort: ties in model order), each to the rank
    # that owns the fewest elements so far (ties: the lower rank).
    loads = [0, 0, 0]
    for numel_i in sorted((p.numel() for _, p in named), reverse=True):
        loads[loads.index(min(loads))] += numel_i
    expected["greedy"] = loads
    # Flat: one bucket (the tiny GPT is far below the bucket size) cut into 3 equal slices; 7,776
    # elements are a multiple of 3 x 4 (ALIGN), so there is no padding and every rank owns a third.
    assert numel == 7776
    expected["flat"] = [numel // 3] * 3
    for name, owned in expected.items():
        assert reports[name].owned_numel == owned, (name, reports[name])
        # The imbalance is max / mean of those counts, written out.
        assert reports[name].imbalance == pytest.approx(max(owned) / (numel / 3)), (name, reports[name])
    assert reports["flat"].imbalance <= reports["greedy"].imbalance < reports["round_robin"].imbalance
    assert imbalance([1, 2, 3]) == 1.5 and imbalance([4, 4]) == 1.0 and imbalance([0, 0]) == 1.0
