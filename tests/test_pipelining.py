"""ZeroAdam under torch's pipeline schedules ([Note: pipeline accumulation] in zerofast/pipelining.py):
TitanLlama cut as torchtitan cuts it (titan_cut: copies with layers removed, original names kept) into
2 stages, pp 2 x dp 2 on 4 gloo ranks, each rank's part trained by ZeroAdam over the ("pp", "dp") mesh
through ZeroPipelineStage. Two oracles: single-process AdamW on the whole model over the global batch
(every micro-batch of every dp rank), and, bitwise, plain ZeroAdam on the whole model over the same dp
ranks with the same micro-batches under no_sync (accumulate_locally=True: .grad summed in the same
order, one reduce), where the schedule does not scale the gradients (scale_grads=False, a loss_fn that
divides by the micro-batch count, as the plain loop divides its loss)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from tolerances import HYPER, fp32_tol, lp_param_tol, max_abs_diff, norm_rel_tol

import zerofast.checkpoint
from zerofast import ZeroAdam
from zerofast.tools.models import TitanLlama, titan_cut

PP, DP, M, ROWS, SEQ, STEPS, LAYERS = 2, 2, 4, 4, 8, 3, 4


class Config(NamedTuple):
    stage: int
    schedule: str = "Schedule1F1B"
    dtype: torch.dtype = torch.float32
    max_norm: float | None = None
    scale_grads: bool = True  # False: the loss_fn divides by M, and the plain run is the bitwise oracle
    partition: str = "flat"
    per_rank: int = 1  # stages on each rank: 2 cuts the model into 4 (looped; "ZBV": V-shaped)
    per_mb: bool = False  # stage 3: ZeroPipelineStage(gather_per_micro_batch=True)


CONFIGS = [
    Config(1, max_norm=0.05),
    Config(2, "ScheduleGPipe"),
    Config(3, max_norm=0.05),
    Config(3, "ScheduleGPipe", partition="round_robin", per_mb=True),
    Config(1, "ScheduleInterleaved1F1B", scale_grads=False),
    Config(2, "ScheduleInterleavedZeroBubble", max_norm=0.05),
    Config(3, "ScheduleInterleavedZeroBubble", scale_grads=False),
    Config(1, "ScheduleInterleavedZeroBubble", torch.bfloat16, scale_grads=False),
    Config(2, dtype=torch.bfloat16, max_norm=0.05, scale_grads=False),
    Config(3, dtype=torch.bfloat16, max_norm=0.05, scale_grads=False),
    Config(3, dtype=torch.bfloat16, scale_grads=False, per_mb=True),
    Config(2, "ScheduleGPipe", torch.float16, max_norm=0.05, scale_grads=False),
    Config(3, dtype=torch.float32, max_norm=0.05, scale_grads=False, partition="greedy"),
    Config(2, "ScheduleInterleaved1F1B", max_norm=0.05, per_rank=2),
    Config(3, "ScheduleLoopedBFS", scale_grads=False, per_rank=2),
    Config(1, "ScheduleZBVZeroBubble", torch.bfloat16, scale_grads=False, per_rank=2),
    Config(3, "ScheduleZBVZeroBubble", max_norm=0.05, per_rank=2),
]
# The schedules that take a list of stages
MULTI = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble")


def _stages_of(config, pp_rank: int) -> list[int]:
    """The stages a rank holds: one, or per_rank of them looped (r, r + PP, ...) or V-shaped (ZBV)."""
    if config.per_rank == 1:
        return [pp_rank]
    if "ZBV" in config.schedule:
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank + k * PP for k in range(config.per_rank)]


def _batch(step: int, dp_rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, TitanLlama().vocab, (DP * ROWS, SEQ), generator=g)
    return ids if dp_rank is None else ids[dp_rank * ROWS : (dp_rank + 1) * ROWS]


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _loss_summed(logits, ids):  # with scale_grads=False: the mean over the step's micro-batches
    return _loss(logits, ids) / M


def _oracle(max_norm):
    """AdamW on one process over the global batch: the mean of the micro-batches' mean losses."""
    model = TitanLlama(layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    norms = []
    for step in range(STEPS):
        ids = _batch(step)
        (sum(_loss(model(c), c) for c in ids.chunk(DP * M)) / (DP * M)).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _policies(config):
    from zerofast import CommPolicy, LossScalePolicy, MixedPrecisionPolicy

    scale = {"loss_scale": LossScalePolicy(init_scale=2.0**4)} if config.dtype == torch.float16 else {}
    mixed = None if config.dtype == torch.float32 else MixedPrecisionPolicy(config.dtype, **scale)
    return mixed, CommPolicy(partition=config.partition, accumulate_locally=True)


def _pipelined(config, mesh, pp_rank, dp_rank):
    from torch.distributed.pipelining import schedules

    from zerofast.estimate import estimate_memory, estimate_traffic
    from zerofast.layout import ALIGN
    from zerofast.optim.zero_adam import parts_of
    from zerofast.pipelining import ZeroPipelineStage

    mixed, comm = _policies(config)
    n = PP * config.per_rank
    indices = _stages_of(config, pp_rank)
    parts = [titan_cut(TitanLlama(layers=LAYERS), s, n) for s in indices]
    part = parts[0] if len(parts) == 1 else parts  # ZeroAdam takes a rank's parts as a list
    opt = ZeroAdam(part, stage=config.stage, process_group=mesh, mixed_precision=mixed, comm=comm, **HYPER)
    group = mesh["pp"].get_group()
    stages = [
        ZeroPipelineStage(p, s, n, torch.device("cpu"), group=group, gather_per_micro_batch=config.per_mb)
        for p, s in zip(parts, indices)
    ]
    loss_fn = _loss if config.scale_grads else _loss_summed
    schedule = getattr(schedules, config.schedule)(
        stages if config.schedule in MULTI else stages[0], M, loss_fn=loss_fn, scale_grads=config.scale_grads
    )
    first, last = 0 in indices, n - 1 in indices
    norms = []
    for step in range(STEPS):
        ids = _batch(step, dp_rank)
        schedule.step(*((ids,) if first else ()), **(dict(target=ids, losses=[]) if last else {}))
        if config.max_norm is not None:
            norms.append(float(opt.clip_grad_norm_(config.max_norm)))
        opt.step()
        opt.zero_grad()
    comm_bytes = opt.report().comm
    with opt.gathered_params():
        params = {name: p.detach().float().clone() for m in parts for name, p in m.named_parameters()}
    # Gradients crossed "dp" once per step: estimate_traffic with pp counts one reduce whatever the
    # micro-batches, the step's own all_reduces over "pp", and stage 3's gathers of the parts kept
    # gathered for the step, each unit once (every key, bytes exact). With gathers per micro-batch, or
    # a zero-bubble schedule's split passes gathering the part once more each, the gathers are not
    # compared.
    if config.per_rank == 1:  # (the estimators take one module)
        world, rank = dist.get_world_size(), dist.get_rank()
        options = dict(mixed_precision=mixed, comm=comm, rank=rank, pp=PP)
        want = estimate_traffic(
            part, world, config.stage, max_grad_norm=config.max_norm, micro_batches=M, backend="gloo", **options
        )
        got = dict(comm_bytes)
        if config.stage == 3 and (config.per_mb or "ZeroBubble" in config.schedule):
            gathers = ("shard/broadcast", "shard/all_gather")
            got, want = ({k: v for k, v in d.items() if k not in gathers} for d in (got, want))
        assert got == want, (config, got, want)
        # estimate_memory with pp: this stage's part over its dp ranks; the optimizer state measured
        # exceeds it by the buckets' padding at most (ALIGN * dp elements a bucket).
        if config.partition == "flat":
            est, mem = estimate_memory(part, world, config.stage, device="cpu", **options), opt.report().memory
            o_bytes = 8 + (4 if config.dtype != torch.float32 else 0)
            pad = ALIGN * DP * len(parts_of(opt).layout.buckets)
            assert 0 <= mem.optimizer + mem.master_copy - est.optimizer <= pad * o_bytes, (config, mem, est)
    return params, norms


def _plain(config, dp_group, dp_rank):
    """ZeroAdam on the whole model over the dp ranks, the same micro-batches under no_sync."""
    mixed, comm = _policies(config)
    model = TitanLlama(layers=LAYERS)
    opt = ZeroAdam(model, stage=config.stage, process_group=dp_group, mixed_precision=mixed, comm=comm, **HYPER)
    norms = []
    for step in range(STEPS):
        chunks = _batch(step, dp_rank).chunk(M)
        for m, c in enumerate(chunks):
            with opt.no_sync() if m < M - 1 else contextlib.nullcontext():
                opt.backward(_loss_summed(model(c), c))
        if config.max_norm is not None:
            norms.append(float(opt.clip_grad_norm_(config.max_norm)))
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}, norms


