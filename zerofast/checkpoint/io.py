"""Checkpoint folders: save and load (atomic, every rank calling), the manifest, latest(), keep=K's
purge, and reading a checkpoint's description without a process group (info).

[Note: atomic checkpoints]
DCP writes into `path + ".incomplete"`; when every rank's data and DCP's .metadata are written, rank
0 adds zerofast.pt (small_state() and the caller's `extra`) and manifest.json (world size, stage,
partition, precision, versions, parameter names, shapes, dtypes, the optimizer's step and a save
counter) and renames the folder to `path`. A run killed during a save leaves only the ".incomplete"
folder, which latest() and load() never take.

[Note: which checkpoint is the latest]
latest() orders the complete checkpoints of a folder by the optimizer step recorded in each
manifest (the most Adam steps any parameter has taken, restored by load, so it keeps growing across
a resumed run), then by the save counter (one more than the largest in the folder when it was
saved: later saves at the same step, one with no update in between say), then by name. Never by
wall-clock time, which a clock step, another machine's clock or a copied folder can reorder.
keep=K purges by the same order.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
import torch.nn as nn

from .dcp import facts, finish_load, sharded_tensors, small_state, tensors

if TYPE_CHECKING:
    from ..optim.zero_adam import ZeroAdam

__all__ = ["save", "load", "latest", "info", "read_manifest", "MANIFEST", "SMALL", "INCOMPLETE"]

MANIFEST = "manifest.json"
SMALL = "zerofast.pt"
INCOMPLETE = ".incomplete"


def save(path: str, model: nn.Module, opt: ZeroAdam, *, extra: Optional[dict] = None,
         keep: Optional[int] = None) -> str:
    """Write a checkpoint of `model` and its ZeroAdam `opt` to the folder `path` (every rank calls
    it; each writes only what it owns). `extra` (LR scheduler state, data position, RNG: anything
    picklable) comes back from load(). The folder appears only when complete: [Note: atomic
    checkpoints]. keep=K (K >= 2): afterwards, delete all but the K latest complete checkpoints
    beside it ([Note: which checkpoint is the latest]), never this one. Returns path."""
    path = os.fspath(path)
    if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 2):
        raise ValueError(f"zerofast.checkpoint.save: keep must be None or an integer >= 2; got {keep!r}")
    if os.path.exists(path):
        raise FileExistsError(f"zerofast.checkpoint.save: {path} exists; a checkpoint is never overwritten "
                              f"(choose a new folder per save, e.g. step-000100)")
    f = facts(opt)
    tmp = path + INCOMPLETE
    if f.rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # what a killed save left behind
    dist.barrier(group=f.group)
    with sharded_tensors():
        torch_dcp.save(tensors(model, opt), checkpoint_id=tmp, process_group=f.group)
    dist.barrier(group=f.group)
    if f.rank == 0:
        root = os.path.dirname(os.path.abspath(path))
        torch.save({**small_state(opt), "extra": extra}, os.path.join(tmp, SMALL))
        with open(os.path.join(tmp, MANIFEST), "w") as out:
            json.dump(_manifest(opt, _next_save_counter(root)), out, indent=1)
        os.replace(tmp, path)
        if keep is not None:
            _purge(root, keep, path)
    dist.barrier(group=f.group)
    return path


def load(path: str, model: nn.Module, opt: ZeroAdam) -> dict:
    """Load the checkpoint at `path` into `model` and its ZeroAdam `opt`, whatever world size,
    stage, partition, bucket size, units or precision either side uses; returns the `extra` saved
    with it. Every rank calls it."""
    path = os.fspath(path)
    _check_manifest(path, opt)
    small = torch.load(os.path.join(path, SMALL), weights_only=False)
    with sharded_tensors():
        torch_dcp.load(tensors(model, opt), checkpoint_id=path, process_group=facts(opt).group)
    finish_load(opt, small)
    return small["extra"]


def latest(root: str) -> Optional[str]:
    """The latest complete checkpoint folder under `root` (by the optimizer step recorded in its
    manifest, then by its save counter, then by name: [Note: which checkpoint is the latest]), or
    None."""
    if not os.path.isdir(root):
        return None
    found = _complete(root)
    return found[-1][1] if found else None


def _order(manifest: dict, name: str) -> tuple:
    """latest()'s sort key (a manifest written before the step and counter were recorded: first)."""
    return (manifest.get("step", -1), manifest.get("save_counter", -1), name)


