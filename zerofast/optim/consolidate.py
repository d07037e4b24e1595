"""The whole model out of its shards, for reading outside training: opt.gathered_params() and
opt.full_state_dict(). Stages 1 and 2 hold every parameter whole on every rank (after the step's
gathers); stage 3 gathers units, one at a time where it can, and releases them again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..stage3 import weights
from .builder import Parts


@contextlib.contextmanager
def gathered(parts: Parts) -> Iterator[None]:
    """Every parameter whole on every rank inside the block. Stage 3 pins every unit: gathered on
    entry, kept through any forwards inside with no collective, released on exit (changes made
    inside are not kept): [Note: generation on stage 3] in zerofast/stage3/schedule.py."""
    parts.gather.wait()
    if parts.units is None:
        yield
        return
    parts.units.pin()
    try:
        yield
    finally:
        parts.units.unpin()


def named_full_tensors(parts: Parts, peft: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state_dict() entry (or a PEFT model's merged weights or adapter) whole, one unit
    gathered at a time (zerofast/stage3/weights.py)."""
    entries = weights.entries_for(parts.model, peft, "named_full_tensors")
    parts.quiesce()
    return weights.named_full_tensors(parts.model, parts.units, entries)


def full_state_dict(parts: Parts, keep: bool, device) -> dict[str, torch.Tensor] | None:
    """model.state_dict() with every tensor whole, copied to `device`; stage 3 gathers one unit at a
    time. Every rank calls it (the gathers are collectives); keep=False copies nothing (None)."""
    parts.quiesce()
    entries = parts.model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}  # a tied tensor is copied once

    def take_present() -> None:
        """Copy every entry whose storage exists now (stage 3: the unit gathered at the moment)."""
        for key, t in entries.items():
            if key not in out and (t.numel() == 0 or t.untyped_storage().nbytes() > 0):
                if keep and id(t) not in copies:
                    copies[id(t)] = t.detach().to(device, copy=True)
                out[key] = copies.get(id(t))

    units = parts.units
    for u in range(len(units.state)) if units is not None else ():
        units.acquire((u,))
        try:
            take_present()
        finally:
            units.release((u,))
    take_present()
    return out if keep else None
