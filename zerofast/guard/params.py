"""A managed parameter's slot, and the guarded class it is in while its values are not on this rank
([Note: the model stays a torch model] in zerofast/guard/__init__.py):
  ParamSlot, slot_of   where a parameter's values are (ParamState)
  guarded_class        a subclass of the parameter's own class (once per class, same name): isinstance
                       and every attribute stay, only __torch_function__ differs (_dispatch)
  ParamView            a view a sharded parameter hands out (`p.data`, `p[i]`, `p.t()`: what nn.init and
                       `embedding.weight.data[padding_idx].zero_()` write through): no storage, the slot
                       and the view ops leading to it, so a write reaches the shards and a read raises
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import ModelConversionError, ShardedParameterError

__all__ = ["ParamState", "ParamSlot", "ParamView", "Shards", "GradView", "manage", "forget", "slot_of", "guarded_class"]


class ParamState(enum.Enum):
    """Where a managed parameter's values are."""

    WHOLE = "whole"
    """On this rank: stages 1 and 2 always, stage 3 while its unit is gathered. The parameter is in
    its own class, unless its gradient window is open (grads.py)."""
    SHARDED = "sharded"
    """Stage 3 between uses: its unit buffer holds no storage; this rank's shard is all there is.
    The parameter is in its guarded class."""
    GATHERING = "gathering"
    """Stages 1 and 2 with CommPolicy(overlap_param_gather=True): the step's gather of its bucket is in
    flight. The parameter is in its guarded class; any call but a metadata read waits for the gather
    first (ParamSlot.wait), so a read sees the updated values and a write is not overwritten."""


class Shards(Protocol):
    """Stage 3's shards of the managed parameters (UnitBuffers in zerofast/stage3/runtime.py)."""

    world: int  # the ranks the shards are spread over

    def pieces(self, slot: ParamSlot) -> list[tuple[int, torch.Tensor]]:
        """This rank's pieces of the parameter: (offset into the flattened parameter, a live 1-D view
        of the shard holding the next numel elements)."""
        ...

    def written(self, slot: ParamSlot, pieces: list[tuple[int, torch.Tensor]]) -> None:
        """The pieces were written: what stands behind them (the fp32 master) follows."""
        ...


class GradView(Protocol):
    """A trainable parameter's gradient as torch sees it (zerofast/guard/grads.py's window)."""

    open: bool  # between a step's last backward and step(): .grad is the reduced gradient

    def grad(self, slot: ParamSlot) -> torch.Tensor | None: ...

    def set_grad(self, slot: ParamSlot, value) -> None: ...


@dataclass(eq=False)
class ParamSlot:
    """One managed parameter: what it is to the user, and where its values are."""

    param: nn.Parameter
    name: str  # its name in model.named_parameters()
    who: str  # what manages it, for messages: "ZeroAdam(stage=3)"
    plain: type  # its own class
    guarded: type  # its guarded subclass
    index: int  # its index in `shards`' and `grads`' numbering
    part: int = 0  # stage 3: which part of the unit buffers (0: trainable, 1: frozen)
    shards: Shards | None = None  # stage 3: its shards (None: whole on every rank)
    grads: GradView | None = None  # a trainable parameter's gradient window
    wait: Callable[[], None] | None = None  # GATHERING: waits for its bucket's gather (the parameter then WHOLE)
    state: ParamState = ParamState.WHOLE

    def refresh(self) -> None:
        """Guarded while sharded or while its gradient window is open; its own class otherwise."""
        guard = self.state is not ParamState.WHOLE or (self.grads is not None and self.grads.open)
        self.param.__class__ = self.guarded if guard else self.plain

    def set_state(self, state: ParamState) -> None:
        self.state = state
        self.refresh()


