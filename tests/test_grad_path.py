"""The compiled per-gradient path (csrc/grad_path.cpp) against Python's path for the same
gradients: bitwise the same results on the awkward model (tied embeddings, a frozen parameter, one
used only in even steps, one used only on rank 0), every stage and partition, with the compiled
path taking all but the first gradient of each backward; and the single-process oracle. Also: a
gradient the path cannot take is named on its rank (typed errors, csrc/errors.h); accumulation under
no_sync() on the compiled path; the step's agreement message as AgreementLayout lays it out."""

import pytest
import torch
import torch.nn as nn
from harness import run_ranks
from models import Quirky
from oracles import single_process_quirky
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import rank_batch, zero_options

from zerofast import ZeroAdam
from zerofast.comm import GradientError
from zerofast.optim.grads import AgreementLayout
from zerofast.optim.zero_adam import parts_of

STEPS = 4


def _quirky(rank, world, stage, partition, python_only):
    model = Quirky()
    opt = ZeroAdam(model, **zero_options(stage, partition=partition, bucket_mb=0.001, min_unit_mb=0), **HYPER)
    if python_only:  # every gradient through Python's path, as fp16 or check_collectives would send it
        parts_of(opt).grads.take_every_gradient_in_python()
    backwards = 0
    for step in range(STEPS):
        loss = model(*rank_batch(model, step, rank), step, rank)
        loss.backward()
        backwards += 1
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(
        params=params,
        fast=parts_of(opt).grads.path.fast_calls,
        counts=opt.checkpoint_view.step_counts(),
        backwards=backwards,
        tensors=len([p for p in model.parameters() if p.requires_grad]),
    )


def _matrix(rank, world):
    return {
        (stage, partition, python_only): _quirky(rank, world, stage, partition, python_only)
        for stage in (1, 2, 3)
        for partition in ("flat", "round_robin")
        for python_only in (False, True)
    }


