"""Opening a checkpoint runs no code from it: the small state as tagged JSON, DCP's metadata through
an allowlist, DCP's byte records as torch.load(weights_only=True) reads them.

[Note: safe checkpoints]
People open checkpoints they did not write (a colleague's run, a downloaded fine-tune), and `info`
and `export` are exactly the tools one runs on them. Every file of a checkpoint that is parsed is
parsed by something that cannot call into code the file names:
  manifest.json    JSON (read_json), then its fields checked (io.read_manifest).
  zerofast.json    the small state and the caller's `extra`, as JSON with a few tagged types
                   (encode / decode below: tuples, dicts with other keys, non-finite floats, bytes,
                   dtypes, tensors and numpy arrays as base64 of their bytes). save() refuses
                   anything else with an error naming where in `extra` it is, so a checkpoint never
                   needs a pickle.
  .metadata        DCP writes it with pickle, and DCP's FileSystemReader reads it with plain
                   pickle.load. SafeReader reads it with _MetadataUnpickler, whose find_class
                   returns only DCP's metadata classes, torch.Size, dtypes, layouts and paths: a
                   pickle naming anything else raises UnsafeCheckpoint, naming the file and the
                   class, before any of it is built. (Every way pickle reaches a callable goes
                   through find_class; the classes allowed only store what they are given; BUILD,
                   which sets attributes, is refused on anything but DCP's metadata objects.)
  DCP data files   tensor records: DCP's reader already uses torch.load(weights_only=True); byte
                   records (a non-tensor entry of a model's state_dict, as `_extra_state`):
                   DCP's DefaultLoadPlanner uses weights_only=False, SafeLoadPlanner True.
What is written stays plain DCP, so dcp.load(..., no_dist=True) still reads our checkpoints.
A damaged file (truncated, not JSON, the wrong fields) is an error naming the file and what is
wrong, raised alike by every rank (each reads the files itself, before any collective).
"""

from __future__ import annotations

import base64
import ctypes
import io
import json
import math
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import UnsafeCheckpoint

try:
    import numpy as np
except ImportError:  # numpy is optional (torch does not require it): only ndarray records need it
    np = None

__all__ = [
    "UnsafeCheckpoint",
    "encode",
    "decode",
    "dumps",
    "loads",
    "read_json",
    "read_metadata",
    "SafeReader",
    "SafeLoadPlanner",
]


# --- tagged JSON ----------------------------------------------------------------------------------

_TAG = "$zf"  # a dict {"$zf": kind, "v": value} is a tagged value; a user dict with this key is tagged too


