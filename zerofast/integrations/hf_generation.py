"""Hugging Face's generate() on a stage-3 model: synced_gpus chosen for the ranks, so that ranks that
stop generating at different steps never hang ([Note: generation on stage 3] in zerofast/stage3/schedule.py).

Written against transformers 5.24.0 (the Makefile's HF_DEPS). generate() decides synced_gpus in one place,
GenerationMixin._extract_generation_mode_kwargs (True for DeepSpeed ZeRO-3 and FSDP when not passed). Importing
this module wraps it once (importing zerofast alone patches nothing; ZeroTrainer's and TRL's integrations import
it): synced_gpus_for decides for the models stage 3 has sharded, which attach registers as a model host
([Note: stage-3 extension points] in zerofast/stage3/extensions.py); every other model's call passes unchanged.
The signature is checked at import, so a transformers that moved it fails here, loudly, not by hanging in a gather.
"""

from __future__ import annotations

import inspect
import weakref

import torch.nn as nn
import transformers
from transformers.generation.utils import GenerationMixin

from ..errors import GenerationSyncError
from ..stage3.extensions import register_model_host

WRITTEN_AGAINST = "5.24.0"
_HOOKED = "_extract_generation_mode_kwargs"
_EXPECTED = ("self", "custom_generate", "kwargs", "synced_gpus", "assistant_model", "streamer")


def _check_host() -> None:
    method = getattr(GenerationMixin, _HOOKED, None)
    found = tuple(inspect.signature(method).parameters) if method is not None else None
    if found != _EXPECTED:
        raise ImportError(
            f"zerofast's generate() hook needs transformers' GenerationMixin.{_HOOKED}{_EXPECTED} "
            f"(transformers {WRITTEN_AGAINST}); transformers {transformers.__version__} has {found=}. "
            f"Install transformers=={WRITTEN_AGAINST}"
        )


_check_host()
_ORIGINAL = getattr(GenerationMixin, _HOOKED)
_TRACKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its UnitTracker


def synced_gpus_for(module: nn.Module, synced_gpus: bool | None) -> bool | None:
    """What generate() on `module` runs with, given what the caller passed (None: nothing)."""
    tracker = _TRACKERS.get(module)
    if tracker is None or tracker.gather_world == 1:
        return synced_gpus
    if tracker.pinned:  # every unit gathered: no collective per token, so none to sync
        return False if synced_gpus is None else synced_gpus
    if synced_gpus is None:
        return True
    if not synced_gpus:
        raise GenerationSyncError(
            f"generate(synced_gpus={synced_gpus!r}) on a ZeRO stage-3 model across "
            f"{tracker.gather_world} ranks: each forward gathers the parameters with every rank, so "
            "a rank that stops generating first would leave the others waiting. Leave synced_gpus "
            "unset (zerofast sets it to True) or pass synced_gpus=True, or generate inside "
            "`with opt.gathered_params():` (the whole model gathered, no collective per token)"
        )
    return synced_gpus


def _extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
    synced = synced_gpus_for(self, synced_gpus)
    return _ORIGINAL(self, custom_generate, kwargs, synced, assistant_model, streamer)


setattr(GenerationMixin, _HOOKED, _extract_generation_mode_kwargs)


class _Registration:
    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)

    @property
    def module(self) -> nn.Module | None:
        return self._module()

    def detach(self) -> None:
        module = self._module()
        if module is not None:
            _TRACKERS.pop(module, None)


def attach(model: nn.Module, tracker) -> list[_Registration]:
    """Register every generating module in `model` (a PEFT model's inner model too) with the
    stage-3 tracker that gathers its parameters; detach() each to undo."""
    hosts = []
    for module in model.modules():
        if isinstance(module, GenerationMixin):
            _TRACKERS[module] = tracker
            hosts.append(_Registration(module))
    return hosts


# Every stage-3 model, sharded before this import or after: [Note: stage-3 extension points].
register_model_host(attach)
