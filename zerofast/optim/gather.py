"""Phase 4 of stages 1 and 2: after the update, each bucket's parameters are gathered (all_gather
for "flat", broadcast from each owner otherwise) straight into the flat parameter buffers the
model's parameters are views of, buckets in forward order.

[Note: overlapped parameter gather]
As Megatron-LM's overlap_param_gather: step() starts the gathers (the last bucket first, since it
holds the first layers) and returns; a forward pre-hook on every module that holds managed
parameters directly waits for their buckets, so the gather of later layers runs while earlier
layers compute. The contract: a parameter is read only inside the forward of a module that holds it
(module.parameters(recurse=False)). A parameter read elsewhere (in a loss function, say) may be read
while its gather is still in flight; that is caught when its gradient arrives, as an error naming
it, when the parameter's bucket has not been waited for by then (zerofast/optim/grads.py). The check is
best-effort: if another module of the same bucket ran its pre-hook in between, the flag is cleared
and the early read goes unnoticed. opt.gathered_params() (and the next step()) wait for everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from .._hook_classes import own_classes, restore_classes
from ..comm import BucketComm
from ..layout import Layout


class ParamGather:
    def __init__(self, comm: BucketComm, layout: Layout, param_buffers: list[torch.Tensor]):
        self.comm, self.layout, self.param_buffers = comm, layout, param_buffers
        self.pending = [False] * len(layout.buckets)  # per bucket: a gather started, not yet waited for

    def start(self) -> None:
        for b in reversed(range(len(self.pending))):  # forward order: first layers first
            self.comm.gather_start(b, self.param_buffers[b])
            self.pending[b] = True

    def wait(self, buckets: Iterable[int] | None = None) -> None:
        for b in range(len(self.pending)) if buckets is None else buckets:
            if self.pending[b]:
                self.comm.gather_wait(b)
                self.pending[b] = False

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
    """The pre-hook of one module: wait for its buckets' gathers (`wait`: ParamGather.wait, run
    eagerly under torch.compile)."""

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
