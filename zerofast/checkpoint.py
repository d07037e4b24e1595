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

__all__ = ["save", "load", "latest", "boxes"]

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
            local.append(Shard(flat[lo:lo + n].view(sizes), self._meta(offsets, sizes, self.opt.rank, flat.device)))
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
        yield


# --- save / load / latest ------------------------------------------------------------------------

def save(path: str, model: nn.Module, opt, *, extra: Optional[dict] = None) -> str:
    """Write a checkpoint of `model` and its ZeroAdam `opt` to the folder `path` (every rank calls
    it; each writes only what it owns). `extra` (LR scheduler state, data position, RNG: anything
    picklable) comes back from load(). The folder appears only when complete: [Note: atomic
    checkpoints]. Returns path."""
    path = os.fspath(path)
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
    dist.barrier(group=opt.group)
    return path


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
    found = []
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        manifest = os.path.join(folder, MANIFEST)
        if name.endswith(INCOMPLETE) or not os.path.isfile(manifest):
            continue
        with open(manifest) as f:
            found.append((json.load(f).get("created", 0), name, folder))
    return max(found)[2] if found else None


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
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"zerofast.checkpoint.load: {manifest_path} is missing: not a complete zerofast "
                                f"checkpoint")
    with open(manifest_path) as f:
        saved = json.load(f)["params"]
    mine = [(n, list(p.shape)) for n, p in zip(opt._names, opt._params)]
    theirs = [(e["name"], e["shape"]) for e in saved]
    for k, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            raise ValueError(f"zerofast.checkpoint.load: parameter {k} differs: the checkpoint has {a[0]} of shape "
                             f"{tuple(a[1])}, the model has {b[0]} of shape {tuple(b[1])}")
    if len(theirs) != len(mine):
        raise ValueError(f"zerofast.checkpoint.load: the checkpoint has {len(theirs)} trainable parameters, the "
                         f"model {len(mine)}")