def _train(rank, world, configs):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    out = []
    for config in configs:
        got = _pipelined(config, mesh, pp_rank, dp_rank)
        plain = None if config.scale_grads else _plain(config, mesh["dp"].get_group(), dp_rank)
        out.append((got, plain))
    dist.barrier()
    return out


def test_pp2_dp2_equals_adamw_and_plain_zero_adam():
    results = run_ranks(_train, PP * DP, (CONFIGS,), timeout=300)
    oracles = {c.max_norm: _oracle(c.max_norm) for c in CONFIGS if c.dtype == torch.float32}
    numel = sum(p.numel() for p in TitanLlama(layers=LAYERS).parameters())
    for rank, runs in enumerate(results):
        names = set()
        for config, ((params, norms), plain) in zip(CONFIGS, runs):
            if config.per_rank == 1:
                names = set(params)
            if plain is not None:
                plain_params, plain_norms = plain
                # Bitwise where .grad sums the micro-batches in the plain loop's order, one reduce a step;
                # LoopedBFS runs a stage's backwards in reverse, and the squared norm is summed per
                # stage first (its rounding, and the clip's through it): within the tolerances then.
                if config.max_norm is None and config.schedule != "ScheduleLoopedBFS":
                    assert all(torch.equal(t, plain_params[n]) for n, t in params.items()), (rank, config)
                else:  # the squared norm summed per stage first: its rounding, and the clip's through it
                    for got, w in zip(norms, plain_norms):
                        assert abs(got - w) <= norm_rel_tol(numel) * w, (rank, config, got, w)
                    tol = (
                        fp32_tol(STEPS)
                        if config.dtype == torch.float32
                        else lp_param_tol(config.dtype, STEPS, plain_params)
                    )
                    assert max_abs_diff(params, {n: plain_params[n] for n in params}) <= tol, (rank, config)
            if config.dtype == torch.float32:  # 16 ulps a step (tolerances.py)
                want, want_norms = oracles[config.max_norm]
                assert max_abs_diff(params, {n: want[n] for n in params}) <= fp32_tol(STEPS), (rank, config)
                for got, w in zip(norms, want_norms):  # the global norm: summed over "pp" too
                    assert abs(got - w) <= norm_rel_tol(numel) * w, (rank, config, got, w)
        # Each rank holds its stage's part, by the original names: stage 0 the embedding and the first
        # layers, stage 1 the rest, the norm and the head.
        first = {"tok_embeddings.weight"} | {n for n in names if n.startswith(("layers.0.", "layers.1."))}
        assert ("tok_embeddings.weight" in names) == (rank < DP) and (names == first) == (rank < DP), names


