"""Checkpoint folders: save and load (every rank calling), latest(), keep=K's purge, the manifest, and
info() / upgrade() without a process group.

[Note: atomic checkpoints]
DCP writes into `path + ".incomplete"`; when every rank's data and DCP's .metadata are written, rank
0 adds zerofast.json (small_state() and the caller's `extra`, as JSON: [Note: safe checkpoints] in
safe.py) and manifest.json (world size, stage, partition, precision, versions, parameter names,
shapes, dtypes, the optimizer's step and a save counter) and renames the folder to `path`. A run
killed during a save leaves only the ".incomplete" folder, which latest() and load() never take.

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
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
import torch.nn as nn

from .._version import __version__
from . import background, safe
from .background import AsyncSave
from .dcp import finish_load, loading_tensors, small_state, tensors
from .staging import Staging
from .view import Checkpointable, CheckpointView

__all__ = [
    "save",
    "load",
    "latest",
    "info",
    "read_manifest",
    "read_small",
    "upgrade",
    "MANIFEST",
    "SMALL",
    "INCOMPLETE",
]

MANIFEST = "manifest.json"
SMALL = "zerofast.json"
LEGACY_SMALL = "zerofast.pt"  # format 1: the small state as a pickle (upgrade() converts it)
INCOMPLETE = ".incomplete"
FORMAT = "zerofast-checkpoint-2"


def save(
    path: str,
    model: nn.Module,
    opt: Checkpointable,
    *,
    extra: dict | None = None,
    keep: int | None = None,
    blocking: bool = True,
) -> str | AsyncSave:
    """Write a checkpoint of `model` and its ZeroAdam `opt` to the folder `path` (every rank calls
    it; each writes only what it owns). `extra` (LR scheduler state, data position, RNG: plain
    values, tensors, numpy arrays; stored as JSON, [Note: safe checkpoints]) comes back from load().
    The folder appears only when complete: [Note: atomic checkpoints]. keep=K (K >= 2): afterwards,
    delete all but the K latest complete checkpoints beside it ([Note: which checkpoint is the
    latest]), never this one. Returns path.

    blocking=False: copy this rank's shard (into memory reused by every such save: staging.Staging) and
    return an AsyncSave handle (.wait(), .done()) while a background thread writes the copy; the
    next step() may run at once. A second save, load() and the process's exit wait for it; its
    error is raised by .wait() or by the next save / load ([Note: asynchronous save])."""
    background.settle()
    path = os.fspath(path)
    if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 2):
        raise ValueError(f"zerofast.checkpoint.save: keep must be None or an integer >= 2; got {keep!r}")
    if not isinstance(blocking, bool):
        raise TypeError(f"zerofast.checkpoint.save: blocking must be True or False; got {blocking!r}")
    if os.path.exists(path):
        raise FileExistsError(
            f"zerofast.checkpoint.save: {path} exists; a checkpoint is never overwritten "
            f"(choose a new folder per save, e.g. step-000100)"
        )
    view = opt.checkpoint_view
    steps = view.step_counts()
    manifest = _manifest(view, step=max(steps.values(), default=0))
    state_small, manifest = _every_stage(view.facts, small_state(view), manifest)
    small = safe.dumps_small(state_small, extra)  # every rank: a bad `extra` fails on all alike
    f = view.facts
    if f.rank == 0 and os.path.exists(path + INCOMPLETE):
        shutil.rmtree(path + INCOMPLETE)  # what a killed save left behind
    if f.rank == 0 and not blocking:
        os.makedirs(path + INCOMPLETE)  # visible at once: a trainer's folder never looks finished without it
    if blocking:
        dist.barrier(group=f.group)
        state = tensors(model, view)
        _write(path, state, f.group, f.rank, small, manifest, keep)
        return path
    group = background.checkpoint_group(f.group, f.world_size)  # every rank, here: also the barrier above's role
    staged = _STAGING.get(view)
    if staged is None:
        staged = _STAGING[view] = Staging()
    state = tensors(model, view, staged)
    staged.synchronize()
    dist.barrier(group=f.group)  # the stale ".incomplete" is gone on every rank's view before any writes
    return background.submit(path, lambda: _write(path, state, group, f.rank, small, manifest, keep))


# Per optimizer (by its view, which lives as long as it), the Staging its asynchronous saves reuse.
_STAGING: weakref.WeakKeyDictionary[CheckpointView, Staging] = weakref.WeakKeyDictionary()


def staging_of(opt: Checkpointable) -> Staging | None:
    """The copy `opt`'s asynchronous saves reuse (None before the first)."""
    return _STAGING.get(opt.checkpoint_view)


