"""Hybrid sharding ([Note: hybrid sharding] in zerofast/topology.py): ZeroAdam(comm=CommPolicy(shard_size=K))
and ZeroAdam(process_group=a 2-D DeviceMesh) shard within groups of K ranks and replicate across them.

- Two torchrun launches of 2 ranks each (two "machines", c10d rendezvous on loopback), K=2,
  stages 1-3 x flat/round_robin on the nested model: parameters equal single-process AdamW on the
  global batch; the bytes that cross machines are the owned gradient shard once per step (plus the
  agreement), also with gradient accumulation; shard_size=W is the flat run bitwise.
- A checkpoint saved at (4 ranks, K=2) loads at (2, K=2), (3, flat) and (1) bitwise as saved.
- On 4 pooled ranks: gradient clipping with K < W equals the flat run (the norm counts each element
  once); a ("replicate", "shard") DeviceMesh as process_group equals shard_size; bad input is named on every rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from harness import free_port, run_ranks
from models import Nested, model_loss
from oracles import single_process
from probes import full_master
from tolerances import HYPER, fp32_tol, max_abs_diff, norm_rel_tol
from training import rank_batch, zero_options

from zerofast import CommPolicy, ZeroAdam, shard_frozen
from zerofast import checkpoint as ck
from zerofast.optim.grads import AgreementLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
STEPS, MICRO = 3, 2  # as tests/jobs/hybrid_job.py
TENSORS = len(list(Nested().parameters()))  # the tied weight is one parameter
PARAM_BYTES = sum(p.numel() * 4 for p in Nested().parameters())


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """tests/jobs/hybrid_job.py on 2 x 2 ranks; every rank's results and the checkpoint's folder."""
    out = str(tmp_path_factory.mktemp("hybrid"))
    port = free_port()
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(i),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                os.path.join(ROOT, "tests", "jobs", "hybrid_job.py"),
                out,
            ],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in launches]
    assert all(p.returncode == 0 for p in launches), "\n".join(logs)
    return torch.load(os.path.join(out, "results.pt"), weights_only=False), os.path.join(out, "ckpt")


def _accumulated_oracle(world: int) -> dict[str, torch.Tensor]:
    """AdamW on one process over every rank's MICRO micro-batches of each step (the job's loss is
    each micro-batch's mean over MICRO, averaged over the ranks by ZeroAdam)."""
    model = Nested()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        total = sum(
            model_loss(model, *rank_batch(model, step * MICRO + m, r)) for r in range(world) for m in range(MICRO)
        ) / (world * MICRO)
        total.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# Two correct runs differ by the order the 4 ranks' gradients are added (a ring over 2 then over 2,
# against one process's sum): fp32_tol's bound (16 ulps of the largest parameter's scale per step;
# tests/tolerances.py says why).
def test_hybrid_equals_single_process_adamw_and_sends_a_shard_across(launched):
    results, _ = launched
    want = single_process(Nested, 4, STEPS)
    agreement = AgreementLayout(TENSORS).numel * 8
    for key in [k for k in results[0] if isinstance(k, tuple) and k[2] == 2 and len(k) == 3]:
        stage, partition, _ = key
        runs = [results[r][key] for r in range(4)]
        d = max_abs_diff(runs[0]["params"], want)
        assert d <= fp32_tol(STEPS), f"{key}: {d:.3g} from single-process AdamW"
        for r in range(1, 4):  # the replicas (and the shard group's ranks) end equal, bitwise
            assert max_abs_diff(runs[r]["params"], runs[0]["params"]) == 0, f"{key}: rank {r} differs"
        for r, run in enumerate(runs):
            for stats in run["stats"]:
                cross = {k: v for k, v in stats.items() if k.startswith("replicate/")}
                # once per step: the owned gradient shard (padding included) and the agreement
                assert cross == {"replicate/all_reduce": run["owned"], "replicate/all_reduce_flags": agreement}, (
                    f"{key} rank {r}: {stats}"
                )
        # the shards of one group cover the parameters once: on average 1/K of them cross machines
        # (flat pads each bucket to a multiple of K x 4 elements: [Note: padding] in zerofast/layout.py)
        padding = runs[0]["buckets"] * 2 * 4 * 4 if partition == "flat" else 0
        for group in ((0, 1), (2, 3)):
            owned = sum(runs[r]["owned"] for r in group)
            assert PARAM_BYTES <= owned <= PARAM_BYTES + padding, (key, owned, PARAM_BYTES)


def test_shard_size_w_is_the_flat_run_bitwise(launched):
    results, _ = launched
    want = single_process(Nested, 4, STEPS)
    for stage in (1, 2, 3):
        for partition in ("flat", "round_robin"):  # flat ZeRO over the two machines, against AdamW too
            assert max_abs_diff(results[0][stage, partition, None]["params"], want) <= fp32_tol(STEPS)
        for r in range(4):
            flat, k4 = results[r][stage, "flat", None], results[r][stage, "flat", 4]
            assert max_abs_diff(flat["params"], k4["params"]) == 0, (stage, r)
            assert flat["stats"] == k4["stats"] and not any(k.startswith("replicate/") for k in flat["stats"][0])