# id(parameter) -> its slot. Weak values: the owners (unit buffers, gradient windows) keep the slots,
# so a dropped optimizer's slots go with it, and its parameters fall back to their own class when
# next touched (_dispatch).
_SLOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _eager(dispatch):
    """[Note: guarded tensors under torch.compile]
    A call on a guarded tensor is decided in Python, eagerly, never traced into a graph: Dynamo would
    inline __torch_function__ (tracing _dispatch with fake tensors, the meta probes included) and
    compile what should raise. Disabled, Dynamo breaks the graph at the call and runs it: a read at
    rest raises ShardedParameterError from compiled code as from eager code. Forward and backward
    never meet it (their parameters are in their own classes then). Wrapped when the first parameter
    is managed (torch.compiler.disable imports Dynamo, which `import zerofast` does not)."""
    _DISPATCH[0] = torch.compiler.disable(dispatch)


def manage(
    named: list[tuple[str, nn.Parameter]],
    who: str,
    *,
    shards: Shards | None = None,
    grads: GradView | None = None,
    part: int = 0,
) -> list[ParamSlot]:
    """A slot for each parameter (index: its position in `named`); the caller keeps them."""
    if _DISPATCH[0] is _dispatch:
        _eager(_dispatch)
    slots = []
    for i, (name, p) in enumerate(named):
        plain = _own_class(type(p))
        slot = ParamSlot(p, name, who, plain, guarded_class(plain), i, part, shards, grads)
        _SLOTS[id(p)] = slot
        slots.append(slot)
    return slots


def forget(slots: list[ParamSlot]) -> None:
    """The parameters back in their own classes, no longer managed (remove_hooks)."""
    for slot in slots:
        if _SLOTS.get(id(slot.param)) is slot:
            del _SLOTS[id(slot.param)]
        slot.param.__class__ = slot.plain


def slot_of(t) -> ParamSlot | None:
    """The slot of a managed parameter (None for any other tensor)."""
    return _SLOTS.get(id(t))


# --- the guarded classes ------------------------------------------------------------------------------


class _Guarded:
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _DISPATCH[0](func, args, kwargs or {})

    def __repr__(self) -> str:
        slot = _SLOTS.get(id(self))
        if slot is None or slot.state is ParamState.WHOLE:
            return _as_plain(self, lambda t: repr(t))
        return _summary(slot, _meta_shape(self), "")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __reduce_ex__(self, protocol):
        slot = _SLOTS.get(id(self))
        if slot is not None and slot.state is ParamState.SHARDED:
            raise ShardedParameterError(_message(slot, "pickled (torch.save, pickle, copy.deepcopy)", save=True))
        return _as_plain(self, lambda t: t.__reduce_ex__(protocol))

    def __deepcopy__(self, memo):
        slot = _SLOTS.get(id(self))
        if slot is not None and slot.state is ParamState.SHARDED:
            raise ShardedParameterError(_message(slot, "copied (copy.deepcopy)", save=True))
        return _as_plain(self, lambda t: t.__deepcopy__(memo))


_GUARDED: dict[type, type] = {}  # a parameter class -> its guarded subclass


def guarded_class(cls: type) -> type:
    """The guarded subclass of `cls` (made once per class: the same name, module and qualified name)."""
    sub = _GUARDED.get(cls)
    if sub is None:
        sub = _GUARDED[cls] = type(
            cls.__name__,
            (_Guarded, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
        )
    return sub


def _own_class(cls: type) -> type:
    """A class without the guard (a parameter managed twice keeps its first own class)."""
    return next(c for c in cls.__mro__ if not issubclass(c, _Guarded)) if issubclass(cls, _Guarded) else cls


def _as_plain(t: torch.Tensor, call):
    """call(t) with t in its own class for the call: what a whole parameter does unguarded."""
    guarded = type(t)
    t.__class__ = _own_class(guarded)
    try:
        return call(t)
    finally:
        t.__class__ = guarded


def _meta_shape(t: torch.Tensor) -> torch.Size:
    with torch._C.DisableTorchFunctionSubclass():
        return t.shape


class ParamView(torch.Tensor):
    """A view of a sharded parameter: metadata, no storage; its slot and the view ops from the whole
    parameter to it, each (op, flattened arguments with _HERE for the tensor, their pytree spec)."""

    @staticmethod
    def __new__(cls, slot: ParamSlot, ops: tuple, meta: torch.Tensor, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), dtype=meta.dtype, device=device, requires_grad=False
        )
        t._slot, t._ops = slot, ops
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _DISPATCH[0](func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        view = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ParamView)), None)
        raise ShardedParameterError(_message(view._slot, f"reached by {func}") if view is not None else str(func))

    def __repr__(self, *, tensor_contents=None) -> str:
        return _summary(self._slot, self.shape, " (a view)")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __reduce_ex__(self, protocol):
        raise ShardedParameterError(_message(self._slot, "pickled (torch.save, pickle, copy.deepcopy)", save=True))

    def __deepcopy__(self, memo):
        raise ShardedParameterError(_message(self._slot, "copied (copy.deepcopy)", save=True))


