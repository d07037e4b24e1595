"""Asynchronous saves: the writer thread, the checkpoint process group it talks on, and the handle a
save(..., blocking=False) returns.

[Note: asynchronous save]
save(blocking=False) does on the caller's thread what must see the live state: it waits for the
previous asynchronous save, checks its arguments, encodes the small state, and copies the rank's
shard into the optimizer's Staging (staging.py; reused, never reallocated). Then it returns, and the
next step() may change the live state at once. The writer thread writes the staged copy exactly as
a blocking save writes the live state (io._write: DCP into path + ".incomplete", rank 0 adds
zerofast.json and manifest.json and renames it), so the folder still appears only when every rank's
data and the metadata are written, and a rank killed meanwhile leaves the previous checkpoint the
latest. keep=K's purge runs after the rename, over complete checkpoints only, so it never deletes
the one being written, nor the newest complete one.
- The writer's collectives (DCP's plan and result exchange, the barriers) run on a gloo group of
  their own over the same ranks, made once per optimizer group: on the training group they could
  interleave with the training thread's collectives in a different order on different ranks.
- One save at a time per process: a second save, load(), and the interpreter's exit (the writer
  thread is joined before atexit runs) wait for the one in flight. Its error, if any, is raised by
  wait(), or else by the next save() / load(), naming the path; it is raised once (one nothing
  waited for is printed at exit). A then() callback's failure is a warning: the checkpoint is
  written, and callbacks run on some ranks only.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import sys
import threading
import warnings
from collections.abc import Callable

import torch.distributed as dist

from .. import compat

__all__ = ["AsyncSave", "submit", "settle", "in_flight", "checkpoint_group"]

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_IN_FLIGHT: AsyncSave | None = None
_GROUPS: dict[tuple[int, ...], tuple[object, dist.ProcessGroup]] = {}  # ranks: (the default group then, group)
_LOCK = threading.Lock()


class AsyncSave:
    """What save(..., blocking=False) returns: the checkpoint being written in the background."""

    def __init__(self, path: str):
        self.path = path
        self._future: concurrent.futures.Future | None = None
        self._reported = False
        self._lock = threading.Lock()
        self._then: list[Callable[[], None]] = []
        self._finished = False  # written, and every then() callback run

    def _job(self, write: Callable[[], None]) -> None:
        """On the writer thread: the write, then the then() callbacks one by one (wait() returns after them)."""
        _lower_priority()
        write()
        while True:
            with self._lock:
                if not self._then:
                    self._finished = True
                    return
                fn = self._then.pop(0)
            self._run(fn)

    def _run(self, fn: Callable[[], None]) -> None:
        """A then() callback. Its failure is a warning naming the checkpoint, not the save's error:
        the checkpoint is written, and callbacks run on some ranks only (a rename on rank 0), so
        raising it from the next save on those ranks alone would leave the others waiting."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            warnings.warn(
                f"zerofast.checkpoint: after the asynchronous save of {self.path} was written, "
                f"{getattr(fn, '__qualname__', fn)} failed: {type(err).__name__}: {err}",
                stacklevel=2,
            )

    def then(self, fn: Callable[[], None]) -> None:
        """Run fn() once the checkpoint is complete, on the writer thread as part of the save (now,
        on this thread, if it is complete already); never if the write fails. For what must wait
        for the folder: a rename around it, deleting older checkpoints (a trainer's rotation), so
        that the newest complete checkpoint is never deleted while this one is being written."""
        with self._lock:
            if not self._finished and not self.done():
                self._then.append(fn)
                return
        if self._future.exception() is None:
            self._run(fn)

    def done(self) -> bool:
        """Whether the write has ended (written, or failed: wait() says which)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is complete (its folder exists); return its path. A failed
        write raises RuntimeError naming the path (and the cause)."""
        try:
            self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"zerofast.checkpoint: the asynchronous save of {self.path} is still being written after {timeout} s"
            ) from None
        except BaseException as err:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
            if not self._future.done() or self._future.exception() is not err:
                raise  # an interrupt of this wait (KeyboardInterrupt), not the writer's error
            self._reported = True
            raise RuntimeError(
                f"zerofast.checkpoint: the asynchronous save of {self.path} failed: {type(err).__name__}: {err}"
            ) from err
        return self.path

    def __repr__(self) -> str:
        state = (
            "written" if self.done() and self._future.exception() is None else ("failed" if self.done() else "writing")
        )
        return f"AsyncSave({self.path!r}, {state})"


def _lower_priority() -> None:
    """The writer thread at the lowest CPU priority (Linux: nice 19 for this thread alone), so that
    it runs on CPU time training leaves: measured on 2 CPU ranks that keep both cores busy, at the
    same priority the write took as much CPU from the steps it overlapped as a blocking save took
    from one step (benchmarks/bench_checkpoint.py, test_save_stall). Where training runs on a GPU
    the host's cores are mostly idle and nothing changes."""
    if _LOWERED.get(threading.get_ident()):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux (per-thread niceness), or not allowed: run as it is
        pass
    _LOWERED[threading.get_ident()] = True


_LOWERED: dict[int, bool] = {}


def settle() -> None:
    """Wait for this process's asynchronous save in flight, if any; raise its error unless wait()
    already did (a save that failed unobserved surfaces here, at the next save or load)."""
    global _IN_FLIGHT
    pending = _IN_FLIGHT
    if pending is None:
        return
    already = pending._reported
    try:
        pending.wait()  # interrupted (KeyboardInterrupt): it stays in flight, and the next call waits again
    except RuntimeError:
        _IN_FLIGHT = None
        if not already:  # else wait() raised it to the caller already: not again
            raise
        return
    _IN_FLIGHT = None


def submit(path: str, write: Callable[[], None]) -> AsyncSave:
    """Run `write` on the writer thread; the handle. The caller settled the previous one."""
    global _EXECUTOR, _IN_FLIGHT
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerofast-ckpt")
    handle = AsyncSave(path)
    handle._future = _EXECUTOR.submit(handle._job, write)
    _IN_FLIGHT = handle
    return handle


@atexit.register
def _report_at_exit() -> None:
    """At exit (the writer thread is joined by then): a failed last save nothing waited for, on stderr."""
    pending = _IN_FLIGHT
    if pending is not None and pending.done() and not pending._reported and pending._future.exception() is not None:
        err = pending._future.exception()
        print(
            f"zerofast.checkpoint: the asynchronous save of {pending.path} failed and nothing waited for it: "
            f"{type(err).__name__}: {err}",
            file=sys.stderr,
        )


def in_flight() -> AsyncSave | None:
    """This process's asynchronous save not yet waited for, if any."""
    return _IN_FLIGHT


def checkpoint_group(group: dist.ProcessGroup, world_size: int) -> dist.ProcessGroup:
    """A gloo group over the ranks of `group`, for the writer thread's collectives (made once per
    set of ranks; every rank of `group` calls this at the same point of its save)."""
    ranks = tuple(dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in range(world_size))
    world, made = _GROUPS.get(ranks, (None, None))
    # None yet, the default group made again, or this one destroyed (dist.destroy_process_group(g)).
    if made is None or world is not dist.group.WORLD or not _alive(made):
        made = compat.new_group(ranks, backend="gloo")
        _GROUPS[ranks] = (dist.group.WORLD, made)
    return made


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)  # a KeyError once the group was destroyed
    except KeyError:
        return False
    return True
