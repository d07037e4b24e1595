"""ShardedGrad: a managed parameter's `.grad` between a step's last backward and step(), standing for
the reduced gradient of which each rank holds its shard ([Note: the model stays a torch model] in
zerofast/guard/__init__.py).

It does what torch.nn.utils.clip_grad_norm_ and clip_grad_value_ do to gradients: a norm (the global
one: every rank calls, as it calls step()), scaling and clamping in place (each rank its own shard, no
communication). It holds no storage: anything else raises ShardedGradientError, in __torch_dispatch__
too for an op that slipped past __torch_function__, so nothing reads memory it does not have.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ..errors import ShardedGradientError

__all__ = ["GradShards", "ShardedGrad"]


class GradShards(Protocol):
    """The reduced gradients a ShardedGrad stands for (zerofast/optim/grad_view.py)."""

    who: str  # "ZeroAdam(stage=2)"

    def norms(self, indices: list[int], ord: float) -> list[torch.Tensor]:
        """The global `ord`-norm of each parameter's gradient (0-dim float32). Collective."""
        ...

    def scale_(self, indices: list[int], factor) -> None:
        """Multiply the parameters' gradients by `factor` (a number or a 0-dim tensor)."""
        ...

    def clamp_(self, indices: list[int], low, high) -> None:
        """Clamp the parameters' gradients to [low, high] (None: unbounded)."""
        ...


_META = frozenset(
    "shape dtype device requires_grad is_leaf grad_fn ndim layout names is_cuda is_cpu is_meta is_sparse "
    "is_quantized is_nested itemsize nbytes size dim numel nelement element_size is_floating_point is_complex "
    "__len__ __hash__ stride is_contiguous get_device".split()
)
_NORMS = frozenset(("norm", "linalg_vector_norm", "linalg_norm", "_foreach_norm"))
_SCALES = frozenset(("mul_", "div_", "__imul__", "__itruediv__", "_foreach_mul_", "_foreach_div_"))
_CLAMPS = frozenset(("clamp_", "clip_", "clamp_min_", "clamp_max_", "_foreach_clamp_min_", "_foreach_clamp_max_"))


class ShardedGrad(torch.Tensor):
    """One managed parameter's gradient, sharded across the ranks, with the parameter's metadata."""

    @staticmethod
    def __new__(cls, shards: GradShards, index: int, name: str, like: torch.Tensor):
        if _HANDLE[0] is _handle:  # eager under torch.compile: [Note: guarded tensors under torch.compile]
            _HANDLE[0] = torch.compiler.disable(_handle)
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype, device = like.shape, like.dtype, like.device
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t._shards, t._index, t._name = shards, index, name
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"ShardedGrad({self._name}: the reduced gradient, sharded by {self._shards.who}; shape="
            f"{tuple(self.shape)}, dtype={self.dtype})"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _HANDLE[0](func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise ShardedGradientError(_message(_first(args), str(func)))


def _handle(func, args, kwargs):
    """What a call on ShardedGrads does (see the module's docstring)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(func.__self__, "__name__", "")
    if name in _META:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if name == "__repr__":
        return args[0].__repr__()
    if name in _NORMS:
        return _norm(name, args, kwargs)
    if name in _SCALES:
        return _scale(name, args, kwargs)
    if name in _CLAMPS:
        return _clamp(name, args, kwargs)
    raise ShardedGradientError(_message(_first(args), f"{name or func!r}()"))


_HANDLE = [_handle]  # run eagerly under torch.compile once a ShardedGrad exists


def _first(args) -> ShardedGrad | None:
    for a in args:
        if isinstance(a, ShardedGrad):
            return a
        if isinstance(a, (list, tuple)):
            found = _first(a)
            if found is not None:
                return found
    return None


def _message(grad: ShardedGrad | None, what: str) -> str:
    name, who = (grad._name, grad._shards.who) if grad is not None else ("a gradient", "zerofast")
    return (
        f"{what} on the .grad of {name}: between the last backward of a step and step(), {who} holds each "
        f"parameter's reduced gradient as shards, one per rank, and .grad stands for it. "
        f"torch.nn.utils.clip_grad_norm_ and clip_grad_value_ work on it (every rank calls them, as it calls step()), "
        f"as do opt.clip_grad_norm_() and max_grad_norm=; other reads of a gradient are not available"
    )


def _grouped(tensors) -> dict[int, tuple[GradShards, list[int], list[int]]]:
    """ShardedGrads grouped by what holds them: id -> (shards, their positions, their indices)."""
    groups: dict[int, tuple[GradShards, list[int], list[int]]] = {}
    for pos, t in enumerate(tensors):
        if not isinstance(t, ShardedGrad):
            raise ShardedGradientError(_message(_first(tensors), "a foreach op mixing sharded and other gradients"))
        entry = groups.setdefault(id(t._shards), (t._shards, [], []))
        entry[1].append(pos)
        entry[2].append(t._index)
    return groups


def _ord(name: str, args, kwargs) -> float:
    key = "p" if name == "norm" else "ord"
    ord = args[1] if len(args) > 1 else kwargs.get(key, kwargs.get("ord", 2.0 if name != "norm" else "fro"))
    if ord in ("fro", None):
        ord = 2.0
    dim = args[2] if len(args) > 2 and name != "_foreach_norm" else kwargs.get("dim")
    if isinstance(ord, str) or dim is not None:
        raise ShardedGradientError(
            _message(_first(args), f"{name}(ord={ord!r}, dim={dim!r}) (only whole-tensor norms)")
        )
    return float(ord)


def _norm(name: str, args, kwargs):
    ord = _ord(name, args, kwargs)
    if name != "_foreach_norm":
        g = args[0]
        return g._shards.norms([g._index], ord)[0]
    tensors = list(args[0])
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for shards, positions, indices in _grouped(tensors).values():
        for pos, norm in zip(positions, shards.norms(indices, ord)):
            out[pos] = norm
    return out


def _scale(name: str, args, kwargs):
    factor = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("scalar"))
    if isinstance(factor, (list, tuple)) or (isinstance(factor, torch.Tensor) and factor.numel() != 1):
        raise ShardedGradientError(_message(_first(args), f"{name}() by a tensor (only a number or a 0-dim tensor)"))
    if name in ("div_", "__itruediv__", "_foreach_div_"):
        factor = 1.0 / factor
    tensors = list(args[0]) if name.startswith("_foreach") else [args[0]]
    for shards, _, indices in _grouped(tensors).values():
        shards.scale_(indices, factor)
    return None if name.startswith("_foreach") else args[0]


def _clamp(name: str, args, kwargs):
    low = high = None
    if name in ("clamp_", "clip_"):
        low = args[1] if len(args) > 1 else kwargs.get("min")
        high = args[2] if len(args) > 2 else kwargs.get("max")
    elif name.endswith("clamp_min_"):
        low = args[1] if len(args) > 1 else kwargs.get("min", kwargs.get("scalar"))
    else:
        high = args[1] if len(args) > 1 else kwargs.get("max", kwargs.get("scalar"))
    for bound in (low, high):
        if isinstance(bound, (list, tuple)) or (isinstance(bound, torch.Tensor) and bound.numel() != 1):
            raise ShardedGradientError(_message(_first(args), f"{name}() with per-element bounds"))
        if isinstance(bound, float) and math.isnan(bound):
            raise ShardedGradientError(_message(_first(args), f"{name}() with a nan bound"))
    tensors = list(args[0]) if name.startswith("_foreach") else [args[0]]
    for shards, _, indices in _grouped(tensors).values():
        shards.clamp_(indices, low, high)
    return None if name.startswith("_foreach") else args[0]
