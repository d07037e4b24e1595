"""Sharded checkpoints on torch.distributed.checkpoint (DCP): each rank writes only what it owns,
keyed by parameter name in each parameter's own shape, and a checkpoint loads into any ZeroAdam
configuration (world size, stage, partition, bucket size, units, precision).

    zerofast.checkpoint.save(path, model, opt, extra={"step": step})   # every rank calls it
    extra = zerofast.checkpoint.load(path, model, opt)                  # any configuration
    path = zerofast.checkpoint.latest(root)                             # newest complete, or None

What a checkpoint holds (one DCP state dict):
  "model": every key of model.state_dict(): trainable parameters from the fp32 master (the source of
      truth; in mixed precision the model's own parameters are its rounding), frozen parameters and
      buffers as the model holds them, a tied weight under each of its names. A plain model loads
      it with dcp.load({"model": model.state_dict()}, checkpoint_id=path, no_dist=True).
  "optim": per trainable parameter name, exp_avg and exp_avg_sq (fp32, the parameter's shape).
Beside it, zerofast.pt (written by rank 0; the same on every rank and small): per-parameter step
counts, the param_groups' hyper-parameters by parameter name, the fp16 loss scaler's state, and the
caller's `extra`, returned by load() as saved.

[Note: flat slices as chunks]
A rank owns 1-D ranges of the flattened parameters (layout.pieces). DCP describes a shard as a
rectangular chunk of the tensor (offsets and sizes per dimension), so each range is cut into at
most 2 * ndim - 1 boxes of the row-major tensor: the tail of a partial first row, the full rows,
the head of a partial last row, recursively. Every rank computes every rank's boxes from the
layout (a pure function), so the ShardedTensors are built without a collective, padding is never
written, and DCP's own resharding reads, for the loading configuration's boxes, whatever saved
chunks overlap them: any world size, stage or partition on either side.

[Note: atomic checkpoints]
DCP writes into `path + ".incomplete"`; when every rank's data and DCP's .metadata are written, rank
0 adds manifest.json (world size, stage, partition, precision, versions, parameter names, shapes,
dtypes) and renames the folder to `path`. A run killed during a save leaves only the
".incomplete" folder, which latest() and load() never take.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

__all__ = ["save", "load", "latest", "to_torch", "from_torch", "export", "info", "boxes"]

MANIFEST = "manifest.json"
SMALL = "zerofast.pt"
INCOMPLETE = ".incomplete"


# --- flat ranges as rectangular chunks: see [Note: flat slices as chunks] --------------------------

def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range [lo, hi) of a row-major tensor of `shape`, as rectangular chunks:
    [(offsets, sizes, flat start)], at most 2 * ndim - 1 of them, in flat order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)] if shape else [((), (), lo)]
    row = 1
    for s in shape[1:]:
        row *= s
    out = []
    first_full, last_full = -(-lo // row), hi // row
    if first_full > last_full:  # inside one row
        r = lo // row
        return [((r,) + o, (1,) + z, r * row + f) for o, z, f in boxes(shape[1:], lo - r * row, hi - r * row)]
    if lo < first_full * row:  # the tail of a partial first row
        r = lo // row
        out += [((r,) + o, (1,) + z, r * row + f) for o, z, f in boxes(shape[1:], lo - r * row, row)]
    if first_full < last_full:
        out.append(((first_full,) + (0,) * (len(shape) - 1), (last_full - first_full,) + tuple(shape[1:]),
                    first_full * row))
    if last_full * row < hi:  # the head of a partial last row
        out += [((last_full,) + o, (1,) + z, last_full * row + f) for o, z, f in boxes(shape[1:], 0, hi - last_full * row)]
    return out


def _exact(view: torch.Tensor) -> torch.Tensor:
    """The same memory as `view`, as a tensor whose storage is exactly its own bytes. DCP clones a
    CPU tensor whose storage is larger than itself before writing it (torch.save would otherwise
    write the whole storage); our boxes are views into the flat buffers, so every box would be
    copied, and the freed copies stay resident: +333 MiB per rank measured saving a 100M-parameter
    model in stage 2. Aliasing through numpy (float32 here: master and moments) avoids the copy."""
    if view.device.type != "cpu" or not view.is_contiguous():
        return view
    return torch.from_numpy(view.detach().numpy())


class _Chunks:
    """For every trainable parameter, every rank's boxes under the optimizer's layout."""

    def __init__(self, opt):
        self.opt = opt
        self.shapes = [tuple(p.shape) for p in opt._params]
        self.global_ranks = [dist.get_global_rank(opt.group, r) if opt.group is not dist.group.WORLD else r
                             for r in range(opt.world_size)]
        # per parameter: [(rank, offsets, sizes)] over every rank; this rank's: [(piece, offsets, sizes, start)]
        self.all: list[list[tuple[int, tuple, tuple]]] = [[] for _ in opt._params]
        self.mine: list[list[tuple]] = [[] for _ in opt._params]
        for r in range(opt.world_size):
            for pc in opt.layout.pieces(r):
                for offsets, sizes, start in boxes(self.shapes[pc.param], pc.param_offset, pc.param_offset + pc.numel):
                    self.all[pc.param].append((r, offsets, sizes))
                    if r == opt.rank:
                        self.mine[pc.param].append((pc, offsets, sizes, start))

    def sharded(self, i: int, flat_of_piece, dtype: torch.dtype) -> ShardedTensor:
        """Parameter i as a ShardedTensor of its shape whose local shards are this rank's boxes,
        each a view of (or a copy from) flat_of_piece(piece): the piece's values, 1-D."""
        local = []
        for pc, offsets, sizes, start in self.mine[i]:
            flat = flat_of_piece(pc)
            lo = start - pc.param_offset
            n = 1
            for s in sizes:
                n *= s
            box = _exact(flat[lo:lo + n].view(sizes))
            local.append(Shard(box, self._meta(offsets, sizes, self.opt.rank, flat.device)))
        dev = local[0].tensor.device if local else self.opt.shard.grad_shard.device
        metas = [self._meta(o, z, r, dev) for r, o, z in self.all[i]]
        props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(self.shapes[i]), tensor_properties=props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta, process_group=self.opt.group)

    def _meta(self, offsets, sizes, rank, device) -> ShardMetadata:
        where = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
        return ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes),
                             placement=f"rank:{self.global_ranks[rank]}/{where}")