def test_accumulation_crosses_machines_once_per_step(launched):
    results, _ = launched
    want = _accumulated_oracle(4)
    for stage in (1, 2, 3):
        runs = [results[r][stage, "flat", 2, "accumulate"] for r in range(4)]
        assert max_abs_diff(runs[0]["params"], want) <= fp32_tol(STEPS), stage
        for run in runs:
            for stats in run["stats"]:  # MICRO micro-batches, one shard's worth across replicas
                assert stats["replicate/all_reduce"] == run["owned"], (stage, stats)


def _load_and_snapshot(rank, world, path, stage, partition, shard_size):
    model = Nested()
    torch.manual_seed(11)
    with torch.no_grad():  # other values than the saved ones: every element must come from the file
        for p in model.parameters():
            p.uniform_(-1, 1)
    opt = ZeroAdam(model, **zero_options(stage, partition=partition, shard_size=shard_size), **HYPER)
    ck.load(path, model, opt)
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = dict(
        params=params,
        steps=opt.checkpoint_view.step_counts(),
        **{k: opt.checkpoint_view.trainable.state_pieces(k) for k in ("master", "exp_avg", "exp_avg_sq")},
    )
    opt.remove_hooks()
    return out


@pytest.mark.parametrize(
    "world, stage, partition, shard_size", [(2, 3, "flat", 2), (3, 1, "greedy", None), (1, 2, "flat", None)]
)
def test_a_hybrid_checkpoint_loads_anywhere_bitwise(launched, world, stage, partition, shard_size):
    results, path = launched
    model_sd, optim_sd = ck.to_torch(path)
    names = [n for n, _ in Nested().named_parameters()]
    for r in range(4):  # what was saved: the job's parameters at the save
        assert all(torch.equal(results[r]["saved"]["params"][n], model_sd[n]) for n in names)
    shapes = {n: tuple(model_sd[n].shape) for n in names}
    # Both replicas hold every chunk; DCP's planner writes each once, balancing the writers by size,
    # so the replicas split the writing (a balanced split gives each about half).
    written = [os.path.getsize(os.path.join(path, f"__{r}_0.distcp")) for r in range(4)]
    assert min(sum(written[:2]), sum(written[2:])) >= sum(written) / 4, written
    after = run_ranks(_load_and_snapshot, world, args=(path, stage, partition, shard_size))
    for kind, want in (("master", model_sd), ("exp_avg", None), ("exp_avg_sq", None)):
        got = full_master([a[kind] for a in after], shapes)
        for i, n in enumerate(names):
            expected = want[n] if want is not None else optim_sd["state"][i][kind]
            assert torch.equal(got[n], expected), f"{kind} of {n} after loading at {world} ranks"
    for snap in after:
        assert all(torch.equal(snap["params"][n], model_sd[n]) for n in names)
        assert set(snap["steps"].values()) == {STEPS}


# --- on 4 pooled ranks ----------------------------------------------------------------------------


def _clipped(rank, world, shard_size, max_norm):
    model = Nested()
    opt = ZeroAdam(model, stage=2, comm=CommPolicy(shard_size=shard_size), **HYPER)
    norms = []
    for step in range(STEPS):
        model_loss(model, *rank_batch(model, step, rank)).backward()
        norms.append(float(opt.clip_grad_norm_(max_norm)))
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.remove_hooks()
    return params, norms


