"""The torch releases zerofast supports, and every difference between them that Python sees, each named
by the release it serves (the compiled ones: csrc/torch_compat.h).

Supported: torch 2.11 to 2.14 (pyproject.toml); CI tests both ends (docs/testing.md). setup.py and
`import zerofast` both refuse another torch, naming the range and the torch found, so an unsupported
torch is a sentence, never a C++ compile error or a missing symbol. ZEROFAST_ANY_TORCH=1 lets it
through with a warning. No zerofast or torch import at module level: setup.py loads this file by
path, before torch is importable as a build dependency.
"""

from __future__ import annotations

import os
import re
import warnings

OLDEST = (2, 11)  # the GPU machine's torch (scripts/gpu_check.sh), and the oldest CI tests
NEWEST = (2, 14)  # the newest CI tests
SUPPORTED = f"torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"
OVERRIDE = "ZEROFAST_ANY_TORCH"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11))."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"zerofast: cannot read a torch release from version {version!r}")
    return int(match.group(1)), int(match.group(2))


def unsupported(version: str) -> str | None:
    """Why this torch is outside the supported range, or None when it is inside."""
    if OLDEST <= release(version) <= NEWEST:
        return None
    return (
        f"zerofast supports torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]} ({SUPPORTED}); "
        f"this is torch {version}. Install a supported torch (pip install '{SUPPORTED}'), or set "
        f"{OVERRIDE}=1 to try this one anyway"
    )


def check_torch(version: str, *, error=ImportError) -> None:
    """Raise `error` naming the supported range when `version` is outside it (a warning instead
    under ZEROFAST_ANY_TORCH=1)."""
    problem = unsupported(version)
    if problem is None:
        return
    if os.environ.get(OVERRIDE) == "1":
        warnings.warn(f"{problem.split('. ')[0]}; going on because {OVERRIDE}=1", stacklevel=3)
        return
    raise error(problem)


# --- process groups ---------------------------------------------------------------------------------

# Groups zerofast made per set of ranks, in this process (torch <= 2.13 only: see new_group).
_MADE: dict[tuple[int, ...], int] = {}


def new_group(ranks, **kwargs):
    """dist.new_group(ranks, use_local_synchronization=True, **kwargs), called by the group's ranks
    only: the one way zerofast makes a group.

    torch 2.11 to 2.13 name such a group by its ranks salted with the number of groups alive
    (distributed_c10d._hash_ranks_to_str: len(_world.pg_names)), so a group made after another was
    destroyed can get that one's name and its rendezvous reads stale addresses from the store (gloo:
    "Connection refused", or worse, the wrong peers). torch 2.14 salts with a count that only grows;
    so does this on the older releases: the groups of these ranks zerofast made in this process, the
    same on every member (each makes the same groups in the same order)."""
    import hashlib

    import torch
    import torch.distributed as dist

    ranks = sorted(int(r) for r in ranks)
    if release(torch.__version__) >= (2, 14):
        return dist.new_group(ranks, use_local_synchronization=True, **kwargs)
    from torch.distributed import distributed_c10d

    key = tuple(ranks)
    made = _MADE.get(key, 0)
    _MADE[key] = made + 1
    name = hashlib.sha1(f"{'_'.join(map(str, key))}_zerofast_{made}".encode(), usedforsecurity=False).hexdigest()
    torch_names = distributed_c10d._hash_ranks_to_str
    distributed_c10d._hash_ranks_to_str = lambda _ranks: name
    try:
        return dist.new_group(ranks, use_local_synchronization=True, **kwargs)
    finally:
        distributed_c10d._hash_ranks_to_str = torch_names


# --- torch.optim.Muon -------------------------------------------------------------------------------


def torch_muon_adjust_lr_fns() -> tuple[str | None, ...]:
    """The adjust_lr_fn values this torch's torch.optim.Muon accepts ("spectral_unclamped" from 2.14):
    which ones torch can be the oracle for, or take a state dict of (ZeroMuon computes them all)."""
    import torch

    return (None, "original", "match_rms_adamw") + (
        ("spectral_unclamped",) if release(torch.__version__) >= (2, 14) else ()
    )
