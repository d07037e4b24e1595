"""Modules that carry zerofast's hooks get a class of their own, so compiled code sees the hooks.

Dynamo guards neither a module's hook dictionaries (skip_nnmodule_hook_guards, on by default) nor
which instance a frame was compiled for, only each inlined module's type, so a frame compiled before
zerofast hooked the modules would run without the hooks. Moving each hooked module to a subclass of
its class (same name, module and qualified name, made once per class, as FSDP2's fully_shard and
torch.nn.utils.parametrize do) fails those frames' guards and Dynamo retraces ([Note: code compiled
before stage 3] in zerofast/stage3/runtime.py): stage 3's unit hooks and stages 1-2's
overlapped-gather waits rely on it. The subclass also carries guard/modules.py's ModuleGuard, so
every module holding a managed parameter moves to it, at every stage.
"""

from __future__ import annotations

import torch.nn as nn

from .guard.modules import ModuleGuard


def own_classes(modules) -> dict[nn.Module, type]:
    """Move every module to its class's hooked subclass (see above); returns the original classes."""
    originals = {}
    for module in modules:
        cls = type(module)
        sub = cls if cls in _HOOKED_SUBCLASSES else _HOOKED_CLASSES.get(cls)
        if sub is None:
            sub = _HOOKED_CLASSES[cls] = type(
                cls.__name__,
                (ModuleGuard, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
            )
            _HOOKED_SUBCLASSES.add(sub)
        module.__class__ = sub
        originals[module] = cls
    return originals


_HOOKED_CLASSES: dict[type, type] = {}  # a module class -> its hooked subclass
_HOOKED_SUBCLASSES: set[type] = set()  # those subclasses (a module already in one stays there)


def restore_classes(originals: dict[nn.Module, type]) -> None:
    """Undo own_classes()."""
    for module, cls in originals.items():
        module.__class__ = cls
