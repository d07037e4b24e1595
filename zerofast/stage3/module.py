"""ShardedModule, the one model-side handle behind ZeroAdam (any stage) and shard_frozen(): the whole
model for a block (gathered_params()), whole tensors one unit at a time (named_full_tensors(),
full_state_dict()), the gathers a forward costs, and taking the hooks off. It holds the model, stage
3's UnitTracker (None at stages 1 and 2: every parameter whole) and the hooks; the front says what
"at rest" means (`settle`: ZeroAdam waits for its step's gathers in flight and releases every unit;
a model sharded for inference only just releases).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from ..tensor_parallel import has_storage, is_dtensor, replicated, whole_copy
from . import weights
from .runtime import UnitTracker


class ShardedModule:
    """A model's stage-3 units (or its whole parameters), its hooks, and the reads of it whole."""

    def __init__(
        self,
        model: nn.Module,
        units: UnitTracker | None,
        hooks: list,
        settle: Callable[[], None] | None = None,
        before_block: Callable[[], None] | None = None,
    ):
        """units: stage 3's tracker (None: the parameters are whole); hooks: handles on the model
        that remove_hooks() removes; settle: brings the model to rest before whole tensors are read
        (default: release every unit); before_block: runs before gathered_params() (ZeroAdam: its
        step's gathers in flight finish)."""
        self.model, self.units, self.hooks = model, units, hooks
        self._settle = settle if settle is not None else self._release_all
        self._before_block = before_block

    def _release_all(self) -> None:
        if self.units is not None:
            self.units.release_all()

    @contextlib.contextmanager
    def gathered_params(self, gather_tp: bool = False) -> Iterator[nn.Module]:
        """Every parameter whole on every rank inside the block. Stage 3 pins every unit: gathered on
        entry (a collective: every rank enters), kept through any number of forwards inside with no
        collective (ranks may run different numbers of them), released on exit, keeping what was
        written inside: [Note: generation on stage 3] in zerofast/stage3/schedule.py. With tensor
        parallelism the parameters stay DTensors on "tp" (each rank's part whole across the
        data-parallel ranks); gather_tp=True makes them whole across "tp" too, read-only
        (zerofast/tensor_parallel.py replicated(): every rank of the mesh enters)."""
        _check_flag("gathered_params", gather_tp)
        if self._before_block is not None:
            self._before_block()
        with contextlib.ExitStack() as stack:
            if self.units is not None:
                self.units.pin()
                stack.callback(self.units.unpin)
            if gather_tp:
                stack.enter_context(replicated(self.model))
            yield self.model

    def named_full_tensors(self, peft: str | None = None, gather_tp: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every state_dict() entry (or another registered view: a PEFT model's merged weights or
        adapter) whole, one unit gathered at a time (zerofast/stage3/weights.py). Every rank runs it
        to its end (the gathers are collectives). gather_tp=False: each DTensor as this rank holds it
        (its local tensor, whole across the data-parallel ranks)."""
        _check_flag("named_full_tensors", gather_tp)
        entries = weights.entries_for(self.model, peft, "named_full_tensors", gather_tp)
        self._settle()
        return weights.named_full_tensors(self.model, self.units, entries)

    def full_state_dict(self, keep: bool = True, device="cpu") -> dict[str, torch.Tensor] | None:
        """model.state_dict() with every tensor whole, copied to `device`; stage 3 gathers one unit at
        a time. Every rank calls it (the gathers are collectives); keep=False copies nothing (None).
        Tied tensors keep one copy under each of their names."""
        self._settle()
        entries = self.model.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # a tied tensor is copied once

        def take_present() -> None:
            """Copy every entry with storage now (stage 3: the unit gathered at the moment)."""
            for key, t in entries.items():
                if key not in out and has_storage(t):
                    # A DTensor is gathered on every rank alike, once (its "tp" ranks take part in it).
                    if id(t) not in copies and (keep or is_dtensor(t)):
                        whole = whole_copy(t).to(device) if is_dtensor(t) else t.detach().to(device, copy=True)
                        copies[id(t)] = whole if keep else None
                    out[key] = copies.get(id(t))

        units = self.units
        for u in range(len(units.state)) if units is not None else ():
            units.acquire((u,))
            try:
                take_present()
            finally:
                units.release((u,))
        take_present()
        return out if keep else None

    @property
    def unit_gathers(self) -> int:
        """Unit gathers started since it was sharded (0 without stage 3)."""
        return self.units.gathers if self.units is not None else 0

    def remove_hooks(self) -> None:
        """Take every hook this handle put on the model off it."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.units is not None:
            self.units.remove()


def _check_flag(who: str, gather_tp) -> None:
    if not isinstance(gather_tp, bool):
        raise TypeError(f"{who}: gather_tp must be True or False; got {gather_tp!r}")
