"""The traffic estimator and the step-time model (zerofast/estimate/traffic.py, timemodel.py):
estimate_traffic against report().comm measured on 4 gloo ranks (exact: equality, no tolerance),
the offloaded state's bytes and traffic against report() on 1 and 2 gloo ranks (equality too),
the cost formulas against hand-computed values, the command line's output and errors.
No timing here: the model's check against measured step times is scripts/probe_links.py."""

import dataclasses
import functools
import math
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from harness import run_ranks
from models import Nested
from training import rank_batch

from zerofast import CommPolicy, MixedPrecisionPolicy, OffloadPolicy, UnitPolicy, ZeroAdam
from zerofast.collectives import collective_names
from zerofast.config import resolve_plan
from zerofast.estimate.memory import estimate_memory
from zerofast.estimate.timemodel import Cluster, Link, collective_time, link_of, predict, step_time
from zerofast.estimate.traffic import AGREEMENT_EXTRA, Op, estimate_traffic
from zerofast.layout import ALIGN
from zerofast.optim.placement import plan_layouts
from zerofast.tools.estimate import main
from zerofast.tools.models import make_gpt
from zerofast.tools.quantities import format_bytes, format_seconds, parse_rate, parse_seconds

WORLD = 4
MODELS = {"nested": Nested, "gpt": lambda: make_gpt("tiny")}
# (model, stage, partition, mixed_precision, micro_batches, max_grad_norm, accumulate_locally, min_unit_mb)
CONFIGS = [
    (m, s, p, None, 1, None, False, None) for m in MODELS for s in (1, 2, 3) for p in ("flat", "round_robin")
] + [
    ("nested", 2, "flat", "bf16", 2, 1.0, False, None),  # reduces per micro-batch, the stats all_reduce
    ("nested", 1, "round_robin", "bf16", 2, None, False, None),  # stage 1 reduces once
    ("gpt", 3, "flat", "fp16", 2, None, True, None),  # loss scaling; accumulate_locally: one reduce
    ("gpt", 3, "round_robin", None, 1, None, False, 0),  # a unit per block (no merging)
]
SHARD_SIZES = (4, 2, 1)


def _kwargs(stage, partition, mp, clip, acc, min_unit_mb, shard_size=None):
    kw = dict(
        stage=stage,
        comm=CommPolicy(partition=partition, accumulate_locally=acc, shard_size=shard_size),
        mixed_precision=mp,
        max_grad_norm=clip,
    )
    if min_unit_mb is not None:
        kw["units"] = UnitPolicy(min_unit_mb=min_unit_mb)
    return kw


def _matrix(rank, world, shard_sizes):
    """Every config and shard size: two steps (the estimate is of the second: stage 3's first step
    gathers more, see stage3_gathers), report().comm of the second."""
    out = {}
    for k in shard_sizes:
        for config in CONFIGS:
            name, stage, partition, mp, micro, clip, acc, min_unit = config
            model = MODELS[name]()
            kwargs = _kwargs(stage, partition, mp, clip, acc, min_unit)
            if k != world:
                kwargs["comm"] = dataclasses.replace(kwargs["comm"], shard_size=k)
            opt = ZeroAdam(model, lr=1e-3, **kwargs)
            for step in range(2):
                for mb in range(micro):
                    x, y = rank_batch(model, 10 * step + mb, rank)
                    if mb < micro - 1:
                        with opt.no_sync():
                            opt.backward(model(x, y)[1])
                    else:
                        opt.backward(model(x, y)[1])
                opt.step()
                opt.zero_grad()
            out[(k, config)] = opt.report().comm
            opt.remove_hooks()
    return out


@functools.cache
def _measured():
    """One launch of 4 ranks for the whole matrix."""
    return run_ranks(_matrix, WORLD, args=(SHARD_SIZES,), timeout=300)


@pytest.mark.parametrize("k", SHARD_SIZES)
def test_estimate_traffic_equals_comm_stats(k):
    results = _measured()
    failures = []
    for rank, got in enumerate(results):
        for config in CONFIGS:
            name, stage, partition, mp, micro, clip, acc, min_unit = config
            measured = got[(k, config)]
            est = estimate_traffic(
                MODELS[name](),
                WORLD,
                backend="gloo",
                rank=rank,
                micro_batches=micro,
                **_kwargs(stage, partition, mp, clip, acc, min_unit, shard_size=k),
            )
            if est != measured:
                failures.append(f"K={k} rank {rank} {config}: estimated {est}, measured {measured}")
    assert not failures, "\n".join(failures)


