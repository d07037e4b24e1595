"""ZeroAdam over a tensor-parallel model ([Note: tensor parallelism] in zerofast/tensor_parallel.py):
TitanLlama under torchtitan's plan on a (dp 2, tp 2) mesh of 4 gloo ranks, against single-process
AdamW on the global batch (the dp ranks' batches together; the tp ranks of a group see the same).
Each test runs in fresh processes: DTensor caches its sharding decisions with the mesh they were
made on, whose process groups a pooled rank destroys between jobs (tests/harness.py _drop_groups);
a later job's mesh of the same shape then hits that cache and names a destroyed group."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from models import TitanLlama, titan_loss, titan_plan
from tolerances import HYPER, fp32_tol, lp_param_tol, max_abs_diff, norm_rel_tol

from zerofast import ZeroAdam

DP, TP, ROWS, SEQ, STEPS = 2, 2, 2, 8, 3


def _batch(step: int, dp_rank: int | None = None) -> torch.Tensor:
    """Step `step`'s global batch of token ids (DP * ROWS rows), or dp rank `dp_rank`'s rows of it."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, TitanLlama().vocab, (DP * ROWS, SEQ), generator=g)
    return ids if dp_rank is None else ids[dp_rank * ROWS : (dp_rank + 1) * ROWS]


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered over "tp"), as float32."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for n, p in model.named_parameters()
    }


def _full_master(opt, model) -> dict[str, torch.Tensor]:
    """The fp32 master, whole: each data-parallel rank's pieces of the local tensors (its stand-ins'),
    gathered over the data-parallel ranks, then each DTensor's local master gathered over "tp"."""
    from torch.distributed.tensor import DTensor

    from zerofast.optim.zero_adam import parts_of

    parts = parts_of(opt)
    mine = [(pc.param, pc.param_offset, parts.shard.piece_view(pc, "master").clone()) for pc in parts.shard.pieces]
    everyone: list = [None] * parts.topology.world
    dist.all_gather_object(everyone, mine, group=parts.topology.group)
    flat = [torch.full((t.numel(),), float("nan")) for t in parts.params]
    for pieces in everyone:
        for i, offset, values in pieces:
            flat[i][offset : offset + values.numel()] = values
    out = {}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for (name, p), local, standin in zip(trainable, flat, parts.params):
        local = local.view(standin.shape)
        if isinstance(p, DTensor):
            local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False).full_tensor()
        out[name] = local
    return out


# Frozen in the configurations that say so: the embedding (a Rowwise DTensor, Shard(0)) and one norm
# (a Replicate DTensor under SequenceParallel): stage 3 shards them without state.
FROZEN = ("tok_embeddings.", "layers.0.attention_norm.")


def _variant(model, variant: str | None):
    """The model as a configuration wants it: "frozen" (FROZEN's parameters frozen), "tied" (the
    output head's weight is the embedding's: after parallelize_module both are Shard(0) on "tp", so
    the one DTensor serves both, its gradient the two paths' sum), or as built (None)."""
    if variant == "frozen":
        for name, p in model.named_parameters():
            if name.startswith(FROZEN):
                p.requires_grad_(False)
    elif variant == "tied":
        model.output.weight = model.tok_embeddings.weight
    return model


def _frozen(name: str, variant: str | None) -> bool:
    return variant == "frozen" and name.startswith(FROZEN)


def _oracle(steps: int, max_norm: float | None, variant: str | None = None) -> tuple[dict, list[float], dict]:
    """AdamW on one process over the global batch (clip_grad_norm_ at max_norm, when given): the
    parameters, each step's norm, and the trainable ones (fp32: they are the master)."""
    model = _variant(TitanLlama(), variant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False, **HYPER)
    norms = []
    for step in range(steps):
        titan_loss(model, _batch(step)).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, max_norm)))
        opt.step()
        opt.zero_grad()
    params = _full(model)
    return params, norms, {n: t for n, t in params.items() if not _frozen(n, variant)}