# --- the state dict: views into the live state (save reads them, load writes them) -----------------

def _piece_views(opt, kind: str):
    """piece -> the 1-D values of `kind` ("master", "exp_avg", "exp_avg_sq") for that piece, as
    views into the optimizer's ShardState, so DCP reads from (save) and writes into (load) them."""
    shard = opt.shard

    def view(pc):
        state = slice(pc.state_offset, pc.state_offset + pc.numel)
        if kind == "master":
            return shard.master_and_copy(pc.bucket, pc.bucket_offset, state)[0]
        return getattr(shard, kind)[state]
    return view


def _model_entries(model: nn.Module, opt, chunks: _Chunks) -> dict[str, Any]:
    """Every key of model.state_dict(): managed parameters from the fp32 master, in their shape;
    frozen parameters and buffers as the model holds them (replicated on every rank)."""
    index_of = {id(p): i for i, p in enumerate(opt._params)}
    master = {}
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        i = index_of.get(id(value))
        if i is None:
            out[key] = value.detach()
            continue
        if i not in master:  # a tied weight: one ShardedTensor under each of its names
            master[i] = chunks.sharded(i, _piece_views(opt, "master"), torch.float32)
        out[key] = master[i]
    return out


def _optim_entries(opt, chunks: _Chunks) -> dict[str, Any]:
    return {name: {"exp_avg": chunks.sharded(i, _piece_views(opt, "exp_avg"), torch.float32),
                   "exp_avg_sq": chunks.sharded(i, _piece_views(opt, "exp_avg_sq"), torch.float32)}
            for i, name in enumerate(opt._names)}


def tensors(model: nn.Module, opt) -> dict[str, Any]:
    """The checkpoint's tensors as a DCP state dict ({"model": ..., "optim": ...}), views into the
    live state: dcp.save reads them, dcp.load writes into them. See the module docstring."""
    opt._gather.wait()
    if opt.units is not None:
        opt.units.release_all()  # stage 3: only the shard is the state
    chunks = _Chunks(opt)
    return {"model": _model_entries(model, opt, chunks), "optim": _optim_entries(opt, chunks)}