def _summary(slot: ParamSlot, shape, what: str) -> str:
    with torch._C.DisableTorchFunctionSubclass():
        dtype, device = slot.param.dtype, slot.param.device
    return (
        f"{slot.plain.__name__}(sharded by {slot.who} across {slot.shards.world} ranks: {slot.name}{what}, "
        f"shape={tuple(shape)}, dtype={dtype}, device={device}; read its values inside "
        f"`with opt.gathered_params():`)"
    )


_HERE = object()  # where the viewed tensor goes in a view op's arguments


def _find(t) -> tuple[ParamSlot, tuple] | None:
    """The slot a guarded tensor stands for, and the view ops from its parameter to it."""
    if isinstance(t, ParamView):
        return t._slot, t._ops
    slot = _SLOTS.get(id(t))
    return (slot, ()) if slot is not None and slot.param is t else None


def _through(ops: tuple, whole: torch.Tensor) -> torch.Tensor:
    """The view `ops` lead to, of `whole` (a tensor of the parameter's shape)."""
    with torch._C.DisableTorchFunctionSubclass():
        for func, flat, spec in ops:
            args, kwargs = tree_unflatten([whole if x is _HERE else x for x in flat], spec)
            whole = func(*args, **kwargs)
    return whole


# --- what a call on a guarded tensor does -------------------------------------------------------------

# The attributes that are not metadata: the values (data), the gradient (grad), and views (T, real, ...,
# which a meta tensor turns into a ParamView); every other attribute torch has (shape, dtype, device,
# requires_grad, is_leaf, grad_fn, names, nbytes, and what torch.compile reads of a tensor) passes.
_VALUE_GETTERS = frozenset("data grad T mT H mH real imag".split())
_META_SETTERS = frozenset(("requires_grad.__set__",))
_META_METHODS = frozenset(
    "size dim ndimension numel nelement element_size stride is_contiguous is_floating_point is_complex "
    "is_signed storage_offset get_device is_shared is_pinned requires_grad_ retain_grad register_hook "
    "register_post_accumulate_grad_hook untyped_storage data_ptr __len__ __hash__ dim_order is_inference "
    "has_names _is_view __dir__ __sizeof__ _is_zerotensor is_neg is_conj".split()
)
# Creating a tensor like another reads its metadata only.
_LIKE = frozenset(
    "new_empty new_zeros new_ones new_full new_tensor new_empty_strided empty_like zeros_like ones_like "
    "full_like rand_like randn_like randint_like".split()
)
# In-place ops whose result at an element depends on that element alone (and on the other arguments):
# applied to a temporary of the whole parameter, each rank keeps its own pieces of the result.
_ELEMENTWISE_WRITES = frozenset(
    "copy_ fill_ zero_ mul_ div_ add_ sub_ addcmul_ addcdiv_ lerp_ clamp_ clamp_min_ clamp_max_ clip_ "
    "uniform_ normal_ bernoulli_ exponential_ log_normal_ cauchy_ geometric_ random_ abs_ neg_ sign_ sgn_ "
    "pow_ sqrt_ rsqrt_ exp_ log_ tanh_ sigmoid_ masked_fill_ erf_ erfinv_ floor_ ceil_ round_ trunc_ frac_ "
    "fmod_ remainder_ reciprocal_ nan_to_num_ copysign_ square_ relu_ true_divide_ multiply_ divide_ "
    "subtract_ __iadd__ __isub__ __imul__ __itruediv__ __idiv__ __setitem__".split()
)
# Writes that overwrite every element they reach: without a view, the temporary need not hold the
# current values.
_OVERWRITES = frozenset(
    "copy_ fill_ zero_ uniform_ normal_ bernoulli_ exponential_ log_normal_ cauchy_ geometric_ random_".split()
)
_CONVERSIONS = frozenset("to cpu cuda xpu mps float double half bfloat16 type".split())