def test_estimator_imports_no_compiled_code():
    code = (
        "import sys; from zerofast.estimate import estimate_traffic; import zerofast.estimate.timemodel; "
        "from zerofast.tools.models import make_gpt; "
        "from zerofast import CommPolicy; "
        "estimate_traffic(make_gpt('tiny'), 4, 3, comm=CommPolicy(shard_size=2)); estimate_traffic(make_gpt('tiny'), 4, 1); "
        "from zerofast.estimate import estimate_memory; estimate_memory(1000, 4, 3, frozen_models=[make_gpt('tiny')]); "
        "assert 'zerofast._C' not in sys.modules, 'the compiled extension was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_restated_constants_agree_with_the_optimizer():
    from zerofast.comm import collectives_for
    from zerofast.optim.grads import AgreementLayout

    assert AgreementLayout(7).numel == 7 + AGREEMENT_EXTRA
    for backend in ("gloo", "nccl"):
        for flat in (True, False):
            assert collective_names(backend, flat) == tuple(c.name for c in collectives_for(backend, flat))


def test_count_estimate_is_close_to_the_module_estimate():
    """A count knows no padding and no tensors: it differs from the module's exact estimate by at
    most the padding (ALIGN * K elements per bucket) and the per-tensor agreement flags."""
    model = make_gpt("tiny")
    numel = sum(p.numel() for p in model.parameters())
    for stage in (1, 2):
        exact = estimate_traffic(model, 8, stage, comm=CommPolicy(shard_size=4))
        approx = estimate_traffic(numel, 8, stage, comm=CommPolicy(shard_size=4))
        assert exact.keys() == approx.keys()
        buckets = len(plan_layouts(model, resolve_plan(stage), 4).layout.buckets)
        bound = ALIGN * 4 * buckets * 4 + 8 * len(list(model.parameters()))  # fp32: 4 bytes an element
        for key in exact:
            assert 0 <= exact[key] - approx[key] <= bound, key


def test_shard_keys_and_replicate_keys():
    model = make_gpt("tiny")
    assert not any(k.startswith("replicate/") for k in estimate_traffic(model, 4, 2))  # K = W
    assert not any(
        k.startswith("shard/") for k in estimate_traffic(model, 4, 2, comm=CommPolicy(shard_size=1))
    )  # a group of one
    est = estimate_traffic(model, 8, 2, rank=5, comm=CommPolicy(shard_size=4))
    assert set(est) == {
        "shard/reduce_scatter",
        "shard/all_gather",
        "shard/all_reduce_flags",
        "replicate/all_reduce",
        "replicate/all_reduce_flags",
    }
    assert est["shard/all_reduce_flags"] == est["replicate/all_reduce_flags"] == 8 * (26 + AGREEMENT_EXTRA)
    # the replicate all_reduce moves this rank's shard, padding included: 1/K of the padded gradient
    assert est["replicate/all_reduce"] * 4 == est["shard/reduce_scatter"]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(comm=CommPolicy(shard_size=3)), "shard_size=3 must divide the number of ranks, 8"),
        (dict(tp=3), "tp must be an integer >= 1 that divides world"),
        (dict(backend="mpi"), "backend must be"),
        (dict(rank=8), "rank must be"),
        (dict(micro_batches=0), "micro_batches must be"),
    ],
)
def test_estimate_traffic_errors_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        estimate_traffic(10**6, 8, 2, **bad)


def test_memory_with_shard_size():
    phi = 7_500_000_000
    flat, hybrid = (
        estimate_memory(phi, 64, 3, mixed_precision="bf16"),
        estimate_memory(phi, 64, 3, mixed_precision="bf16", comm=CommPolicy(shard_size=8)),
    )
    assert estimate_memory(phi, 64, 3, mixed_precision="bf16", comm=CommPolicy(shard_size=64)) == flat
    assert hybrid.optimizer == 12 * math.ceil(phi / 8) and hybrid.params == 2 * math.ceil(phi / 8)
    with pytest.raises(ValueError, match="shard_size=5 must divide the number of ranks, 64"):
        estimate_memory(phi, 64, 3, comm=CommPolicy(shard_size=5))


# --- the optimizer state offloaded: bytes by placement, and the disk's agreement ---------------------

# (stage, precision, partition, shard_size, window_mb): stages 1-3 in fp32, bf16 and with 8-bit state
# (a block of 2048 elements: chunks aligned to it, not to 1024), windows whose chunk is the
# alignment's floor (0.03 MiB) or a multiple of it; round_robin's shards differ between ranks
EIGHT_BIT = MixedPrecisionPolicy(torch.bfloat16, state_bits=8, state_block=2048)
OFFLOAD_CASES = {
    2: [
        (1, None, "flat", None, 0.03),
        (2, None, "round_robin", None, 0.2),
        (3, None, "flat", None, 0.5),
        (1, "bf16", "round_robin", None, 0.5),
        (2, "bf16", "flat", None, 0.03),
        (3, "bf16", "round_robin", None, 0.2),
        (1, EIGHT_BIT, "flat", None, 0.2),
        (2, EIGHT_BIT, "flat", None, 0.5),
        (3, EIGHT_BIT, "flat", None, 0.03),
        (2, "bf16", "flat", 1, 0.2),  # hybrid: two replicas of one shard, the agreement over the replicas
    ],
    1: [(1, None, "flat", None, 0.2), (2, "bf16", "flat", None, 0.03), (3, EIGHT_BIT, "flat", None, 0.5)],
}


# "host" on the CPU with the delayed update keeps the state apart (HostState), for its thread to update
DELAYED_HOST = OffloadPolicy("host", delayed_update=True)


def _offload_model():
    return Nested(width=32, layers=4)  # ~19K elements: a rank's shard spans several chunks of the window


def _offload_kwargs(stage, precision, partition, shard_size):
    bucket_mb = 0.004 if stage < 3 else None  # stage 3's buckets are its units
    comm = CommPolicy(partition=partition, shard_size=shard_size, bucket_mb=bucket_mb)
    return dict(stage=stage, mixed_precision=precision, comm=comm)