def staging_bytes(opt: Checkpointable) -> int:
    """Host memory held for `opt`'s asynchronous saves (0 before the first)."""
    staged = staging_of(opt)
    return 0 if staged is None else staged.nbytes()


def _write(path: str, state: dict, group, rank: int, small: bytes, manifest: dict, keep: int | None) -> None:
    """Write `state` (live views, or a staged copy) as `path`, every rank of `group` calling; rank 0
    completes the folder, then purges ([Note: atomic checkpoints]). A failure is raised by every rank:
    DCP reports one rank's to all, and rank 0 sends the outcome of its part to the others (a barrier
    there would leave them waiting on a rank that raised); rank 0 removes the unfinished folder."""
    tmp = path + INCOMPLETE
    try:
        torch_dcp.save(state, checkpoint_id=tmp, process_group=group)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier(group=group)
    failed: BaseException | None = None
    if rank == 0:
        try:
            root = os.path.dirname(os.path.abspath(path))
            with open(os.path.join(tmp, SMALL), "wb") as out:
                out.write(small)
            with open(os.path.join(tmp, MANIFEST), "w") as out:
                json.dump({**manifest, "save_counter": next_save_counter(root)}, out, indent=1)
            os.replace(tmp, path)
            if keep is not None:
                _purge(root, keep, path)
        except Exception as err:  # noqa: BLE001 (every rank must hear of it)
            failed = err
            shutil.rmtree(tmp, ignore_errors=True)
    outcome = [None if failed is None else f"{type(failed).__name__}: {failed}"]
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
    if failed is not None:
        raise failed
    if outcome[0] is not None:
        raise RuntimeError(f"zerofast.checkpoint.save: rank 0 could not complete {path}: {outcome[0]}")


def load(path: str, model: nn.Module, opt: Checkpointable) -> dict:
    """Load the checkpoint at `path` into `model` and its ZeroAdam `opt`, whatever world size,
    stage, partition, bucket size, units or precision either side uses; returns the `extra` saved
    with it. Every rank calls it (after this process's asynchronous save in flight, if any, ends).
    Nothing in the checkpoint is run as code: [Note: safe checkpoints]."""
    background.settle()
    path = os.fspath(path)
    view = opt.checkpoint_view
    manifest = _check_manifest(path, view)
    small = read_small(path)
    # fp32 and 8-bit state load into each other: [Note: 8-bit checkpoints] in dcp.py
    state, convert = loading_tensors(model, view, manifest.get("state_block", 0))
    torch_dcp.load(
        state,
        storage_reader=safe.SafeReader(path),
        planner=safe.SafeLoadPlanner(),
        process_group=view.facts.group,
    )
    convert()
    finish_load(view, small)
    return small["extra"]


def latest(root: str) -> str | None:
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
        found.append((_order(_manifest_fields(manifest), name), folder))
    return sorted(found)


def next_save_counter(root: str) -> int:
    """The save counter of the next checkpoint written under `root`: one more than the largest of
    its complete checkpoints ([Note: which checkpoint is the latest]). Rank 0 reads it after every
    rank's data is written, just before the manifest (tests fail a save at that point through it)."""
    counters = [key[1] for key, _ in _complete(root)] if os.path.isdir(root) else []
    return max(counters, default=0) + 1


def _purge(root: str, keep: int, written: str) -> None:
    """Delete all but the `keep` latest complete checkpoints under root; never `written`."""
    for _, folder in _complete(root)[:-keep]:
        if os.path.abspath(folder) != os.path.abspath(written):
            shutil.rmtree(folder)


