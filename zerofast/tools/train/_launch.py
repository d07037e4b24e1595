"""Starting the main job's ranks: launch (the local ranks through torch.distributed.run, which restarts them
after a failure), _without_nproc (the ranks' arguments) and _init_process_group (each rank's process group)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.rendezvous import rendezvous
from torch.distributed.run import main as torchrun_main


def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Start `nproc` local ranks running this module, through torch.distributed.run; its agent
    restarts them up to max_restarts times after a failure (they resume: see _resuming)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun_main(
            [
                "--standalone",
                f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}",
                "-m",
                "zerofast.train",
                *_without_nproc(argv),
            ]
        )
    except ChildFailedError:  # the workers said why on stderr; torchrun printed its summary
        return 1
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    """The ranks don't need --nproc, and torchrun's own parser would take it for an abbreviation of
    its --nproc-per-node even after the module name."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """init_process_group from torchrun's environment. After a restart by torchrun's agent
    (TORCHELASTIC_RESTART_COUNT > 0) the rendezvous store can still hold the previous attempt's keys, among
    them the addresses of workers that are gone, and gloo then fails to connect to them (measured:
    "connectFullMesh failed ... Connection refused" on every restart); so each attempt gets its own prefix."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"zerofast/attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
