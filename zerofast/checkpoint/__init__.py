"""Sharded checkpoints on torch.distributed.checkpoint (DCP): each rank writes only what it owns,
keyed by parameter name in each parameter's own shape, and a checkpoint loads into any ZeroAdam
configuration (world size, stage, partition, bucket size, units, precision).

    zerofast.checkpoint.save(path, model, opt, extra={"step": step})   # every rank calls it
    extra = zerofast.checkpoint.load(path, model, opt)                  # any configuration
    path = zerofast.checkpoint.latest(root)                             # latest complete, or None
    handle = zerofast.checkpoint.save(path, model, opt, blocking=False) # copy, write in the background
    zerofast.checkpoint.wait()                                          # the save in flight, if any

A checkpoint is a folder: DCP's files (the tensors: dcp.py, [Note: flat slices as chunks]), and
beside them zerofast.json (written by rank 0; the same on every rank and small: per-parameter step
counts, the param_groups' hyper-parameters by parameter name, the fp16 loss scaler's state, and the
caller's `extra`, returned by load() as saved) and manifest.json (io.py, [Note: atomic checkpoints]).
Opening one runs no code from it (safe.py, [Note: safe checkpoints]).

The package, by concern:
  dcp.py      flat ranges as boxes, the DCP state dict of a rank's pieces, binding to the
              optimizer (ZeroAdam.state_dict / load_state_dict)
  chunked.py  ChunkedTensor: a rank's boxes of a tensor, as DCP saves and loads them (its
              checkpointable protocol)
  staging.py  Staging: an asynchronous save's copy of a rank's state
  io.py       save / load in atomic folders, the manifest, latest(), keep=K's purge, info(), upgrade()
  background.py  asynchronous saves: the writer thread, its gloo group, the AsyncSave handle
  safe.py     reading without running code: the small state as tagged JSON, DCP's metadata through
              an allowlist, byte records with weights_only=True
  convert.py  to_torch / from_torch: plain torch.optim.AdamW state, both ways
  export.py   the model as one safetensors file, streamed ([Note: streaming export])
  __main__.py `python -m zerofast.checkpoint info|export`
  view.py     CheckpointView: what the package reads and writes of an optimizer
It reads the optimizer only through that view (opt.checkpoint_view) and imports nothing of
zerofast.optim: the optimizer imports this package (state_dict), not the other way round.
"""

from __future__ import annotations

from importlib import import_module

from .export import export

# name -> (module, its name there), imported when the name is first read (PEP 562), as the package
# root does: DCP, and the DTensor it imports, take about a second to import, which the optimizer
# (it imports view.py) and a process that never saves should not pay. export is imported above, not
# here: a lazy name that is also a submodule's would be shadowed by the submodule once that is
# imported.
_LAZY = {
    "AsyncSave": (".background", "AsyncSave"),
    "in_flight": (".background", "in_flight"),
    "wait": (".background", "settle"),
    "from_torch": (".convert", "from_torch"),
    "to_torch": (".convert", "to_torch"),
    "ChunkedTensor": (".chunked", "ChunkedTensor"),
    "boxes": (".dcp", "boxes"),
    "load_state_dict": (".dcp", "load_state_dict"),
    "state_dict": (".dcp", "state_dict"),
    **{
        name: (".io", name)
        for name in ("INCOMPLETE", "MANIFEST", "SMALL", "info", "latest", "load", "save", "staging_bytes", "upgrade")
    },
    **{name: (".safe", name) for name in ("SafeLoadPlanner", "SafeReader", "UnsafeCheckpoint")},
    **{name: (".view", name) for name in ("Checkpointable", "CheckpointView", "ShardedPart")},
}

# What users call. The rest stays reachable by name (the optimizer's state_dict binding, DCP's
# ChunkedTensor and safe reader and planner, CheckpointView, the folder's file names, the command
# line's main) for the library's own modules and tests, but is not the package's surface;
# UnsafeCheckpoint, the error a load raises, lives with every other in zerofast.errors.
__all__ = [
    "save",
    "load",
    "latest",
    "wait",
    "in_flight",
    "AsyncSave",
    "staging_bytes",
    "to_torch",
    "from_torch",
    "export",
    "info",
    "upgrade",
]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(module, __name__), attr)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'zerofast.checkpoint' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def main(argv=None) -> int:
    """`python -m zerofast.checkpoint info|export ...` (zerofast/checkpoint/__main__.py), as a call.
    Imported when called: importing __main__ with the package would make `python -m` warn."""
    from .__main__ import main as cli

    return cli(argv)
