"""The full weights one tensor at a time (named_full_tensors): what an inference engine receiving
fresh weights after each step reads (vLLM's load_weights), with no rank ever holding the whole model.

Stage 3 gathers one unit at a time, hands out copies of the tensors it brings into existence, then
releases it; stages 1 and 2 copy their whole parameters. So a rank holds at most one gathered unit
plus the copy being handed over (if the receiver drops each before asking for the next). By default
the entries are model.state_dict()'s, bitwise (tied tensors under each name), grouped by unit;
another view (a PEFT model's merged weights or adapter: zerofast/integrations/peft_weights.py)
passes its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

from ..tensor_parallel import has_storage
from .entries import Entry, copy_of
from .extensions import weight_view


def state_dict_entries(model: nn.Module, gather_tp: bool = True) -> list[tuple[str, Entry]]:
    """model.state_dict()'s names, each handing out a copy of its tensor (a DTensor's whole, or with
    gather_tp=False this rank's local tensor)."""
    return [(name, copy_of(t, gather_tp)) for name, t in model.state_dict(keep_vars=True).items()]


def entries_for(model: nn.Module, peft: str | None, who: str, gather_tp: bool = True) -> list[tuple[str, Entry]]:
    """state_dict()'s entries (peft=None), or a view an integration registered ([Note: stage-3
    extension points] in extensions.py): PEFT's "merged" weights or "adapter". gather_tp=False
    (state_dict's entries only): each DTensor's local tensor, not gathered over "tp"."""
    if peft is None:
        return state_dict_entries(model, gather_tp)
    if not gather_tp:
        raise ValueError(f"{who}: gather_tp=False takes state_dict()'s entries (peft=None); got peft={peft!r}")
    return weight_view(peft, who)(model, who)


def _has_storage(t: torch.Tensor) -> bool:
    return has_storage(t)


def named_full_tensors(
    model: nn.Module, units=None, entries: list[tuple[str, Entry]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry (default: state_dict_entries(model)); `units`: stage 3's
    UnitTracker (None: the parameters are whole already). The gathers are collectives: every rank
    must run the iterator to its end."""
    pending = dict(entries if entries is not None else state_dict_entries(model))

    def present() -> Iterator[tuple[str, torch.Tensor]]:
        """The entries whose tensors all have storage now (stage 3: the gathered unit's)."""
        for name, entry in list(pending.items()):
            if all(_has_storage(t) for t in entry.needs):
                del pending[name]
                yield name, entry.make()

    if units is not None:
        for u in range(len(units.state)):
            units.acquire((u,))
            try:
                yield from present()
            finally:
                units.release((u,))
        # An entry made from tensors of several units (a LoRA layer split across units): those
        # units together, then released; every rank has the same entries, so the same gathers.
        for name in list(pending):
            if name not in pending:  # made while another entry's units were gathered
                continue
            together = sorted({u for m in pending[name].modules for u in units.schedule.needs.get(m, ())})
            if len(together) < 2:
                continue
            units.acquire(together)
            try:
                yield from present()
            finally:
                units.release(together)
    yield from present()  # buffers, and whatever no unit holds
    if pending:
        raise RuntimeError(f"named_full_tensors: never gathered whole: {sorted(pending)}")
