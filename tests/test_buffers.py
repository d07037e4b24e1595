"""Gradient buffers: at most `bucket_buffers` pooled bucket buffers alive at once during
backward, counted by the C++ side, even when one rank's backward runs far ahead of another's; and
stage 1's gradients as views of persistent buckets reduced in place, with no second copy."""

import os
import time

import pytest
import torch
from harness import run_ranks
from oracles import single_process_adamw
from probes import held_tensor_bytes
from tolerances import HYPER, fp32_tol, max_abs_diff
from training import rank_batch, train_steps, zero_options

from zerofast import ZeroAdam
from zerofast.optim.zero_adam import parts_of
from zerofast.tools.models import make_gpt

STEPS = 2  # the bound holds from the first backward; the second reuses the pooled buffers
PARTITIONS = ("flat", "round_robin", "greedy")
SLOW_RANK = 1
WAIT_S = 60  # the slow rank waiting longer than this for the others' go-ahead: they are stuck


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _go_ahead(sync_dir, step, rank) -> None:
    """A fast rank tells the slow rank that it may start step `step`'s backward (a marker file)."""
    path = os.path.join(sync_dir, f"step{step}-rank{rank}")
    if not os.path.exists(path):
        open(path, "w").close()


def _wait_for_go_ahead(sync_dir, step, world) -> None:
    """The slow rank: block until every other rank has given its go-ahead for this step."""
    paths = [os.path.join(sync_dir, f"step{step}-rank{r}") for r in range(world) if r != SLOW_RANK]
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go-ahead for step {step} after {WAIT_S} s: {paths}")
        time.sleep(0.001)


def _train_counting(rank, world, stage, partition, budget, slow, sync_dir, precision=None, reduce_dtype=None):
    """STEPS steps on a 10-block tiny GPT in many small buckets (stage 3: a unit per block). Samples
    the C++ live-buffer count at every gradient.

    `slow`: rank SLOW_RANK starts each backward only after every other rank has run ahead as far as
    it can alone, which they signal through a file in `sync_dir` (no sleep, no race): a fast rank
    gives the go-ahead when it holds `budget` live buffers (its next buffer may have to wait for a
    reduce, and no reduce can finish before the slow rank's joins), before a gather in stage 3's
    backward (which needs the slow rank), or at the end of its backward (nothing made it wait: no
    bound). Only the budget keeps the fast ranks' buffers bounded then."""
    sync_dir = os.path.join(sync_dir, f"stage{stage}-{partition}-budget{budget}-{precision}")
    os.makedirs(sync_dir, exist_ok=True)
    model = make_gpt("tiny", n_layer=10)
    opt = ZeroAdam(
        model,
        **zero_options(
            stage,
            partition=partition,
            bucket_mb=0.002,
            min_unit_mb=0,
            bucket_buffers=budget,
            mixed_precision=precision,
            reduce_dtype=reduce_dtype,
        ),
        **HYPER,
    )
    samples = []
    fast = slow and rank != SLOW_RANK
    state = {"step": 0, "backward": False}

    # Tensor post-accumulate hooks run before ZeroAdam's (a post hook on the AccumulateGrad node), so
    # each sample sees the buffers as the previous gradient left them, before this gradient's buffer
    # is taken (and waited for); the C++ peaks see every moment.
    def sample(_):
        live = opt.report().buffers.live
        samples.append(live)
        if fast and budget and live >= budget:
            _go_ahead(sync_dir, state["step"], rank)

    handles = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters()]
    if fast and stage == 3:
        unit_buffers = parts_of(opt).units.buffers  # the test seam: a gather delayed until a go-ahead
        wait = unit_buffers.gather_wait

        def go_ahead_then_wait(unit):
            if state["backward"]:
                _go_ahead(sync_dir, state["step"], rank)
            wait(unit)

        unit_buffers.gather_wait = go_ahead_then_wait

    def forward(model, x, y, step):
        state.update(step=step, backward=False)
        return model(x, y)[1]

    def backward(loss):
        state["backward"] = True
        if slow and rank == SLOW_RANK:
            _wait_for_go_ahead(sync_dir, state["step"], world)
        opt.backward(loss)
        if fast:
            _go_ahead(sync_dir, state["step"], rank)

    train_steps(model, opt, rank, STEPS, forward=forward, backward=backward)
    for h in handles:
        h.remove()
    with opt.gathered_params():  # stage 3's parameters exist only while gathered
        params = _params(model)
    buckets = len(opt.checkpoint_view.trainable.layout.buckets)
    return dict(counts=opt.report().buffers, sampled=max(samples), buckets=buckets, params=params)


def _budget_matrix(rank, world, sync_dir):
    out = {}
    for stage in (2, 3):
        for partition in PARTITIONS:
            # Stage 3's root unit (embeddings, tied head, final norm) gets gradients at both ends of
            # backward, so its buffer is open throughout: 2 is the least budget that can hold.
            for budget in (1, 2) if stage == 2 else (2, 3):
                out[(stage, partition, budget)] = _train_counting(rank, world, stage, partition, budget, True, sync_dir)
    out["unbounded"] = _train_counting(rank, world, 2, "flat", 0, True, sync_dir)
    # Stage 1 copies into pooled buffers only when it reduces in another dtype than its gradients.
    out["stage1_fp32_reduce"] = _train_counting(
        rank, world, 1, "flat", 2, True, sync_dir, precision="bf16", reduce_dtype=torch.float32
    )
    out["stage1_views"] = _train_counting(rank, world, 1, "flat", 2, True, sync_dir)
    return out


