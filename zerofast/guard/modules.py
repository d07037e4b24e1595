"""The module side of [Note: the model stays a torch model] (zerofast/guard/__init__.py): ModuleGuard,
the mixin of the class every module holding a managed parameter (and the root) is moved to
(zerofast/_hook_classes.py's own_classes: the same subclass as stage 3's hooks).
  - _apply (model.to(), .cpu(), .cuda(), .float(), .half(), .double(), .bfloat16(), .type(),
    share_memory(), to_empty()): check_conversion tries the conversion once on a tiny tensor of each
    managed parameter's dtype, device and rank, before anything changes. If it changes none of them
    (a move to where the model is: "cpu:0" for a CPU model, "cuda" for one on the current device; a
    cast to the dtype it has), the managed parameters stay as they are and the rest is converted as
    torch does; otherwise ModelConversionError, with nothing converted.
  - _save_to_state_dict: at stage 3 outside gathered_params(), state_dict() holds ParamViews
    (params.py): the plain model's keys, shapes and dtypes (what PEFT and others read it for), and
    saving it or reading a value raises ShardedParameterError, naming opt.full_state_dict() and
    zerofast.checkpoint; inside gathered_params(), whole copies (they outlive the block).
    keep_vars=True gives the parameters themselves, as torch does.
  - load_state_dict(assign=True), torch.__future__'s swap_module_params_on_conversion, and a managed
    parameter replaced by another object (module.weight = nn.Parameter(...)): ModelConversionError.
  - DistributedDataParallel(model): ModelConversionError ([Note: DDP over a managed model]).
    load_state_dict itself copies into each parameter (params.py takes the copy at stage 3; at
    stages 1 and 2 the parameter is its buffer's view and the master follows).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ModelConversionError
from .params import ParamState, conversion_message, same_device, slot_of

__all__ = ["ModuleGuard", "holders"]

_APPLYING = [0]  # depth of _apply calls: the outermost checks the whole tree once


class ModuleGuard:
    """What the moved classes add (see the module's docstring); all else is the module's own class's."""

    def _apply(self, fn, recurse=True):
        if _APPLYING[0] == 0:
            check_conversion(self, fn)
        managed = [k for k, p in self._parameters.items() if p is not None and slot_of(p) is not None]
        _APPLYING[0] += 1
        try:
            if not managed:
                return super()._apply(fn, recurse)
            kept = self._parameters
            self._parameters = {k: (None if k in managed else p) for k, p in kept.items()}
            try:
                return super()._apply(fn, recurse)
            finally:  # the managed ones back, the others as converted (torch may have replaced them)
                self._parameters = {k: (kept[k] if k in managed else p) for k, p in self._parameters.items()}
        finally:
            _APPLYING[0] -= 1

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for key, p in self._parameters.items():
            slot = slot_of(p) if p is not None else None
            if slot is not None and slot.shards is not None and slot.state is ParamState.WHOLE:
                # Gathered now (gathered_params()), released after the block: a copy outlives it.
                destination[prefix + key] = destination[prefix + key].clone()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign or torch.__future__.get_swap_module_params_on_conversion():
            how = (
                "load_state_dict(assign=True)"
                if assign
                else "load_state_dict under torch.__future__.set_swap_module_params_on_conversion(True)"
            )
            managed = next((slot_of(p) for p in self.parameters() if slot_of(p) is not None), None)
            if managed is not None:
                raise ModelConversionError(
                    f"{how} would replace the model's parameters ({managed.name} first), which {managed.who} "
                    "manages as views of its buffers: the optimizer would go on training the old ones. Load with "
                    "assign=False (the default: each value is copied into its parameter, which the optimizer "
                    "follows)"
                )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """[Note: DDP over a managed model]
        torch's DistributedDataParallel would reduce the gradients of a model ZeroAdam already
        reduces (stages 1 and 2: each gradient averaged twice, the two reduces racing on the same
        buffers; stage 3: its constructor reads the released parameters). Its constructor reads this
        attribute of the module it wraps first (`hasattr`, torch 2.11-2.14), before it touches a
        parameter: here that read, and only from DDP's constructor, is a ModelConversionError naming
        what serves the framework instead. Anyone else finds no attribute, or the one they set (DDP's
        own _set_params_and_buffers_to_ignore_for_model). A DDP over a wrapper module that holds the
        model as a child (Lightning wraps its module so) reaches no guarded root: not detected."""
        if sys._getframe(1).f_code is _DDP_INIT:
            slot = next(s for s in map(slot_of, self.parameters()) if s is not None)
            raise ModelConversionError(
                f"torch.nn.parallel.DistributedDataParallel cannot wrap a model that {slot.who} trains: "
                "ZeroAdam reduces its gradients itself, and DDP would reduce them a second time. Train the "
                "model unwrapped; with a framework, use its zerofast integration: "
                "zerofast.integrations.accelerate.ZeroAccelerator (Hugging Face Accelerate), "
                "zerofast.integrations.hf.ZeroTrainer (transformers), "
                "zerofast.integrations.lightning.ZeroStrategy (Lightning)"
            )
        if "_ddp_ignore" in self.__dict__:
            return self.__dict__["_ddp_ignore"]
        raise AttributeError(f"{type(self).__name__} has no attribute '_ddp_params_and_buffers_to_ignore'")

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names):
        self.__dict__["_ddp_ignore"] = names

    def register_parameter(self, name: str, param) -> None:
        params = self.__dict__.get("_parameters")
        old = params.get(name) if params is not None else None
        slot = slot_of(old) if old is not None else None
        if slot is not None and param is not old:
            raise ModelConversionError(
                f"{type(self).__name__}.{name} = {type(param).__name__} would replace {slot.name}, which {slot.who} "
                "manages (a view of its buffers): the optimizer would go on training the old parameter. Write the new "
                f"values into it instead (with torch.no_grad(): {slot.name}.copy_(new)), or build the optimizer after "
                "the model is final (tie weights before)"
            )
        super().register_parameter(name, param)


_DDP_INIT = DistributedDataParallel.__init__.__code__


def check_conversion(module: nn.Module, fn) -> None:
    """ModelConversionError, before anything changes, if `fn` (module._apply's) would change a managed
    parameter's dtype, device or layout."""
    tried: dict[tuple, torch.Tensor] = {}
    for p in module.parameters():
        slot = slot_of(p)
        if slot is None:
            continue
        with torch._C.DisableTorchFunctionSubclass():
            key = (p.dtype, p.device, p.dim(), p.layout)
        if key not in tried:
            probe = torch.empty((1,) * key[2], dtype=key[0], device=key[1])
            with torch.no_grad():
                tried[key] = fn(probe)
        out = tried[key]
        if not isinstance(out, torch.Tensor):
            raise ModelConversionError(conversion_message(slot.name, slot.who, f"a module conversion ({fn!r})", p))
        if out.dtype != key[0] or not same_device(out.device, key[1]) or out.layout != key[3]:
            what = f"converting the model to {out.dtype} on {out.device} (model.to(), .half(), .cuda(), ...)"
            raise ModelConversionError(conversion_message(slot.name, slot.who, what, p))


def holders(model: nn.Module, params) -> list[nn.Module]:
    """The modules that hold any of `params` directly, and the root: the ones moved to a guarded class."""
    ids = {id(p) for p in params}
    found = [m for m in model.modules() if any(id(p) in ids for p in m.parameters(recurse=False))]
    return found if model in found else [model, *found]