def _manifest(view: CheckpointView, step: int) -> dict:
    """The manifest but its save counter (rank 0 adds it when the folder is complete)."""
    f = view.facts
    return {
        "format": FORMAT,
        "created": time.time(),
        "world_size": f.world_size,
        "shard_size": f.shard_size,
        "stage": f.stage,
        "partition": f.partition,
        "precision": f.precision,
        "state_block": view.trainable.state_block,  # 0: fp32 optimizer state ([Note: 8-bit checkpoints])
        "zerofast": __version__,
        "torch": torch.__version__,
        "step": step,
        "params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype)} for n, p in view.trainable.params],
    }


def _every_stage(f, small: dict, manifest: dict) -> tuple[dict, dict]:
    """A pipelined model's small state and manifest over every stage, in "pp" rank order (each rank
    holds other parameters: [Note: pipeline accumulation] in zerofast/pipelining.py), so the files
    rank 0 writes name the whole model. The stages' parameter groups with the same hyper-parameters
    are one group of the model (each stage's part groups its parameters as the model does), so
    to_torch gives one torch optimizer's groups. Collective over "pp"; unchanged without a "pp" dim."""
    if f.pp_group is None:
        return small, manifest
    everyone: list = [None] * dist.get_world_size(f.pp_group)
    dist.all_gather_object(everyone, (small["steps"], small["param_groups"], manifest["params"]), group=f.pp_group)
    groups: dict[str, dict] = {}
    for _, stage_groups, _ in everyone:
        for g in stage_groups:
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.setdefault(repr(sorted(hyper.items())), {**hyper, "params": []})["params"].extend(g["params"])
    small = {
        **small,
        "steps": {n: s for steps, _, _ in everyone for n, s in steps.items()},
        "param_groups": list(groups.values()),
    }
    return small, {**manifest, "params": [e for _, _, params in everyone for e in params], "pp": len(everyone)}


def _check_manifest(path: str, view: CheckpointView) -> dict:
    """Every rank reads the manifest itself, so a mismatch is the same error everywhere, never a
    hang; returns it."""
    if not os.path.exists(path):
        if os.path.exists(path + INCOMPLETE):
            raise FileNotFoundError(
                f"zerofast.checkpoint.load: {path} was never completed (only {path}{INCOMPLETE} "
                f"exists: the save was interrupted); use latest() to find the last complete one"
            )
        raise FileNotFoundError(f"zerofast.checkpoint.load: no checkpoint at {path}")
    manifest = read_manifest(path)
    saved = manifest["params"]
    mine = [(n, list(p.shape)) for n, p in view.trainable.params]
    theirs = [(e["name"], e["shape"]) for e in saved]
    if view.facts.pp_group is not None or manifest.get("pp", 1) > 1:
        _check_by_name(theirs, mine, whole=view.facts.pp_group is None)
        return manifest
    for k, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            raise ValueError(
                f"zerofast.checkpoint.load: parameter {k} differs: the checkpoint has {a[0]} of shape "
                f"{tuple(a[1])}, the model has {b[0]} of shape {tuple(b[1])}"
            )
    if len(theirs) != len(mine):
        raise ValueError(
            f"zerofast.checkpoint.load: the checkpoint has {len(theirs)} trainable parameters, the model {len(mine)}"
        )
    return manifest


def _check_by_name(theirs: list, mine: list, whole: bool) -> None:
    """A pipelined save or load: the parameters by name (a stage's part is some of the model's, in
    its own order): each of this rank's in the checkpoint with its shape; all of them for a model
    that is not cut (whole)."""
    saved = dict(theirs)
    for name, shape in mine:
        if name not in saved:
            raise ValueError(
                f"zerofast.checkpoint.load: the checkpoint has no parameter {name} (this rank's part has it)"
            )
        if saved[name] != shape:
            raise ValueError(
                f"zerofast.checkpoint.load: {name} has shape {tuple(saved[name])} in the checkpoint, "
                f"{tuple(shape)} in the model"
            )
    if whole and len(mine) != len(saved):
        missing = sorted(set(saved) - {n for n, _ in mine})
        raise ValueError(
            f"zerofast.checkpoint.load: the checkpoint has {len(saved)} trainable parameters, the model {len(mine)} "
            f"(not in the model: {missing[:3]})"
        )


