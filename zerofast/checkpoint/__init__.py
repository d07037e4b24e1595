"""Sharded checkpoints on torch.distributed.checkpoint (DCP): each rank writes only what it owns, keyed
by parameter name in the parameter's own shape; a checkpoint loads into any ZeroAdam configuration
(world size, stage, partition, bucket size, units, precision).

    zerofast.checkpoint.save(path, model, opt, extra={"step": step})   # every rank calls it
    extra = zerofast.checkpoint.load(path, model, opt)                  # any configuration
    path = zerofast.checkpoint.latest(root)                             # latest complete, or None
    handle = zerofast.checkpoint.save(path, model, opt, blocking=False) # copy, write in the background
    zerofast.checkpoint.wait()                                          # the save in flight, if any

A checkpoint is a folder: DCP's files (the tensors), zerofast.json (the small state and the caller's
`extra`, which load() returns) and manifest.json. The package, by concern:
  dcp.py         the DCP state dict of a rank's pieces; ZeroAdam.state_dict / load_state_dict
                 ([Note: flat slices as chunks], [Note: 8-bit checkpoints])
  chunked.py     ChunkedTensor: a rank's boxes of a tensor behind DCP's checkpointable protocol
  io.py          save / load in atomic folders, latest(), keep=K, info(), upgrade()
                 ([Note: atomic checkpoints], [Note: which checkpoint is the latest])
  background.py  asynchronous saves: writer thread, gloo group, AsyncSave ([Note: asynchronous save])
  staging.py     Staging: an asynchronous save's copy of a rank's state
  safe.py        reading that runs no code from the checkpoint ([Note: safe checkpoints])
  convert.py     to_torch / from_torch: plain torch optimizer state, both ways
  export.py      the model as one safetensors file, streamed ([Note: streaming export])
  view.py        CheckpointView, the package's only access to an optimizer; binding.py builds it
  __main__.py    `python -m zerofast.checkpoint info|export|upgrade`
The optimizer imports this package (state_dict), never the other way round.
"""

from __future__ import annotations

from importlib import import_module

from .export import export

# name -> (module, its name there), imported on first read (PEP 562): DCP and the DTensor it imports
# take about a second, which the optimizer (it imports view.py) and a process that never saves should
# not pay. export is imported above: a lazy name that is also a submodule's would be shadowed once the
# submodule is imported.
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

# What users call; the other names serve the library's own modules and tests. UnsafeCheckpoint, the
# error a load raises, is public in zerofast.errors with every other.
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
    """`python -m zerofast.checkpoint ...` as a call; __main__ is imported here, as importing it with
    the package would make `python -m` warn."""
    from .__main__ import main as cli

    return cli(argv)