def small_state(opt) -> dict[str, Any]:
    """What is the same on every rank and small: step counts, param_groups by parameter name, the
    loss scaler. Rank 0 writes it beside DCP's files (zerofast.pt), with the caller's `extra`."""
    name_of = {id(p): n for n, p in zip(opt._names, opt._params)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
              for g in opt.param_groups]
    scaler = opt._scaler
    return {"steps": dict(zip(opt._names, opt.shard.steps)), "param_groups": groups,
            "loss_scaler": {"scale": scaler.scale, "growth_tracker": scaler.growth_tracker, "enabled": scaler.enabled}}


def finish_load(opt, small: dict[str, Any]) -> None:
    """After dcp.load filled the views of tensors(): step counts, hyper-parameters and the loss
    scale from small_state(), the low-precision parameters as the master's rounding, and (stages 1
    and 2) every rank's full parameters gathered from the owners."""
    for i, name in enumerate(opt._names):
        opt.shard.steps[i] = small["steps"][name]
    saved_group_of = {n: g for g in small["param_groups"] for n in g["params"]}
    name_of = {id(p): n for n, p in zip(opt._names, opt._params)}
    for group in opt.param_groups:
        saved = saved_group_of[name_of[id(group["params"][0])]]
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
    scaler = small["loss_scaler"]
    if opt._scaler.enabled and scaler["enabled"]:
        opt._scaler.scale, opt._scaler.growth_tracker = scaler["scale"], scaler["growth_tracker"]
    shard = opt.shard
    with torch.no_grad():
        if shard.master.numel():  # mixed precision: the parameters are the master's rounding
            for pc in shard.pieces:
                state = slice(pc.state_offset, pc.state_offset + pc.numel)
                master, copy = shard.master_and_copy(pc.bucket, pc.bucket_offset, state)
                copy.copy_(master)
        if opt.units is None:
            opt._gather.start()
            opt._gather.wait()


