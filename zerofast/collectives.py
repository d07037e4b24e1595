"""Which collectives run, pure Python so that comm.py and the estimator (estimate/traffic.py) read
the same choice: a layout's reduce and gather per backend, and ZEROFAST_DEBUG's collective check."""

from __future__ import annotations

import os

__all__ = ["collective_names", "debug_from_env"]


def collective_names(backend: str, flat: bool) -> tuple[str, str]:
    """The (reduce, gather) collective names of a layout on a backend. Owner layouts reduce to and
    broadcast from each owner; flat uses NCCL's ring-optimal reduce_scatter and all_gather, and on
    gloo all_reduce and broadcasts, faster there with the same result ([Note: collectives per
    backend] in csrc/buckets.cpp)."""
    if not flat:
        return "reduce", "broadcast"
    return ("all_reduce", "broadcast") if backend == "gloo" else ("reduce_scatter", "all_gather")


def debug_from_env() -> bool:
    """ZEROFAST_DEBUG=1 turns check_collectives on where CommPolicy leaves it None."""
    return os.environ.get("ZEROFAST_DEBUG", "0") not in ("", "0")