def _tp_oracle(tp_mesh, sp: bool, max_norm: float | None, dtype) -> tuple[dict, list[float], dict]:
    """The low-precision oracle, run on each "tp" group: torch.optim.AdamW over the same tensor-parallel
    model as a PyTorch user writes mixed precision with DTensors: the model converted, an fp32 master
    (DTensors) that AdamW steps and that is copied back rounded, each dp rank's rows given their own
    backward on the global batch and the gradients, in the parameters' placements, summed in fp32.
    Its forward rounds exactly as ZeroAdam's run (the same tensor-parallel split; a single process's
    bf16 matmuls round otherwise, by more than the step's own rounding), so what differs is only the
    reduce's and the step's rounding."""
    model = titan_plan(TitanLlama(), tp_mesh, sequence_parallel=sp)
    master = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    model.to(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(master, foreach=False, **HYPER)
    norms = []
    for step in range(STEPS):
        total = None
        for r in range(DP):
            # fp16: the loss scaled as ZeroAdam's run scales it (LossScalePolicy(init_scale=16), no
            # overflow), the gradients unscaled in fp32: the same rounding in the backward's subnormals.
            scale = 2.0**4 if dtype == torch.float16 else 1.0
            grads = torch.autograd.grad(titan_loss(model, _batch(step, r)) * scale, params)
            grads = [g.redistribute(p.device_mesh, p.placements).float() / scale for g, p in zip(grads, params)]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for m, t in zip(master, total):
            m.grad = t / DP
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(master, max_norm).full_tensor()))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return _full(model), norms, {n: m.detach().full_tensor() for n, m in zip(names, master)}


class Config(NamedTuple):
    """One training run of the 4 ranks. mesh "dp" is (dp 2, tp 2); "hybrid" is (replicate 2, dp 1,
    tp 2), hybrid sharding's replicas around tensor parallelism. micro 2: each rank's rows one at a
    time, all but the last inside no_sync() (stage 1 keeps the gradients in its buckets, stages 2 and 3
    reduce each into the shard). variant "frozen": FROZEN's parameters do not train, "tied": the
    head's weight is the embedding's (_variant). partition: CommPolicy's ("round_robin", "greedy":
    whole local tensors to owners, reduced to and broadcast from them). Stage 3 gathers each unit across "dp" only, its parameters left DTensors."""

    stage: int
    sp: bool = True  # SequenceParallel norms
    max_norm: float | None = None
    dtype: torch.dtype = torch.float32
    mesh: str = "dp"
    micro: int = 1
    variant: str | None = None
    partition: str = "flat"


MESHES = {"dp": ((DP, TP), ("dp", "tp")), "hybrid": ((DP, 1, TP), ("replicate", "dp", "tp"))}
CONFIGS = [
    Config(1),
    Config(2, max_norm=0.05),
    Config(2, sp=False),
    Config(1, sp=False, max_norm=0.05),
    Config(2, max_norm=0.05, dtype=torch.bfloat16),
    Config(1, dtype=torch.bfloat16),
    Config(2, max_norm=0.05, dtype=torch.float16),
    Config(2, max_norm=0.05, mesh="hybrid"),
    Config(1, max_norm=0.05, micro=2),
    Config(2, micro=2),
    Config(3, max_norm=0.05),
    Config(3, sp=False, micro=2),
    Config(3, max_norm=0.05, dtype=torch.bfloat16),
    Config(3, max_norm=0.05, mesh="hybrid"),
    Config(3, max_norm=0.05, variant="frozen"),
    Config(2, variant="frozen"),
    Config(2, max_norm=0.05, variant="tied"),
    Config(3, max_norm=0.05, variant="tied"),
    Config(1, max_norm=0.05, partition="round_robin"),
    Config(2, partition="greedy", variant="tied"),
    Config(3, max_norm=0.05, partition="round_robin"),
    Config(3, partition="greedy", variant="frozen"),
]