def _errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    from zerofast.pipelining import ZeroPipelineStage

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    messages = []

    def attempt(fn):
        try:
            fn()
        except (ValueError, RuntimeError, NotImplementedError) as e:
            messages.append(str(e))
        else:
            messages.append(None)

    # The whole model on every stage: its names are on two "pp" ranks.
    attempt(lambda: ZeroAdam(TitanLlama(layers=LAYERS), process_group=mesh, **HYPER))
    part = titan_cut(TitanLlama(layers=LAYERS), pp_rank, PP)
    # A stage over a part no ZeroAdam trains, at the schedule's first backward... and at construction
    # when the optimizer was built over a dp group only (no "pp" dim: its step would not span the
    # pipeline), or the stage's group is not the mesh's "pp".
    plain = ZeroAdam(part, process_group=mesh["dp"].get_group(), **HYPER)
    attempt(lambda: ZeroPipelineStage(part, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group()))
    plain.remove_hooks()
    part = titan_cut(TitanLlama(layers=LAYERS), pp_rank, PP)
    opt = ZeroAdam(part, process_group=mesh, **HYPER)
    attempt(lambda: ZeroPipelineStage(part, pp_rank, PP, torch.device("cpu"), group=mesh["dp"].get_group()))
    # opt.state_dict() of a pipelined model: refused (its small state is per stage; zerofast.checkpoint
    # joins the stages'); a consolidated copy of this stage's part, by the original names, is whole.
    attempt(lambda: opt.state_dict())
    whole = opt.full_state_dict()
    assert set(whole) == set(part.state_dict()) and "layers.0.attention.wq.weight" in whole or pp_rank == 1, whole
    # Fewer micro-batches than the schedule needs (1F1B: one per stage): torch's own error, at
    # construction, before any rank waits on another.
    stage = ZeroPipelineStage(part, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    attempt(lambda: Schedule1F1B(stage, PP - 1, loss_fn=_loss))
    # Another rank's stage index (its schedule would exchange activations with the wrong ranks).
    attempt(lambda: ZeroPipelineStage(part, 1 - pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group()))
    dist.barrier()
    return messages


def test_named_errors():
    for messages in run_ranks(_errors, PP * DP):
        whole, no_pp, wrong_group, checkpoint, too_few, not_mine = messages
        assert "is in the parts of pp ranks 0 and 1" in whole, whole
        assert 'built without a "pp" mesh dim' in no_pp, no_pp
        assert 'pass group=mesh["pp"].get_group()' in wrong_group, wrong_group
        assert "is saved with zerofast.checkpoint.save" in checkpoint, checkpoint
        assert "Number of microbatches (1) must be greater than" in too_few, too_few
        assert "is not this rank's: it is rank" in not_mine and "of the 2 in group=" in not_mine, not_mine


@pytest.mark.parametrize("n", [2])
def test_titan_cut_keeps_the_names(n):
    model = TitanLlama(layers=LAYERS)
    parts = [titan_cut(model, s, n) for s in range(n)]
    names = [set(dict(p.named_parameters())) for p in parts]
    assert set().union(*names) == set(dict(model.named_parameters())) and sum(map(len, names)) == len(
        dict(model.named_parameters())
    )
    with pytest.raises(ValueError, match="titan_cut: stage=2 of stages=2"):
        titan_cut(model, 2, 2)


TP_CONFIGS = [(1, "ScheduleGPipe"), (2, "Schedule1F1B"), (3, "Schedule1F1B")]


def _train_tp(rank, world):
    """pp 2 x dp 1 x tp 2: each stage's part under torchtitan's tensor-parallel plan (titan_plan skips
    the ends a part lacks); the one dp rank trains on the whole global batch, clipping at 0.05."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules

    from zerofast.pipelining import ZeroPipelineStage
    from zerofast.tools.models import titan_plan

    def loss_fn(logits, ids):
        return _loss(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, ids)

    out = []
    for stage, name in TP_CONFIGS:
        mesh = init_device_mesh("cpu", (PP, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank = mesh["pp"].get_local_rank()
        part = titan_plan(titan_cut(TitanLlama(layers=LAYERS), pp_rank, PP), mesh["tp"], sequence_parallel=False)
        opt = ZeroAdam(part, stage=stage, process_group=mesh, max_grad_norm=0.05, **HYPER)
        pipe = ZeroPipelineStage(part, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = getattr(schedules, name)(pipe, M, loss_fn=loss_fn)
        for step in range(STEPS):
            ids = _batch(step)
            schedule.step(ids) if pp_rank == 0 else schedule.step(target=ids, losses=[])
            opt.step()
            opt.zero_grad()
        with opt.gathered_params(gather_tp=True):
            out.append(
                {
                    n: p.to_local().detach().float().clone() if hasattr(p, "to_local") else p.detach().float().clone()
                    for n, p in part.named_parameters()
                }
            )
        comm = opt.report().comm
        assert comm["pp/all_reduce_flags"] > 0 and comm["tp/all_reduce_stats"] > 0, comm
    return out, _hf_train_tp()


def test_pp2_tp2_equals_adamw_on_the_global_batch():
    """TitanLlama (TP_CONFIGS) and the Hugging Face Llama (stage 3, 1F1B) at pp 2 x dp 1 x tp 2, in the
    same fresh processes: DTensor caches its sharding decisions with the mesh's groups
    (test_tensor_parallel.py)."""
    results = run_ranks(_train_tp, 4, timeout=300, fresh=True)
    # The oracle's micro-batches: the global batch's DP * M chunks of ROWS / M rows; here the one dp
    # rank's M micro-batches of DP * ROWS / M rows, the same mean over the same tokens.
    want, _ = _oracle(0.05)
    want_hf = _hf_oracle(0.05)
    for rank, (runs, hf) in enumerate(results):
        for (stage, name), params in zip(TP_CONFIGS, runs):
            assert max_abs_diff(params, {n: want[n] for n in params}) <= fp32_tol(STEPS), (rank, stage, name)
        assert max_abs_diff(hf, {n: want_hf[n] for n in hf}) <= fp32_tol(STEPS), (rank, "hf")


def _pipeline_steps(part_or_parts, opt, mesh, pp: int, steps: range, rows):
    """Schedule1F1B over this rank's one stage of `pp`, the steps' batches as `rows(step)` gives them."""
    from torch.distributed.pipelining import Schedule1F1B

    from zerofast.pipelining import ZeroPipelineStage

    s = mesh["pp"].get_local_rank()
    stage = ZeroPipelineStage(part_or_parts, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, M, loss_fn=_loss)
    for step in steps:
        ids = rows(step)
        schedule.step(*((ids,) if s == 0 else ()), **(dict(target=ids, losses=[]) if s == pp - 1 else {}))
        opt.step()
        opt.zero_grad()


def _whole(opt, model) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _checkpoints(rank, world, root):
    """A pp 2 x dp 2 run (stage 2) saved after 2 steps and continued for a third; the checkpoint then
    loaded at pp 2 x dp 2 at stage 3, by plain ZeroAdam over the 4 ranks (pp 1, dp 4), and at pp 4 x
    dp 1, each taking the third step."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    path = os.path.join(root, "step-2")
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = titan_cut(TitanLlama(layers=LAYERS), s, PP)
    opt = ZeroAdam(part, stage=2, process_group=mesh, **HYPER)
    _pipeline_steps(part, opt, mesh, PP, range(2), lambda step: _batch(step, d))
    zerofast.checkpoint.save(path, part, opt)
    _pipeline_steps(part, opt, mesh, PP, range(2, 3), lambda step: _batch(step, d))
    out = {"uninterrupted": _whole(opt, part)}

    part = titan_cut(TitanLlama(layers=LAYERS), s, PP)
    opt = ZeroAdam(part, stage=3, process_group=mesh, **HYPER)
    zerofast.checkpoint.load(path, part, opt)
    _pipeline_steps(part, opt, mesh, PP, range(2, 3), lambda step: _batch(step, d))
    out["pp2 stage 3"] = _whole(opt, part)

    model = TitanLlama(layers=LAYERS)  # plain ZeroAdam, the whole model on every rank
    opt = ZeroAdam(model, stage=2, **HYPER)
    zerofast.checkpoint.load(path, model, opt)
    rows = _batch(2).chunk(world)[rank]
    _loss(model(rows), rows).backward()
    opt.step()
    out["pp1 dp4"] = _whole(opt, model)

    mesh4 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    part = titan_cut(TitanLlama(layers=LAYERS), mesh4["pp"].get_local_rank(), 4)
    opt = ZeroAdam(part, stage=1, process_group=mesh4, **HYPER)
    zerofast.checkpoint.load(path, part, opt)
    _pipeline_steps(part, opt, mesh4, 4, range(2, 3), _batch)  # dp 1: the whole global batch
    out["pp4 dp1"] = _whole(opt, part)
    dist.barrier()
    return out


def test_a_pipelined_checkpoint_loads_at_other_pp_dp_stage_and_into_one_process(tmp_path):
    from zerofast.checkpoint import to_torch

    results = run_ranks(_checkpoints, 4, (str(tmp_path),), timeout=300)
    want = {}
    for out in results:
        want.update(out["uninterrupted"])
    # One process: to_torch's state dict and AdamW state (parameters in the saved order: the stages in
    # turn, which is the model's order with one stage a rank), the third step on the global batch.
    state, optim = to_torch(str(tmp_path / "step-2"))
    model = TitanLlama(layers=LAYERS)
    model.load_state_dict(state)
    adamw = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    adamw.load_state_dict(optim)
    ids = _batch(2)
    (sum(_loss(model(c), c) for c in ids.chunk(DP * M)) / (DP * M)).backward()
    adamw.step()
    one = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert set(want) == set(one)
    # The third step's gradient summed in another order (other micro-batches, ranks, reduces): 16 ulps
    # a step (tolerances.py), over the three steps.
    assert max_abs_diff(one, want) <= fp32_tol(STEPS)
    for rank, out in enumerate(results):
        for how, params in out.items():
            assert max_abs_diff(params, {n: want[n] for n in params}) <= fp32_tol(STEPS), (rank, how)


def _overflow(rank, world):
    """fp16 under pipelining, an overflow on one rank of the last stage only (rank 3: its part's head
    weight's gradient made infinite in step 1, a tensor hook): the first stage's ranks see no inf in
    their own shards, only through the overflow flag's sum over "pp"; every rank of every stage must
    skip that step and halve the one loss scale, or the stages drift apart."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerofast import LossScalePolicy, MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = titan_cut(TitanLlama(layers=LAYERS), s, PP)
    mixed = MixedPrecisionPolicy(torch.float16, loss_scale=LossScalePolicy(init_scale=2.0**4))
    opt = ZeroAdam(part, stage=2, process_group=mesh, mixed_precision=mixed, **HYPER)
    poison = [False]
    if rank == 3:
        part.output.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison[0] else g)
    seen = []
    for step in range(3):
        poison[0] = step == 1
        before = _whole(opt, part)
        _pipeline_steps(part, opt, mesh, PP, range(step, step + 1), lambda st: _batch(st, d))
        after = _whole(opt, part)
        changed = any(not torch.equal(before[n], after[n]) for n in before)
        seen.append((opt.step_was_skipped, opt.loss_scale, changed))
    return seen


def test_an_fp16_overflow_on_one_stage_skips_the_step_on_every_stage():
    for rank, seen in enumerate(run_ranks(_overflow, PP * DP)):
        assert seen == [(False, 16.0, True), (True, 8.0, False), (False, 8.0, True)], (rank, seen)


def test_the_estimators_name_a_bad_pp():
    from zerofast.estimate import estimate_memory, estimate_traffic

    part = titan_cut(TitanLlama(layers=LAYERS), 0, PP)
    for fn in (estimate_memory, estimate_traffic):
        for bad in (3, 0, True, 2.0):
            with pytest.raises(ValueError, match=rf"pp must be an integer >= 1 that divides world \(4\); got {bad!r}"):
                fn(part, 4, 2, pp=bad)
    # pp 2 of 4 ranks: the part over its stage's 2 dp ranks, as over a world of 2 without "pp".
    assert estimate_memory(part, 4, 2, pp=2, rank=3) == estimate_memory(part, 2, 2, rank=1)


def test_gather_per_micro_batch_must_be_a_bool():
    from zerofast.pipelining import ZeroPipelineStage

    with pytest.raises(TypeError, match="gather_per_micro_batch must be True or False; got 'yes'"):
        ZeroPipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"), gather_per_micro_batch="yes")


def _muon(rank, world):
    """ZeroMuon over a pipeline part (1F1B, stage 2) and plain ZeroMuon over the whole model on the same
    dp ranks with the same micro-batches under no_sync: the same gradient sums in the same order, and
    each matrix's Newton-Schulz the same computation wherever its owner is."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerofast import CommPolicy, ZeroMuon

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    comm = CommPolicy(partition="greedy", accumulate_locally=True)
    part = titan_cut(TitanLlama(layers=LAYERS), s, PP)
    opt = ZeroMuon(part, stage=2, process_group=mesh, comm=comm, lr=0.02)
    from torch.distributed.pipelining import Schedule1F1B

    from zerofast.pipelining import ZeroPipelineStage

    stage = ZeroPipelineStage(part, s, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, M, loss_fn=_loss_summed, scale_grads=False)
    for step in range(STEPS):
        ids = _batch(step, d)
        schedule.step(ids) if s == 0 else schedule.step(target=ids, losses=[])
        opt.step()
        opt.zero_grad()
    piped = _whole(opt, part)
    model = TitanLlama(layers=LAYERS)
    opt = ZeroMuon(model, stage=2, process_group=mesh["dp"].get_group(), comm=comm, lr=0.02)
    for step in range(STEPS):
        for m, c in enumerate(_batch(step, d).chunk(M)):
            with opt.no_sync() if m < M - 1 else contextlib.nullcontext():
                _loss_summed(model(c), c).backward()
        opt.step()
        opt.zero_grad()
    plain = _whole(opt, model)
    return [n for n, t in piped.items() if not torch.equal(t, plain[n])], len(piped)


def test_zero_muon_under_a_pipeline_is_plain_zero_muon_bitwise():
    for rank, (differ, count) in enumerate(run_ranks(_muon, PP * DP)):
        assert count > 0 and differ == [], (rank, differ)


def test_the_example_runs_under_torchrun_and_exits_cleanly():
    """examples/pipeline_example.py as a user launches it, at stage 3 on 2 processes (pp 2 x dp 1: the
    example's code is the same at any dp, and the suite pays ~2 s a process under torchrun); every
    process ends with exit code 0 and the loss falls."""
    import os
    import re
    import subprocess
    import sys

    from harness import ROOT, free_port, launch_env

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    command += [os.path.join(ROOT, "examples", "pipeline_example.py"), "--pp", "2", "--stage", "3", "--steps", "10"]
    done = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], done.stdout


