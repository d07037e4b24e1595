"""A PEFT model's weights as an inference engine wants them (peft_entries: the merged model or the adapter), for
the weight iterator (opt.named_full_tensors(peft=...), zerofast/stage3/weights.py). Imported only when peft= is
given; written against peft 0.21.2 (the Makefile's HF_DEPS): RELIES_ON below is checked at import.

[Note: merged weights unit by unit]
What TRL's vLLM sync sends for a PEFT model is the merged model, PeftModel.merge_and_unload()'s
state_dict(): every adapted layer's base weights plus its adapter's delta, under the names the model
has without PEFT. PEFT merges in place, into the base layer's parameters, and TRL under DeepSpeed
ZeRO-3 gathers the whole model to do so. Here nothing of the model is changed and no rank holds it:
  - names: PEFT's unloading replaces each tuner layer by its base layer and each modules-to-save
    wrapper by its active copy; the same replacements are made in the module tree for the length of
    one state_dict(keep_vars=True) call and undone, so the names are exactly the merged model's,
    mapped to the live tensors they come from;
  - values: an adapted layer's entries are made when its unit is gathered (its tensors have storage), by
    PEFT's own merge (the layer's merge(), as merge_and_unload calls it, whatever the variant: LoRA, DoRA)
    run onto copies of the base layer's parameters, swapped in for the call and swapped back; so the values
    are bitwise PEFT's, and a rank holds one unit plus one layer's merged copies. A layer whose tensors lie
    in several units is made with those units gathered together (stage 3's units= can split it).
The adapter alone is get_peft_model_state_dict(model): PEFT's own choice of entries and names, read
from the live tensors.
"""

from __future__ import annotations

import peft as peft_module
import torch
import torch.nn as nn
from peft import PeftModel, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

from ..stage3.entries import Entry, copy_of
from ..stage3.extensions import register_weight_view
from . import hosts


def peft_entries(model: nn.Module, peft: str, who: str) -> list[tuple[str, Entry]]:
    """The entries of `model` (a PeftModel) for peft="merged" or "adapter"."""
    if not isinstance(model, PeftModel):
        raise ValueError(f"{who}: peft={peft!r} needs a peft.PeftModel; the model is a {type(model).__name__}")
    if peft == "adapter":
        live = model.state_dict(keep_vars=True)
        return [(n, copy_of(t)) for n, t in get_peft_model_state_dict(model, live, model.active_adapter).items()]
    return _merged_entries(model.get_base_model(), who)


def _merged_entries(root: nn.Module, who: str) -> list[tuple[str, Entry]]:
    """merge_and_unload().state_dict()'s names and values: [Note: merged weights unit by unit]."""
    replaced, merges = [], {}
    try:
        for name, target in _unloaded(root):
            parent_name, _, child = name.rpartition(".")
            parent = root.get_submodule(parent_name)
            if isinstance(target, ModulesToSaveWrapper):
                active = target.modules_to_save[target.active_adapter] if target.active_adapters else None
                substitute = active if active is not None else target.original_module
            elif isinstance(target, AuxiliaryTrainingWrapper) or not hasattr(target, "base_layer"):
                raise NotImplementedError(
                    f"{who}: peft='merged' merges LoRA-style layers and modules_to_save; {name!r} is "
                    f"PEFT's {type(target).__name__} (use peft='adapter', or PEFT's merge_and_unload)"
                )
            else:
                substitute = target
            if hasattr(substitute, "base_layer"):  # a tuner layer: its base layer, merged
                merge = _Merge(substitute)
                for p in merge.base._parameters.values():
                    if p is not None:
                        merges[id(p)] = merge
                substitute = merge.base
            replaced.append((parent, child, parent._modules[child]))
            parent._modules[child] = substitute
        live = root.state_dict(keep_vars=True)
    finally:
        for parent, child, original in reversed(replaced):
            parent._modules[child] = original
    return [(n, merges[id(t)].entry(n, t) if id(t) in merges else copy_of(t)) for n, t in live.items()]


def _unloaded(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules PEFT's unloading replaces (tuner layers, training wrappers), by name."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            found.append((name, module))
    return found


class _Merge:
    """One tuner layer's merged base parameters: PEFT's merge on copies when first asked for, each handed out once."""

    def __init__(self, layer: BaseTunerLayer):
        self.layer = layer
        self.base = layer.get_base_layer()
        self._made: dict[str, torch.Tensor] | None = None
        self._wanted: dict[str, int] = {}  # base parameter -> names still to hand it out under (tied: several)

    def entry(self, name: str, t: torch.Tensor) -> Entry:
        key = next(k for k, p in self.base._parameters.items() if p is t)
        self._wanted[key] = self._wanted.get(key, 0) + 1
        return Entry(tuple(self.layer.parameters()), lambda: self._take(key), tuple(self.layer.modules()))

    def _take(self, key: str) -> torch.Tensor:
        if self._made is None:
            self._made = self._merged()
        self._wanted[key] -= 1
        return self._made.pop(key) if self._wanted[key] == 0 else self._made[key].clone()

    def _merged(self) -> dict[str, torch.Tensor]:
        """PEFT's merge() onto copies of the base parameters, with the layer's merge record and
        caches (DoRA's weight norms) put back: the model ends as it began."""
        layer, base = self.layer, self.base
        originals = dict(base._parameters)
        merged_before = list(layer.merged_adapters)
        caches = getattr(layer, "_caches", None)
        caches_before = dict(caches) if caches is not None else None
        try:
            for key, p in originals.items():
                if p is not None:
                    base._parameters[key] = nn.Parameter(p.detach().clone(), requires_grad=False)
            with torch.no_grad():
                layer.merge(safe_merge=False, adapter_names=None)  # as merge_and_unload() calls it
            return {key: base._parameters[key].detach() for key, p in originals.items() if p is not None}
        finally:
            base._parameters.update(originals)
            layer.merged_adapters[:] = merged_before
            if caches is not None:
                caches.clear()
                caches.update(caches_before)


RELIES_ON = hosts.Reliance(
    "zerofast.integrations.peft_weights",
    extra="hf",
    pins=(hosts.Pin("peft", tested="0.21.2", supported=">=0.21.2,<0.22"),),
    entries=(
        hosts.Reads(BaseTunerLayer, ("merge", "get_base_layer", "merged_adapters")),
        hosts.Reads(ModulesToSaveWrapper, ("active_adapter", "active_adapters")),
        hosts.Reads(PeftModel, ("get_base_model", "active_adapters")),
        hosts.Calls(BaseTunerLayer, "merge", 0, ("safe_merge", "adapter_names")),
        hosts.Calls(peft_module, "get_peft_model_state_dict", 3),
    ),
)
hosts.check(RELIES_ON)
# named_full_tensors(peft="merged" | "adapter"): [Note: stage-3 extension points] in zerofast/stage3/extensions.py.
register_weight_view("merged", lambda model, who: peft_entries(model, "merged", who))
register_weight_view("adapter", lambda model, who: peft_entries(model, "adapter", who))
