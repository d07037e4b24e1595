"""Hybrid sharding on 4 gloo ranks x 1 thread taken as 2 "machines" of 2 ranks (ranks 0-1 and 2-3):
per step, the payload bytes that cross machines and the step time, for ZeroAdam flat (CommPolicy(shard_size=4))
against ZeroAdam shard_size=2 (stages 1-3), next to torch FSDP2 flat (a 1-D mesh of 4) and FSDP2
HSDP (a 2-D ("replicate", "shard") mesh of 2 x 2), each with reshard_after_forward True (ZeRO-3's
parameter sharding) and False (parameters kept after forward: ZeRO-2's traffic), and DDP.

Bytes that cross machines: the payload (the data a collective reduces or gathers, as report().comm
counts it) of every collective whose group holds ranks of both machines. ZeroAdam's come from
report().comm (a shard group of 4 spans both machines; a replicate group always does). FSDP2's are
counted by wrapping the three collectives it issues from Python (dist.all_gather_single,
dist.reduce_scatter_single, dist.all_reduce) for one step; DDP's all_reduce runs in its C++ reducer
and is not counted (its traffic is the whole gradient, Φ, every step, across machines).
Loopback has no slow link, so the step times show the cost of the extra collective, not its benefit.
"""

import functools

import pytest
from rankpool import RankPool

WORLD, PER_MACHINE = 4, 2
BATCH, SEQ = 4, 64
ROUNDS, WARMUP = 5, 1
GROUP = "hybrid: 4 gloo ranks x 1 thread as 2 machines x 2, GPT 6.4M params, batch 4x64"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _crosses(ranks) -> bool:
    return len({r // PER_MACHINE for r in ranks}) > 1


class _Counter:
    """Payload bytes of FSDP2's collectives in one step, split by whether their group crosses machines."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes = {"cross": 0, "within": 0}
        for name, payload in (
            ("all_gather_single", lambda a, k: _arg(a, k, 0, "output")),
            ("reduce_scatter_single", lambda a, k: _arg(a, k, 1, "input")),
            ("all_reduce", lambda a, k: _arg(a, k, 0, "tensor")),
        ):
            setattr(dist, name, self._wrap(getattr(dist, name), payload))

    def _wrap(self, fn, payload):
        import torch.distributed as dist

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            t = payload(args, kwargs)
            group = kwargs.get("group")
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            if len(ranks) > 1:
                self.bytes["cross" if _crosses(ranks) else "within"] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return counted


def _arg(args, kwargs, index, name):
    return kwargs[name] if name in kwargs else args[index]


def build(case, rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerofast import CommPolicy, ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt("small")
    kind, *rest = case.split()
    count = None
    if kind == "ddp":
        module = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        hsdp, reshard = rest[0] == "hsdp", rest[1] == "reshard=1"
        mesh = (
            init_device_mesh("cpu", (WORLD // PER_MACHINE, PER_MACHINE), mesh_dim_names=("replicate", "shard"))
            if hsdp
            else init_device_mesh("cpu", (world,))
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        module, opt = model, torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
        counter = _Counter()

        def count():
            return dict(counter.bytes)
    else:
        stage, k = int(rest[0]), int(rest[1].split("=")[1])
        module = model
        opt = ZeroAdam(model, stage=stage, comm=CommPolicy(shard_size=k), **HYPER)

        def count():
            stats = opt.report().comm
            cross = sum(
                v
                for key, v in stats.items()
                if key.startswith("replicate/") or (key.startswith("shard/") and k > PER_MACHINE)
            )
            return {"cross": cross, "within": sum(stats.values()) - cross}

    state = {"step": 0}

    def step():
        x, y = random_batch(model.cfg, BATCH, SEQ, seed=1000 * (state["step"] % 4) + rank)
        state["step"] += 1
        _, loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def info():
        if count is None:
            return None
        if kind == "fsdp2":
            counter.bytes = {"cross": 0, "within": 0}
        step()
        return count()

    step.info = info
    return step


CASES = (
    ["ddp"]
    + [f"zerofast {s} k={k}" for s in (1, 2, 3) for k in (4, 2)]
    + [f"fsdp2 {m} reshard={r}" for r in (0, 1) for m in ("flat", "hsdp")]
)


@pytest.mark.parametrize("case", CASES)
def test_hybrid_step(benchmark, record, case):
    pool = RankPool(functools.partial(build, case), world=WORLD)
    try:
        benchmark.pedantic(pool.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        counted = pool.info()
    finally:
        pool.close()
    if counted[0] is not None:
        benchmark.extra_info["cross_mib"] = max(c["cross"] for c in counted) / 2**20
        benchmark.extra_info["within_mib"] = max(c["within"] for c in counted) / 2**20
    record(benchmark, GROUP, case)