@contextlib.contextmanager
def _sharded_tensors():
    """DCP warns that ShardedTensor is deprecated in favour of DTensor; but a DTensor shards each
    dimension evenly, and a rank's flat range of a parameter is a few boxes of any shape
    ([Note: flat slices as chunks]), which only ShardedTensor's per-shard metadata can describe."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
        # export / to_torch read in one process, without a process group, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled.*", category=UserWarning)
        yield


def state_dict(opt) -> dict[str, Any]:
    """ZeroAdam.state_dict(): tensors() (model and optimizer tensors, this rank's pieces, views of
    the live state) and "zerofast": small_state() as pickled bytes, one opaque item for DCP."""
    import pickle
    return {**tensors(opt.model, opt), "zerofast": pickle.dumps(small_state(opt))}


def load_state_dict(opt, loaded: dict[str, Any]) -> None:
    """ZeroAdam.load_state_dict(): after dcp.load filled a state_dict() of this optimizer."""
    import pickle
    if not isinstance(loaded, dict) or not isinstance(loaded.get("zerofast"), bytes) or "optim" not in loaded:
        raise ValueError("ZeroAdam.load_state_dict: pass the dict from this optimizer's state_dict() after "
                         "torch.distributed.checkpoint.load filled it (or use zerofast.checkpoint.load)")
    finish_load(opt, pickle.loads(loaded["zerofast"]))


# --- save / load / latest ------------------------------------------------------------------------

def save(path: str, model: nn.Module, opt, *, extra: Optional[dict] = None, keep: Optional[int] = None) -> str:
    """Write a checkpoint of `model` and its ZeroAdam `opt` to the folder `path` (every rank calls
    it; each writes only what it owns). `extra` (LR scheduler state, data position, RNG: anything
    picklable) comes back from load(). The folder appears only when complete: [Note: atomic
    checkpoints]. keep=K (K >= 2): afterwards, delete all but the K newest complete checkpoints
    beside it (never the newest, which this one now is). Returns path."""
    path = os.fspath(path)
    if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 2):
        raise ValueError(f"zerofast.checkpoint.save: keep must be None or an integer >= 2; got {keep!r}")
    if os.path.exists(path):
        raise FileExistsError(f"zerofast.checkpoint.save: {path} exists; a checkpoint is never overwritten "
                              f"(choose a new folder per save, e.g. step-000100)")
    tmp = path + INCOMPLETE
    if opt.rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # what a killed save left behind
    dist.barrier(group=opt.group)
    with _sharded_tensors():
        dcp.save(tensors(model, opt), checkpoint_id=tmp, process_group=opt.group)
    dist.barrier(group=opt.group)
    if opt.rank == 0:
        torch.save({**small_state(opt), "extra": extra}, os.path.join(tmp, SMALL))
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(_manifest(model, opt), f, indent=1)
        os.replace(tmp, path)
        if keep is not None:
            _purge(os.path.dirname(os.path.abspath(path)), keep)
    dist.barrier(group=opt.group)
    return path


def _complete(root: str) -> list[tuple[float, str, str]]:
    """(created, name, folder) of every complete checkpoint directly under root."""
    found = []
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        manifest = os.path.join(folder, MANIFEST)
        if name.endswith(INCOMPLETE) or not os.path.isfile(manifest):
            continue
        with open(manifest) as f:
            found.append((json.load(f).get("created", 0), name, folder))
    return sorted(found)


def _purge(root: str, keep: int) -> None:
    for _, _, folder in _complete(root)[:-keep]:
        shutil.rmtree(folder)


def load(path: str, model: nn.Module, opt) -> dict:
    """Load the checkpoint at `path` into `model` and its ZeroAdam `opt`, whatever world size,
    stage, partition, bucket size, units or precision either side uses; returns the `extra` saved
    with it. Every rank calls it."""
    path = os.fspath(path)
    _check_manifest(path, model, opt)
    small = torch.load(os.path.join(path, SMALL), weights_only=False)
    with _sharded_tensors():
        dcp.load(tensors(model, opt), checkpoint_id=path, process_group=opt.group)
    finish_load(opt, small)
    return small["extra"]


def latest(root: str) -> Optional[str]:
    """The newest complete checkpoint folder under `root` (by the step recorded in its manifest,
    then by name), or None."""
    if not os.path.isdir(root):
        return None
    found = _complete(root)
    return found[-1][2] if found else None


def _manifest(model: nn.Module, opt) -> dict:
    import time

    import zerofast
    return {
        "format": "zerofast-checkpoint-1", "created": time.time(), "world_size": opt.world_size,
        "stage": opt.stage, "partition": opt.partition, "precision": opt.mixed_precision or "fp32",
        "zerofast": zerofast.__version__, "torch": torch.__version__,
        "params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype)} for n, p in zip(opt._names, opt._params)],
    }


def _check_manifest(path: str, model: nn.Module, opt) -> None:
    """Every rank reads the manifest itself, so a mismatch is the same error everywhere, never a hang."""
    if not os.path.exists(path):
        if os.path.exists(path + INCOMPLETE):
            raise FileNotFoundError(f"zerofast.checkpoint.load: {path} was never completed (only {path}{INCOMPLETE} "
                                    f"exists: the save was interrupted); use latest() to find the last complete one")
        raise FileNotFoundError(f"zerofast.checkpoint.load: no checkpoint at {path}")
    saved = _read_manifest(path)["params"]
    mine = [(n, list(p.shape)) for n, p in zip(opt._names, opt._params)]
    theirs = [(e["name"], e["shape"]) for e in saved]
    for k, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            raise ValueError(f"zerofast.checkpoint.load: parameter {k} differs: the checkpoint has {a[0]} of shape "
                             f"{tuple(a[1])}, the model has {b[0]} of shape {tuple(b[1])}")
    if len(theirs) != len(mine):
        raise ValueError(f"zerofast.checkpoint.load: the checkpoint has {len(theirs)} trainable parameters, the "
                         f"model {len(mine)}")


# --- plain torch, both ways (small models, migration) ---------------------------------------------

def _adamw_defaults() -> dict:
    """The keys torch.optim.AdamW's param groups carry, with its defaults (read from torch itself, so
    a state dict made here loads into the AdamW of any torch version)."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def to_torch(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint at `path` as a plain model state dict (fp32 master values for trainable
    parameters) and a torch.optim.AdamW state dict, read in this process without a process group.
    The optimizer's parameter indices follow the saved param_groups, each listing its parameters
    in model order: AdamW(model.parameters()) for one group."""
    from torch.distributed.checkpoint import FileSystemReader
    _read_manifest(path)
    small = torch.load(os.path.join(path, SMALL), weights_only=False)
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    model_sd = {k[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                for k, md in meta.items() if k.startswith("model.") and hasattr(md, "size")}
    names = [n for g in small["param_groups"] for n in g["params"]]
    moments = {n: {"exp_avg": torch.empty(model_sd[n].shape), "exp_avg_sq": torch.empty(model_sd[n].shape)}
               for n in names}
    with _sharded_tensors():
        dcp.load({"model": model_sd, "optim": moments}, checkpoint_id=path, no_dist=True)
    defaults = _adamw_defaults()
    index = {n: i for i, n in enumerate(names)}
    groups = [{**defaults, **{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"},
               "params": [index[n] for n in g["params"]]} for g in small["param_groups"]]
    state = {index[n]: {"step": torch.tensor(float(small["steps"][n])), **moments[n]}
             for n in names if small["steps"][n] > 0}
    return model_sd, {"state": state, "param_groups": groups}


def from_torch(model_state_dict: dict[str, torch.Tensor], optim_state_dict: Optional[dict], model: nn.Module,
               opt) -> None:
    """Continue a plain-torch run in ZeroAdam: `model_state_dict` (model.state_dict() of the same
    architecture) and, optionally, the state dict of torch.optim.AdamW over model.parameters() (or
    over the trainable ones), in full on every rank; each rank keeps what it owns."""
    index_of = {id(p): i for i, p in enumerate(opt._params)}
    missing = [k for k in model.state_dict(keep_vars=True) if k not in model_state_dict]
    if missing:
        raise ValueError(f"zerofast.checkpoint.from_torch: model_state_dict has no {missing[0]} "
                         f"({len(missing)} keys missing)")
    full = {}
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            given = model_state_dict[key]
            if tuple(given.shape) != tuple(value.shape):
                raise ValueError(f"zerofast.checkpoint.from_torch: {key} has shape {tuple(given.shape)}, the model "
                                 f"{tuple(value.shape)}")
            i = index_of.get(id(value))
            if i is None:
                value.copy_(given)
            else:
                full.setdefault(i, given)
    moments = {}
    if optim_state_dict is not None:
        moments = _adamw_moments(optim_state_dict, model, opt)
    shard = opt.shard
    with torch.no_grad():
        for pc in shard.pieces:
            state = slice(pc.state_offset, pc.state_offset + pc.numel)
            lo, hi = pc.param_offset, pc.param_offset + pc.numel
            shard.master_and_copy(pc.bucket, pc.bucket_offset, state)[0].copy_(full[pc.param].reshape(-1)[lo:hi])
            if pc.param in moments:
                for kind in ("exp_avg", "exp_avg_sq"):
                    getattr(shard, kind)[state].copy_(moments[pc.param][kind].reshape(-1)[lo:hi])
    if opt.units is not None:
        opt.units.release_all()
    finish_load(opt, {"steps": {opt._names[i]: int(m["step"]) for i, m in moments.items()}
                      | {n: 0 for i, n in enumerate(opt._names) if i not in moments},
                      "param_groups": _groups_by_name(optim_state_dict, model, opt),
                      "loss_scaler": {"enabled": False}})


def _adamw_param_order(optim_state_dict: dict, model: nn.Module, opt) -> list[int | None]:
    """Index k of the AdamW state dict -> ZeroAdam's parameter index (None: not managed)."""
    count = sum(len(g["params"]) for g in optim_state_dict["param_groups"])
    everything = list(model.parameters())
    trainable = [p for p in everything if p.requires_grad]
    params = everything if count == len(everything) else trainable if count == len(trainable) else None
    if params is None:
        raise ValueError(f"zerofast.checkpoint.from_torch: the optimizer state dict holds {count} parameters; the "
                         f"model has {len(everything)} ({len(trainable)} trainable)")
    index_of = {id(p): i for i, p in enumerate(opt._params)}
    return [index_of.get(id(p)) for p in params]