def encode(obj: Any, where: str = "extra") -> Any:
    """`obj` as JSON values: None, bool, int, str, finite float, list and str-keyed dict as they
    are; tuples, other dicts, non-finite floats, bytes, torch dtypes and Sizes, tensors (any device:
    read back on the CPU) and numpy arrays tagged. Anything else: TypeError naming `where`."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {_TAG: "float", "v": repr(float(obj))}
    if isinstance(obj, torch.Size):
        return {_TAG: "size", "v": list(obj)}
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [encode(x, f"{where}[{i}]") for i, x in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(x, f"{where}[{i}]") for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {
            _TAG: "dict",
            "v": [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()],
        }
    if isinstance(obj, (bytes, bytearray)):
        return {_TAG: "bytes", "v": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "v": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8) if t.dim() and t.numel() else t.reshape(-1).view(torch.uint8)
        return {
            _TAG: "tensor",
            "v": {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": base64.b64encode(_cpu_bytes(raw)).decode(),
            },
        }
    if np is not None and isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        a = np.ascontiguousarray(obj)
        return {
            _TAG: "ndarray",
            "v": {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()},
        }
    if np is not None and isinstance(obj, np.generic):
        return encode(obj.item(), where)
    raise TypeError(
        f"zerofast.checkpoint.save: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; "
        f"a checkpoint stores None, bool, int, float, str, bytes, lists, tuples, dicts, torch dtypes, "
        f"tensors and numpy arrays (as JSON, so that opening it can never run code): store a "
        f"state_dict() or plain values instead"
    )


def decode(obj: Any, where: str = "zerofast.json") -> Any:
    """The inverse of encode; a value encode would not write: ValueError naming `where`."""
    if isinstance(obj, list):
        return [decode(x, where) for x in obj]
    if not isinstance(obj, dict):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(f"{where}: unexpected JSON value {obj!r}")
    if _TAG not in obj:
        return {k: decode(v, where) for k, v in obj.items()}
    kind, v = obj.get(_TAG), obj.get("v")
    try:
        if kind == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if kind == "size":
            return torch.Size([int(x) for x in v])
        if kind == "tuple":
            return tuple(decode(x, where) for x in v)
        if kind == "dict":
            return {_hashable(decode(k, where)): decode(x, where) for k, x in v}
        if kind == "bytes":
            return base64.b64decode(v, validate=True)
        if kind == "dtype":
            return _dtype(v)
        if kind == "tensor":
            dtype, shape = _dtype(v["dtype"]), [int(s) for s in v["shape"]]
            raw = bytearray(base64.b64decode(v["data"], validate=True))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(shape).clone()
        if kind == "ndarray":
            if np is None:
                raise ValueError("the checkpoint holds a numpy array, and numpy is not installed")
            dt = np.dtype(v["dtype"])
            if dt.kind not in "biuf":
                raise ValueError(f"numpy dtype {dt} is not plain numbers")
            return np.frombuffer(base64.b64decode(v["data"], validate=True), dtype=dt).reshape(v["shape"]).copy()
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as err:
        raise ValueError(f"{where}: a damaged {kind!r} value ({type(err).__name__}: {err})") from None
    raise ValueError(f"{where}: unknown tagged value {kind!r}")


def _hashable(key):
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def _dtype(name) -> torch.dtype:
    got = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(got, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return got


def dumps(obj: Any, where: str = "extra") -> bytes:
    return json.dumps(encode(obj, where), separators=(",", ":"), allow_nan=False).encode()


def dumps_small(small: dict, extra: Any) -> bytes:
    """zerofast.json's bytes: the small state with the caller's `extra` (errors name extra[...])."""
    return json.dumps(
        {**encode(small, "the small state"), "extra": encode(extra, "extra")}, separators=(",", ":"), allow_nan=False
    ).encode()


def loads(data: bytes, where: str) -> Any:
    return decode(_parse_json(data, where), where)


def _parse_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        raise ValueError(
            f"{where}: not valid JSON ({err}); the file is damaged, truncated or not a zerofast checkpoint's"
        ) from None


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def read_json(path: str) -> Any:
    """A JSON file, as plain values; a file that is not JSON: ValueError naming it."""
    with open(path, "rb") as f:
        return _parse_json(f.read(), path)


# --- DCP's .metadata --------------------------------------------------------------------------------


def _allowed() -> dict[tuple[str, str], Any]:
    """What a DCP .metadata pickle may name (torch 2.4 to 2.14 write these): DCP's metadata classes,
    the storage layout's record, torch.Size, the path type of checkpoint_id; dtypes and layouts by
    name below."""
    out = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(dcp_meta, name):
            out["torch.distributed.checkpoint.metadata", name] = getattr(dcp_meta, name)
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        out["pathlib", name] = getattr(pathlib, name)
    return out


class _MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 (the pure-Python one: its opcodes can be overridden)
    """find_class: only the allowlist. BUILD (which sets attributes, or calls __setstate__): only on
    instances of DCP's metadata classes, never on a class, function or module the pickle named (a
    crafted BUILD on pathlib.PosixPath would otherwise replace its methods for the whole process)."""

    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path
        self.allowed = _allowed()
        self.buildable = tuple(
            c
            for c in self.allowed.values()
            if isinstance(c, type) and c.__module__.startswith("torch.distributed.checkpoint")
        )

    def find_class(self, module: str, name: str):
        got = self.allowed.get((module, name))
        if got is not None:
            return got
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"{self.path}: refusing to load {module}.{name}: a DCP .metadata file holds only "
            f"DCP's metadata classes, and this one names something else (it was not written by "
            f"torch.distributed.checkpoint, or was altered); nothing from it was run"
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpoint(f"{self.path}: refusing a persistent id in DCP metadata")

    def load_build(self):
        inst = self.stack[-2]
        if type(inst) not in self.buildable:
            raise UnsafeCheckpoint(
                f"{self.path}: refusing to set the state of a {type(inst).__name__} "
                f"({getattr(inst, '__qualname__', inst)!r}) in DCP metadata: only DCP's metadata "
                f"objects have state there; nothing from it was run"
            )
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001
    dispatch[pickle.BUILD[0]] = load_build


_PARSED: dict[tuple, dcp_meta.Metadata] = {}  # one parse kept for one later use (keep=True)


def _file_key(path: str) -> tuple:
    st = os.stat(path)
    return os.path.abspath(path), st.st_mtime_ns, st.st_size, st.st_ino


def read_metadata(path: str, keep: bool = False) -> dcp_meta.Metadata:
    """DCP's .metadata file at `path`, through the allowlist: [Note: safe checkpoints]. The
    allowlist needs pickle's pure-Python unpickler (its BUILD can be refused), about 12 times slower
    than C's (57 ms against 5 ms for the 100M model's metadata); so keep=True keeps this parse for
    the next read of the same unchanged file, once (load: its checks, then DCP's own read)."""
    key = _file_key(path)
    kept = _PARSED.pop(key, None)
    if kept is not None:
        return kept
    with open(path, "rb") as f:
        data = f.read()
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as err:  # noqa: BLE001 (any parse failure of a damaged file: name the file)
        raise ValueError(
            f"{path}: not a readable DCP metadata file ({type(err).__name__}: {err}); the file is "
            f"damaged or truncated ({len(data):,} bytes)"
        ) from None
    if not (
        isinstance(meta, dcp_meta.Metadata)
        and isinstance(meta.state_dict_metadata, dict)
        and isinstance(meta.storage_data, dict)
    ):
        raise ValueError(f"{path}: not DCP metadata (it holds a {type(meta).__name__})")
    for index, info in meta.storage_data.items():
        if not (
            isinstance(getattr(info, "relative_path", None), str)
            and isinstance(getattr(info, "offset", None), int)
            and isinstance(getattr(info, "length", None), int)
        ):
            raise ValueError(f"{path}: a damaged storage record for {getattr(index, 'fqn', index)!r}")
        if os.path.isabs(info.relative_path) or ".." in pathlib.PurePath(info.relative_path).parts:
            raise UnsafeCheckpoint(f"{path}: a storage record points outside the checkpoint: {info.relative_path!r}")
    if keep:
        _PARSED.clear()
        _PARSED[key] = meta
    return meta


class SafeReader(torch_dcp.FileSystemReader):
    """DCP's FileSystemReader, reading .metadata through the allowlist (read_metadata)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        meta = read_metadata(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_meta.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, reading byte records with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(
                f"refusing to load the checkpoint's entry {read_item.dest_index.fqn!r}: its pickle "
                f"names something torch.load(weights_only=True) does not build; nothing from it "
                f"was run"
            ) from err
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _cpu_bytes(raw: torch.Tensor) -> bytes:
    """A contiguous CPU uint8 tensor's bytes, read straight from its memory: numpy is no dependency
    of torch's, and a checkpoint must not need it."""
    return ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b""