def _train(rank, world, configs):
    from torch.distributed.device_mesh import init_device_mesh

    from zerofast import CommPolicy, LossScalePolicy, MixedPrecisionPolicy
    from zerofast.estimate import estimate_memory, estimate_traffic
    from zerofast.layout import ALIGN
    from zerofast.optim.zero_adam import parts_of

    out = []
    for stage, sp, max_norm, dtype, mesh_kind, micro, variant, partition in configs:
        shape, names = MESHES[mesh_kind]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp_rank = dist.get_rank(dist.group.WORLD) // TP  # the mesh is row-major, "tp" innermost
        model = _variant(titan_plan(TitanLlama(), mesh["tp"], sequence_parallel=sp), variant)
        # fp16: a small power-of-two scale, exact on the gradients (no overflow, no subnormals here), so
        # the oracle's unscaled fp16 gradients are the same values; one that overflows is below.
        scale = {"loss_scale": LossScalePolicy(init_scale=2.0**4)} if dtype == torch.float16 else {}
        mixed = None if dtype == torch.float32 else MixedPrecisionPolicy(dtype, reduce_dtype=torch.float32, **scale)
        policy = CommPolicy(partition=partition)
        opt = ZeroAdam(model, stage=stage, process_group=mesh, mixed_precision=mixed, comm=policy, **HYPER)
        norms = []
        for step in range(STEPS):
            rows = _batch(step, dp_rank)
            for m in range(micro):
                with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    loss = titan_loss(model, rows[m * ROWS // micro : (m + 1) * ROWS // micro]) / micro
                    opt.backward(loss) if dtype == torch.float16 else loss.backward()  # fp16: the loss scaled
            if max_norm is not None:
                norms.append(float(opt.clip_grad_norm_(max_norm)))
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():  # stage 3: every unit gathered (across "dp"; DTensors on "tp")
            whole = _full(model)
        got = (whole, norms, _full_master(opt, model))
        # The estimator with tp: each rank's local tensors, sharded over the data-parallel ranks; the
        # measured bytes exceed it by the buckets' padding at most (ALIGN * dp elements a bucket).
        # The "dp" dim shards (hybrid: the "replicate" dim copies), as CommPolicy(shard_size=...) says it.
        sharded = dataclasses.replace(policy, shard_size=shape[-2])
        est = estimate_memory(model, world, stage, mixed_precision=mixed, comm=sharded, tp=TP)
        # The optimizer's own collectives over "tp" (the agreement joined; the norm's sum when clipping),
        # counted in the last step's report.
        comm = opt.report().comm
        assert comm.get("tp/all_reduce_flags", 0) > 0, comm
        assert ("tp/all_reduce_stats" in comm) == (max_norm is not None), comm
        # The traffic estimate with tp: the same layouts over the local tensors, and the "tp" all_reduces.
        traffic = estimate_traffic(
            model,
            world,
            stage,
            mixed_precision=mixed,
            comm=sharded,
            tp=TP,
            rank=dist.get_rank(),
            max_grad_norm=max_norm,
            micro_batches=micro,
            backend="gloo",
        )
        assert traffic == comm, f"{stage=} {variant=} {partition=} {mesh_kind=}: estimated {traffic}, measured {comm}"
        # (The estimate's formula shards evenly, as "flat" does; round_robin and greedy give each rank
        # whole tensors, an uneven share: not compared.)
        if partition == "flat":
            mem, parts = opt.report().memory, parts_of(opt)
            pad = ALIGN * shape[-2] * len(parts.layout.buckets)
            frozen_pad = ALIGN * shape[-2] * len(parts.frozen.layout.buckets) if parts.frozen is not None else 0
            p_bytes, o_bytes = dtype.itemsize, 8 + (4 if dtype != torch.float32 else 0)
            # Frozen parameters: stage 3's shard of them, or (stages 1 and 2) the model's own local tensors.
            local = [p._local_tensor if hasattr(p, "_local_tensor") else p for p in model.parameters()]
            whole_frozen = sum(t.numel() for t, p in zip(local, model.parameters()) if not p.requires_grad) * p_bytes
            held = mem.params + mem.param_padding + (mem.frozen_params if stage == 3 else whole_frozen)
            assert 0 <= held - est.params <= (pad + frozen_pad) * p_bytes, (mem, est)
            assert 0 <= mem.optimizer + mem.master_copy - est.optimizer <= pad * o_bytes, (mem, est)
        # The model's whole tensors as a consolidated save reads them (rank 1 takes part, keeps none).
        saved = opt.full_state_dict(keep=rank != 1)
        sent = dict(opt.named_full_tensors())
        assert saved is None if rank == 1 else all(torch.equal(saved[n].float(), t) for n, t in got[0].items())
        assert all(torch.equal(sent[n].float(), t) for n, t in got[0].items())
        out.append((got, None if dtype == torch.float32 else _tp_oracle(mesh["tp"], sp, max_norm, dtype)))
    dist.barrier()
    return out


def test_tp2_dp2_equals_adamw_on_the_global_batch():
    results = run_ranks(_train, DP * TP, (CONFIGS,), timeout=300, fresh=True)
    oracles = {
        (c.max_norm, c.variant): _oracle(STEPS, c.max_norm, c.variant) for c in CONFIGS if c.dtype == torch.float32
    }
    numel = sum(p.numel() for p in TitanLlama().parameters())
    for rank, runs in enumerate(results):
        for config, ((params, norms, master), tp_oracle) in zip(CONFIGS, runs):
            want, want_norms, want_master = tp_oracle or oracles[config.max_norm, config.variant]
            # fp32: 16 ulps a step (tolerances.py); bf16 against the oracle whose gradients are the
            # same: the master within the step's rounding, the parameters its rounding to bf16, one
            # ulp of bf16 at the largest parameter where two masters round to neighbours.
            tol = fp32_tol(STEPS) if tp_oracle is None else lp_param_tol(config.dtype, STEPS, want)
            assert max_abs_diff(master, want_master) <= fp32_tol(STEPS), (rank, config)
            assert max_abs_diff(params, want) <= tol, (rank, config)
            for got, w in zip(norms, want_norms):
                assert abs(got - w) <= norm_rel_tol(numel) * w, (rank, config, got, w)


def _overflow(rank, world):
    """fp16 under tensor parallelism, an overflow on one rank's part only: rank 1's gradient of a
    Colwise weight (its local rows, no collective after it) made infinite in one step. Its dp peer
    sees it through the reduce, its "tp" peers only through the overflow flag's sum over "tp": every
    rank must skip that step and halve the scale, or the model's parts drift apart. The next step runs
    under torch.profiler, which shows its zerofast:: ranges as without tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerofast import LossScalePolicy, MixedPrecisionPolicy

    out = {}
    for stage in (2, 3):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        model = titan_plan(TitanLlama(), mesh["tp"])
        mixed = MixedPrecisionPolicy(torch.float16, reduce_dtype=torch.float32, loss_scale=LossScalePolicy(2.0**4))
        opt = ZeroAdam(model, stage=stage, process_group=mesh, mixed_precision=mixed, **HYPER)
        weight = dict(model.named_parameters())["layers.1.feed_forward.w1.weight"]
        states, scales = [], []
        for step in range(3):
            hook = weight.register_hook(lambda g: g * float("inf")) if step == 1 and rank == 1 else None
            # The last step profiled: where it goes, as without tensor parallelism (test_contract.py).
            profiled = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if step == 2 else None
            with profiled or contextlib.nullcontext():
                opt.backward(titan_loss(model, _batch(step, dp_rank)))
                if hook is not None:
                    hook.remove()
                opt.step()
            opt.zero_grad()
            with opt.gathered_params():
                states.append(_full(model))
            scales.append(opt.loss_scale)
        names = sorted({e.name for e in profiled.events() if e.name.startswith("zerofast::")})
        out[stage] = (states, scales, names)
    dist.barrier()
    return out


def test_an_fp16_overflow_on_one_tp_rank_skips_the_step_on_every_rank_and_the_profiler_sees_the_step():
    results = run_ranks(_overflow, DP * TP, timeout=300, fresh=True)
    profiled = {2: {"zerofast::adam", "zerofast::gather", "zerofast::reduce"}}
    profiled[3] = {"zerofast::adam", "zerofast::reduce", "zerofast::unit_gather"}
    for stage in (2, 3):
        first, scales, _ = results[0][stage]
        assert scales == [2.0**4, 2.0**3, 2.0**3], (stage, scales)  # skipped, halved; then applied
        assert max_abs_diff(first[1], first[0]) == 0, stage  # the overflowed step changed nothing
        assert max_abs_diff(first[2], first[1]) > 0, stage  # the next one applies
        for rank, out in enumerate(results):
            states, got, names = out[stage]
            assert got == scales, (rank, stage, got)
            assert profiled[stage] <= set(names), (rank, stage, names)
            assert all(max_abs_diff(a, b) == 0 for a, b in zip(states, first)), (rank, stage)


def _refused(rank, world):
    """What the configuration cannot serve, each a named error on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerofast.checkpoint as ckpt
    from zerofast import ZeroMuon

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    errors = []

    def attempt(fn):
        try:
            fn()
            errors.append(None)
        except (ValueError, TypeError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {e}")

    attempt(lambda: ZeroMuon(titan_plan(TitanLlama(), mesh["tp"]), process_group=mesh, lr=0.02))
    # The model parallelized over every rank, the optimizer told "tp" is 2 of them.
    whole = init_device_mesh("cpu", (DP * TP,), mesh_dim_names=("tp",))
    attempt(lambda: ZeroAdam(titan_plan(TitanLlama(), whole), stage=2, process_group=mesh, **HYPER))
    opt = ZeroAdam(titan_plan(TitanLlama(), mesh["tp"]), stage=2, process_group=mesh, **HYPER)
    from zerofast import MixedPrecisionPolicy

    eight = ZeroAdam(
        titan_plan(TitanLlama(), mesh["tp"]),
        stage=2,
        process_group=mesh,
        mixed_precision=MixedPrecisionPolicy(state_bits=8, state_block=32),
        **HYPER,
    )
    attempt(lambda: eight.state_dict())
    attempt(lambda: ckpt.save(f"/tmp/zerofast-tp-refused-{rank}", eight.model, eight))
    # A step that one rank cannot apply (its lr made invalid, on global rank 1 only): every rank of
    # the model, across "tp" too, applies nothing, or the tp ranks' halves of a layer would diverge.
    before = _full(opt.model)
    titan_loss(opt.model, _batch(0, mesh.get_local_rank("dp"))).backward()
    if rank == 1:
        opt.param_groups[0]["lr"] = -1.0
    try:
        opt.step()
        failed = None
    except Exception as e:  # noqa: BLE001  (whichever error: that every rank raised is the point)
        failed = type(e).__name__
    dist.barrier()
    return errors, failed, max_abs_diff(_full(opt.model), before)


def test_what_tensor_parallelism_cannot_serve_yet_is_named():
    expected = [
        "ValueError: ZeroMuon: parameter 'tok_embeddings.weight' is a DTensor (placements (Shard(dim=0),) on a 1-D "
        "DeviceMesh with mesh_dim_names=('tp',)); ZeroMuon does not take tensor-parallel models",
        "ValueError: ZeroAdam: parameter 'tok_embeddings.weight' is a DTensor on a 1-D DeviceMesh over ranks "
        "[0, 1, 2, 3] (mesh_dim_names=('tp',)); with tensor parallelism every DTensor parameter must live on the "
        "process_group mesh's 'tp' dim",
        "NotImplementedError: ZeroAdam: checkpoints of a tensor-parallel model with 8-bit optimizer state",
        "NotImplementedError: ZeroAdam: checkpoints of a tensor-parallel model with 8-bit optimizer state",
    ]
    results = run_ranks(_refused, DP * TP, fresh=True)
    failed = ["StepNotAppliedError", "ValueError", "StepNotAppliedError", "StepNotAppliedError"]
    assert [f for _, f, _ in results] == failed, results  # rank 1's own error; every other rank's too
    assert all(moved == 0 for _, _, moved in results), results
    for errors, _, _ in results:
        assert len(errors) == len(expected)
        for got, want in zip(errors, expected):
            assert got is not None and got.startswith(want), (got, want)


def _state(model, opt) -> dict:
    """This rank's parameters (each DTensor's local part) and its pieces of the state, bitwise."""
    with opt.gathered_params():
        params = {n: getattr(p, "_local_tensor", p).detach().clone() for n, p in model.named_parameters()}
    view = opt.checkpoint_view
    return dict(params=params, **{k: view.trainable.state_pieces(k) for k in ("master", "exp_avg", "exp_avg_sq")})


def _differs(a: dict, b: dict) -> list[str]:
    bad = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        if not all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a[kind], b[kind])):
            bad.append(kind)
    return bad


def _offloaded(rank, world, root):
    """The state on disk under tensor parallelism, stages 2 and 3, against the same run in memory;
    then one write fails on rank 1 alone (dp 0, tp 1): the step must be applied on no rank, the other
    "tp" rank of its layer parts included ([Note: the all-or-none offloaded step])."""
    import errno

    from torch.distributed.device_mesh import init_device_mesh

    from zerofast import OffloadPolicy
    from zerofast.offload import OffloadError
    from zerofast.optim.zero_adam import parts_of

    out = {}
    for stage in (2, 3):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        runs = []
        for offload in (None, OffloadPolicy("disk", root, window_mb=0.05)):
            model = titan_plan(TitanLlama(), mesh["tp"])
            runs.append((model, ZeroAdam(model, stage=stage, process_group=mesh, offload=offload, **HYPER)))

        def train(model, opt, steps):
            for s in steps:
                titan_loss(model, _batch(s, dp_rank)).backward()
                opt.step()
                opt.zero_grad()

        for model, opt in runs:
            train(model, opt, range(STEPS))
        (a, oa), (b, ob) = runs
        before = _state(b, ob)

        def full_disk(path, chunk):
            if rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)", path)

        parts_of(ob).store.fail_write = full_disk
        try:
            train(b, ob, [STEPS])
            raised = None
        except Exception as e:
            raised = type(e).__name__, str(e), isinstance(e, OffloadError)
        parts_of(ob).store.fail_write = None
        unchanged = _differs(before, _state(b, ob))
        train(a, oa, [STEPS])
        train(b, ob, [STEPS])  # the failed step again: the runs are the same
        out[stage] = dict(
            same=_differs(_state(a, oa), _state(b, ob)),
            unchanged=unchanged,
            raised=raised,
            state=ob.report().offload.state,
            shard=parts_of(ob).shard.exp_avg.numel(),
            tp_flags=ob.report().comm.get("tp/all_reduce_flags", 0),
        )
    dist.barrier()
    return out


