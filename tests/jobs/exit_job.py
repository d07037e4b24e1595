"""A rank of tests/test_exit.py, launched as its own interpreter (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, as torchrun sets them), so that it ends the way a job ends: through the
interpreter's atexit and finalization ([Note: clean exit] in csrc/work_keeper.cpp).

    python tests/jobs/exit_job.py FOLDER   # every kind of work in flight at exit; FOLDER gets a checkpoint

One launch for all of it: each rank is an interpreter that imports torch and zerofast (seconds).

Each rank holds the GIL through its last atexit callback into finalization (HOLD_S seconds, in C:
no bytecode runs between it and finalization, so no other thread can take the GIL in between). A
backend thread that needs the GIL in that time, to drop a Work whose last reference it holds, is
ended by CPython inside a C++ destructor, and the process aborts (SIGABRT): what a finished job
showed now and then under torchrun, made certain here.
"""

import atexit
import ctypes

HOLD_S = 3.0
# Registered before anything else, so it runs last. ctypes.PyDLL calls keep the GIL.
atexit.register(ctypes.PyDLL(None).usleep, int(HOLD_S * 1e6))

import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zerofast import CommPolicy, UnitPolicy, ZeroAdam, checkpoint  # noqa: E402


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))


def _loss(model, seed: int) -> torch.Tensor:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    return (model(x) - x).pow(2).mean()


def reduce_in_flight(rank: int, store) -> None:
    """Rank 0 runs a backward (its bucket reduces start there, in autograd's thread state, and wait
    for rank 1), drops the optimizer with them in flight and exits; rank 1 joins them only once
    rank 0 is in its last atexit callback, holding the GIL. Before [Note: clean exit], gloo's
    thread dropped the last reference to each Work, with autograd's Python context in it, right
    then, and rank 0 aborted every time."""
    model = _mlp()
    opt = ZeroAdam(model, stage=2, lr=1e-2)
    if rank == 1:
        store.wait(["dropped"])
        time.sleep(HOLD_S / 3)  # rank 0 is past its drain, in the GIL-holding callback, by now (before: it was)
    _loss(model, rank).backward()
    if rank == 0:
        del opt, model
        gc.collect()
        store.set("dropped", "1")


class _Raises(torch.nn.Module):
    """A block whose forward raises when asked: stage 3's prefetch of the next unit is then in flight."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("a forward that stops half-way")
        return self.linear(x)


def all_in_flight(rank: int, folder: str) -> None:
    """Everything that may be in flight when a script ends: stage 2's overlapped parameter gather
    (step() returns before it completes), an asynchronous checkpoint save (the writer thread), and
    stage 3's prefetch of the next unit (a forward that raised after starting it)."""
    model = _mlp()
    opt = ZeroAdam(model, stage=2, lr=1e-2, comm=CommPolicy(overlap_param_gather=True, bucket_mb=0.01))
    for step in range(3):
        _loss(model, 2 * step + rank).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(os.path.join(folder, "step-3"), model, opt, blocking=False)

    blocks = torch.nn.Sequential(*(_Raises(64) for _ in range(4)))
    opt3 = ZeroAdam(blocks, stage=3, lr=1e-2, units=UnitPolicy(min_unit_mb=0))
    blocks[1].fail = True
    try:
        blocks(torch.randn(4, 64))
    except RuntimeError as e:
        assert "half-way" in str(e), e
    assert opt3 is not None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: exit_job.py FOLDER; got {sys.argv[1:]}")
    all_in_flight(rank, sys.argv[1])
    reduce_in_flight(rank, dist.distributed_c10d._get_default_store())  # last: rank 0 exits right after
    print(f"rank {rank}: exiting", flush=True)


if __name__ == "__main__":
    main()
