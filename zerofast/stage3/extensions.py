"""What integrations add to stage 3, registered by them: the core names none of them.

[Note: stage-3 extension points]
Two things about a model that only its library knows:
  - Model hosts: a library whose models run forwards of their own (Hugging Face's generate(): many
    forwards, a different number per rank) registers a host, attach(model, tracker) -> handles: for
    every module tree stage 3 shards (ZeroAdam(stage=3), shard_frozen), the host claims the modules
    it serves, e.g. makes generate() sync the ranks ([Note: generation on stage 3] in schedule.py),
    and returns one handle per claimed module (its `module`, and detach() to undo). A host
    registered after a model was sharded is attached to it at once.
  - Weight views: named_full_tensors(peft=...)'s other views of a model (a PEFT model's merged
    weights, its adapter), registered by name as entries(model, who) -> [(name, Entry)].
Importing zerofast registers nothing and patches nothing in another library: the user asks for an
integration by importing it (zerofast.integrations.hf_generation, .peft_weights; the trainers'
integrations import what they need).

A module with a generate() method that no host claims is guarded instead: generate() on it unit by
unit, across ranks, raises at once and names what to do (import the library's integration, or
generate inside gathered_params()), rather than leaving a rank that stops early waiting in a gather;
unless the call itself keeps the ranks' forwards matched: Hugging Face's generate(synced_gpus=True)
(transformers' own way for ZeRO-3) runs forwards on every rank until all have finished.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch.nn as nn

__all__ = ["ModelHost", "register_model_host", "register_weight_view", "weight_view", "attach_hosts", "detach_hosts"]


class Handle(Protocol):
    module: nn.Module  # the module the host claimed

    def detach(self) -> None: ...


ModelHost = Callable[[nn.Module, object], list]  # (model, tracker) -> [Handle]

_HOSTS: list[ModelHost] = []
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # live UnitTracker -> its handles
_VIEWS: dict[str, Callable] = {}


def register_model_host(host: ModelHost) -> None:
    """Add a model host (see the note); it is attached to every model stage 3 shards from now on, and
    to those sharded already. Registering the same host twice is a no-op."""
    if host in _HOSTS:
        return
    _HOSTS.append(host)
    for tracker, handles in list(_ATTACHED.items()):
        added = host(tracker.model, tracker)
        served = _served(tracker.model, added)
        for guard in [h for h in handles if isinstance(h, _GuardedGenerate) and id(h.module) in served]:
            guard.detach()
            handles.remove(guard)
        handles += added


def register_weight_view(name: str, entries: Callable) -> None:
    """named_full_tensors(peft=name) hands out entries(model, who)."""
    _VIEWS[name] = entries


def weight_view(name: str, who: str) -> Callable:
    """The entries function registered for `name`, or a named error that says who registers it."""
    if name not in _VIEWS:
        known = ", ".join(repr(n) for n in sorted(_VIEWS)) or "none registered"
        raise ValueError(
            f"{who}: peft={name!r} is not a registered weight view ({known}); PEFT's 'merged' and "
            f"'adapter' views are registered by `import zerofast.integrations.peft_weights`"
        )
    return _VIEWS[name]


def attach_hosts(model: nn.Module, tracker) -> None:
    """Every registered host attached to a model stage 3 has just sharded (its UnitTracker); modules
    with a generate() that no host serves get the guard."""
    handles = [h for host in _HOSTS for h in host(model, tracker)]
    served = _served(model, handles)
    _ATTACHED[tracker] = handles + [
        _GuardedGenerate(m, tracker)
        for m in model.modules()
        if id(m) not in served and "generate" not in m.__dict__ and callable(getattr(m, "generate", None))
    ]


def detach_hosts(tracker) -> None:
    """Undo attach_hosts (the tracker's hooks are being removed)."""
    for h in _ATTACHED.pop(tracker, []):
        h.detach()


def _served(model: nn.Module, handles: list) -> set[int]:
    """The modules a host claimed and every module around one of them: a wrapper's generate() (PEFT's)
    reaches its inner model's, which the host serves."""
    claimed = {id(h.module) for h in handles}
    return {id(m) for m in model.modules() if any(id(d) in claimed for d in m.modules())}


class _GuardedGenerate:
    """generate() on a module no host claims: called unit by unit across ranks, raise at once."""

    def __init__(self, module: nn.Module, tracker):
        self.module = module
        self._tracker = weakref.ref(tracker)
        self._generate = module.generate  # the class's, bound
        module.__dict__["generate"] = self

    def __call__(self, *args, **kwargs):
        tracker = self._tracker()
        synced = kwargs.get("synced_gpus") is True  # the ranks' forwards kept matched by the call itself
        if tracker is not None and tracker.gather_world > 1 and not tracker.pinned and not synced:
            raise RuntimeError(
                f"{type(self.module).__name__}.generate() on a ZeRO stage-3 model across {tracker.gather_world} "
                "ranks: each forward gathers parameters with every rank, so a rank that stops generating "
                "first would leave the others waiting, and no integration makes this generate() sync "
                "the ranks. For a Hugging Face model, pass synced_gpus=True or `import "
                "zerofast.integrations.hf_generation` (it sets synced_gpus); or generate inside "
                "`with opt.gathered_params():` (no collective per token)"
            )
        return self._generate(*args, **kwargs)

    def detach(self) -> None:
        if self.module.__dict__.get("generate") is self:
            del self.module.__dict__["generate"]