def test_disk_offload_under_tp_is_the_state_in_memory_and_all_or_none(tmp_path):
    results = run_ranks(_offloaded, DP * TP, (str(tmp_path),), timeout=300, fresh=True)
    for rank, out in enumerate(results):
        for stage, got in out.items():
            where = (rank, stage)
            assert got["state"] == "disk" and got["shard"] > 0, (where, got)
            assert got["same"] == [] and got["unchanged"] == [], (where, got)
            assert got["tp_flags"] > 0, where
            kind, message, own = got["raised"]
            if rank == 1:
                assert own and "No space left" in message, (where, message)
            else:  # rank 3 shares rank 1's dp group, rank 0 its "tp" group, rank 2 neither
                assert kind == "StepNotAppliedError" and "rank 1 could not write" in message, (where, message)


def _rows(step: int, dp_rank: int, dp: int) -> torch.Tensor:
    """Step `step`'s global batch split into `dp` equal parts: part `dp_rank`."""
    ids = _batch(step)
    n = ids.size(0) // dp
    return ids[dp_rank * n : (dp_rank + 1) * n]


def _checkpoints(rank, world, root):
    """A TP x ZeRO checkpoint loaded into another tp degree and into plain ZeroAdam, and a plain one
    loaded back into TP: each continues as the run that saved it does."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerofast.checkpoint as ckpt

    def tp_run(shape, stage, variant=None):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        model = _variant(titan_plan(TitanLlama(), mesh["tp"]), variant)
        return model, ZeroAdam(model, stage=stage, process_group=mesh, **HYPER), mesh.get_local_rank("dp"), shape[0]

    def step(model, opt, s, dp_rank, dp):
        titan_loss(model, _rows(s, dp_rank, dp)).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            return _full(model)

    saved, plain_saved = f"{root}/tp", f"{root}/plain"
    model, opt, dp_rank, dp = tp_run((2, 2), 2)  # the run that saves, and goes on
    for s in range(2):
        step(model, opt, s, dp_rank, dp)
    ckpt.save(saved, model, opt)
    want = [step(model, opt, s, dp_rank, dp) for s in (2, 3)]
    model, opt, dp_rank, dp = tp_run((1, 4), 1)  # tp 4, stage 1
    ckpt.load(saved, model, opt)
    ckpt.save(f"{root}/tp4", model, opt)  # saved again before it steps: the same state, bitwise
    tp4 = step(model, opt, 2, dp_rank, dp)
    plain_model = TitanLlama()  # plain ZeroAdam on the 4 ranks
    plain = ZeroAdam(plain_model, stage=2, **HYPER)
    ckpt.load(saved, plain_model, plain)
    flat = step(plain_model, plain, 2, rank, world)
    ckpt.save(plain_saved, plain_model, plain)
    model, opt, dp_rank, dp = tp_run((2, 2), 2)  # and back into tp 2 x dp 2
    ckpt.load(plain_saved, model, opt)
    back = step(model, opt, 3, dp_rank, dp)
    # Stage 3 with frozen DTensors (sharded, no state; [Note: frozen parameters in stage 3]): saved
    # at tp 2 x dp 2, loaded at tp 4 x dp 1.
    model, opt, dp_rank, dp = tp_run((2, 2), 3, "frozen")
    for s in range(2):
        step(model, opt, s, dp_rank, dp)
    ckpt.save(f"{root}/stage3", model, opt)
    want3 = [step(model, opt, s, dp_rank, dp) for s in (2,)]
    model, opt, dp_rank, dp = tp_run((1, 4), 3, "frozen")
    ckpt.load(f"{root}/stage3", model, opt)
    ckpt.save(f"{root}/stage3_tp4", model, opt)
    got3 = step(model, opt, 2, dp_rank, dp)
    dist.barrier()
    return want, tp4, flat, back, want3[0], got3


def test_a_tp_checkpoint_loads_into_another_tp_degree_plain_zero_adam_and_one_process(tmp_path):
    """Saved at tp 2 x dp 2 after two steps; the third step after loading it at tp 4 x dp 1 (stage 1),
    into plain ZeroAdam on 4 ranks, and into torch.optim.AdamW in one process (to_torch), and the
    fourth after the plain run's checkpoint loads back into tp 2 x dp 2; and a stage-3 run with frozen
    DTensors saved at tp 2 x dp 2, its third step after loading at tp 4: each equals the saving run's
    (fp32_tol: the same state, the step's rounding; the reduction order differs). The state itself
    moves bitwise: each tp-4 run saved again before it steps holds what the tp 2 x dp 2 run saved."""
    import zerofast.checkpoint as ckpt

    results = run_ranks(_checkpoints, DP * TP, (str(tmp_path),), timeout=300, fresh=True)
    # Loading moves the state bitwise: saved again at tp 4 before stepping, it is the saved state.
    for first, again in (("tp", "tp4"), ("stage3", "stage3_tp4")):
        (model_a, optim_a), (model_b, optim_b) = (ckpt.to_torch(str(tmp_path / n)) for n in (first, again))
        assert model_a.keys() == model_b.keys() and all(torch.equal(model_a[k], model_b[k]) for k in model_a), first
        assert optim_a["state"].keys() == optim_b["state"].keys(), first
        for i, state in optim_a["state"].items():
            assert all(torch.equal(v, optim_b["state"][i][k]) for k, v in state.items()), (first, i)
    model_sd, optim_sd = ckpt.to_torch(str(tmp_path / "tp"))
    model = TitanLlama()
    model.load_state_dict(model_sd)
    adamw = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    adamw.load_state_dict(optim_sd)
    titan_loss(model, _batch(2)).backward()
    adamw.step()
    one_process = _full(model)
    for rank, (want, tp4, flat, back, want3, got3) in enumerate(results):
        assert max_abs_diff(want[0], results[0][0][0]) == 0, rank  # every rank saw the same whole model
        moved = max_abs_diff(want[1], want[0])
        for name, got, w in (
            ("tp4", tp4, want[0]),
            ("plain", flat, want[0]),
            ("one process", one_process, want[0]),
            ("back", back, want[1]),
            ("stage 3 at tp 4", got3, want3),
        ):
            assert max_abs_diff(got, w) <= fp32_tol(1), (rank, name, max_abs_diff(got, w))
        assert moved > 100 * fp32_tol(1), moved  # the compared step moves the parameters: the test can fail


def _hf_plan(model, tp_mesh):
    """A tensor-parallel plan for Hugging Face's Llama (its module names): q/k/v and gate/up Colwise,
    o and down Rowwise, the embedding Rowwise and the head Colwise, both gathered; norms plain."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


# Generation after training, per dp rank: (prompt length, max_new_tokens); the tp ranks of a group
# generate together (their forwards are collectives over "tp"), the dp ranks differently long.
GENERATE = [(5, 6), (4, 3)]


def _prompt(dp_rank: int) -> torch.Tensor:
    length = GENERATE[dp_rank][0]
    return torch.randint(1, 32, (2, length), generator=torch.Generator().manual_seed(77 + dp_rank))


def _greedy(model, dp_rank: int) -> torch.Tensor:
    ids = _prompt(dp_rank)
    new = GENERATE[dp_rank][1]
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)