@pytest.mark.parametrize("world", [3])  # 3 ranks: uneven shards; the budget does not depend on the count
def test_buffers_alive_at_once_stay_within_the_budget(world, tmp_path):
    results = run_ranks(_budget_matrix, world, args=(str(tmp_path),), timeout=300)
    for rank, out in enumerate(results):
        for key, r in out.items():
            c, where = r["counts"], f"rank {rank}/{world} {key}"
            if key == "unbounded":
                continue
            if key == "stage1_views":  # no pooled buffer at all: the gradients are the buckets
                assert c.peak_alive == 0 and r["sampled"] == 0, where
                continue
            stage, budget = (key[0], key[2]) if isinstance(key, tuple) else (1, 2)
            assert r["buckets"] >= 3 * budget, where  # enough buckets for the bound to matter
            # In use and kept for reuse together, from the C++ side, at every moment.
            assert c.peak_live <= budget and c.peak_alive <= budget, (where, c)
            assert r["sampled"] <= budget and c.over_budget == 0, (where, r["sampled"], c)
            if rank != SLOW_RANK and stage < 3:
                # And the budget was spent: a fast rank held `budget` buffers before the slow rank
                # started its backward, so its next buffer waited for the oldest reduce (stage 3's
                # backward meets a gather the slow rank must join first, so it may run ahead less).
                assert r["sampled"] == budget, (where, r["sampled"], c)
            # Waiting for the oldest reduce changes when the data moves, not what is summed: the
            # same collectives in the same order, so bitwise equal to the unbounded run.
            if key[:2] == (2, "flat"):
                assert max_abs_diff(r["params"], out["unbounded"]["params"]) == 0.0, where
    # The test can fail: without a bound, a fast rank's whole backward runs before the slow rank's
    # starts, so none of its reduces can finish and every bucket's buffer is alive at once.
    for rank, out in enumerate(results):
        if rank != SLOW_RANK:
            unbounded = out["unbounded"]
            assert unbounded["counts"].peak_live == unbounded["buckets"] > 2, (rank, unbounded["counts"])


# --- stage 1: gradients as views of the buckets ---------------------------------------------------------


def _stage1(rank, world, precision):
    model = make_gpt("tiny")
    opt = ZeroAdam(model, **zero_options(1, bucket_mb=0.01), mixed_precision=precision, **HYPER)
    grad_buckets = parts_of(opt).shard.grad_buckets  # the test seam: where .grad must live
    buckets = [(g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()) for g in grad_buckets]
    inside, after_step = [], []
    steps = 6
    for step in range(steps):
        _, loss = model(*rank_batch(model, step, rank))
        opt.backward(loss)
        # Every .grad lives in its bucket slot: no second copy of the gradients. (Read past the guard:
        # between backward and step() .grad reads as the reduced gradient, a ShardedGrad.)
        with torch._C.DisableTorchFunctionSubclass():
            grads = [p.grad for p in model.parameters()]
        inside.append(all(any(lo <= g.data_ptr() < hi for lo, hi in buckets) for g in grads))
        opt.step()
        after_step.append(all(p.grad is None for p in model.parameters()))
        # Alternately: .grad dropped (the next backward's fresh gradient is copied into its slot
        # once) and zeroed views (autograd accumulates into the slots in place).
        opt.zero_grad(set_to_none=step % 2 == 0)
    _, loss = model(*rank_batch(model, steps, rank))
    opt.backward(loss)
    held = held_tensor_bytes(opt)
    report = opt.report()
    layout = opt.checkpoint_view.trainable.layout
    return dict(
        inside=inside,
        after_step=after_step,
        held=held,
        report=report.memory,
        params=_params(model),
        numel=sum(p.numel() for p in model.parameters()),
        padded=sum(b.numel for b in layout.buckets),
        shard=layout.shard_numel(rank),
        counts=report.buffers,
        steps=steps,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_stage1_holds_one_copy_of_the_gradients(world):
    for precision, size in ((None, 4), ("bf16", 2)):
        results = run_ranks(_stage1, world, args=(precision,))
        for rank, m in enumerate(results):
            where = f"rank {rank}/{world} {precision}"
            assert all(m["inside"]) and all(m["after_step"]), where
            # The ZeRO paper's stage-1 row: parameters and gradients in full (their flat buckets, padding
            # included), Adam's m and v (and in mixed precision the fp32 master) for the shard only.
            optimizer = (8 if precision is None else 12) * m["shard"]
            assert m["held"] == 2 * size * m["padded"] + optimizer, where
            r = m["report"]
            assert r.grads == size * m["padded"] and r.grad_shard == 0, where
            assert m["counts"].peak_alive == 0, where  # no buffer beside the gradients
        if precision is None:
            want = single_process_adamw(world, results[0]["steps"])
            for rank, m in enumerate(results):
                assert max_abs_diff(m["params"], want) <= fp32_tol(m["steps"]), f"rank {rank}/{world}"
