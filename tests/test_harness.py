"""The multi-rank harness itself: results come back by rank, exceptions and hangs are reported."""

import signal
import threading

import harness
import pytest
import torch
import torch.distributed as dist
from harness import RankFailed, run_ranks


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "threads": torch.get_num_threads()}


def _raise_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return rank


def _raise_while_rank_0_waits(rank, world):
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.all_reduce(torch.zeros(1))  # rank 1 never joins
    return rank


HANG_S = 600.0  # how long rank 0 stays stuck: far beyond the harness's 5 s timeout below


def _hang_on_rank_0(rank, world):
    """Rank 0 stuck outside any collective, waiting for an event nothing sets. Bounded, so that a
    harness that waited for it would get the rank's result back (and the test would fail on
    that) instead of hanging the suite."""
    if rank == 0:
        threading.Event().wait(timeout=HANG_S)
    return rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_come_back_by_rank(world):
    out = run_ranks(_sum_of_ranks, world)
    assert [o["rank"] for o in out] == list(range(world))
    assert all(o["sum"] == sum(range(world)) for o in out)
    assert all(o["threads"] == 1 for o in out)


def test_exception_surfaces_with_traceback():
    with pytest.raises(RankFailed, match="(?s)rank 1 raised.*ValueError: planted failure on rank 1"):
        run_ranks(_raise_on_rank_1, 2)


def test_a_failure_releases_the_ranks_waiting_for_it():
    # Rank 1 raises and leaves; rank 0, waiting for it in a collective, fails on the closed
    # connection and reports too, long before the timeout (60 s here, 600 s in the pool's group).
    with pytest.raises(RankFailed, match="(?s)2 of 2 ranks failed.*rank 0 raised.*rank 1 raised.*planted failure"):
        run_ranks(_raise_while_rank_0_waits, 2, timeout=60)


def test_hang_fails_with_clear_message():
    # A warm pool first: the 5 s must not include starting the ranks (seconds on a loaded machine),
    # or rank 1 would be reported too.
    run_ranks(_sum_of_ranks, 2)
    pool = harness._POOLS[2]
    with pytest.raises(RankFailed, match=r"ranks \[0\] of 2 did not finish within 5 s"):
        run_ranks(_hang_on_rank_0, 2, timeout=5)
    # The raise itself shows the harness gave up instead of waiting: rank 0 returns once HANG_S is
    # out, and a harness that waited would have got its result. It killed that pool's ranks (SIGKILL,
    # not the orderly exit an idle pool gets), and the next call starts a new pool.
    assert [p.exitcode for p in pool.procs] == [-signal.SIGKILL] * 2
    assert 2 not in harness._POOLS