def _hf(rank, world):
    from models import tiny_llama
    from torch.distributed.device_mesh import init_device_mesh

    import zerofast.integrations.hf_generation  # noqa: F401  (generate() synced outside the block)
    from zerofast import UnitPolicy

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = _hf_plan(tiny_llama(eos_token_id=None, pad_token_id=0), mesh["tp"])
    opt = ZeroAdam(model, stage=3, process_group=mesh, max_grad_norm=0.05, units=UnitPolicy(min_unit_mb=0), **HYPER)
    for step in range(STEPS):
        _hf_loss(model, _batch(step, dp_rank)).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        out = _full(model)
        # Gathered across "dp" only: each DTensor holds this tp rank's part ([Note: tensor parallelism]).
        split = [p for p in model.parameters() if hasattr(p, "placements") and p.placements[0].is_shard()]
        local = bool(split) and all(p._local_tensor.numel() * TP == p.numel() for p in split)
    # Generation on stage 3 under TP ([Note: generation on stage 3]): the whole model pinned, each dp
    # rank its own number of forwards and no gather; then unit by unit, generate() synced.
    with opt.gathered_params(), torch.inference_mode():
        before = opt.report().unit_gathers
        pinned = _greedy(model, dp_rank)
        gathers_in_block = opt.report().unit_gathers - before
    with torch.no_grad():
        streamed = _greedy(model, dp_rank)
    # Whole across "tp" too (gather_tp=True): every parameter's local tensor is the whole one, and the
    # model still generates; afterwards each is its DTensor part again. named_full_tensors hands out
    # whole tensors, or with gather_tp=False each rank's part.
    with opt.gathered_params(gather_tp=True) as m:
        whole = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in m.named_parameters()}
        with torch.inference_mode():
            replicated = _greedy(m, dp_rank)
    with opt.gathered_params():
        again = _full(model)
        parts = {n: p._local_tensor.clone() for n, p in model.named_parameters() if hasattr(p, "_local_tensor")}
    sent = dict(opt.named_full_tensors())
    sent_parts = dict(opt.named_full_tensors(gather_tp=False))
    checks = {
        "whole inside": all(torch.equal(whole[n], t) for n, t in out.items()),
        "restored": all(torch.equal(again[n], t) for n, t in out.items()),
        "sent whole": all(torch.equal(sent[n], t) for n, t in out.items()),
        "sent parts": all(torch.equal(sent_parts[n], t) for n, t in parts.items()) and len(parts) > 0,
    }
    for bad in ("yes", 1):
        for call in (
            lambda: opt.gathered_params(gather_tp=bad).__enter__(),
            lambda: opt.named_full_tensors(gather_tp=bad),
        ):
            try:
                call()
                checks[f"refused {bad!r}"] = False
            except TypeError as e:
                checks[f"refused {bad!r}"] = "gather_tp must be True or False" in str(e)
    dist.barrier()
    return out, local, pinned, streamed, gathers_in_block, replicated, checks