def _complete(root: str) -> list[tuple[tuple, str]]:
    """(sort key, folder) of every complete checkpoint directly under root, oldest first."""
    found = []
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        manifest = os.path.join(folder, MANIFEST)
        if name.endswith(INCOMPLETE) or not os.path.isfile(manifest):
            continue
        with open(manifest) as f:
            found.append((_order(json.load(f), name), folder))
    return sorted(found)


def _next_save_counter(root: str) -> int:
    counters = [key[1] for key, _ in _complete(root)] if os.path.isdir(root) else []
    return max(counters, default=0) + 1


def _purge(root: str, keep: int, written: str) -> None:
    """Delete all but the `keep` latest complete checkpoints under root; never `written`."""
    for _, folder in _complete(root)[:-keep]:
        if os.path.abspath(folder) != os.path.abspath(written):
            shutil.rmtree(folder)


def _manifest(opt: ZeroAdam, save_counter: int) -> dict:
    from .. import __version__
    f = facts(opt)
    steps = opt.step_counts()
    return {
        "format": "zerofast-checkpoint-1", "created": time.time(), "world_size": f.world_size,
        "stage": f.stage, "partition": f.partition, "precision": f.precision,
        "zerofast": __version__, "torch": torch.__version__,
        "step": max(steps.values(), default=0), "save_counter": save_counter,
        "params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype)} for n, p in opt.named_params],
    }


def _check_manifest(path: str, opt: ZeroAdam) -> None:
    """Every rank reads the manifest itself, so a mismatch is the same error everywhere, never a hang."""
    if not os.path.exists(path):
        if os.path.exists(path + INCOMPLETE):
            raise FileNotFoundError(f"zerofast.checkpoint.load: {path} was never completed (only {path}{INCOMPLETE} "
                                    f"exists: the save was interrupted); use latest() to find the last complete one")
        raise FileNotFoundError(f"zerofast.checkpoint.load: no checkpoint at {path}")
    saved = read_manifest(path)["params"]
    mine = [(n, list(p.shape)) for n, p in opt.named_params]
    theirs = [(e["name"], e["shape"]) for e in saved]
    for k, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            raise ValueError(f"zerofast.checkpoint.load: parameter {k} differs: the checkpoint has {a[0]} of shape "
                             f"{tuple(a[1])}, the model has {b[0]} of shape {tuple(b[1])}")
    if len(theirs) != len(mine):
        raise ValueError(f"zerofast.checkpoint.load: the checkpoint has {len(theirs)} trainable parameters, the "
                         f"model {len(mine)}")


# --- looking inside without a process group -------------------------------------------------------

def read_manifest(path: str) -> dict:
    """The manifest, after checking that every file the checkpoint's metadata points into exists
    and is long enough: a missing or truncated file is an error naming it, raised by every rank
    alike (each reads the metadata itself), before any collective."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zerofast.checkpoint: no checkpoint at {path}")
    manifest_path = os.path.join(path, MANIFEST)
    for needed in (manifest_path, os.path.join(path, SMALL), os.path.join(path, ".metadata")):
        if not os.path.isfile(needed):
            raise FileNotFoundError(f"zerofast.checkpoint: {needed} is missing: not a complete zerofast checkpoint")
    ends: dict[str, int] = {}
    for item in torch_dcp.FileSystemReader(path).read_metadata().storage_data.values():
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


def info(path: str) -> str:
    """A few lines about the checkpoint at `path`: how it was saved and what it holds."""
    m = read_manifest(path)
    numel = sum(torch.Size(p["shape"]).numel() for p in m["params"])
    files = sorted(os.listdir(path))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    step = f", optimizer step {m['step']} (save {m['save_counter']} in its folder)" if "step" in m else ""
    return "\n".join([
        f"{path}: zerofast checkpoint ({m['format']}), zerofast {m['zerofast']}, torch {m['torch']}",
        f"saved by {m['world_size']} ranks, stage {m['stage']}, {m['partition']} partition, {m['precision']}{step}",
        f"{len(m['params'])} trainable parameters, {numel:,} elements; {len(files)} files, {size:,} bytes",
    ])