@pytest.mark.parametrize("world", [2, 3])
def test_the_compiled_path_equals_pythons(world):
    want = single_process_quirky(world, STEPS, groups=False, scheduler=False)
    for rank, out in enumerate(run_ranks(_matrix, world, timeout=300)):
        for (stage, partition, python_only), r in out.items():
            where = f"rank {rank}/{world} stage {stage} {partition} python_only={python_only}"
            other = out[(stage, partition, not python_only)]
            assert max_abs_diff(r["params"], other["params"]) == 0.0, where  # the same sums, the same order
            assert r["counts"] == other["counts"], where
            assert max_abs_diff(r["params"], want) <= fp32_tol(STEPS), where
            if python_only:
                assert r["fast"] == 0, where
            else:  # all but the first gradient of each backward (which queues the backward's end)
                # `sometimes` (2 tensors) gets gradients in even steps only, `rank0_only` on rank 0 only
                assert r["fast"] >= STEPS * (r["tensors"] - 3 - 1) - 2 * (STEPS // 2), (where, r["fast"])


def _freed(rank, world):
    import gc
    import weakref

    from zerofast.tools.models import make_gpt

    out = []
    for stage in (1, 2, 3):
        model = make_gpt("tiny")
        opt = ZeroAdam(model, stage=stage, **HYPER)
        _, loss = model(*rank_batch(model, 0, rank))
        loss.backward()
        opt.step()
        ref = weakref.ref(opt)
        del opt
        gc.collect()
        out.append(ref() is None)
        if stage == 3:  # its parameters stay sharded (released) without it: nothing to train on
            continue
        # The model trains on with a plain optimizer: no hook of the dropped one is left behind.
        plain = torch.optim.SGD(model.parameters(), lr=0.1)
        _, loss = model(*rank_batch(model, 1, rank))
        loss.backward()
        plain.step()
        out.append(all(p.grad is not None for p in model.parameters()))
    return out


def test_a_dropped_optimizer_is_freed_and_leaves_no_hooks():
    # The compiled path holds its Python callbacks weakly: a reference cycle through C++ would keep
    # every dropped optimizer (its buffers, shards and moments) alive until the process ends.
    for rank, out in enumerate(run_ranks(_freed, 2)):
        assert all(out), (rank, out)


def _gather_in_flight(rank, world, guarded):
    """overlap_param_gather: `sometimes` runs only in even steps; in step 1 the loss reads its weight
    outside its module, while its bucket's gather (started by step 0's step()) may be in flight. The
    read waits for the gather (the parameter is guarded while it is in flight); with the guard taken
    off (as a read from compiled code that holds the parameter from before would slip past it), the
    gradient path's check names it."""
    from zerofast.guard.params import ParamState

    model = Quirky()
    opt = ZeroAdam(model, **zero_options(2, overlap_param_gather=True, bucket_mb=0.001), **HYPER)
    model(*rank_batch(model, 0, rank), 0, rank).backward()
    opt.step()
    opt.zero_grad()
    if not guarded:
        for slot in parts_of(opt).slots:
            slot.state, slot.wait = ParamState.WHOLE, None
            slot.refresh()
    loss = model(*rank_batch(model, 1, rank), 1, rank) + 0.1 * model.sometimes.weight.square().sum()
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    opt.step()
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _read_outside_its_module(rank, world):
    """The same two steps with the gather not overlapped: what the read must give."""
    model = Quirky()
    opt = ZeroAdam(model, **zero_options(2, bucket_mb=0.001), **HYPER)
    model(*rank_batch(model, 0, rank), 0, rank).backward()
    opt.step()
    opt.zero_grad()
    (model(*rank_batch(model, 1, rank), 1, rank) + 0.1 * model.sometimes.weight.square().sum()).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_read_while_the_overlapped_gather_is_in_flight_waits_for_it():
    for got, want in zip(run_ranks(_gather_in_flight, 2, args=(True,)), run_ranks(_read_outside_its_module, 2)):
        assert max_abs_diff(got, want) == 0.0


def test_the_overlapped_gathers_check_still_runs_for_every_gradient():
    # Each gradient must reach Python's check, not only the first of the backward (which the
    # compiled path would otherwise leave to Python alone).
    for rank, msg in enumerate(run_ranks(_gather_in_flight, 2, args=(False,))):
        assert isinstance(msg, str) and "sometimes.weight was used while its gather was still in flight" in msg, (
            rank,
            msg,
        )


# --- typed errors: a gradient the path cannot take ------------------------------------------------------


class _Embedded(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = nn.Embedding(16, 8, sparse=sparse)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.emb(x)).square().mean()


# Each replaces the accumulated .grad's data after AccumulateGrad (a post-accumulate-grad hook runs
# before the gradient path's), as user code can; autograd itself rejects a tensor hook that changes a
# gradient's dtype or shape.
_SWAPS = {"dtype": lambda g: g.double(), "shape": lambda g: g.reshape(-1)}
_PROBLEMS = {
    "sparse": "got a sparse gradient (layout Sparse)",
    "dtype": "got a gradient of dtype torch.float64 for a parameter of dtype torch.float32",
    "shape": "got a gradient of shape [128] for a parameter of shape [16, 8]",
}


def _bad_gradient(rank, world, python_only):
    out = {}
    for stage in (1, 2, 3):
        for kind in _PROBLEMS:
            torch.manual_seed(0)
            model = _Embedded(sparse=kind == "sparse")
            opt = ZeroAdam(model, **zero_options(stage, min_unit_mb=0), **HYPER)
            if python_only:
                parts_of(opt).grads.take_every_gradient_in_python()
            if kind in _SWAPS:

                def swap(p, f=_SWAPS[kind]):
                    p.grad.data = f(p.grad.data)

                model.emb.weight.register_post_accumulate_grad_hook(swap)
            try:
                model(torch.tensor([[1, 2, 3]])).backward()  # emb.weight's gradient comes after head's
                opt.step()
                out[(stage, kind)] = None
            except Exception as e:  # noqa: BLE001
                out[(stage, kind)] = (type(e), str(e))
            opt.remove_hooks()
    return out


@pytest.mark.parametrize("python_only", [False, True], ids=["compiled", "python"])
def test_a_gradient_it_cannot_take_is_named_on_its_rank(python_only):
    # Before typed errors, a sparse embedding in stage 1 was reported as "an earlier reduce ...
    # failed: another rank died": the C++ path's copy failed, and its message was classified by text.
    for rank, out in enumerate(run_ranks(_bad_gradient, 2, args=(python_only,))):
        for (stage, kind), got in out.items():
            where = f"rank {rank} stage {stage} {kind}: {got}"
            assert got is not None, where
            error, msg = got
            assert issubclass(error, GradientError) and issubclass(error, RuntimeError), where
            assert msg.startswith(f"ZeroAdam: emb.weight {_PROBLEMS[kind]}"), where
            assert "another rank" not in msg and "Exception raised from" not in msg, where


def _second_gradient(rank, world, stage):
    model = _Embedded(sparse=False)
    _opt = ZeroAdam(model, **zero_options(stage, min_unit_mb=0), **HYPER)  # its hooks stay installed
    x = torch.tensor([[1, 2, 3]])
    model(x).backward()
    try:
        model(x).backward()
    except GradientError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_second_gradient_before_step_is_named(stage):
    for rank, msg in enumerate(run_ranks(_second_gradient, 2, args=(stage,))):
        assert msg is not None and "got a second gradient before step()" in msg, (rank, msg)


# --- accumulation under no_sync() on the compiled path -----------------------------------------------------


def _accumulate(rank, world, stage, accumulate_locally, python_only):
    model = Quirky()
    opt = ZeroAdam(
        model, **zero_options(stage, bucket_mb=0.001, min_unit_mb=0, accumulate_locally=accumulate_locally), **HYPER
    )
    if python_only:
        parts_of(opt).grads.take_every_gradient_in_python()
    for step in range(2):
        with opt.no_sync():
            for micro in range(2):
                model(*rank_batch(model, 10 * step + micro, rank), step, rank).backward()
        model(*rank_batch(model, 10 * step + 2, rank), step, rank).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(
        params=params,
        fast=parts_of(opt).grads.path.fast_calls,
        counts=opt.checkpoint_view.step_counts(),
        tensors=len([p for p in model.parameters() if p.requires_grad]),
    )


def _accumulate_matrix(rank, world):
    return {
        (stage, local, python_only): _accumulate(rank, world, stage, local, python_only)
        for stage in (1, 2, 3)
        for local in ((False,) if stage == 1 else (False, True))
        for python_only in (False, True)
    }


def test_accumulation_on_the_compiled_path_equals_pythons():
    # Under no_sync() the compiled path takes the gradients too (kept in .grad, or reduced into the
    # shard every micro-batch); the results are bitwise those of Python's path.
    for rank, out in enumerate(run_ranks(_accumulate_matrix, 2, timeout=300)):
        for (stage, local, python_only), r in out.items():
            where = f"rank {rank} stage {stage} accumulate_locally={local} python_only={python_only}"
            other = out[(stage, local, not python_only)]
            assert max_abs_diff(r["params"], other["params"]) == 0.0, where
            assert r["counts"] == other["counts"], where
            # 2 steps of 3 backwards: more than the last backwards' gradients alone can account for
            assert (r["fast"] == 0) if python_only else (r["fast"] > 2 * r["tensors"]), (where, r["fast"])


# --- the step's agreement ----------------------------------------------------------------------------------


def test_the_agreement_message_round_trips_through_its_layout():
    layout = AgreementLayout(3)
    assert layout.numel == 3 + 2 * len(AgreementLayout.COUNTERS) + 1
    counts = dict(steps=4, micro_batches=2, reduces=123, gathers=0)
    mine = layout.pack([True, False, True], counts, None)
    other = layout.pack([False, False, True], dict(counts, micro_batches=3), 1)
    agreed = layout.read([max(a, b) for a, b in zip(mine, other)])  # what all_reduce(MAX) leaves
    assert agreed.used == [True, False, True]
    assert agreed.ranges["micro_batches"] == (2, 3) and not agreed.same("micro_batches")
    assert agreed.same("steps") and agreed.same("reduces") and agreed.same("gathers")
    assert agreed.failed_rank == 1
    assert layout.read(mine).failed_rank is None
