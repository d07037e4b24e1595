"""The full weights, one tensor at a time: what an inference engine that receives fresh weights
after each step (vLLM's load_weights) reads, without any rank ever holding the whole model.

Stage 3 gathers one unit at a time and hands out copies of the tensors that unit brings into
existence, then releases it; stages 1 and 2 hold the full parameters and hand out copies of them.
So a rank holds at most one gathered unit plus the copy being handed over (if the receiver drops
each before asking for the next). The names and order are model.state_dict()'s (tied tensors under
each of their names), grouped by unit; the tensors are bitwise those state_dict() holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn


def named_full_tensors(model: nn.Module, units=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of model.state_dict(); `units`: stage 3's UnitTracker
    (None: the parameters are whole already). The gathers are collectives: every rank must run the
    iterator to its end."""
    entries = model.state_dict(keep_vars=True)
    handed: set[str] = set()

    def present() -> Iterator[tuple[str, torch.Tensor]]:
        """The entries whose storage exists now (stage 3: those of the unit gathered now)."""
        for name, t in entries.items():
            if name not in handed and (t.numel() == 0 or t.untyped_storage().nbytes() > 0):
                handed.add(name)
                yield name, t.detach().clone()

    if units is not None:
        for u in range(len(units.state)):
            units.acquire((u,))
            try:
                yield from present()
            finally:
                units.release((u,))
    yield from present()  # buffers, and whatever no unit holds