_DISPATCH = [None]  # _dispatch, once managed run eagerly under torch.compile: _eager()


def _name(func) -> str:
    """The name a call goes by: a method's or function's, or "attr.__get__" / "attr.__set__"."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return f"{getattr(func.__self__, '__name__', '?')}.{name}"
    return name


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _is_init(func) -> bool:
    """torch.nn.init's functions hand a guarded tensor to __torch_function__ whole: they overwrite it."""
    return getattr(func, "__module__", None) == "torch.nn.init"


def _dispatch(func, args, kwargs):
    name = _name(func)
    head = name.split(".", 1)[0]
    first = args[0] if args else None
    getter = name.endswith(".__get__") and head not in _VALUE_GETTERS  # any other attribute is metadata
    if name in _META_METHODS or name in _META_SETTERS or getter:
        return _view_meta(first, func, args, kwargs) if isinstance(first, ParamView) else _plain(func, args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    found = []  # (position, tensor, slot, ops) of every guarded tensor among the arguments
    for i, t in enumerate(flat):
        if isinstance(t, (_Guarded, ParamView)):
            f = _find(t)
            if f is None:  # its optimizer is gone: the tensor is its own again
                t.__class__ = _own_class(type(t))
            else:
                found.append((i, t, *f))
    if name in ("grad.__get__", "grad.__set__") and found and found[0][1] is first and not found[0][3]:
        slot = found[0][2]
        if slot.grads is not None and slot.grads.open:
            return slot.grads.grad(slot) if name == "grad.__get__" else slot.grads.set_grad(slot, args[1])
        return _plain(func, args, kwargs)
    for _, _, slot, _ in found:
        if slot.state is ParamState.GATHERING:  # the step's gather lands first
            slot.wait()
    if not any(slot.state is ParamState.SHARDED for _, _, slot, _ in found):
        return _whole(func, flat, spec, found)
    index, target, slot, ops = next(f for f in found if f[2].state is ParamState.SHARDED)
    if name == "data.__set__":
        return _set_data(slot, target, ops, args[1])
    if name == "data.__get__" or (head in ("detach", "alias") and index == 0):  # the same values, no history
        return _view(slot, ops, torch.Tensor.detach, [_HERE], tree_flatten(((_HERE,), {}))[1], target)
    if head in _LIKE:
        return _plain(func, *tree_unflatten([_standin(t) if isinstance(t, ParamView) else t for t in flat], spec))
    if head in _CONVERSIONS and index == 0:
        return _convert(slot, target, name, args, kwargs)
    written = _written(func, head, index, kwargs, found)
    if written is None:
        view = _view_of(slot, ops, target, func, flat, spec, index) if index == 0 else None
        if view is None:
            raise ShardedParameterError(_message(slot, f"read ({head}())" if head else f"read ({func!r})"))
        return view
    for _, t, other, _ in found:
        if t is not written and other.state is ParamState.SHARDED:  # a sharded value the write reads
            raise ShardedParameterError(_message(other, f"read (as an argument of {head}() on {slot.name})"))
    w_slot, w_ops = next((s, o) for _, t, s, o in found if t is written)
    init = _is_init(func)
    if not init and written is w_slot.param and torch.is_grad_enabled() and w_slot.param.requires_grad:
        # As torch raises for the plain parameter (nn.init's functions write under no_grad themselves).
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    reads = bool(w_ops) or not (head in _OVERWRITES or init)
    return _write(w_slot, w_ops, written, func, flat, spec, reads)


_DISPATCH[0] = _dispatch


def _written(func, head: str, index: int, kwargs, found) -> torch.Tensor | None:
    """The guarded tensor an in-place call writes: out=, the first argument of an elementwise in-place
    op or of a torch.nn.init function; None for any other call."""
    out = kwargs.get("out")
    if out is not None and any(out is t for _, t, _, _ in found):
        return out
    if _is_init(func):
        return found[0][1]
    if index == 0 and head in _ELEMENTWISE_WRITES:
        return found[0][1]
    return None


def _whole(func, flat, spec, found):
    """Every guarded tensor's values are here (a view made while sharded may be used after the
    gather): each view is taken of its parameter, and the call runs."""
    views = {id(t): _through(ops, slot.param) for _, t, slot, ops in found if isinstance(t, ParamView)}
    args, kwargs = tree_unflatten([views.get(id(t), t) for t in flat], spec)
    return _plain(func, args, kwargs)


def _view_meta(view: ParamView, func, args, kwargs):
    """A view's metadata is the wrapper's own; its storage is not there to read."""
    if _name(func) in ("untyped_storage", "data_ptr", "is_shared", "is_pinned", "_base.__get__"):
        raise ShardedParameterError(_message(view._slot, f"read ({_name(func)} of a view)"))
    return _plain(func, args, kwargs)


def _standin(view: ParamView) -> torch.Tensor:
    """A tensor of a view's shape, dtype and device, for calls that read only those (empty_like)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.empty(view.shape, dtype=view.dtype, device=view.device)


def _view_of(slot: ParamSlot, ops: tuple, target, func, flat, spec, index: int):
    """The ParamView of the call's result if, run on a meta tensor of the parameter, it gives a view
    of it; else None (the call reads values)."""
    name = _name(func)
    if name.endswith("_") and not name.endswith("__"):  # in place (t_, unsqueeze_): it would change the parameter
        return None
    op = (func, [_HERE if i == index else x for i, x in enumerate(flat)], spec)
    try:
        meta, base = _meta_of(slot)
        out = _through(ops + (op,), meta)
    except Exception:  # noqa: BLE001 (a call that cannot run on meta reads values)
        return None
    if not (isinstance(out, torch.Tensor) and out._is_view() and out._base is base):
        return None
    return ParamView(slot, ops + (op,), out, _device_of(slot))


def _view(slot: ParamSlot, ops: tuple, func, flat: list, spec, target) -> ParamView:
    meta, _ = _meta_of(slot)
    op = (func, flat, spec)
    return ParamView(slot, ops + (op,), _through(ops + (op,), meta), _device_of(slot))


def _meta_of(slot: ParamSlot) -> tuple[torch.Tensor, torch.Tensor]:
    """A meta tensor like the parameter, and its base: a view, so that views of it share that base."""
    with torch._C.DisableTorchFunctionSubclass():
        base = torch.empty(slot.param.shape, dtype=slot.param.dtype, device="meta")
        return base.view(base.shape), base


def _device_of(slot: ParamSlot) -> torch.device:
    with torch._C.DisableTorchFunctionSubclass():
        return slot.param.device


def _set_data(slot: ParamSlot, target, ops: tuple, value) -> None:
    """p.data = value: itself (module._apply after a conversion that changed nothing) is a no-op; a
    tensor of its shape, dtype and device is written into it."""
    if ops:
        raise ShardedParameterError(_message(slot, "rebound through a view (view.data = ...)"))
    found = _find(value) if isinstance(value, (_Guarded, ParamView)) else None
    if found is not None and found[0] is slot and all(op[0] is torch.Tensor.detach for op in found[1]):
        return
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype, device = target.shape, target.dtype, target.device
    if isinstance(value, torch.Tensor) and found is None:
        if value.shape == shape and value.dtype == dtype and value.device == device:
            flat, spec = tree_flatten(((target, value), {}))
            _write(slot, (), target, torch.Tensor.copy_, flat, spec, reads=False)
            return
    got = f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, torch.Tensor) else repr(value)
    raise ShardedParameterError(
        _message(slot, f"rebound (p.data = a tensor of {got}; it is {tuple(shape)} {dtype} on {device})")
    )


def _convert(slot: ParamSlot, target, name: str, args, kwargs):
    """A conversion of a sharded parameter: one that changes nothing (model.to(where it is), .float() in
    fp32) gives the parameter itself, as torch's .to() does; any other is a named error."""
    dtype = device = None
    copy = bool(kwargs.get("copy", False))
    if name == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
    elif name in ("cpu", "cuda", "xpu", "mps"):
        index = args[1] if len(args) > 1 else kwargs.get("device")
        device = (
            torch.device(name)
            if index is None
            else torch.device(name, index)
            if isinstance(index, int)
            else torch.device(index)
        )
    elif name == "type":
        if len(args) == 1 and not kwargs:
            return _plain(torch.Tensor.type, args, kwargs)  # the type's name: metadata
        raise ModelConversionError(_conversion_message(slot, f"type({args[1:]!r})"))
    else:
        dtype = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}[
            name
        ]
    with torch._C.DisableTorchFunctionSubclass():
        own_dtype, own_device = target.dtype, target.device
    if not copy and (dtype is None or dtype == own_dtype) and (device is None or same_device(device, own_device)):
        return target
    got = ", ".join(str(x) for x in (device, dtype) if x is not None)
    raise ModelConversionError(_conversion_message(slot, f"{name}({got})"))


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether a move to `a` leaves a tensor on `b` where it is ("cpu:0" is the CPU; "cuda" is the
    current CUDA device)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index is None and b.index is None:
        return True
    if a.type == "cuda":
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index or a.index is None or b.index is None


