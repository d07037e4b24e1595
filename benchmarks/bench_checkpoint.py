"""Checkpoint save and load on gloo, 2 ranks x 1 thread, after one training step: ZeroAdam stages 1-3
(zerofast.checkpoint.save / load) next to FSDP2 (fully_shard per block, then the root) with
torch.distributed.checkpoint.state_dict.get_state_dict + dcp.save (and set_state_dict + dcp.load),
on the step benchmark's GPT (6.4M parameters) and on a ~100M-parameter one (d=768, 14 blocks).

Each round is one save into a new folder (or one load of a checkpoint another pool of ranks wrote),
timed from rank 0's side across both ranks. The summary adds each case's extra peak memory on rank
0: the process's peak RSS during the save or load (Linux's VmHWM, reset before it through
/proc/self/clear_refs) less its RSS just before, the largest over the rounds; so C++ and DCP
buffers count, and nothing that happened before does.
"""

import functools
import os
import shutil
import tempfile

import pytest
from rankpool import RankPool

WORLD = 2
ROUNDS, WARMUP = 3, 1
MODELS = {"gpt-6.4M": dict(), "gpt-100M": dict(n_embd=768, n_layer=14, n_head=12)}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _extra_peak(fn) -> int:
    """Run fn(); the peak RSS during it less the RSS before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak) to the current RSS
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before


def _model_and_optimizer(system, size, rank, world):
    """The GPT of `size` with its optimizer (FSDP2, fully_shard per block then the root, + AdamW; or
    ZeroAdam at the stage `system` ends with), and a function doing one training step on this
    rank's batch."""
    import torch

    from zerofast import ZeroAdam
    from zerofast.tools.models import make_gpt, random_batch

    model = make_gpt("small", **MODELS[size])
    if system != "fsdp2":
        opt = ZeroAdam(model, stage=int(system[-1]), **HYPER)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    x, y = random_batch(model.cfg, 1, 16, seed=rank)

    def train_step():
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()

    return model, opt, train_step


def build(case, root, rank, world):
    """Runs in each rank: a model after one step, and a function doing one save (or load)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zerofast import checkpoint as ck

    system, action, size = case.split()
    model, opt, train_step = _model_and_optimizer(system, size, rank, world)
    if system == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    train_step()

    def save(path):
        if system == "fsdp2":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        else:
            ck.save(path, model, opt)

    def load(path):
        if system == "fsdp2":
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            ck.load(path, model, opt)

    state = {"round": 0, "extra": 0}
    saved = os.path.join(root, "loaded-from")

    def step():
        if action == "prepare":  # write the checkpoint the load case reads
            save(saved)
        elif action == "save":
            path = os.path.join(root, f"round-{state['round']}")
            state["extra"] = max(state["extra"], _extra_peak(lambda: save(path)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)  # the disk holds one checkpoint at a time
        else:
            state["extra"] = max(state["extra"], _extra_peak(lambda: load(saved)))
        state["round"] += 1

    step.info = lambda: state["extra"]
    return step


CASES = [
    f"{system} {action} {size}"
    for size in MODELS
    for action in ("save", "load")
    for system in ("zerofast-1", "zerofast-2", "zerofast-3", "fsdp2")
]


@pytest.mark.parametrize("case", CASES)
def test_checkpoint(benchmark, record, case):
    root = tempfile.mkdtemp(prefix="zerofast-bench-ckpt-")
    if " load " in case:  # another pool of ranks writes what this one loads
        writer = RankPool(functools.partial(build, case.replace(" load ", " prepare "), root), world=WORLD, timeout=900)
        writer.step()
        writer.close()
    pool = RankPool(functools.partial(build, case, root), world=WORLD, timeout=900)
    try:
        benchmark.pedantic(pool.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        benchmark.extra_info["rank_mib"] = pool.info()[0] / 2**20
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    record(benchmark, f"checkpoint {case.split()[-1]}: 2 gloo ranks x 1 thread", case)


# --- the stall a save adds to the step it happens in -----------------------------------------------


def build_stall(case, root, rank, world):
    """Runs in each rank: the 100M model after one step, and a round that times a plain training step,
    then a step with a save at its start (blocking, or asynchronous: ZeroAdam's save(blocking=False),
    FSDP2's dcp.async_save with a gloo group of its own as DCP recommends), then waits for the
    write. The stall is the second less the first; the staging copy is what save() itself took."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zerofast import checkpoint as ck

    system, mode = case.split()
    model, opt, train_step = _model_and_optimizer(system, "gpt-100M", rank, world)
    if system == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        ckpt_group = dist.new_group(backend="gloo")

    def save(path):
        """The save as the training loop calls it; returns what to wait for (None: written)."""
        if system == "fsdp2":
            msd, osd = get_state_dict(model, opt)
            if mode == "async":
                return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=ckpt_group)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            return None
        handle = ck.save(path, model, opt, blocking=mode == "blocking")
        return None if mode == "blocking" else handle

    train_step()
    state = {"round": 0, "stall": [], "call": [], "written": []}

    def step():
        path = os.path.join(root, f"round-{state['round']}")
        dist.barrier()
        t0 = time.perf_counter()
        train_step()
        plain = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        pending = save(path)
        call = time.perf_counter() - t0
        train_step()
        with_save = time.perf_counter() - t0
        if pending is not None:
            pending.result() if hasattr(pending, "result") else pending.wait()
        written = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
        state["stall"].append(with_save - plain)
        state["call"].append(call)
        state["written"].append(written)
        state["round"] += 1

    step.info = lambda: {k: sorted(v)[len(v) // 2] for k, v in state.items() if k != "round"}
    return step


STALL_CASES = [
    f"{system} {mode}"
    for system in ("zerofast-1", "zerofast-2", "zerofast-3", "fsdp2")
    for mode in ("blocking", "async")
]


@pytest.mark.parametrize("case", STALL_CASES)
def test_save_stall(benchmark, record, case):
    root = tempfile.mkdtemp(prefix="zerofast-bench-stall-")
    pool = RankPool(functools.partial(build_stall, case, root), world=WORLD, timeout=900)
    try:
        benchmark.pedantic(pool.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        info = pool.info()[0]  # rank 0's medians
        benchmark.extra_info.update(
            stall_ms=info["stall"] * 1e3, call_ms=info["call"] * 1e3, written_ms=info["written"] * 1e3
        )
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    record(benchmark, "save stall, gpt-100M: 2 gloo ranks x 1 thread (round = a plain step + a step with a save)", case)