def _adamw_moments(optim_state_dict: dict, model: nn.Module, opt) -> dict[int, dict]:
    order = _adamw_param_order(optim_state_dict, model, opt)
    return {order[k]: v for k, v in optim_state_dict["state"].items() if order[k] is not None}


def _groups_by_name(optim_state_dict: Optional[dict], model: nn.Module, opt) -> list[dict]:
    if optim_state_dict is None:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [opt._names[i] for i, p in enumerate(opt._params) if any(p is q for q in g["params"])]}
                for g in opt.param_groups]
    order = _adamw_param_order(optim_state_dict, model, opt)
    keys = ("lr", "betas", "eps", "weight_decay")
    return [{**{k: g[k] for k in keys if k in g}, "params": [opt._names[order[k]] for k in g["params"]
                                                             if order[k] is not None]}
            for g in optim_state_dict["param_groups"]]


# --- looking inside without a process group -------------------------------------------------------

def _read_manifest(path: str) -> dict:
    """The manifest, after checking that every file the checkpoint's metadata points into exists
    and is long enough: a missing or truncated file is an error naming it, raised by every rank
    alike (each reads the metadata itself), before any collective."""
    from torch.distributed.checkpoint import FileSystemReader
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zerofast.checkpoint: no checkpoint at {path}")
    manifest_path = os.path.join(path, MANIFEST)
    for needed in (manifest_path, os.path.join(path, SMALL), os.path.join(path, ".metadata")):
        if not os.path.isfile(needed):
            raise FileNotFoundError(f"zerofast.checkpoint: {needed} is missing: not a complete zerofast checkpoint")
    ends: dict[str, int] = {}
    for item in FileSystemReader(path).read_metadata().storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        data = os.path.join(path, name)
        if not os.path.isfile(data):
            raise FileNotFoundError(f"zerofast.checkpoint: {data} is missing")
        if os.path.getsize(data) < end:
            raise ValueError(f"zerofast.checkpoint: {data} is truncated: {os.path.getsize(data):,} bytes, the "
                             f"metadata needs {end:,}")
    with open(manifest_path) as f:
        return json.load(f)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def export(path: str, out: str, dtype: str = "fp32") -> None:
    """The model entry as one safetensors file, streamed: the header first (names, shapes, dtypes,
    offsets, all known from the checkpoint's metadata), then every saved chunk copied, a few MiB
    at a time, from its data file to its place in the output; no tensor is ever held whole, so
    memory stays a constant however large the model and its tensors are ([Note: streaming export]).
    dtype: "fp32" or "bf16" for the floating-point tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"zerofast.checkpoint.export: dtype must be fp32 or bf16; got {dtype!r}")
    _read_manifest(path)
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    metadata = FileSystemReader(path).read_metadata()
    where = {(index.fqn, tuple(index.offset)): info for index, info in metadata.storage_data.items()}
    entries = [(k, md) for k, md in metadata.state_dict_metadata.items() if k.startswith("model.") and hasattr(md, "size")]
    header, starts, offset = {}, {}, 0
    for key, md in entries:
        kept = want if md.properties.dtype.is_floating_point else md.properties.dtype
        nbytes = torch.Size(md.size).numel() * _itemsize(kept)
        header[key[len("model."):]] = {"dtype": _SAFETENSORS_DTYPES[kept], "shape": list(md.size),
                                       "data_offsets": [offset, offset + nbytes]}
        starts[key] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = out + ".incomplete"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        base = f.tell()
        for key, md in entries:
            kept = want if md.properties.dtype.is_floating_point else md.properties.dtype
            for chunk in md.chunks:
                info = where[(key, tuple(chunk.offsets))]
                _copy_chunk(path, info, md, chunk, kept, f, base + starts[key])
    os.replace(tmp, out)


# [Note: streaming export]
# DCP stores each saved chunk as one torch.save record (an uncompressed zip) at (offset, length) in
# a data file, its values in "<archive>/data/0", row-major, little-endian. A chunk is a box of the
# tensor; its trailing dimensions that span the whole tensor make runs contiguous in both the
# record and the output, so the copy is a loop over those runs, each read in blocks of at most
# _BLOCK bytes (converted to bf16 on the way when asked) and written at its offset in the output.

_BLOCK = 4 << 20


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class _FileSlice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of their own (for zipfile)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def _copy_chunk(path: str, info, md, chunk, kept: torch.dtype, out, out_base: int) -> None:
    import zipfile
    stored = md.properties.dtype
    shape, sizes, offsets = list(md.size), list(chunk.sizes), list(chunk.offsets)
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"zerofast.checkpoint.export: {info.relative_path} holds transformed data "
                         f"({info.transform_descriptors}); export reads plain DCP records only")
    with open(os.path.join(path, info.relative_path), "rb") as f:
        record = zipfile.ZipFile(_FileSlice(f, info.offset, info.length))
        names = record.namelist()
        data = next(n for n in names if n.endswith("/data/0"))
        order = next((n for n in names if n.endswith("/byteorder")), None)
        if order is not None and record.read(order) != b"little":
            raise ValueError(f"zerofast.checkpoint.export: {info.relative_path} is big-endian")
        numel = torch.Size(sizes).numel()
        if record.getinfo(data).file_size != numel * _itemsize(stored):
            raise ValueError(f"zerofast.checkpoint.export: a chunk in {info.relative_path} holds "
                             f"{record.getinfo(data).file_size} bytes, its box {numel * _itemsize(stored)}")
        # The longest run contiguous in both: the trailing dimensions the box spans entirely, and one more.
        k = len(shape)
        while k > 0 and (k == len(shape) or sizes[k] == shape[k]):
            k -= 1
            if sizes[k] != shape[k]:
                break
        run = torch.Size(sizes[k:]).numel() if shape else 1
        strides = [torch.Size(shape[d + 1:]).numel() for d in range(len(shape))]
        with record.open(data) as src:
            for index in _row_major(sizes[:k]):
                flat = sum((offsets[d] + index[d]) * strides[d] for d in range(k)) + sum(
                    offsets[d] * strides[d] for d in range(k, len(shape)))
                out.seek(out_base + flat * _itemsize(kept))
                left = run * _itemsize(stored)
                while left:
                    block = src.read(min(left, _BLOCK - _BLOCK % _itemsize(stored)))
                    left -= len(block)
                    if kept != stored:
                        block = torch.frombuffer(bytearray(block), dtype=stored).to(kept).view(torch.uint8).numpy().tobytes()
                    out.write(block)


def _row_major(sizes: list[int]):
    """Every index tuple of a box of `sizes`, in row-major order (one empty tuple for no dimensions)."""
    import itertools
    return itertools.product(*(range(n) for n in sizes))


def info(path: str) -> str:
    """A few lines about the checkpoint at `path`: how it was saved and what it holds."""
    m = _read_manifest(path)
    numel = sum(torch.Size(p["shape"]).numel() for p in m["params"])
    files = sorted(os.listdir(path))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    return "\n".join([
        f"{path}: zerofast checkpoint ({m['format']}), zerofast {m['zerofast']}, torch {m['torch']}",
        f"saved by {m['world_size']} ranks, stage {m['stage']}, {m['partition']} partition, {m['precision']}",
        f"{len(m['params'])} trainable parameters, {numel:,} elements; {len(files)} files, {size:,} bytes",
    ])


def main(argv=None) -> int:
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="python -m zerofast.checkpoint", description="Inspect or export a zerofast checkpoint.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="the model as one safetensors file, streamed tensor by tensor")
    e.add_argument("path", help="a checkpoint, or a folder of them (its newest complete one)")
    e.add_argument("out")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    i = sub.add_parser("info", help="how the checkpoint was saved and what it holds")
    i.add_argument("path", help="a checkpoint, or a folder of them (its newest complete one)")
    args = p.parse_args(argv)
    path = args.path
    if not os.path.isfile(os.path.join(path, MANIFEST)) and latest(path) is not None:
        path = latest(path)  # a folder of checkpoints: its newest complete one
    try:
        if args.command == "export":
            export(path, args.out, args.dtype)
            print(f"wrote {args.out}")
        else:
            print(info(path))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
