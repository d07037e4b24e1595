"""ZeroAdam stages 1 and 2 on real gloo ranks, against both oracles: single-process
torch.optim.AdamW on the global batch, and the reference stage (the seed's algorithm)."""
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from oracles import (HYPER, fp32_tol, held_tensor_bytes, Quirky, make_scheduler, max_abs_diff, rank_batch, single_process_adamw,
                     single_process_quirky, two_groups)
from zerofast import ZeroAdam
from zerofast.tools.models import make_gpt
from zerofast.partition import imbalance
from zerofast.reference import ReferenceZero, round_robin_owners

STEPS = 10
PARTITIONS = ("flat", "round_robin", "greedy")
TOL = fp32_tol(STEPS)  # see the tolerances in tests/oracles.py


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_gpt(rank, engine, stage, partition="flat", bucket_mb=0.01, steps=STEPS, overlap=True):
    model = make_gpt("tiny")
    if engine == "zero":
        opt = ZeroAdam(model, stage=stage, partition=partition, bucket_mb=bucket_mb, overlap=overlap, **HYPER)
    else:
        opt = ReferenceZero(model, stage=stage, **HYPER)
    for step in range(steps):
        _, loss = model(*rank_batch(model, step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
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
        assert all(torch.equal(out[("zero", 2, "flat")][k], results[0][("zero", 2, "flat")][k]) for k in out[("zero", 2, "flat")])


def _train_quirky(rank, world, stage, partition, groups, scheduler, bucket_mb, steps):
    model = Quirky()
    params = dict(param_groups=two_groups(model)) if groups else {}
    opt = ZeroAdam(model, stage=stage, partition=partition, bucket_mb=bucket_mb, **HYPER, **params)
    sched = make_scheduler(opt) if scheduler else None
    frozen_before = model.frozen.detach().clone()
    for step in range(steps):
        model(*rank_batch(model, step, rank), step, rank).backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
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
    model(*rank_batch(model, 1, rank), 1, rank).backward()  # step 1: odd, `sometimes` unused
    opt.step()
    opt.zero_grad()
    counts = opt.step_counts()
    return torch.equal(before, model.sometimes.weight), counts["sometimes.weight"], counts["gpt.wte.weight"]


def test_unused_parameter_is_left_untouched():
    for same, steps, other in run_ranks(_unused_everywhere, 2):
        assert same and steps == 0 and other == 1


def _memory(rank, world, stage, partition):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, stage=stage, partition=partition, bucket_mb=0.01, **HYPER)
    _, loss = model(*rank_batch(model, 0, rank))
    loss.backward()
    opt.step()
    report = opt.memory_report()
    measured = {
        "grads": sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None),
        "held": held_tensor_bytes(opt),
    }
    numel = sum(p.numel() for p in model.parameters())
    return dict(report=report, measured=measured, numel=numel, owned=opt.layout.owned_numel(rank),
                shard=opt.layout.shard_numel(rank), buckets=len(opt.layout.buckets),
                padded=sum(b.numel for b in opt.layout.buckets))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("partition", ["flat", "round_robin"])