def _write(slot: ParamSlot, ops: tuple, written, func, flat, spec, reads: bool):
    """An in-place op on a sharded parameter (or its view) run on a temporary of the whole parameter,
    holding this rank's pieces where the op reads them (or writes part of it); this rank's pieces of
    the result go back into the shard, and the master follows. The op draws from the random generator
    as on the plain model."""
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype, device = slot.param.shape, slot.param.dtype, slot.param.device
    pieces = slot.shards.pieces(slot)
    temp = (torch.zeros if reads else torch.empty)(shape, dtype=dtype, device=device)
    whole = temp.view(-1)
    if reads:
        for offset, view in pieces:
            whole[offset : offset + view.numel()].copy_(view)
    target = _through(ops, temp)
    args, kwargs = tree_unflatten([target if t is written else t for t in flat], spec)
    with torch.no_grad():
        out = _plain(func, args, kwargs)
    for offset, view in pieces:
        view.copy_(whole[offset : offset + view.numel()])
    slot.shards.written(slot, pieces)
    return written if out is target else out


def _message(slot: ParamSlot, what: str, *, save: bool = False, elementwise: bool = True) -> str:
    """The ShardedParameterError text: which parameter, what was done, and what to do instead."""
    where = f"{slot.who} holds only this rank's shard of it between uses (stage 3, across {slot.shards.world} ranks)"
    if save:
        instead = (
            "for whole tensors call opt.full_state_dict() (every rank; keep=rank == 0 to copy on one) or "
            "opt.named_full_tensors(), or save with zerofast.checkpoint.save"
        )
    elif not elementwise:
        instead = (
            "do it inside `with opt.gathered_params():` (every rank enters it; what is written there is kept), "
            "or write whole values with p.copy_(t)"
        )
    else:
        instead = (
            "read it inside `with opt.gathered_params():` (every rank enters it), or take whole tensors with "
            "opt.full_state_dict() / opt.named_full_tensors() (every rank)"
        )
    return f"{slot.name} was {what} outside forward and backward, and {where}: {instead}"


def _conversion_message(slot: ParamSlot, what: str) -> str:
    return conversion_message(slot.name, slot.who, what, slot.param)


def conversion_message(name: str, who: str, what: str, param: torch.Tensor) -> str:
    """The ModelConversionError text for a conversion of a managed parameter."""
    with torch._C.DisableTorchFunctionSubclass():
        dtype, device = param.dtype, param.device
    return (
        f"{what} would convert {name} ({dtype} on {device}), a parameter {who} manages: it is a view of the "
        f"optimizer's buffers, and its shards, fp32 master and Adam state would not follow. Convert the model before "
        f"building the optimizer (model.to(device); opt = ZeroAdam(model, ...)); for bf16 or fp16 training pass "
        f"mixed_precision='bf16' or 'fp16' to the optimizer; for a model in another dtype or place, load "
        f"opt.full_state_dict() into a copy of it"
    )