# --- looking inside without a process group -------------------------------------------------------


def read_manifest(path: str) -> dict:
    """The manifest, after checking every file of the checkpoint: the manifest's fields, the small
    state, DCP's .metadata (through the allowlist: [Note: safe checkpoints]), and that every data file
    the metadata points into exists and is long enough. A missing, damaged or crafted file is an error
    naming it, raised by every rank alike (each reads the files itself) before any collective or other read."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zerofast.checkpoint: no checkpoint at {path}")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"zerofast.checkpoint: {manifest_path} is missing: not a complete zerofast checkpoint")
    manifest = _manifest_fields(manifest_path)
    if manifest["format"] != FORMAT or os.path.exists(os.path.join(path, LEGACY_SMALL)):
        _refuse_legacy(path, manifest["format"])
    for needed in (os.path.join(path, SMALL), os.path.join(path, ".metadata")):
        if not os.path.isfile(needed):
            raise FileNotFoundError(f"zerofast.checkpoint: {needed} is missing: not a complete zerofast checkpoint")
    small = read_small(path)
    names = {e["name"] for e in manifest["params"]}
    if set(small["steps"]) != names or not {n for g in small["param_groups"] for n in g["params"]} <= names:
        raise ValueError(
            f"zerofast.checkpoint: {os.path.join(path, SMALL)} does not match {manifest_path} (other "
            f"parameter names): the files are from different checkpoints, or were altered"
        )
    ends: dict[str, int] = {}
    for item in safe.read_metadata(os.path.join(path, ".metadata"), keep=True).storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        data = os.path.join(path, name)
        if not os.path.isfile(data):
            raise FileNotFoundError(f"zerofast.checkpoint: {data} is missing")
        if os.path.getsize(data) < end:
            raise ValueError(
                f"zerofast.checkpoint: {data} is truncated: {os.path.getsize(data):,} bytes, the metadata needs {end:,}"
            )
    return manifest


def _sharded_by(m: dict) -> str:
    """info()'s words for a hybrid-sharded save, else "" (a manifest without shard_size: flat)."""
    k = m.get("shard_size", m["world_size"])
    return f" (sharded in groups of {k}, replicated across {m['world_size'] // k})" if k != m["world_size"] else ""


def _valid_shard_size(m: dict) -> bool:
    """A manifest's shard_size (absent before hybrid sharding): an int dividing world_size."""
    k = m.get("shard_size", m.get("world_size"))
    return isinstance(k, int) and not isinstance(k, bool) and k >= 1 and m["world_size"] % k == 0


def _manifest_fields(manifest_path: str) -> dict:
    """manifest.json as JSON, its fields checked (format, step, save counter, parameters)."""
    m = safe.read_json(manifest_path)
    ok = (
        isinstance(m, dict)
        and isinstance(m.get("format"), str)
        and all(isinstance(m.get(k, 0), int) and not isinstance(m.get(k, 0), bool) for k in ("step", "save_counter"))
    )
    if ok and m["format"] == FORMAT:
        ok = (
            all(
                isinstance(m.get(k), int) and not isinstance(m.get(k), bool)
                for k in ("world_size", "stage", "step", "save_counter")
            )
            and all(isinstance(m.get(k), str) for k in ("partition", "precision", "zerofast", "torch"))
            and _valid_shard_size(m)
            and isinstance(m.get("pp", 1), int)
            and isinstance(m.get("state_block", 0), int)
            and not isinstance(m.get("state_block", 0), bool)
            and m.get("state_block", 0) >= 0
            and isinstance(m.get("params"), list)
            and all(
                isinstance(e, dict)
                and isinstance(e.get("name"), str)
                and isinstance(e.get("dtype"), str)
                and isinstance(e.get("shape"), list)
                and all(isinstance(d, int) for d in e["shape"])
                for e in m["params"]
            )
        )
    if not ok:
        raise ValueError(
            f"zerofast.checkpoint: {manifest_path} is not a zerofast manifest (its fields are missing "
            f"or of the wrong type): the file is damaged or was altered"
        )
    return m


