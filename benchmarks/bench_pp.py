"""Pipeline parallelism (issue #53 item 8): pp 2 x dp 2 on 4 gloo ranks x 1 thread, a TitanLlama cut
into 2 stages (titan_cut), torch's Schedule1F1B over 4 micro-batches, fp32 AdamW; ZeroAdam stages 1-3
through ZeroPipelineStage against torch's own compositions with the same schedule: DDP over each part
(torch's PipelineStage applies no_sync itself) and FSDP2 over each part's blocks and the part
(torchtitan's composition).

One run, interleaved as bench_tp.py: every case's ranks live at once and each round times one step of
every case in turn; the table gives the median step time, its ratio to DDP's, the median of the
rounds' paired ratios, per rank the bytes of training state held at rest after a step, the process's
peak resident memory, and the bytes each rank sends across "dp" in a step: ZeroAdam's report().comm
(every collective's payload over the dp group), DDP's one all_reduce of the part's gradients (its
buckets' payload: every gradient once, no_sync in the other micro-batches); FSDP2's are not counted
(its collectives report no bytes).
"""

from __future__ import annotations

import statistics

from rankpool import run_interleaved

WORLD, PP, DP, MICRO = 4, 2, 2, 4
BATCH, SEQ = 8, 64
ROUNDS = 10
MODEL = dict(vocab=2048, dim=256, heads=8, hidden=768, layers=4)
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
TITLE = (
    "pipeline parallelism: 4 gloo ranks x 1 thread as pp 2 x dp 2, TitanLlama 4.5M params (dim 256, "
    "4 layers, vocab 2048) cut into 2 stages, Schedule1F1B over 4 micro-batches, batch 8x64 per dp rank, fp32 AdamW"
)
CASES = ["ddp", "fsdp2", "zerofast stage 1", "zerofast stage 2", "zerofast stage 3", "zerofast stage 3 per mb"]


def _local_bytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _loss(logits, ids):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def build(case, rank, world):
    import resource

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from zerofast import ZeroAdam
    from zerofast.pipelining import ZeroPipelineStage
    from zerofast.tools.models import TitanLlama, titan_cut

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = titan_cut(TitanLlama(**MODEL), s, PP)
    pp_group = mesh["pp"].get_group()
    dp_bytes = 0
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(part, process_group=mesh["dp"].get_group())
        opt = torch.optim.AdamW(part.parameters(), **HYPER)
        stage = PipelineStage(module, s, PP, torch.device("cpu"), group=pp_group)
        dp_bytes = sum(p.numel() * p.element_size() for p in part.parameters())
    elif case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in part.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        opt = torch.optim.AdamW(part.parameters(), **HYPER)
        stage = PipelineStage(part, s, PP, torch.device("cpu"), group=pp_group)
    else:
        per_mb = case.endswith("per mb")  # stage 3 gathering each unit per micro-batch, not once a step
        opt = ZeroAdam(part, stage=int(case.split()[2]), process_group=mesh, **HYPER)
        stage = ZeroPipelineStage(part, s, PP, torch.device("cpu"), group=pp_group, gather_per_micro_batch=per_mb)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=_loss)

    def state_bytes() -> int:
        if case.startswith("zerofast"):
            m = opt.report().memory
            return m.params + m.param_padding + m.grad_shard + m.optimizer + m.master_copy + m.grads + m.bucket_pool
        params = sum(_local_bytes(p) for p in part.parameters())
        grads = sum(_local_bytes(p.grad) for p in part.parameters() if p.grad is not None)
        moments = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if v.dim() > 0)
        return params + grads + moments

    state = {"step": 0}

    def step():
        g = torch.Generator().manual_seed(1000 * (state["step"] % 4) + d)
        ids = torch.randint(0, MODEL["vocab"], (BATCH, SEQ), generator=g)
        state["step"] += 1
        if s == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=[])
        opt.step()
        opt.zero_grad()

    def info():
        sent = dp_bytes
        if case.startswith("zerofast"):
            sent = sum(v for k, v in opt.report().comm.items() if k.startswith("shard/"))
        return {
            "state": state_bytes(),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "dp_bytes": sent,
        }

    step.info = info
    return step


def test_pp_against_ddp_and_fsdp2_interleaved(benchmark, record_ratios):
    times, infos = run_interleaved(build, CASES, WORLD, ROUNDS, benchmark)
    base = statistics.median(times["ddp"])
    lines = [
        f"{'case':24s} {'step ms':>9s} {'x ddp':>7s} {'paired':>7s} {'state MiB/rank':>15s} "
        f"{'peak RSS MiB':>13s} {'dp MiB/step':>12s}"
    ]
    for case in CASES:
        med = statistics.median(times[case])
        paired = statistics.median(a / b for a, b in zip(times[case], times["ddp"]))
        state = max(i["state"] for i in infos[case]) / 2**20
        rss = max(i["peak_rss"] for i in infos[case]) / 2**20
        sent = max(i["dp_bytes"] for i in infos[case]) / 2**20
        shown = f"{sent:12.2f}" if sent else f"{'-':>12s}"
        lines.append(f"{case:24s} {med * 1e3:9.1f} {med / base:6.2f}x {paired:6.2f}x {state:15.2f} {rss:13.0f} {shown}")
        benchmark.extra_info[f"{case} ms"] = med * 1e3
        benchmark.extra_info[f"{case} state MiB"] = state
    lines.append(f"medians over {ROUNDS} interleaved rounds (one step of each case per round, order alternating)")
    record_ratios(TITLE, lines)