def test_memory_follows_the_seeds_table(world, stage, partition):
    for rank, m in enumerate(run_ranks(_memory, world, args=(stage, partition))):
        owned, shard, numel = m["owned"], m["shard"], m["numel"]
        # Seed, fp32 form: what the optimizer holds is the parameters (4 bytes per element, in the
        # flat buffers, padding included), the gradients (stage 1: in full, in its flat gradient
        # buckets; stage 2: the reduced shard, 4 per owned element) and Adam's moments (8 per owned
        # element); in fp32 there is no separate master. The shard adds only padding: see
        # [Note: padding]. After step() no .grad is left (stage 1's were views of its buckets).
        grads = 4 * m["padded"] if stage == 1 else 4 * shard
        assert m["measured"]["held"] == 4 * m["padded"] + grads + 8 * shard
        assert shard - owned <= (m["buckets"] * 4 * world if partition == "flat" else 0)
        assert m["measured"]["grads"] == 0
        r = m["report"]
        assert r["grads"] + r["grad_shard"] == grads
        assert r["params"] + r["grads"] + r["grad_shard"] + r["optimizer"] + r["master_copy"] == m["measured"]["held"]
        assert (r["optimizer"], r["master_copy"]) == (8 * shard, 0)
        # After step() no bucket buffer is alive; the peak is what backward needed at most (stage
        # 1 needs none: its gradients are the buckets).
        assert m["report"]["bucket_buffers"] == 0
        if stage == 1:
            assert m["report"]["bucket_buffers_peak"] == 0
        else:
            assert 0 < m["report"]["bucket_buffers_peak"] <= 4 * (numel + m["buckets"] * 4 * world)


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
    cases = [
        (dict(stage=4), "stage must be 1, 2 or 3; got 4"),
        (dict(partition="zigzag"), "partition must be one of flat, round_robin, greedy; got 'zigzag'"),
        (dict(bucket_mb=0), "bucket_mb must be None or a positive number; got 0"),
        (dict(bucket_buffers=-1), r"bucket_buffers must be an integer >= 0 \(0: no bound\); got -1"),
        (dict(bucket_buffers=1.5), r"bucket_buffers must be an integer >= 0 \(0: no bound\); got 1.5"),
        (dict(lr=-1.0), "lr must be a number >= 0; got -1.0"),
        (dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\); got \(0.9, 1.0\)"),
        (dict(eps=-1e-8), "eps must be a number >= 0; got -1e-08"),
        (dict(stage=3, min_unit_mb=-1), "min_unit_mb must be None or a number >= 0; got -1"),
        (dict(stage=3, min_unit_mb="2"), "min_unit_mb must be None or a number >= 0; got '2'"),
        (dict(weight_decay=-0.1), "weight_decay must be a number >= 0; got -0.1"),
        (dict(param_groups=[{"params": [model.wte.weight]}]), "is in no param group"),
        (dict(param_groups=[{"params": [model.wte.weight]}, {"params": list(model.parameters())}]),
         r"wte.weight is in param_groups\[0\] and param_groups\[1\]"),
        (dict(param_groups=[{"params": [torch.nn.Parameter(torch.zeros(3))]}]), "not one of the model's trainable parameters"),
        (dict(param_groups=[{"params": list(model.parameters()), "momentum": 0.9}]), "unknown keys \\['momentum'\\]"),
        (dict(param_groups=[{"params": list(model.parameters()), "lr": -2}]), r"param_groups\[0\]: lr must be a number >= 0; got -2"),
    ]
    cases += [
        (dict(adamw="yes"), "adamw must be True or False; got 'yes'"),
        (dict(overlap=1), "overlap must be True or False; got 1"),
        (dict(overlap_param_gather=None), "overlap_param_gather must be True or False; got None"),
        (dict(check_collectives="yes"), "check_collectives must be True or False; got 'yes'"),
        (dict(process_group="world"), "process_group must be a torch.distributed ProcessGroup or None; got str"),
    ]
    import re
    failures = []
    for kwargs, pattern in cases:
        try:
            ZeroAdam(make_gpt("tiny") if "param_groups" not in kwargs else model, **kwargs)
            failures.append(f"{kwargs}: no error")
        except (ValueError, TypeError) as e:
            if not re.search(pattern, str(e)):
                failures.append(f"{kwargs}: {e}")
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
    opt = ZeroAdam(model, stage=2)
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
    opts = {p: ZeroAdam(make_gpt("tiny"), stage=1, partition=p).partition_report() for p in PARTITIONS}
    return opts


def test_partition_report():
    reports = run_ranks(_reports, 3)[0]
    numel = sum(p.numel() for p in make_gpt("tiny").parameters())
    # The seed's round-robin rule, from the reference stage: parameter i to rank i % 3.
    model = make_gpt("tiny")
    owners = round_robin_owners([n for n, _ in model.named_parameters()], 3)
    by_rank = [sum(p.numel() for n, p in model.named_parameters() if owners[n] == r) for r in range(3)]
    assert reports["round_robin"]["owned_numel"] == by_rank
    for p, r in reports.items():
        assert sum(r["owned_numel"]) == numel
        assert r["imbalance"] == imbalance(r["owned_numel"])
    assert imbalance([1, 2, 3]) == 1.5 and imbalance([4, 4]) == 1.0 and imbalance([0, 0]) == 1.0
    assert reports["flat"]["imbalance"] <= reports["greedy"]["imbalance"] <= reports["round_robin"]["imbalance"]