# A Hugging Face Llama built from a config (tests/models.py's tiny_llama, 4 layers, untied), cut by
# zerofast.integrations.hf_pipeline.cut_causal_lm: the whole model's forward is the oracle's.
class HFConfig(NamedTuple):
    pp: int
    stage: int
    schedule: str
    dtype: torch.dtype = torch.float32
    max_norm: float | None = None
    per_rank: int = 1


HF_CONFIGS = [
    HFConfig(2, 3, "Schedule1F1B", max_norm=0.05),  # saved, then exported: from_pretrained loads it
    HFConfig(2, 1, "ScheduleGPipe"),
    HFConfig(2, 2, "ScheduleInterleaved1F1B", max_norm=0.05, per_rank=2),  # cut into 4
    HFConfig(4, 2, "Schedule1F1B", max_norm=0.05),  # pp 4 x dp 1
    HFConfig(2, 3, "Schedule1F1B", torch.bfloat16),  # against plain ZeroAdam over the whole model, bitwise
]


def _hf_llama():
    from models import tiny_llama

    return tiny_llama(num_hidden_layers=LAYERS, tie_word_embeddings=False)


def _hf_batch(step: int, rows: int = DP * ROWS) -> torch.Tensor:
    return torch.randint(0, 32, (rows, SEQ), generator=torch.Generator().manual_seed(2000 + step))