def read_small(path: str) -> dict:
    """zerofast.json of the checkpoint at `path`: the small state and the caller's `extra`, decoded
    from JSON ([Note: safe checkpoints]), its fields checked."""
    where = os.path.join(path, SMALL)
    with open(where, "rb") as f:
        small = safe.loads(f.read(), where)
    ok = (
        isinstance(small, dict)
        and {"steps", "param_groups", "loss_scaler", "extra"} <= small.keys()
        and isinstance(small["steps"], dict)
        and all(isinstance(k, str) and isinstance(v, int) for k, v in small["steps"].items())
        and isinstance(small["param_groups"], list)
        and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"])
            for g in small["param_groups"]
        )
        and (small["loss_scaler"] is None or isinstance(small["loss_scaler"], dict))
    )
    if not ok:
        raise ValueError(
            f"zerofast.checkpoint: {where} is not a zerofast small state (its fields are missing or "
            f"of the wrong type): the file is damaged or was altered"
        )
    return small


def _refuse_legacy(path: str, fmt: str) -> None:
    if fmt == "zerofast-checkpoint-1" and os.path.isfile(os.path.join(path, LEGACY_SMALL)):
        raise ValueError(
            f"zerofast.checkpoint: {path} was written by an older zerofast, whose small state "
            f"({LEGACY_SMALL}) is a pickle, which can run code when opened. If you trust where it came "
            f"from, convert it once: python -m zerofast.checkpoint upgrade {path} --trust-pickle"
        )
    raise ValueError(f"zerofast.checkpoint: {path} has format {fmt!r}; this zerofast reads {FORMAT!r}")


def upgrade(path: str, trust_pickle: bool = False) -> None:
    """Convert a checkpoint written by an older zerofast (format 1: the small state as a pickle,
    zerofast.pt) to this format (zerofast.json): only for a checkpoint whose origin you trust, as
    reading the pickle can run code (trust_pickle=True says so). The tensors are not touched."""
    manifest_path = os.path.join(path, MANIFEST)
    manifest = _manifest_fields(manifest_path)
    legacy = os.path.join(path, LEGACY_SMALL)
    if manifest["format"] == FORMAT and not os.path.exists(legacy):
        return
    if manifest["format"] != "zerofast-checkpoint-1" or not os.path.isfile(legacy):
        raise ValueError(
            f"zerofast.checkpoint.upgrade: {path} is not a format-1 zerofast checkpoint (format {manifest['format']!r})"
        )
    if not trust_pickle:
        raise ValueError(
            f"zerofast.checkpoint.upgrade: reading {legacy} unpickles it, which runs whatever code it "
            f"names; pass trust_pickle=True (--trust-pickle) only for a checkpoint you trust"
        )
    small = torch.load(legacy, weights_only=False)
    data = safe.dumps(small, where=legacy)
    with open(os.path.join(path, SMALL + ".tmp"), "wb") as out:
        out.write(data)
    os.replace(os.path.join(path, SMALL + ".tmp"), os.path.join(path, SMALL))
    manifest.update(format=FORMAT, step=manifest.get("step", 0), save_counter=manifest.get("save_counter", 0))
    with open(manifest_path + ".tmp", "w") as out:
        json.dump(manifest, out, indent=1)
    os.replace(manifest_path + ".tmp", manifest_path)
    os.remove(legacy)


def info(path: str) -> str:
    """A few lines about the checkpoint at `path`: how it was saved and what it holds."""
    m = read_manifest(path)
    numel = sum(torch.Size(p["shape"]).numel() for p in m["params"])
    files = sorted(os.listdir(path))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    step = f", optimizer step {m['step']} (save {m['save_counter']} in its folder)" if "step" in m else ""
    return "\n".join(
        [
            f"{path}: zerofast checkpoint ({m['format']}), zerofast {m['zerofast']}, torch {m['torch']}",
            f"saved by {m['world_size']} ranks{_sharded_by(m)}, stage {m['stage']}, {m['partition']} partition, "
            f"{m['precision']}{step}",
            f"{len(m['params'])} trainable parameters, {numel:,} elements; {len(files)} files, {size:,} bytes",
        ]
    )
