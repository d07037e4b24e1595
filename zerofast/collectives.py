"""Which collectives run, in one pure-Python module that the compiled engine's face
(zerofast/comm.py) and the estimator (zerofast/estimate/traffic.py) both read: the per-backend
choice of a layout's reduce and gather, and whether every collective is checked first
(ZEROFAST_DEBUG, where CommPolicy.check_collectives leaves it None).
"""

from __future__ import annotations

import os

__all__ = ["collective_names", "debug_from_env"]


def collective_names(backend: str, flat: bool) -> tuple[str, str]:
    """The (reduce, gather) collectives of a layout on a backend, by name: the one place that
    chooses them (zerofast/comm.py maps them onto the compiled engine's; the estimator counts them).
    Owner layouts reduce to and broadcast from each owner. The flat layout uses NCCL's ring-optimal
    reduce_scatter and all_gather, and on gloo all_reduce and broadcasts, which gloo runs faster
    with the same result ([Note: collectives per backend] in csrc/buckets.cpp)."""
    if not flat:
        return "reduce", "broadcast"
    return ("all_reduce", "broadcast") if backend == "gloo" else ("reduce_scatter", "all_gather")


def debug_from_env() -> bool:
    """ZEROFAST_DEBUG=1 turns check_collectives on where CommPolicy leaves it None."""
    return os.environ.get("ZEROFAST_DEBUG", "0") not in ("", "0")