def _hf_oracle(max_norm):
    """AdamW on one process over the global batch, the whole model's own forward."""
    model = _hf_llama()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        ids = _hf_batch(step)
        (sum(_loss(model(c).logits, c) for c in ids.chunk(DP * M)) / (DP * M)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _hf_train(rank, world, root):
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules

    from zerofast import MixedPrecisionPolicy
    from zerofast.integrations.hf_pipeline import cut_causal_lm
    from zerofast.pipelining import ZeroPipelineStage

    out = []
    for i, config in enumerate(HF_CONFIGS):
        dp = world // config.pp
        mesh = init_device_mesh("cpu", (config.pp, dp), mesh_dim_names=("pp", "dp"))
        p, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        n = config.pp * config.per_rank
        indices = [p + k * config.pp for k in range(config.per_rank)]
        parts = [cut_causal_lm(_hf_llama(), s, n) for s in indices]
        lp = config.dtype != torch.float32
        mixed = MixedPrecisionPolicy(config.dtype) if lp else None
        comm = zerofast.CommPolicy(accumulate_locally=True)
        opt = ZeroAdam(parts[0] if len(parts) == 1 else parts, stage=config.stage, process_group=mesh,
                       mixed_precision=mixed, max_grad_norm=config.max_norm, comm=comm, **HYPER)  # fmt: skip
        stages = [ZeroPipelineStage(m, s, n, torch.device("cpu"), group=mesh["pp"].get_group())
                  for m, s in zip(parts, indices)]  # fmt: skip
        multi = config.per_rank > 1
        # bf16: the loss divided by M and the schedule not scaling, as the plain loop divides its loss
        schedule = getattr(schedules, config.schedule)(
            stages if multi else stages[0], M, loss_fn=_loss_summed if lp else _loss, scale_grads=not lp
        )
        for step in range(STEPS):
            ids = _hf_batch(step).chunk(dp)[d]
            first, last = 0 in indices, n - 1 in indices
            schedule.step(*((ids,) if first else ()), **(dict(target=ids, losses=[]) if last else {}))
            opt.step()
            opt.zero_grad()
        if i == 0:
            zerofast.checkpoint.save(os.path.join(root, "hf"), parts[0], opt)
        got = {name: t for m in parts for name, t in _whole(opt, m).items()}
        plain = None
        if lp:  # plain ZeroAdam on the whole model over the same dp ranks, the same micro-batches
            model = _hf_llama()
            opt = ZeroAdam(model, stage=config.stage, process_group=mesh["dp"].get_group(), mixed_precision=mixed,
                           comm=comm, **HYPER)  # fmt: skip
            for step in range(STEPS):
                for m, c in enumerate(_hf_batch(step).chunk(dp)[d].chunk(M)):
                    with opt.no_sync() if m < M - 1 else contextlib.nullcontext():
                        opt.backward(_loss_summed(model(c).logits, c))
                opt.step()
                opt.zero_grad()
            plain = _whole(opt, model)
        out.append((got, plain))
    dist.barrier()
    return out


def test_a_hugging_face_llama_cut_into_stages_equals_adamw_and_exports_for_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM

    from zerofast.checkpoint import export

    results = run_ranks(_hf_train, 4, (str(tmp_path),), timeout=300)
    names = set(dict(_hf_llama().named_parameters()))
    oracles = {c.max_norm: _hf_oracle(c.max_norm) for c in HF_CONFIGS if c.dtype == torch.float32}
    for i, config in enumerate(HF_CONFIGS):
        whole: dict[str, torch.Tensor] = {}
        for rank, runs in enumerate(results):
            got, plain = runs[i]
            whole.update(got)
            if plain is not None:  # the same sums in the same order: bitwise
                assert all(torch.equal(t, plain[n]) for n, t in got.items()), (rank, config)
        assert set(whole) == names, (config, names ^ set(whole))  # the stages' parts: the model, by its names
        if config.dtype == torch.float32:  # 16 ulps a step (tolerances.py)
            assert max_abs_diff(whole, oracles[config.max_norm]) <= fp32_tol(STEPS), config
        if i == 0:  # the pipelined run's checkpoint, exported, is the model from_pretrained loads
            out = tmp_path / "exported"
            out.mkdir()
            export(str(tmp_path / "hf"), str(out / "model.safetensors"))
            _hf_llama().config.save_pretrained(out)
            loaded = LlamaForCausalLM.from_pretrained(out)
            assert all(torch.equal(p, whole[n]) for n, p in loaded.named_parameters()), "the export differs"
            ids = _hf_batch(0, 1)
            assert loaded.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, SEQ + 4)


