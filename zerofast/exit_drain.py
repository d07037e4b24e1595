"""The drain at the interpreter's exit, so that a process that trained ends cleanly ([Note: clean
exit] in csrc/work_keeper.cpp). Installed with atexit when the compiled core is first used
(zerofast/comm.py passes it the core's drain); this module imports nothing of zerofast."""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable

# How long the exit waits for collectives still in flight, in all: the peers are finishing the same
# step; one that died or is stuck must not hold this rank's exit for a process group's timeout.
_EXIT_WAIT_S = 10.0
# How long it waits for c10d's worker threads to put down the Works they completed, and their names
# (torch names ProcessGroupGloo's worker threads so).
_SETTLE_S = 1.0
_BACKEND_THREADS = ("pt_gloo_runloop",)


_DRAIN: list[Callable] = []  # the compiled core's drain_kept_works, once installed


def install(drain_kept_works: Callable) -> None:
    """Drain at the interpreter's exit with the compiled core's drain_kept_works (once per process)."""
    if not _DRAIN:
        _DRAIN.append(drain_kept_works)
        atexit.register(_drain_at_exit)


def _drain_at_exit() -> None:
    """Before finalization (the checkpoint writer's thread is joined before this): our collectives
    still in flight are waited for (_EXIT_WAIT_S in all) and released on this thread, then c10d's
    worker threads get the moment they need to drop the Works they completed, ours or not. A
    collective that failed or still runs is said on stderr; the exit status stays the program's."""
    report = _DRAIN[0](_EXIT_WAIT_S)
    for error in report.errors:
        first = error.strip().splitlines()[0] if error.strip() else "(no message)"
        print(f"zerofast: a collective still in flight at exit failed: {first}", file=sys.stderr)
    backend_threads_settled(_SETTLE_S)


def _thread_stat(tid: str) -> tuple[str, str]:
    """(name, scheduler state) of one of this process's threads; ("", "") once it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
    except OSError:
        return "", ""
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return name, stat[stat.rindex(")") + 2 :].split(" ", 1)[0]


def backend_threads_settled(limit_s: float) -> bool:
    """Whether, within limit_s, none of c10d's worker threads is runnable (Linux's state R: running,
    or preempted before it could drop the Work it just completed), seen twice in a row with the GIL
    let go in between (so that one waiting for the GIL has had it). Elsewhere than Linux, True at
    once. [Note: clean exit] in csrc/work_keeper.cpp says why."""
    try:
        tids = [t for t in os.listdir("/proc/self/task") if _thread_stat(t)[0] in _BACKEND_THREADS]
    except OSError:
        return True
    deadline = time.monotonic() + limit_s
    idle = 0
    while idle < 2:
        busy = any(_thread_stat(t)[1] == "R" for t in tids)
        idle = 0 if busy else idle + 1
        if busy and time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # lets go of the GIL
    return True