def _offloaded_reports(rank, world, root, cases):
    """Each case on disk: report().offload before the first step, and report().memory, .offload and
    .comm after the second (the traffic estimate is of a step after the first); then "host" on the
    CPU beside no offload (the same optimizer: the state is in host memory already), and with the
    delayed update (the state apart, in HostState)."""
    out = {}
    for case in cases:
        stage, precision, partition, shard_size, window_mb = case
        model = _offload_model()
        opt = ZeroAdam(
            model,
            lr=1e-3,
            **_offload_kwargs(stage, precision, partition, shard_size),
            offload=OffloadPolicy("disk", root, window_mb=window_mb),
        )
        before = opt.report().offload
        for step in range(2):
            x, y = rank_batch(model, step, rank)
            opt.backward(model(x, y)[1])
            opt.step()
            opt.zero_grad()
        report = opt.report()
        out[case] = (before, report.memory, report.offload, report.comm)
        opt.remove_hooks()
    stage, precision, partition, shard_size, _ = cases[-1]
    for name, where in ((None, None), ("host", "host"), ("delayed", DELAYED_HOST)):
        model = _offload_model()
        opt = ZeroAdam(model, lr=1e-3, **_offload_kwargs(stage, precision, partition, shard_size), offload=where)
        x, y = rank_batch(model, 0, rank)
        opt.backward(model(x, y)[1])
        opt.step()
        opt.flush()
        report = opt.report()
        out[name] = (report.memory, report.offload)
        opt.remove_hooks()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_estimate_counts_offloaded_state_exactly(world):
    """estimate_memory(offload=...) against report() on real ranks, to the byte: on disk the device
    holds no state (report().memory's optimizer and master_copy are 0) and host_bytes, disk_bytes,
    window_bytes are report().offload's (the fp32 master counted in fp32 too, 8-bit state's scales,
    each rank's padded shard, DiskState's chunk); the window is in host memory once a step ran.
    estimate_traffic counts the disk's agreement (8 bytes in each group of more than one rank).
    "host" holds what the disk's generation holds (on a CUDA model, or on the CPU with the delayed
    update); on the CPU without it, it moves nothing. One launch per world size, about 3 s."""
    root = tempfile.mkdtemp(prefix="zerofast-estimate-")
    try:
        results = run_ranks(_offloaded_reports, world, args=(root, OFFLOAD_CASES[world]), timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failures = []
    for rank, got in enumerate(results):
        for case in OFFLOAD_CASES[world]:
            stage, precision, partition, shard_size, window_mb = case
            before, memory, offload, comm = got[case]
            kwargs = _offload_kwargs(stage, precision, partition, shard_size)
            policy = OffloadPolicy("disk", "/never/touched", window_mb=window_mb)
            est = estimate_memory(_offload_model(), world, offload=policy, device="cpu", rank=rank, **kwargs)
            measured = (offload.state, memory.optimizer + memory.master_copy, offload.host_bytes)
            measured += (offload.disk_bytes, offload.window_bytes)
            estimated = (est.placement, est.optimizer, est.host_bytes, est.disk_bytes, est.window_bytes)
            if measured != estimated or memory.optimizer != 0 or memory.master_copy != 0:
                failures.append(f"rank {rank} {case}: measured {measured} {memory}, estimated {estimated}")
            if (before.host_bytes, before.window_bytes) != (0, est.window_bytes):
                failures.append(f"rank {rank} {case}: before the first step {before}")
            host = estimate_memory(_offload_model(), world, offload="host", device="cuda", rank=rank, **kwargs)
            # the same state in host memory; on disk each of its (at most 5) files is padded to a page
            padding = est.disk_bytes // 2 - host.host_bytes
            if (host.placement, host.optimizer, host.disk_bytes) != ("host", 0, 0) or not 0 <= padding < 5 * 4096:
                failures.append(f"rank {rank} {case}: host on a GPU {host}, disk {est}")
            traffic = estimate_traffic(_offload_model(), world, backend="gloo", rank=rank, offload=policy, **kwargs)
            if traffic != comm:
                failures.append(f"rank {rank} {case}: traffic estimated {traffic}, measured {comm}")
        (plain, plain_offload), (on_cpu, host_offload) = got[None], got["host"]
        stage, precision, partition, shard_size, _ = OFFLOAD_CASES[world][-1]
        kwargs = _offload_kwargs(stage, precision, partition, shard_size)
        est = estimate_memory(_offload_model(), world, offload="host", device="cpu", rank=rank, **kwargs)
        assert est == dataclasses.replace(estimate_memory(_offload_model(), world, **kwargs), placement="host")
        assert (plain_offload.state, host_offload.state) == ("device", "host")
        assert (host_offload.host_bytes, host_offload.disk_bytes, host_offload.window_bytes) == (0, 0, 0)
        assert (on_cpu.optimizer, on_cpu.master_copy) == (plain.optimizer, plain.master_copy) != (0, 0)
        delayed_memory, delayed = got["delayed"]
        est = estimate_memory(_offload_model(), world, offload=DELAYED_HOST, device="cpu", rank=rank, **kwargs)
        measured = (delayed.state, delayed_memory.optimizer + delayed_memory.master_copy, delayed.host_bytes)
        assert measured == (est.placement, est.optimizer, est.host_bytes) == ("host", 0, est.host_bytes)
        assert (delayed.disk_bytes, delayed.window_bytes) == (est.disk_bytes, est.window_bytes) == (0, 0)
        assert (
            est.host_bytes == estimate_memory(_offload_model(), world, offload="host", rank=rank, **kwargs).host_bytes
        )
    assert not failures, "\n".join(failures)


def test_offload_arguments():
    """offload= as ZeroAdam takes it (its shortcuts and its errors); DDP has none; the device named."""
    phi = 10**6
    disk = estimate_memory(phi, 4, 2, mixed_precision="bf16", offload="disk:/scratch")
    assert disk == estimate_memory(phi, 4, 2, mixed_precision="bf16", offload=OffloadPolicy("disk", "/elsewhere"))
    file = -(-4 * phi // 4 // 4096) * 4096  # each of the fp32 master, exp_avg, exp_avg_sq of a quarter, in pages
    assert (disk.placement, disk.optimizer, disk.disk_bytes) == ("disk", 0, 2 * 3 * file)
    # a chunk of 64 MiB / 3 of state would be 1.86M elements; it is capped at the shard (4096-aligned)
    assert disk.host_bytes == disk.window_bytes == 3 * 12 * (-(-(phi // 4) // 4096) * 4096)
    plain = estimate_memory(phi, 4, 2, mixed_precision="bf16")
    assert disk.total == plain.total - plain.optimizer - ALIGN * 4 * 1 * 12  # the state and its padding
    fp32 = estimate_memory(phi, 4, 1, mixed_precision=None, offload="host", device=torch.device("cuda", 1))
    assert (fp32.host_bytes, fp32.optimizer) == (12 * phi // 4, 0)  # the master apart, in fp32 too
    with pytest.raises(
        ValueError, match="offload must be None, 'host', 'disk:PATH', 'infinity:PATH' or an OffloadPolicy"
    ):
        estimate_memory(phi, 4, 2, offload="nvme")
    with pytest.raises(ValueError, match="offload applies to ZeroAdam's stages 1-3; stage 0 is DDP"):
        estimate_memory(phi, 4, 0, offload="host")
    with pytest.raises(ValueError, match="device must be the device the model trains on"):
        estimate_memory(phi, 4, 2, offload="host", device="gpu")
    with pytest.raises(ValueError, match=r"rank must be None or an integer in \[0, 4\)"):
        estimate_memory(phi, 4, 2, rank=4)
    flags = estimate_traffic(phi, 8, 2, offload="disk:/scratch", comm=CommPolicy(shard_size=4))
    base = estimate_traffic(phi, 8, 2, comm=CommPolicy(shard_size=4))
    assert {k: flags[k] - base[k] for k in base} == {
        **{k: 0 for k in base},
        "shard/all_reduce_flags": 8,
        "replicate/all_reduce_flags": 8,
    }
    assert estimate_traffic(phi, 8, 2, offload="host", comm=CommPolicy(shard_size=4)) == base


# --- the time model: hand-computed values -------------------------------------------------------

LINK = Link("test", 1e9, 1e-5)  # 1 GB/s, 10 us


@pytest.mark.parametrize(
    "name, expected",
    [
        ("all_reduce", 2 * 3 / 4 * 1.0 + 2 * 3 * 1e-5),  # 2(n-1)/n B/bw + 2(n-1) alpha
        ("replicate/all_reduce", 2 * 3 / 4 * 1.0 + 2 * 3 * 1e-5),
        ("all_reduce_flags", 2 * 3 / 4 * 1.0 + 2 * 3 * 1e-5),
        ("reduce_scatter", 3 / 4 * 1.0 + 3 * 1e-5),  # (n-1)/n B/bw + (n-1) alpha
        ("all_gather", 3 / 4 * 1.0 + 3 * 1e-5),
        ("broadcast", 1.0 + 3 * 1e-5),  # B/bw + (n-1) alpha
        ("reduce", 1.0 + 3 * 1e-5),
    ],
)
def test_collective_cost(name, expected):
    # 1e9 bytes, 1 call, 4 ranks; float arithmetic of a few terms: equal to 1e-12 relative
    assert collective_time(name, 1e9, 1, 4, LINK) == pytest.approx(expected, rel=1e-12)


def test_collective_cost_calls_and_one_rank():
    assert collective_time("reduce_scatter", 1e9, 10, 4, LINK) == pytest.approx(0.75 + 10 * 3e-5, rel=1e-12)
    assert collective_time("all_reduce", 1e9, 1, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="no cost model for the collective 'alltoall'"):
        collective_time("alltoall", 1, 1, 2, LINK)


def test_links():
    c = Cluster(gpus_per_node=8)
    assert link_of("shard", 64, 64, c) is c.inter  # flat over 8 nodes: every ring crosses nodes
    assert link_of("shard", 8, 8, c) is c.intra  # one node
    assert link_of("shard", 64, 8, c) is c.intra  # hybrid, a node per shard group
    assert link_of("replicate", 64, 8, c) is c.inter
    assert link_of("shard", 64, 4, c) is c.intra
    assert link_of("shard", 64, 16, c) is c.inter


def test_predict_overlap():
    ops = [
        Op("shard", "reduce_scatter", 4_000_000_000, 1, "backward", 2),  # 2 s on LINK (bandwidth 1e9, 1/2 of B)
        Op("shard", "all_gather", 1_000_000_000, 1, "forward", 2),  # 0.5 s
        Op("replicate", "all_reduce", 1_000_000_000, 1, "step", 2),
    ]  # 1 s
    c = Cluster(gpus_per_node=2, intra=Link("intra-node", 1e9, 0.0), inter=Link("inter-node", 1e9, 0.0))
    t = predict(ops, 4, 2, c, forward=1.0, backward=1.5, update=0.25)
    # exposed: forward max(0, 0.5 - 1) + backward max(0, 2 - 1.5) + step 1
    assert t.exposed == pytest.approx(1.5) and t.step == pytest.approx(2.75 + 1.5)
    assert t.comm == pytest.approx({"intra-node": 2.5, "inter-node": 1.0})
    assert predict(ops, 4, 2, c, 1.0, 1.5, 0.25, overlap=False).exposed == pytest.approx(3.5)


def test_parse_quantities():
    assert parse_rate("400Gb/s") == 50e9 and parse_rate("300GB/s") == 300e9 and parse_rate("25 MB/s") == 25e6
    assert parse_seconds("5us") == pytest.approx(5e-6) and parse_seconds("0.2ms") == pytest.approx(2e-4)
    for bad in ("fast", "-3GB/s", "10"):
        with pytest.raises(ValueError):
            parse_rate(bad)


# --- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--params", "7.5B", "--world", "64", "--shard-size", "7"], "--shard-size 7 must divide --world 64"),
        (["--params", "7.5B", "--world", "64", "--time", "--stage", "0"], "--time models ZeRO stages 1-3"),
        (["--params", "7.5B", "--world", "64", "--time", "--inter-bw", "fast"], "--inter-bw"),
        (["--params", "7.5B", "--world", "64", "--time", "--inter-latency", "10"], "--inter-latency"),
        (["--params", "7.5B", "--world", "64", "--backend", "mpi"], "--backend must be nccl or gloo"),
        (["--params", "7.5B", "--world", "64", "--time", "--global-tokens", "10"], "--global-tokens must be at least"),
        (["--params", "7.5B", "--world", "64", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
        (["--params", "7.5B", "--world", "64", "--state-bits", "4"], "--state-bits must be 32 or 8; got 4"),
        (["--params", "7.5B", "--world", "64", "--frozen-models", "lots"], "--frozen-models"),
        (["--params", "7.5B", "--world", "64", "--offload", "nvme"], "--offload: invalid choice: 'nvme'"),
        (["--params", "7.5B", "--world", "64", "--window-mb", "8"], "--window-mb applies to --offload disk"),
        (["--params", "7.5B", "--world", "64", "--offload", "disk", "--window-mb", "0"], "--window-mb must be"),
        (["--params", "7.5B", "--world", "64", "--offload", "host", "--time"], "--offload's CPU update"),
        (["--params", "7.5B", "--world", "64", "--device", "tpu"], "--device: invalid choice: 'tpu'"),
    ],
)
def test_cli_errors_name_the_argument(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_cli_prints_links_and_times(capsys):
    main(["--params", "7.5B", "--world", "64", "--shard-size", "8"])
    out = capsys.readouterr().out
    assert "replicate/all_reduce" in out and "inter-node" in out and "sharded over K = 8" in out
    main(["--params", "7.5B", "--world", "64", "--time", "--stage", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("stage 2")]
    assert [r[2] for r in rows] == ["64", "8"]  # flat, then hybrid with a node per shard group


def test_cli_counts_8bit_state_and_models_sharded_for_inference(capsys):
    """--state-bits 8 and --frozen-models: each stage's row is estimate_memory's with the main job's
    8-bit policy and the frozen models, to the byte as the table prints it (what the library counts,
    the command line now takes); the traffic, which 8-bit state does not change, stays the same."""
    from zerofast import MixedPrecisionPolicy
    from zerofast.tools.estimate import format_table

    main(["--params", "7B", "--world", "8", "--state-bits", "8", "--frozen-models", "7B", "1.5B"])
    out = capsys.readouterr().out
    policy = MixedPrecisionPolicy(torch.bfloat16, state_bits=8)
    rows = [
        estimate_memory(7 * 10**9, 8, s, mixed_precision=policy, frozen_models=[7 * 10**9, 15 * 10**8])
        for s in (0, 1, 2, 3)
    ]
    assert format_table(rows) in out and "8-bit Adam state, 2 model(s) sharded for inference only" in out
    assert all(r.frozen_models > 0 for r in rows)
    plain = [estimate_memory(7 * 10**9, 8, s, mixed_precision="bf16") for s in (0, 1, 2, 3)]
    assert all(r.optimizer < p.optimizer / 1.9 for r, p in zip(rows, plain))  # 4 + 1 + 1 bytes, not 4 + 4 + 4
    traffic = out.split("Communication per step")[1]
    main(["--params", "7B", "--world", "8"])
    assert capsys.readouterr().out.split("Communication per step")[1] == traffic


def _inference_models(rank, world):
    """shard_frozen's parameter storage per rank at its peak (shard + the most gathered at any
    decoder layer's pre- or post-forward, in a forward after the first, which prefetches), fp32 and bf16 (the policy's precision), beside the
    estimate of the same model unsharded (estimate_memory plans it without a process group)."""
    from test_generation import prompt, tiny_llama

    from zerofast import shard_frozen
    from zerofast.estimate.memory import frozen_model_bytes

    out = []
    for precision, dtype in ((None, torch.float32), ("bf16", torch.bfloat16)):
        model = tiny_llama()
        estimated = frozen_model_bytes(model, world, dtype, UnitPolicy(min_unit_mb=0))
        listed = estimate_memory(
            model, world, 3, mixed_precision=precision, units=UnitPolicy(min_unit_mb=0), frozen_models=[model, model]
        ).frozen_models
        ref = shard_frozen(model, mixed_precision=precision, units=UnitPolicy(min_unit_mb=0))
        peak = [0]

        def sample(*_):
            peak.append(ref.parameter_bytes()["gathered"])

        for layer in model.model.layers:
            layer.register_forward_pre_hook(sample)
            layer.register_forward_hook(sample)
        with torch.no_grad():
            for _ in range(2):  # the second prefetches the next block (in the first one's order)
                peak[:] = [0]
                model(prompt(rank, 0, 6))
        out.append((ref.parameter_bytes()["shard"] + max(peak), estimated, listed))
        ref.remove_hooks()
    return out


def test_estimate_counts_models_sharded_for_inference():
    """estimate_memory(frozen_models=[...]): each model sharded by shard_frozen costs its shard
    plus the root's unit and two block units per rank, planned as shard_frozen plans it: equal to
    ShardedFrozenModel.parameter_bytes() measured at its peak in a forward (2 ranks, a 4-unit
    Llama, fp32 and bf16; one pooled call, about 3 s)."""
    for rank, results in enumerate(run_ranks(_inference_models, 2, timeout=120)):
        for measured, estimated, listed in results:
            assert measured == estimated, f"{rank=} {measured=} {estimated=}"
            assert listed == 2 * estimated


def test_estimate_counts_inference_models_given_as_counts():
    """A count: Φ/N in the dtype, plus two of stage 2's default buckets standing in for the units
    (at most the whole model); in the total; a bad value named."""
    phi = 10**9
    base = estimate_memory(phi, 8, 3, mixed_precision="bf16")
    with_ref = estimate_memory(phi, 8, 3, mixed_precision="bf16", frozen_models=[phi])
    stand_in = 2 * 8 * 2**20  # two of stage 2's default 8 MiB buckets, in bytes
    assert with_ref.frozen_models == 2 * phi // 8 + stand_in
    assert with_ref.total == base.total + with_ref.frozen_models
    assert estimate_memory(1000, 8, 3, mixed_precision=None, frozen_models=[1000]).frozen_models == 4 * (125 + 1000)
    with pytest.raises(ValueError, match="frozen_models"):
        estimate_memory(phi, 8, 3, frozen_models=phi)
    with pytest.raises(ValueError, match="frozen_models"):
        estimate_memory(phi, 8, 3, frozen_models=[-1])


def test_cli_prints_device_host_and_disk_bytes(capsys):
    """--offload disk|host: each stage's row is estimate_memory's with the policy (DDP's without: it
    has no offload), the device's total beside the host's and the disk's bytes; the disk's agreement
    adds 8 bytes to every step's flags; "host" on a CPU model changes no row."""
    from zerofast.tools.estimate import format_table

    main(["--params", "7B", "--world", "8", "--offload", "disk", "--window-mb", "16", "--state-bits", "8"])
    out = capsys.readouterr().out
    policy = MixedPrecisionPolicy(torch.bfloat16, state_bits=8)
    disk = OffloadPolicy("disk", "/never/touched", window_mb=16)
    rows = [estimate_memory(7 * 10**9, 8, s, mixed_precision=policy, offload=disk if s else None) for s in (0, 1, 2, 3)]
    table = format_table(rows)
    assert table in out and "state offloaded to disk" in out and "two generations" in out
    assert table.splitlines()[0].split()[-3:] == ["device", "host", "disk"]
    assert [r.host_bytes for r in rows[1:]] == [rows[1].window_bytes] * 3 and rows[1].window_bytes <= 16 * 2**20

    def page(n):
        return -(-n // 4096) * 4096

    shard = 7 * 10**9 // 8  # the master (4 bytes), the moments (1 each), the scales (4 per block of 256), in pages
    assert rows[3].disk_bytes == 2 * (page(4 * shard) + 2 * page(shard) + 2 * page(4 * -(-shard // 256)))
    flags = [line.split() for line in out.splitlines() if "shard/all_reduce_flags" in line]
    main(["--params", "7B", "--world", "8"])
    plain = [line.split() for line in capsys.readouterr().out.splitlines() if "shard/all_reduce_flags" in line]
    assert [f[-3:-1] for f in flags] == [["80", "B"]] * 3 and [f[-3:-1] for f in plain] == [["72", "B"]] * 3
    main(["--params", "7B", "--world", "8", "--offload", "host", "--device", "cpu"])
    out = capsys.readouterr().out
    same = [
        dataclasses.replace(estimate_memory(7 * 10**9, 8, s, mixed_precision="bf16"), placement="host")
        for s in (0, 1, 2, 3)
    ]
    same[0] = dataclasses.replace(same[0], placement="device")
    assert format_table(same) in out and "nothing moves" in out


def test_memory_with_tensor_parallelism():
    """tp: each rank holds 1/tp of a count, ZeRO shards it over world/tp ranks (the exact count of a
    parallelized module's local tensors against report(): tests/test_tensor_parallel.py)."""
    phi = 7_000_000
    for stage in (0, 1, 2, 3):
        assert estimate_memory(phi, 16, stage, mixed_precision="bf16", tp=4) == estimate_memory(
            phi // 4, 4, stage, mixed_precision="bf16"
        )
    assert estimate_memory(phi, 16, 2, tp=1) == estimate_memory(phi, 16, 2)
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1 that divides world \(16\); got 3"):
        estimate_memory(phi, 16, 2, tp=3)


def test_the_command_line_takes_a_tp_degree(capsys):
    """--tp 4 on 16 ranks, 8 a node: stages 0-3, each rank 1/4 of Φ (each row the library's
    estimate with tp), and the data-parallel groups (every 4th rank: tp innermost) cross nodes."""
    assert main(["--params", "7B", "--world", "16", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: tp 4 x dp 4 (each rank 1/4 of Φ)" in out, out
    from zerofast.tools.estimate import format_table

    rows = [estimate_memory(7 * 10**9, 16, s, mixed_precision="bf16", tp=4) for s in (0, 1, 2, 3)]
    assert format_table(rows) in out, out
    assert "inter-node" in out and "intra-node" not in out, out
    # Hybrid sharding over the data-parallel ranks (K counts those) and offload compose with tp: each
    # row the library's estimate with the same arguments.
    assert main(["--params", "7B", "--world", "16", "--tp", "4", "--shard-size", "2", "--offload", "host"]) == 0
    out = capsys.readouterr().out
    assert "sharded over K = 2 (x2 replicas), tensor parallel: tp 4 x dp 4" in out, out
    rows = [
        estimate_memory(
            7 * 10**9, 16, s, mixed_precision="bf16", offload="host" if s else None, tp=4, comm=CommPolicy(shard_size=2)
        )
        for s in (0, 1, 2, 3)
    ]
    assert rows[1].placement == "host" and rows[1].optimizer == 0 < rows[1].host_bytes, rows[1]
    assert format_table(rows) in out, out
    for argv, message in (
        (["--tp", "3"], "--tp must be at least 1 and divide --world (16); got 3"),
        (["--tp", "4", "--shard-size", "3"], "--shard-size 3 must divide the data-parallel ranks (--world / --tp = 4)"),
        (["--tp", "4", "--time", "--hidden", "4096"], "--time --tp needs the model's --layers and --hidden"),
        (["--tp", "4", "--layers", "32", "--hidden", "4096"], "--layers and --hidden apply to --time with --tp"),
    ):
        with pytest.raises(SystemExit):
            main(["--params", "7B", "--world", "16", *argv])
        assert message in capsys.readouterr().err, argv


def test_step_time_with_tensor_parallelism():
    """[Note: tensor parallelism in the time model], by its formulas: ZeRO's traffic of a rank's Φ/tp
    over the world/tp data-parallel ranks (every tp-th rank: across nodes), each layer's four
    all_reduces of the tp group's tokens x hidden activations on the tp group's link (intra-node when
    tp divides a node), exposed whole; the same FLOPs per GPU as without tensor parallelism."""
    from zerofast.estimate.traffic import traffic_ops

    phi, world, tokens, layers, hidden, c = 70 * 10**9, 64, 4096, 80, 8192, Cluster()
    plain = step_time(phi, world, 2, tokens, cluster=c)
    assert step_time(phi, world, 2, tokens, cluster=c, tp=1) == plain
    for tp, link in ((8, c.intra), (16, c.inter)):
        t = step_time(phi, world, 2, tokens, cluster=c, tp=tp, layers=layers, hidden=hidden)
        dp_bytes = sum(
            op.nbytes
            for op in traffic_ops(
                -(-phi // tp), world // tp, 2, mixed_precision="bf16", comm=CommPolicy(shard_size=world // tp)
            )
        )
        act = 4 * layers * (tokens * tp) * hidden * 2  # bf16 activations, the tp group's tokens
        tp_time = 2 * collective_time("all_reduce", act // 2, 2 * layers, tp, link)
        if link is c.intra:
            assert t.bytes == {"inter-node": dp_bytes, "intra-node": act}, t.bytes
        else:  # a tp group wider than a node crosses it too
            assert t.bytes == {"inter-node": dp_bytes + act}, t.bytes
        assert t.phases["tp"] == pytest.approx(tp_time)
        assert t.exposed >= tp_time
        assert t.forward + t.backward == pytest.approx(plain.forward + plain.backward)
    for kwargs, message in (
        (dict(tp=8, hidden=8192), "tp > 1 needs the model's layers"),
        (dict(tp=8, layers=80, hidden=0), "tp > 1 needs the model's hidden"),
        (dict(tp=3, layers=80, hidden=8192), "tp must be an integer >= 1 that divides world (64); got 3"),
        (dict(tp=8, layers=80, hidden=8192, shard_size=3), "with tp=8 (over its 8 data-parallel ranks): shard_size=3"),
        (dict(tp=8, layers=80, hidden=8192, model=torch.nn.Linear(2, 2)), "with tp > 1 the model is a count"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            step_time(phi, world, 2, tokens, **kwargs)
    # Hybrid under tp: tp 4 (a node holds two tp groups), K = 2 dp ranks to a shard: each shard group
    # is a block of 8 consecutive ranks, one node, so its ring is intra-node like the tp links; the
    # replicas (every 8th rank) cross nodes.
    t = step_time(phi, world, 2, tokens, cluster=c, tp=4, layers=layers, hidden=hidden, shard_size=2)
    ops = traffic_ops(-(-phi // 4), world // 4, 2, mixed_precision="bf16", comm=CommPolicy(shard_size=2))
    shard = sum(op.nbytes for op in ops if op.group == "shard")
    replicate = sum(op.nbytes for op in ops if op.group == "replicate")
    act = 4 * layers * (tokens * 4) * hidden * 2
    assert shard > 0 < replicate and t.bytes == {"intra-node": shard + act, "inter-node": replicate}, t.bytes
    flat = step_time(phi, world, 2, tokens, cluster=c, tp=4, layers=layers, hidden=hidden)
    assert step_time(phi, world, 2, tokens, cluster=c, tp=4, layers=layers, hidden=hidden, shard_size=16) == flat


def test_the_time_table_takes_a_tp_degree(capsys):
    """--time --tp 8 --layers 80 --hidden 8192 on 64 GPUs: per stage flat ZeRO over the 8 dp ranks and
    hybrid with a node per shard group (K = 1 dp rank: a node is one tp group), each step_time's with
    tp, the intra-node column's bytes the tp links' (and a node's shard group's); --shard-size 1 gives
    the hybrid rows alone."""
    argv = ["--params", "70B", "--world", "64", "--tp", "8", "--time", "--layers", "80", "--hidden", "8192"]
    assert main([*argv, "--tokens-per-rank", "4096"]) == 0
    out = capsys.readouterr().out
    assert "tp 8 x dp 8: ZeRO over the dp ranks (K) on 1/8 of Φ" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("stage ")]
    assert [r[:3] for r in rows] == [["stage", str(s), k] for s in (1, 2, 3) for k in ("8", "1")], out
    for row in rows:
        stage, k = int(row[1]), int(row[2])
        t = step_time(70 * 10**9, 64, stage, 4096, cluster=Cluster(), tp=8, layers=80, hidden=8192, shard_size=k)
        assert " ".join(row[3:5]) == format_bytes(t.bytes["intra-node"]), (row, t)
        assert " ".join(row[5:7]) == format_bytes(t.bytes["inter-node"]), (row, t)
    assert main([*argv, "--tokens-per-rank", "4096", "--shard-size", "1"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("stage ")] == [
        ["stage", str(s), "1"] for s in (1, 2, 3)
    ], out


def test_step_time_with_pipeline_parallelism():
    """[Note: pipeline parallelism in the time model], by its formulas: ZeRO within a stage as over a
    world of W/P ranks on ceil(Φ/P), once a step (the windows 1/M of the compute); the bubble
    (P-1)/(V*M) of forward and backward; 2*V*M micro-batch activations a GPU on the "pp" link, the
    fill and the drain's 2*(P*V-1) exposed; the same compute per GPU as without pipelining."""
    from zerofast.estimate.traffic import traffic_ops

    phi, world, tokens, hidden, c = 70 * 10**9, 64, 4096, 8192, Cluster()
    plain = step_time(phi, world, 2, tokens, cluster=c)
    assert step_time(phi, world, 2, tokens, cluster=c, pp=1) == plain
    for pp, m, v in ((2, 8, 1), (4, 8, 1), (4, 32, 2)):
        t = step_time(phi, world, 2, tokens, cluster=c, pp=pp, micro_batches=m, hidden=hidden, stages_per_rank=v)
        part = -(-phi // pp)
        assert t.forward + t.backward == pytest.approx(6 * part * tokens * pp / c.flops)  # 6 Φ tokens, cut rounding
        assert t.bubble == pytest.approx((pp - 1) / (v * m) * (t.forward + t.backward))
        assert t.step == pytest.approx(t.compute + t.exposed + t.bubble)
        ops = traffic_ops(part, world, 2, mixed_precision="bf16", comm=CommPolicy(shard_size=world // pp), pp=pp)
        dp = sum(op.nbytes for op in ops if op.group == "shard")  # one reduce, one gather: once a step
        one = tokens * pp // m * hidden * 2  # a micro-batch's bf16 activations (tp 1)
        on_pp = sum(op.nbytes for op in ops if op.group == "pp")
        assert on_pp > 0 and t.bytes == {"inter-node": dp + on_pp + 2 * v * m * one}, t.bytes  # stages: 32+ GPUs
        transfer = one / c.inter.bandwidth + c.inter.latency
        flags = sum(collective_time(op.name, op.nbytes, op.calls, op.ranks, c.inter) for op in ops if op.group == "pp")
        assert t.phases["pp"] == pytest.approx(flags + 2 * v * m * transfer)
        shard = collective_time("reduce_scatter", dp // 2, 1, world // pp, c.inter)
        assert t.exposed >= max(0.0, shard - t.backward / m) + 2 * (pp * v - 1) * transfer
    # More micro-batches: a smaller bubble, the same compute and dp traffic.
    few, many = (step_time(phi, world, 3, tokens, cluster=c, pp=4, micro_batches=m, hidden=hidden) for m in (4, 64))
    assert many.bubble < few.bubble and many.compute == few.compute
    # Under tensor parallelism: the stage's ceil(layers/P) layers' all_reduces on the tp link.
    t = step_time(phi, world, 2, tokens, cluster=c, pp=2, micro_batches=8, hidden=hidden, tp=8, layers=80)
    ops = traffic_ops(-(-phi // 2), world, 2, mixed_precision="bf16", comm=CommPolicy(shard_size=4), tp=8, pp=2)
    agreement = sum(collective_time(op.name, op.nbytes, op.calls, op.ranks, c.intra) for op in ops if op.group == "tp")
    assert t.phases["tp"] == pytest.approx(
        agreement + 2 * collective_time("all_reduce", 2 * 40 * (tokens * 2 * 8) * hidden * 2, 2 * 40, 8, c.intra)
    )
    for kwargs, message in (
        (dict(pp=3, hidden=hidden), "pp must be an integer >= 1 that divides world (64); got 3"),
        (dict(pp=4, hidden=hidden, micro_batches=2), "micro_batches must be an integer >= pp (4"),
        (dict(pp=4, micro_batches=4), "pp > 1 needs the model's hidden"),
        (dict(pp=4, micro_batches=4, hidden=hidden, tp=2), "pp > 1 needs the model's layers"),
        (dict(pp=4, micro_batches=4, hidden=hidden, stages_per_rank=0), "stages_per_rank must be an integer >= 1"),
        (dict(pp=4, micro_batches=4, hidden=hidden, shard_size=3), "with pp=4 (over a stage's 16 data-parallel"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            step_time(phi, world, 2, tokens, cluster=c, **kwargs)


def test_the_estimator_takes_a_pp_degree(capsys):
    """--pp 2: each row the library's estimate of a stage's part (an even cut) with pp; the link table
    a stage's traffic (within a node here: 8 consecutive ranks) and the step's all_reduces over "pp";
    --time adds the pipeline's columns, each step_time's with pp."""
    assert main(["--params", "7B", "--world", "16", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: pp 2 (each stage 1/2 of Φ, an even cut)" in out, out
    rows = [estimate_memory(3_500_000_000, 16, s, mixed_precision="bf16", pp=2) for s in (0, 1, 2, 3)]
    from zerofast.tools.estimate import format_table

    assert format_table(rows) in out, out
    lines = [line.split() for line in out.splitlines() if line.startswith("stage 3 ") and "/" in line]
    assert [row[2] for row in lines] == ["shard/reduce_scatter", "shard/all_gather", "shard/all_reduce_flags",
                                         "pp/all_reduce_flags"], lines  # fmt: skip
    assert [row[-1] for row in lines] == ["intra-node"] * 3 + ["inter-node"], lines
    assert lines[0][3:5] == lines[1][3:5], lines  # stage 3 under a pipeline: one gather a step, as the reduce
    argv = ["--params", "70B", "--world", "64", "--pp", "4", "--time", "--hidden", "8192", "--micro-batches", "16"]
    assert main([*argv, "--tokens-per-rank", "4096"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("stage ")]
    # flat over a stage's 16 dp ranks (two nodes) and hybrid with a node per shard group
    assert [r[:3] for r in rows] == [["stage", str(s), k] for s in (1, 2, 3) for k in ("16", "8")], out
    for row in rows:
        t = step_time(70 * 10**9, 64, int(row[1]), 4096, int(row[2]), Cluster(), pp=4, micro_batches=16, hidden=8192)
        assert " ".join(row[-2:]) == format_seconds(t.bubble) and " ".join(row[-4:-2]) == format_seconds(
            t.phases["pp"]
        ), (row, t)
    for extra, message in (
        (["--pp", "3"], "--pp must be at least 1 and divide --world / --tp (64); got 3"),
        (["--pp", "4", "--time", "--hidden", "8192", "--micro-batches", "2"], "--micro-batches must be at least 4"),
        (["--pp", "4", "--time"], "--time --pp needs the model's --hidden"),
        (
            ["--pp", "4", "--shard-size", "3"],
            "--shard-size 3 must divide the data-parallel ranks (--world / --pp = 16)",
        ),
        (["--stages-per-rank", "2"], "--stages-per-rank must be at least 1, and more only with --pp; got 2"),
        (["--pp", "4", "--hidden", "8192"], "--layers and --hidden apply to --time with --tp"),
    ):
        with pytest.raises(SystemExit):
            main(["--params", "70B", "--world", "64", *extra])
        assert message in capsys.readouterr().err, extra