def test_a_hugging_face_llama_under_a_tp_plan_equals_adamw_and_generates():
    """Not our own model: Hugging Face's Llama built from its config (its attention reshapes to the
    local heads, its rotary buffers and norms stay plain), tp 2 x dp 2, stage 3 (each unit gathered
    across "dp", its parameters left DTensors on "tp"), clipped, against single-process AdamW with
    torch's clip_grad_norm_ on the global batch (fp32_tol); then generate() on each dp rank, of its
    own length, inside gathered_params() (no gather) and unit by unit: the tokens of single-process
    generate() with the oracle's weights."""
    from models import tiny_llama

    results = run_ranks(_hf, DP * TP, timeout=300, fresh=True)
    model = tiny_llama(eos_token_id=None, pad_token_id=0)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        _hf_loss(model, _batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    want = _full(model)
    initial = _full(tiny_llama())
    model.eval()
    tokens = []
    for dp_rank in range(DP):
        with torch.no_grad():
            scores = model.generate(
                _prompt(dp_rank),
                attention_mask=torch.ones_like(_prompt(dp_rank)),
                max_new_tokens=GENERATE[dp_rank][1],
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens.append(scores.sequences)
        # Greedy picks the largest logit: the oracle's top two differ by far more than the rounding
        # that tensor parallelism's split sums add (fp32 ulps of logits of order 1), so the same
        # tokens are the right answer on any CPU, not a tie broken one way.
        gaps = [float((s.topk(2).values[:, 0] - s.topk(2).values[:, 1]).min()) for s in scores.scores]
        assert min(gaps) > 1e-3, gaps
    for rank, (got, local, pinned, streamed, gathers_in_block, replicated, checks) in enumerate(results):
        assert all(checks.values()), (rank, checks)
        assert torch.equal(replicated, tokens[rank // TP]), (rank, replicated, tokens[rank // TP])
        assert max_abs_diff(got, want) <= fp32_tol(STEPS), (rank, max_abs_diff(got, want))
        assert local, rank
        assert torch.equal(pinned, tokens[rank // TP]), (rank, pinned, tokens[rank // TP])
        assert torch.equal(streamed, tokens[rank // TP]), (rank, streamed, tokens[rank // TP])
        assert gathers_in_block == 0, rank
    assert max_abs_diff(want, initial) > 100 * fp32_tol(STEPS)  # it trained: the comparison can fail


def test_titan_plan_refuses_sequence_parallelism_without_the_parallel_embedding():
    """parallel_embedding=False leaves the embedding's output whole, which sequence parallelism
    would take as sharded: a named error before any mesh is touched."""
    with pytest.raises(ValueError, match="sequence_parallel=True shards the embedding's output"):
        titan_plan(TitanLlama(), None, sequence_parallel=True, parallel_embedding=False)
