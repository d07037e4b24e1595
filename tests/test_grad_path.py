"""The compiled per-gradient path (issue 16; csrc/grad_path.cpp) against Python's path for the same
gradients: bitwise the same results on the awkward model (tied embeddings, a frozen parameter, one
used only in even steps, one used only on rank 0), every stage and partition, with the compiled
path taking all but the first gradient of each backward; and the single-process oracle."""
import pytest
import torch

from harness import run_ranks
from oracles import HYPER, Quirky, fp32_tol, max_abs_diff, rank_batch, single_process_quirky
from zerofast import ZeroAdam

STEPS = 4


def _quirky(rank, world, stage, partition, python_only):
    model = Quirky()
    opt = ZeroAdam(model, stage=stage, partition=partition, bucket_mb=0.001, min_unit_mb=0, **HYPER)
    if python_only:  # every gradient through Python's path, as fp16 or no_sync would send it
        opt._grads.always_python = True
        opt._grads._refresh()
    backwards = 0
    for step in range(STEPS):
        loss = model(*rank_batch(model, step, rank), step, rank)
        loss.backward()
        backwards += 1
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(params=params, fast=opt._grads.path.fast_calls, counts=opt.step_counts(), backwards=backwards,
                tensors=len([p for p in model.parameters() if p.requires_grad]))


def _matrix(rank, world):
    return {(stage, partition, python_only): _quirky(rank, world, stage, partition, python_only)
            for stage in (1, 2, 3) for partition in ("flat", "round_robin") for python_only in (False, True)}


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


def _gather_in_flight(rank, world):
    """overlap_param_gather: `sometimes` runs only in even steps; in step 1 the loss reads its weight
    outside its module, while its bucket's gather (started by step 0's step()) may be in flight."""
    model = Quirky()
    opt = ZeroAdam(model, stage=2, overlap_param_gather=True, bucket_mb=0.001, **HYPER)
    model(*rank_batch(model, 0, rank), 0, rank).backward()
    opt.step()
    opt.zero_grad()
    loss = model(*rank_batch(model, 1, rank), 1, rank) + 0.1 * model.sometimes.weight.square().sum()
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_the_overlapped_gathers_check_still_runs_for_every_gradient():
    # Each gradient must reach Python's check, not only the first of the backward (which the
    # compiled path would otherwise leave to Python alone).
    for rank, msg in enumerate(run_ranks(_gather_in_flight, 2)):
        assert msg is not None and "sometimes.weight was used while its gather was still in flight" in msg, (rank, msg)