def _clipped_oracle(world, max_norm):
    model = Nested()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    norms = []
    for step in range(STEPS):
        (sum(model_loss(model, *rank_batch(model, step, r)) for r in range(world)) / world).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def test_clipping_counts_each_gradient_element_once():
    """K < W: the squared norm is summed over the shard group only (each replica holds the same
    shard); summed over every rank it would be W/K times too large (VeOmni#862's bug)."""
    max_norm = 0.05  # below the norms here (~0.3-1): every step clips
    want_params, want_norms = _clipped_oracle(4, max_norm)
    for k in (1, 2, 4):
        params, norms = run_ranks(_clipped, 4, args=(k, max_norm))[0]
        # the norm: a sum of every element's square in another order (norm_rel_tol), per step
        assert all(abs(a - b) <= norm_rel_tol(PARAM_BYTES // 4) * b for a, b in zip(norms, want_norms)), (
            k,
            norms,
            want_norms,
        )
        assert max_abs_diff(params, want_params) <= fp32_tol(STEPS), k


def _mesh_and_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for stage in (1, 3):
        runs = {}
        for how in ("mesh", "shard_size", "checked"):
            model = Nested()
            extra = (
                dict(process_group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
                if how == "mesh"
                else {}
            )
            # stage 1 in buckets of ~500 elements: the replicas' all_reduces coalesce several buckets' ranges
            comm = dict(bucket_mb=0.002) if stage == 1 else {}
            if how != "mesh":
                comm["shard_size"] = 2
            if how == "checked":  # every collective described first; the replicas' all_reduce in step()
                comm["check_collectives"] = True
            extra["comm"] = CommPolicy(**comm)
            opt = ZeroAdam(model, stage=stage, **extra, **HYPER)
            for step in range(2):
                model_loss(model, *rank_batch(model, step, rank)).backward()
                opt.step()
                opt.zero_grad()
            with opt.gathered_params():
                runs[how] = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.report().comm)
            opt.remove_hooks()
        out[stage] = runs
    # check_collectives where the replicate group is larger than the shard group (4 replicas of 1)
    model = Nested()
    opt = ZeroAdam(model, stage=2, comm=CommPolicy(check_collectives=True, shard_size=1), **HYPER)
    model_loss(model, *rank_batch(model, 0, rank)).backward()
    opt.step()
    opt.remove_hooks()
    # a subgroup as process_group (tensor x data parallel): ranks {0, 1} and {2, 3} each train alone
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = Nested()
    opt = ZeroAdam(model, stage=2, comm=CommPolicy(shard_size=1), process_group=pairs[rank // 2], **HYPER)
    model_loss(model, *rank_batch(model, 0, rank)).backward()
    opt.step()
    subgroup_stats = opt.report().comm
    opt.remove_hooks()
    errors = []
    for options in (
        lambda: dict(comm=CommPolicy(shard_size=2 if rank < 2 else 4)),  # ranks given different shard sizes
        lambda: dict(comm=CommPolicy(shard_size=3 if rank == 0 else 2)),  # one of them bad on its own
        lambda: dict(comm=CommPolicy(shard_size=3)),
        lambda: dict(comm=CommPolicy(shard_size=0)),
        lambda: dict(comm=CommPolicy(shard_size=8)),
        lambda: dict(comm=CommPolicy(shard_size=2.0)),
        lambda: dict(process_group=init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))),
        lambda: dict(process_group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))),
        lambda: dict(
            process_group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
            comm=CommPolicy(shard_size=2),
        ),
        lambda: dict(process_group="2x2"),
        lambda: dict(process_group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))),
    ):
        try:
            ZeroAdam(Nested(), stage=2, **options())
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    # A tensor-parallel model (DTensor parameters) without a mesh that names its "tp" dim: named
    # before any collective, by ZeroAdam and shard_frozen alike (tests/test_tensor_parallel.py: with one).
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for build in (lambda m: ZeroAdam(m, stage=2, **HYPER), shard_frozen):
        tp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        parallelize_module(
            tp, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
        )
        try:
            build(tp)
            errors.append(None)
        except ValueError as e:
            errors.append(f"{type(e).__name__}: {e}")
    dist.barrier()
    return out, errors, subgroup_stats


def test_a_mesh_equals_shard_size_and_bad_input_is_named_on_every_rank():
    results = run_ranks(_mesh_and_errors, 4)
    for out, _, subgroup_stats in results:
        assert subgroup_stats["replicate/all_reduce"] > 0 and not any(k.startswith("shard/") for k in subgroup_stats)
        for stage, runs in out.items():
            (pm, sm), (ps, ss), (pc, sc) = runs["mesh"], runs["shard_size"], runs["checked"]
            assert max_abs_diff(pm, ps) == 0 and sm == ss, stage  # the same groups: the same run, bitwise
            # The replicas' sum in step() (one all_reduce of the shard) against the engine's in backward
            # (one per bucket): each element is a + b of the same two replicas' values, bitwise alike.
            assert max_abs_diff(pc, ps) == 0, stage
            assert sc["replicate/all_reduce"] == ss["replicate/all_reduce"], (sc, ss)
            assert "replicate/all_reduce" in sm
    expected = [
        "ranks were given different options: rank 0 has shard_size=2, rank 2 has shard_size=4",
        "ranks were given different options: rank 0 has shard_size=3, rank 1 has shard_size=2",
        "shard_size=3 must divide the number of ranks, 4",
        "shard_size must be None or an integer >= 1; got 0",
        "shard_size=8 must divide the number of ranks, 4",
        "shard_size must be None or an integer >= 1; got 2.0",
        "a DeviceMesh as process_group must have mesh_dim_names ('replicate', 'shard') (hybrid sharding",
        "a 2-D mesh of shape (2, 2) with mesh_dim_names=('shard', 'replicate')",
        "pass it without CommPolicy.shard_size (got shard_size=2)",
        "TypeError: ZeroAdam: process_group must be a torch.distributed ProcessGroup, a 2-D DeviceMesh",
        "('dp', 'tp') or ('replicate', 'dp', 'tp') (tensor parallelism), 'shard' and 'dp' naming the same dim, "
        "each with 'pp' in front (pipeline parallelism; also ('pp', 'dp')); got a 2-D mesh of shape (2, 2) with "
        "mesh_dim_names=('tp', 'dp')",
        "ZeroAdam: parameter '0.weight' is a DTensor (placements (Shard(dim=0),) on a 1-D DeviceMesh",
        "shard_frozen: parameter '0.weight' is a DTensor (placements (Shard(dim=0),)",
    ]
    assert all(len(errors) == len(expected) for _, errors, _ in results)
    for _, errors, _ in results:  # every rank raises the same error
        for got, want in zip(errors, expected):
            assert got is not None and want in got, (got, want)
