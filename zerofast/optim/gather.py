"""ParamGather: phase 4 of stages 1 and 2. After the update each bucket's parameters are gathered
(all_gather for "flat", broadcast from each owner otherwise) into the flat parameter buffers the
model's parameters view, buckets in forward order.

[Note: overlapped parameter gather]
As Megatron-LM's overlap_param_gather: step() starts the gathers (the last bucket first: it holds the
first layers) and returns; a forward pre-hook on every module holding managed parameters directly
waits for their buckets, so later layers' gathers run while earlier layers compute. A parameter used
anywhere else (in a loss function, say; written between steps) is in its guarded class while its
gather is in flight (ParamState.GATHERING in zerofast/guard/params.py): any call on it waits for its
bucket first, so it reads the updated values and a write is not overwritten. What escapes that (a
read inside compiled code that holds the parameter from before) is caught, best-effort, when its
gradient arrives before its bucket was waited for: an error naming it (grads.py); if another module
of the same bucket ran its pre-hook in between, the flag is cleared. opt.gathered_params() (and the
next step()) wait for everything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from .._hook_classes import own_classes, restore_classes
from ..comm import BucketComm
from ..guard.params import ParamSlot, ParamState
from ..layout import Layout


class ParamGather:
    def __init__(self, comm: BucketComm, layout: Layout, param_buffers: list[torch.Tensor]):
        self.comm, self.layout, self.param_buffers = comm, layout, param_buffers
        self.pending = [False] * len(layout.buckets)  # per bucket: a gather started, not yet waited for
        self._slots: list[list[ParamSlot]] = [[] for _ in layout.buckets]  # guard_in_flight()'s, per bucket

    def guard_in_flight(self, slots: list[ParamSlot]) -> None:
        """With the overlapped gather: a bucket's parameters are GATHERING while its gather is in
        flight, so a call on one outside its module's forward waits for it instead of racing it."""
        for slot in slots:
            b = self.layout.slots[slot.index].bucket
            self._slots[b].append(slot)
            slot.wait = functools.partial(self.wait, (b,))

    def start(self) -> None:
        for b in reversed(range(len(self.pending))):  # forward order: first layers first
            self.comm.gather_start(b, self.param_buffers[b])
            self.pending[b] = True
            for slot in self._slots[b]:
                slot.set_state(ParamState.GATHERING)

    def wait(self, buckets: Iterable[int] | None = None) -> None:
        for b in range(len(self.pending)) if buckets is None else buckets:
            if self.pending[b]:
                self.comm.gather_wait(b)
                self.pending[b] = False
                for slot in self._slots[b]:
                    slot.set_state(ParamState.WHOLE)

    def register_waits(self, model: nn.Module, params: list[nn.Parameter]) -> list:
        """A forward pre-hook per module holding managed parameters directly, waiting for their
        buckets: see [Note: overlapped parameter gather]."""
        index_of = {id(p): i for i, p in enumerate(params)}
        # A wait on a collective runs eagerly under torch.compile (Dynamo breaks the graph at it).
        # Disabled here, not where defined: torch.compiler.disable imports Dynamo (see UnitTracker).
        wait = torch.compiler.disable(self.wait)
        handles, hooked = [], []
        for module in model.modules():
            buckets = sorted(
                {
                    self.layout.slots[index_of[id(p)]].bucket
                    for p in module.parameters(recurse=False)
                    if id(p) in index_of
                }
            )
            if buckets:
                handles.append(module.register_forward_pre_hook(_WaitFor(wait, tuple(buckets))))
                hooked.append(module)
        # Code compiled before these hooks existed must not skip them: see zerofast/_hook_classes.py.
        handles.append(_ClassesBack(own_classes(hooked)))
        return handles


class _WaitFor:
    """One module's pre-hook: wait for its buckets' gathers (ParamGather.wait, eager under torch.compile)."""

    def __init__(self, wait: Callable[[Iterable[int]], None], buckets: tuple[int, ...]):
        self.wait, self.buckets = wait, buckets

    def __call__(self, module, args) -> None:
        self.wait(self.buckets)


class _ClassesBack:
    """A hook handle whose remove() puts the hooked modules back in their own classes."""

    def __init__(self, originals: dict[nn.Module, type]):
        self.originals = originals

    def remove(self) -> None:
        restore_classes(self.originals)
        self.originals = {}
