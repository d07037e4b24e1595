"""Tensor parallelism (issue #43 item 7): tp 2 x ZeRO dp 2 against FSDP2 + TP (torchtitan's
composition: parallelize_module over mesh["tp"], then fully_shard over mesh["dp"]) on the same 4 gloo
ranks x 1 thread, a TitanLlama under torchtitan's plan (SequenceParallel norms), fp32, AdamW.

One run, interleaved: every case's ranks live at once (a pool each) and each round times one step
of every case in turn, so the machine's drift falls on all of them alike; the table gives the
median step time, its ratio to FSDP2 + TP's, the median of the rounds' paired ratios, and per rank
the bytes of training state held at rest after a step (parameters, gradients kept between steps,
the optimizer's state; ZeroAdam's report(), FSDP2's from its DTensors' local tensors) and the
process's peak resident memory.
"""

from __future__ import annotations

import statistics

from rankpool import run_interleaved

WORLD, DP, TP = 4, 2, 2
BATCH, SEQ = 4, 64
ROUNDS = 12
MODEL = dict(vocab=2048, dim=256, heads=8, hidden=768, layers=4)
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
TITLE = (
    "tensor parallelism: 4 gloo ranks x 1 thread as tp 2 x dp 2, TitanLlama 4.5M params "
    "(dim 256, 4 layers, vocab 2048, SequenceParallel norms), batch 4x64 per dp rank, fp32 AdamW"
)
CASES = ["fsdp2+tp", "zerofast stage 1", "zerofast stage 2", "zerofast stage 3"]


def _local_bytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def build(case, rank, world):
    import resource

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from zerofast import ZeroAdam
    from zerofast.tools.models import TitanLlama, titan_loss, titan_plan

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = titan_plan(TitanLlama(**MODEL), mesh["tp"])
    if case == "fsdp2+tp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():  # a ModuleDict (titan_cut keeps the indices)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), **HYPER)

        def state_bytes() -> int:
            params = sum(_local_bytes(p) for p in model.parameters())
            grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            moments = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if v.dim() > 0)
            return params + grads + moments
    else:
        opt = ZeroAdam(model, stage=int(case.split()[-1]), process_group=mesh, **HYPER)

        def state_bytes() -> int:
            m = opt.report().memory
            return m.params + m.param_padding + m.grad_shard + m.optimizer + m.master_copy + m.grads + m.bucket_pool

    dp_rank = mesh.get_local_rank("dp")
    state = {"step": 0}

    def step():
        g = torch.Generator().manual_seed(1000 * (state["step"] % 4) + dp_rank)
        ids = torch.randint(0, MODEL["vocab"], (BATCH, SEQ), generator=g)
        state["step"] += 1
        titan_loss(model, ids).backward()
        opt.step()
        opt.zero_grad()

    def info():
        return {"state": state_bytes(), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    step.info = info
    return step


def test_tp_against_fsdp2_tp_interleaved(benchmark, record_ratios):
    times, infos = run_interleaved(build, CASES, WORLD, ROUNDS, benchmark)
    base = statistics.median(times["fsdp2+tp"])
    lines = [
        f"{'case':18s} {'step ms':>9s} {'x fsdp2+tp':>11s} {'paired':>7s} {'state MiB/rank':>15s} {'peak RSS MiB':>13s}"
    ]
    for case in CASES:
        med = statistics.median(times[case])
        paired = statistics.median(a / b for a, b in zip(times[case], times["fsdp2+tp"]))
        state = max(i["state"] for i in infos[case]) / 2**20
        rss = max(i["peak_rss"] for i in infos[case]) / 2**20
        lines.append(f"{case:18s} {med * 1e3:9.1f} {med / base:10.2f}x {paired:6.2f}x {state:15.2f} {rss:13.0f}")
        benchmark.extra_info[f"{case} ms"] = med * 1e3
        benchmark.extra_info[f"{case} state MiB"] = state
    lines.append(f"medians over {ROUNDS} interleaved rounds (one step of each case per round, order alternating)")
    record_ratios(TITLE, lines)