def test_cut_causal_lm_names_what_it_cannot_cut():
    from models import tiny_llama

    from zerofast.integrations.hf_pipeline import cut_causal_lm

    with pytest.raises(ValueError, match="stage=2 of stages=2 must index the model's 4 layers cut evenly"):
        cut_causal_lm(_hf_llama(), 2, 2)
    with pytest.raises(ValueError, match="stage=0 of stages=3 must index"):
        cut_causal_lm(_hf_llama(), 0, 3)
    with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight"):
        cut_causal_lm(tiny_llama(tie_word_embeddings=True), 0, 2)
    with pytest.raises(NotImplementedError, match="model must be one of LlamaForCausalLM .*; got TitanLlama"):
        cut_causal_lm(TitanLlama(), 0, 2)


def _hybrid(rank, world):
    """pp 2 x replicate 2 x dp 1: each stage's part unsharded (a shard group of one rank), replicated
    twice; the replicas' all_reduce is the step's data-parallel traffic. Stages 2 and 3, clipped."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, 2, 1), mesh_dim_names=("pp", "replicate", "dp"))
    s, r = mesh["pp"].get_local_rank(), mesh["replicate"].get_local_rank()
    out = []
    for stage in (2, 3):
        part = titan_cut(TitanLlama(layers=LAYERS), s, PP)
        opt = ZeroAdam(part, stage=stage, process_group=mesh, max_grad_norm=0.05, **HYPER)
        _pipeline_steps(part, opt, mesh, PP, range(STEPS), lambda step: _batch(step, r))
        out.append((_whole(opt, part), {k for k, v in opt.report().comm.items() if v}))
    return out


def test_hybrid_sharding_under_a_pipeline_equals_adamw():
    want, _ = _oracle(0.05)
    for rank, runs in enumerate(run_ranks(_hybrid, 4)):
        for stage, (params, moved) in zip((2, 3), runs):
            # 16 ulps a step (tolerances.py); the gradients crossed between the replicas
            assert max_abs_diff(params, {n: want[n] for n in params}) <= fp32_tol(STEPS), (rank, stage)
            assert "replicate/all_reduce" in moved and "pp/all_reduce_stats" in moved, (rank, stage, moved)


def _hf_tp_plan(part, tp_mesh):
    """tests/test_tensor_parallel.py's plan for Hugging Face's Llama over a cut stage: q/k/v and gate/up
    Colwise, o and down Rowwise, the embedding Rowwise and the head Colwise (gathered) where the stage
    has them; the layers by their original indices."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    if part.model.embed_tokens is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if part.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in part.model.layers:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(part, tp_mesh, plan)


def _hf_train_tp():
    """pp 2 x dp 1 x tp 2: the Hugging Face Llama's stages under a tensor-parallel plan, stage 3 (stages
    1 and 2 under tp: TitanLlama's TP_CONFIGS), 1F1B, clipped at 0.05; the one dp rank trains on the
    whole global batch. Run by _train_tp, in its fresh processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    from zerofast.integrations.hf_pipeline import cut_causal_lm
    from zerofast.pipelining import ZeroPipelineStage

    mesh = init_device_mesh("cpu", (PP, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    s = mesh["pp"].get_local_rank()
    part = _hf_tp_plan(cut_causal_lm(_hf_llama(), s, PP), mesh["tp"])
    opt = ZeroAdam(part, stage=3, process_group=mesh, max_grad_norm=0.05, **HYPER)
    pipe = ZeroPipelineStage(part, s, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, M, loss_fn=_loss)
    for step in range(STEPS):
        ids = _hf_batch(step)
        schedule.step(ids) if s == 0 else schedule.step(target=ids, losses=[])
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        out = {n: getattr(p, "full_tensor", p.clone)().detach().clone() for n, p in part.named_parameters()}
    dist.barrier()
    return out
