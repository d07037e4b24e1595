"""One training step on gloo, 2 ranks x 1 thread, a GPT of 6.4M parameters in 92 tensors, batch
8 x 64 per rank: ZeroAdam (stages 1 and 2, each partition) against zerofast.reference's stages,
torch DDP + AdamW, torch's ZeroRedundancyOptimizer + DDP, DeepSpeed ZeRO 1, 2 and 3 (when installed;
DS_ACCELERATOR=cpu), the same model with no communication at all, and for stage 3: the reference
stage 3 and torch FSDP2 (fully_shard on each block, then on the root). "overlap_gather" cases pass
overlap_param_gather=True (the gather after step() overlapped with the next forward).

The summary prints each case's median step time as a ratio to the no-communication step, and for
the stage-3 cases (ZeroAdam, FSDP2) the peak parameter storage on rank 0 sampled at both ends of
every block's forward and backward: the shard plus whatever is gathered then.
Every torch optimizer here is AdamW(fused=True), torch's fastest CPU AdamW.
"""

import functools
import importlib.util

import pytest
from rankpool import RankPool

WORLD = 2
BATCH, SEQ = 8, 64
ROUNDS, WARMUP = 8, 2
GROUP = "step: 2 gloo ranks x 1 thread, GPT 6.4M params, batch 8x64"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _batch(model, rank, step):
    from zerofast.tools.models import random_batch

    return random_batch(model.cfg, BATCH, SEQ, seed=1000 * step + rank)


def _loop(model, rank, backward_and_step, param_bytes=None):
    """One training step per call; with `param_bytes` (a function: parameter storage alive now),
    step.info() runs one more step and returns the peak of it sampled inside every block."""
    state = {"step": 0}

    def step():
        x, y = _batch(model, rank, state["step"] % 4)
        state["step"] += 1
        backward_and_step(x, y)

    if param_bytes is not None:
        step.info = lambda: _peak_inside_blocks(model, step, param_bytes)
    return step


def _peak_inside_blocks(model, step, param_bytes) -> int:
    """One step with hooks at both ends of every block's forward and backward sampling
    param_bytes(); the hooks exist only for this step, so the timed steps run without them."""
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], param_bytes())

    handles = [
        register(sample)
        for block in model.blocks
        for register in (
            block.register_forward_pre_hook,
            block.register_forward_hook,
            block.register_full_backward_pre_hook,
            block.register_full_backward_hook,
        )
    ]
    step()
    for h in handles:
        h.remove()
    return peak[0]


def _fsdp2_param_bytes(model):
    """FSDP2's parameter storage alive now: each parameter's shard plus its unsharded (all-gathered)
    copy while that exists (read from FSDPParam, FSDP2's own record of both)."""
    fsdp_params = [
        fp
        for m in model.modules()
        if hasattr(m, "_get_fsdp_state")
        for group in [m._get_fsdp_state()._fsdp_param_group]
        if group is not None
        for fp in group.fsdp_params
    ]

    def nbytes():
        return sum(
            fp._sharded_param_data.untyped_storage().nbytes()
            + sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
            for fp in fsdp_params
        )

    return nbytes


