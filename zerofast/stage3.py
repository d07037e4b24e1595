"""Stage 3: units, their hooks, and the gather/release lifecycle of their parameters.

A unit is a group of parameters gathered and released together. By default each child module of
the root that holds parameters (recursing through ModuleList / ModuleDict, so each transformer block
is one) is a unit, and the root's own remaining parameters form one more. A parameter shared by two
units (a tied embedding) belongs to the first; a module that holds it needs that unit as well.

[Note: stage 3 lifecycle]
Each unit's flat parameter buffer exists only while gathered: releasing resizes its storage to 0
bytes, gathering resizes it back and fills it (each rank copies in its own shard, then the gather
collective brings the rest). The model's parameters are views into these buffers, and so are the
tensors autograd saved in forward: they share the storage, so the re-gather before backward makes
them valid again without touching the graph.
  forward pre-hook of a module that needs units: acquire them (gather, or wait for the prefetch),
    then prefetch the units of the next module in the recorded forward order;
  forward post-hook: release them (when no enclosing module still needs them), and hook the
    module's outputs, so that backward reaching them acquires the units again (pre-backward) and
    prefetches the units of the module before it;
  backward through the module's inputs (an identity autograd function wrapped around them in the
    pre-hook): release them again (post-backward);
  end of backward (a callback queued on the autograd engine): release whatever is still gathered
    (the first module's inputs, token ids, need no gradient, so its post-backward never runs).
A unit's state is an enum, and the code switches on it. The order is recorded in the first step;
if a later step runs modules in another order, a wrong prefetch costs a gather, never correctness,
since every module acquires what it needs itself.
"""
from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.nn as nn


class UnitState(enum.Enum):
    SHARDED = "sharded"      # storage released; only this rank's shard exists (in the optimizer)
    GATHERING = "gathering"  # storage allocated, a gather collective in flight (a prefetch)
    GATHERED = "gathered"    # full parameters in place


def find_units(model: nn.Module, params: list[nn.Parameter],
               unit_modules: list[nn.Module] | None = None) -> tuple[list[list[int]], list[nn.Module]]:
    """Group the managed parameters (indices into `params`) into units, in module order.

    Returns (units, modules): units[k] lists the parameter indices of unit k; modules[k] is the module
    defining it, or the root for the last unit (the root's remaining parameters), if any.
    """
    index_of = {id(p): i for i, p in enumerate(params)}
    if unit_modules is None:
        unit_modules = list(_default_unit_modules(model))
    units, modules, claimed = [], [], set()
    for module in unit_modules:
        mine = [index_of[id(p)] for p in module.parameters() if id(p) in index_of and id(p) not in claimed]
        if mine:
            claimed.update(id(params[i]) for i in mine)
            units.append(mine)
            modules.append(module)
    rest = [i for i, p in enumerate(params) if id(p) not in claimed]
    if rest:
        units.append(rest)
        modules.append(model)
    return units, modules


def _default_unit_modules(module: nn.Module):
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _default_unit_modules(child)
        elif any(True for _ in child.parameters()):
            yield child


class _PostBackward(torch.autograd.Function):
    """Identity in forward; in backward, tells the unit tracker that the module's backward is done."""

    @staticmethod
    def forward(ctx, done: Callable[[], None], *inputs):
        ctx.done = done
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None,) + grads


class UnitTracker:
    """Drives the lifecycle of every unit: see [Note: stage 3 lifecycle].

    gather_start(u) / gather_wait(u) / release(u) are the engine's (ZeroAdam's) operations on unit u.
    """

    def __init__(self, model: nn.Module, needs: dict[nn.Module, tuple[int, ...]], num_units: int,
                 gather_start, gather_wait, release):
        self.model = model
        self.needs = needs                      # hooked module -> units it needs while it runs
        self.state = [UnitState.SHARDED] * num_units
        self.refs = [0] * num_units             # modules running (forward or backward) that need it
        self._gather_start, self._gather_wait, self._release = gather_start, gather_wait, release
        self.order: list[nn.Module] = []        # modules in forward order, recorded in the first step
        self._recording = True
        self._position: dict[nn.Module, int] = {}
        self._callback_queued = False
        self.peak_gathered = 0                  # most units gathered or gathering at once
        self.handles = []
        for module in needs:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))

    # --- unit operations ------------------------------------------------------------------------

    def acquire(self, units) -> None:
        for u in units:
            self.refs[u] += 1
            self._ensure_gathered(u)

    def release(self, units) -> None:
        for u in units:
            self.refs[u] = max(0, self.refs[u] - 1)
            if self.refs[u] == 0:
                self._release_unit(u)

    def prefetch(self, units) -> None:
        for u in units:
            if self.state[u] is UnitState.SHARDED:
                self._gather_start(u)
                self.state[u] = UnitState.GATHERING
                self._note_peak()

    def _ensure_gathered(self, u: int) -> None:
        if self.state[u] is UnitState.SHARDED:
            self._gather_start(u)
            self.state[u] = UnitState.GATHERING
            self._note_peak()
        if self.state[u] is UnitState.GATHERING:
            self._gather_wait(u)
            self.state[u] = UnitState.GATHERED

    def _release_unit(self, u: int) -> None:
        if self.state[u] is UnitState.GATHERING:
            self._gather_wait(u)  # a prefetch nobody used: finish it before freeing its buffer
        if self.state[u] is not UnitState.SHARDED:
            self._release(u)
            self.state[u] = UnitState.SHARDED

    def release_all(self) -> None:
        self.refs = [0] * len(self.refs)
        for u in range(len(self.state)):
            self._release_unit(u)

    def gather_all(self) -> None:
        self.acquire(range(len(self.state)))

    def _note_peak(self) -> None:
        live = sum(s is not UnitState.SHARDED for s in self.state)
        self.peak_gathered = max(self.peak_gathered, live)

    # --- hooks ----------------------------------------------------------------------------------

    def _neighbour(self, module: nn.Module, step: int) -> nn.Module | None:
        i = self._position.get(module)
        if i is None or not 0 <= i + step < len(self.order):
            return None
        return self.order[i + step]

    def _pre_forward(self, module, args):
        if module is self.model:
            if self.order:
                self._recording = False
        elif self._recording:
            self._position.setdefault(module, len(self.order))
            if self._position[module] == len(self.order):
                self.order.append(module)
        self.acquire(self.needs[module])
        nxt = self._neighbour(module, +1)
        if nxt is not None:
            self.prefetch(self.needs[nxt])
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._wrap_inputs(module, args)
        return None

    def _wrap_inputs(self, module, args):
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        wrapped = _PostBackward.apply(lambda: self.release(self.needs[module]), *(args[i] for i in positions))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        args = list(args)
        for i, t in zip(positions, wrapped):
            args[i] = t
        return tuple(args)

    def _post_forward(self, module, args, output):
        self.release(self.needs[module])
        if module is self.model:
            self.release_all()  # prefetches that no module claimed
        outputs = [t for t in output_tensors(output) if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads, m=module: self._pre_backward(m), mode="any")

    def _pre_backward(self, module) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.acquire(self.needs[module])
        prev = self._neighbour(module, -1)
        if prev is not None:
            self.prefetch(self.needs[prev])

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.release_all()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in output_tensors(item)]
    return []