def build(case, rank, world):
    """Runs in each rank: set up `case`, return a function doing one training step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerofast import CommPolicy, UnitPolicy, ZeroAdam
    from zerofast.reference import ReferenceZero
    from zerofast.tools.models import make_gpt

    shape = next((k for k in SHAPES if case.endswith(f" @{k}")), None)
    case = case.removesuffix(f" @{shape}")
    model = make_gpt("small", **(SHAPES[shape] if shape else {}))
    kind, _, rest = case.partition(" ")

    def plain(opt, module):
        def run(x, y):
            _, loss = module(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return run

    if kind == "nocomm":
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
        return _loop(model, rank, plain(opt, model))
    if kind == "ddp":
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), fused=True, **HYPER)
        return _loop(model, rank, plain(opt, ddp))
    if kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **HYPER)
        return _loop(model, rank, plain(opt, ddp))
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
        return _loop(model, rank, plain(opt, model), _fsdp2_param_bytes(model))
    if kind == "reference":
        opt = ReferenceZero(model, stage=int(rest), **HYPER)
        return _loop(model, rank, plain(opt, model))
    if kind == "zerofast":
        stage, partition, *extra = rest.split()
        # "k=v" words are policy fields: UnitPolicy's min_unit_mb, CommPolicy's bucket_mb (numbers),
        # bucket_buffers (an int) and check_collectives (0 or 1: the debug check before every collective)
        options = {
            k: bool(int(v)) if k == "check_collectives" else int(v) if k == "bucket_buffers" else float(v)
            for k, v in (e.split("=") for e in extra if "=" in e)
        }
        units = UnitPolicy(min_unit_mb=options.pop("min_unit_mb")) if "min_unit_mb" in options else None
        comm = CommPolicy(partition=partition, overlap_param_gather="overlap_gather" in extra, **options)
        opt = ZeroAdam(model, stage=int(stage), comm=comm, units=units, **HYPER)
        param_bytes = (lambda: opt.report().memory.materialized_params) if opt.plan.params_sharded else None
        return _loop(model, rank, plain(opt, model), param_bytes)
    if kind == "deepspeed":
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": int(rest)},
            "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "weight_decay": HYPER["weight_decay"]}},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def run(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()

        return _loop(model, rank, run)
    raise ValueError(case)


CASES = (
    ["nocomm", "ddp", "zero_redundancy", "reference 1", "reference 2"]
    + [f"zerofast {s} {p}" for s in (1, 2) for p in ("flat", "round_robin", "greedy")]
    + [f"zerofast {s} {p} overlap_gather" for s in (1, 2) for p in ("flat", "greedy")]
    + ["deepspeed 1", "deepspeed 2"]
    + ["reference 3", "fsdp2"]
    + [f"zerofast 3 {p}" for p in ("flat", "round_robin", "greedy")]
    + ["deepspeed 3"]
    + [f"zerofast {s} flat check_collectives=1" for s in (1, 2, 3)]
)  # ZEROFAST_DEBUG's cost


# The narrow, deep GPT (many small tensors): d=64, 32 blocks (356 tensors), where per-tensor and
# per-unit costs show; stage 3 at several min_unit_mb (0: one unit per block, 0.2 MiB each).
DEEP = dict(n_embd=64, n_layer=32, n_head=2)
GROUP_DEEP = "step: 2 gloo ranks x 1 thread, narrow deep GPT (d=64, 32 blocks), batch 8x64"
CASES_DEEP = [
    f"{c} @deep"
    for c in ["nocomm", "ddp", "fsdp2", "zerofast 1 flat", "zerofast 2 flat"]
    + [f"zerofast 3 flat min_unit_mb={mb}" for mb in (0, 0.5, 1, 2, 4)]
]

# The wide GPT of the buffer-budget memory benchmark (d=512, 25.4M parameters; bench_memory.py
# measures its memory): step time of the buffer budget and bucket size against the previous
# defaults (stage 2: 25 MB buckets, no bound).
WIDE = dict(n_embd=512)
GROUP_WIDE = "step: 2 gloo ranks x 1 thread, GPT 25.4M params (d=512), batch 8x64"
CASES_WIDE = [
    f"{c} @wide"
    for c in [
        "nocomm",
        "ddp",
        "fsdp2",
        "zerofast 1 flat",
        "zerofast 2 flat",
        "zerofast 2 flat bucket_mb=25",
        "zerofast 2 flat bucket_mb=25 bucket_buffers=0",
        "zerofast 2 flat bucket_buffers=1",
        "zerofast 3 flat",
        "zerofast 3 flat bucket_buffers=0",
    ]
]
SHAPES = {"deep": DEEP, "wide": WIDE}
GROUPS = {"deep": GROUP_DEEP, "wide": GROUP_WIDE}


@pytest.mark.parametrize("case", CASES + CASES_DEEP + CASES_WIDE)
def test_step(benchmark, record, case):
    if case.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (optional: pip install deepspeed)")
    pool = RankPool(functools.partial(build, case), world=WORLD)
    try:
        benchmark.pedantic(pool.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        peak = pool.info()[0]
        if peak is not None:
            benchmark.extra_info["param_peak_mib"] = peak / 2**20
    finally:
        pool.close()
    shape = next((k for k in SHAPES if case.endswith(f" @{k}")), None)
    record(benchmark, GROUPS.get(shape, GROUP), case)


# Interleaved: the cases' rank pools alive together, stepped in turn (ROUNDS_INTERLEAVED rounds of
# STEPS_PER_ROUND steps each), so that a change in the machine's load hits every case alike; medians
# over all steps, as a ratio to DDP's. What stage 3's goal (<= 1.05x DDP) is read against.
INTERLEAVED = ["ddp", "zerofast 2 flat", "zerofast 3 flat", "fsdp2"]
ROUNDS_INTERLEAVED, STEPS_PER_ROUND = 10, 3


def _interleaved():
    import statistics
    import time

    pools = {}
    try:
        for case in INTERLEAVED:
            pools[case] = RankPool(functools.partial(build, case), world=WORLD)
        for pool in pools.values():  # warm-up
            for _ in range(WARMUP):
                pool.step()
        times = {case: [] for case in INTERLEAVED}
        for _ in range(ROUNDS_INTERLEAVED):
            for case, pool in pools.items():
                for _ in range(STEPS_PER_ROUND):
                    t = time.perf_counter()
                    pool.step()
                    times[case].append(time.perf_counter() - t)
    finally:
        for pool in pools.values():
            pool.close()
    return {case: statistics.median(ts) for case, ts in times.items()}


def test_step_interleaved(benchmark, capsys):
    medians = benchmark.pedantic(_interleaved, rounds=1, iterations=1)
    with capsys.disabled():
        print(f"\ninterleaved, {ROUNDS_INTERLEAVED} rounds x {STEPS_PER_ROUND} steps, {GROUP}:")
        for case, t in medians.items():
            print(f"  {case:24s} {t * 1e3:8.1f} ms  {t / medians['ddp']:5.2f}x DDP")
