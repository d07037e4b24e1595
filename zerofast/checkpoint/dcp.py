"""The checkpoint's tensors as a torch.distributed.checkpoint (DCP) state dict, keyed by parameter name
in each parameter's shape, views of this rank's pieces of the live state (tensors()); small_state();
ZeroAdam.state_dict / load_state_dict. The optimizer is read only through opt.checkpoint_view.
  "model": every key of model.state_dict(): trainable parameters from the fp32 master (the source of
      truth; in mixed precision the model's parameters are its rounding), stage 3's frozen parameters
      from their shard, as chunks too ([Note: frozen parameters in stage 3]), other frozen parameters
      and buffers as the model holds them, a tied weight under each of its names. A plain model loads
      it with dcp.load({"model": model.state_dict()}, checkpoint_id=path, no_dist=True).
  "optim": per trainable parameter name, its optimizer state by kind (exp_avg and exp_avg_sq, or a
      ZeroMuon matrix's momentum_buffer), fp32 in the parameter's shape ([Note: 8-bit checkpoints]).
small_state() is the rest, small and the same on every rank: per-parameter step counts, the
param_groups' hyper-parameters by parameter name, the fp16 loss scaler's state.

[Note: flat slices as chunks]
A rank owns 1-D ranges of the flattened parameters (layout.pieces). DCP describes a shard as a
rectangular chunk of the tensor (offsets and sizes per dimension), so each range is cut into at most
2 * ndim - 1 boxes of the row-major tensor: the tail of a partial first row, the full rows, the head
of a partial last row, recursively. A rank computes its boxes from the layout (a pure function),
without a collective, and padding is never written. Each tensor goes to DCP as a ChunkedTensor
(chunked.py) of this rank's boxes, views of the live state. The metadata is DCP's
TensorStorageMetadata, one chunk per box of every rank (DCP checks on save that they cover the
tensor once), and DCP's own resharding reads, for the loading configuration's boxes, whatever saved
chunks overlap them: any world size, stage or partition on either side. zerofast before
ChunkedTensor gave DCP the same boxes as ShardedTensors: the same metadata and files, which load as
they are (tests/test_checkpoint_format.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..quant import block_slice, code_of, num_blocks, scale_kind
from . import safe
from .chunked import ChunkedTensor
from .view import Checkpointable, CheckpointView, ShardedPart

if TYPE_CHECKING:
    from .staging import Staging

__all__ = [
    "boxes",
    "tensors",
    "loading_tensors",
    "small_state",
    "finish_load",
    "groups_by_name",
    "state_dict",
    "load_state_dict",
]


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
        out.append(
            ((first_full,) + (0,) * (len(shape) - 1), (last_full - first_full,) + tuple(shape[1:]), first_full * row)
        )
    if last_full * row < hi:  # the head of a partial last row
        out += [
            ((last_full,) + o, (1,) + z, last_full * row + f) for o, z, f in boxes(shape[1:], 0, hi - last_full * row)
        ]
    return out


def _exact(view: torch.Tensor) -> torch.Tensor:
    """`view`'s memory as a tensor whose storage is exactly its bytes. DCP clones a CPU tensor whose
    storage is larger than itself before writing it (else torch.save writes the whole storage); our
    boxes are views into the flat buffers, so every box would be copied, and the freed copies stay
    resident: +333 MiB per rank measured saving a 100M-parameter model in stage 2. Aliasing through
    numpy (float32 here: master and moments) avoids the copy."""
    if view.device.type != "cpu" or not view.is_contiguous() or view.dtype == torch.bfloat16:  # numpy has no bf16
        return view
    try:
        return torch.from_numpy(view.detach().numpy())
    except RuntimeError:  # torch without numpy ("Numpy is not available"): DCP copies the view
        return view


class _Chunks:
    """This rank's boxes of every parameter of one sharded part (trainable: fp32 values and state;
    stage 3's frozen: values in their dtype), views of the live state or of `staged`'s copy. Under
    hybrid sharding every replica describes the same boxes, and DCP's planner writes each once, the
    replicas splitting the writing (its dedup of replicated writes, balanced by size)."""

    def __init__(
        self,
        view: CheckpointView,
        part: ShardedPart,
        staged: Staging | _Decoding | None = None,
        block: int | None = None,
    ):
        self.shapes = [tuple(p.shape) for _, p in part.params]
        self.dtype, self.device = part.dtype, part.device
        self.view = part.piece_view if staged is None else staged.piece_view
        # per parameter, this rank's boxes: [(piece, offsets, sizes, flat start)]
        self.mine: list[list[tuple]] = [[] for _ in self.shapes]
        # 8-bit state's scales: per parameter a 1-D tensor, one per block ([Note: 8-bit checkpoints])
        self.block = part.state_block if block is None else block  # the format saved (a load's: the checkpoint's)
        self.scale_shapes = [(num_blocks(_numel(s), self.block),) if self.block else () for s in self.shapes]
        self.scale_mine: list[list[tuple]] = [[] for _ in self.shapes]
        for pc in part.layout.pieces(view.facts.shard_rank):
            # A DTensor parameter's pieces are of its local tensor: boxes of that, shifted to where it
            # sits in the whole ([Note: tensor parallelism] in zerofast/tensor_parallel.py).
            geometry = part.local_geometry[pc.param] if part.local_geometry is not None else None
            local, shift = (
                geometry if geometry is not None else (self.shapes[pc.param], (0,) * len(self.shapes[pc.param]))
            )
            for offsets, sizes, start in boxes(local, pc.param_offset, pc.param_offset + pc.numel):
                offsets = tuple(o + s for o, s in zip(offsets, shift))
                self.mine[pc.param].append((pc, offsets, sizes, start))
            if self.block:
                blocks = block_slice(pc.param_offset, pc.numel, self.block)
                self.scale_mine[pc.param].append((pc, (blocks.start,), (blocks.stop - blocks.start,), pc.param_offset))

    def _geometry(self, i: int, kind: str):
        """Parameter i's `kind` as saved: (this rank's boxes, shape, dtype)."""
        if self.block and kind.endswith("_scale"):
            return self.scale_mine[i], self.scale_shapes[i], torch.float32
        if self.block and kind != "master":
            return self.mine[i], self.shapes[i], torch.uint8
        return self.mine[i], self.shapes[i], self.dtype

    def chunked(self, i: int, kind: str) -> ChunkedTensor:
        """Parameter i's `kind` ("master", a state kind or, 8-bit, its scales) as a ChunkedTensor whose
        chunks are this rank's boxes."""
        mine, shape, dtype = self._geometry(i, kind)
        chunks = []
        for pc, offsets, sizes, start in mine:
            flat = self.view(pc, kind)
            lo = start - pc.param_offset
            chunks.append((offsets, _exact(flat[lo : lo + _numel(sizes)].view(sizes))))
        return ChunkedTensor(shape, dtype, chunks, device=None if chunks else self.device)


# --- the state dict: views into the live state (save reads them, load writes them) -----------------


def _model_entries(
    model: nn.Module, view: CheckpointView, chunks: _Chunks, staged: Staging | None = None
) -> dict[str, Any]:
    """The "model" entry (see the module docstring); with `staged`, buffers from its copy."""
    master, frozen = {}, {}
    frozen_chunks = _Chunks(view, view.frozen) if view.frozen is not None else None
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        i = view.trainable.index(value)
        j = view.frozen.index(value) if i is None and view.frozen is not None else None
        if j is not None:  # tied: one ChunkedTensor under each name
            if j not in frozen:
                frozen[j] = frozen_chunks.chunked(j, "master")
            out[key] = frozen[j]
            continue
        if i is None:
            out[key] = (
                value.detach() if staged is None or isinstance(value, nn.Parameter) else staged.buffer(key, value)
            )
            continue
        if i not in master:  # a tied weight: one ChunkedTensor under each of its names
            master[i] = chunks.chunked(i, "master")
        out[key] = master[i]
    return out


def _optim_entries(part: ShardedPart, chunks: _Chunks) -> dict[str, Any]:
    """The "optim" entry: per parameter name, its state by kind (ShardedPart.saved_kinds)."""
    return {
        name: {kind: chunks.chunked(i, kind) for kind in part.saved_kinds(i)} for i, (name, _) in enumerate(part.params)
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensors(
    model: nn.Module, view: CheckpointView, staged: Staging | None = None, decoding: _Decoding | None = None
) -> dict[str, Any]:
    """{"model": ..., "optim": ...}, views into the live state: dcp.save reads them, dcp.load writes
    them. `staged` (an asynchronous save): the state is copied into it first and the trainable values
    and buffers are views of the copy, which the next step() leaves alone. `decoding` (a load from
    another optimizer-state format: loading_tensors): "optim" is its temporaries."""
    view.quiesce()  # stage 3: only the shard is the state
    if staged is not None:
        staged.copy_from(view)
    chunks = _Chunks(view, view.trainable, staged)
    optim = decoding.entries(view) if decoding is not None else _optim_entries(view.trainable, chunks)
    return {"model": _model_entries(model, view, chunks, staged), "optim": optim}


def loading_tensors(model: nn.Module, view: CheckpointView, saved_block: int) -> tuple[dict[str, Any], Callable]:
    """What dcp.load fills for a checkpoint whose optimizer state was saved in `saved_block`'s
    format (0: fp32), and what to call after it: tensors() and nothing when the run's format is the
    same, else the temporaries of a conversion and their write ([Note: 8-bit checkpoints])."""
    if saved_block == view.trainable.state_block:
        return tensors(model, view), lambda: None
    decoding = _Decoding(view.trainable, saved_block)
    return tensors(model, view, decoding=decoding), decoding.write


# [Note: 8-bit checkpoints]
# 8-bit state is saved as it is stored: per parameter and moment, its uint8 code indices in the
# parameter's shape (chunked like the fp32 moments: [Note: flat slices as chunks]) and its blocks'
# fp32 scales as a 1-D tensor of its own (scale_kind: "exp_avg_scale", one per `state_block`
# elements of the flattened parameter). Blocks belong to parameters, not ranks, and every rank's
# piece of a parameter starts at a block boundary ([Note: quantized state] in zerofast/quant.py), so
# a piece's scales are one contiguous range of that 1-D tensor: DCP reshards codes and scales like
# any tensor, to any world size, stage, partition or shard size of a run with the same block size,
# and the bytes loaded are the bytes saved. The manifest records the format ("state_block": 0 for
# fp32 state). Where a checkpoint's format differs from the run's (fp32 into 8-bit, 8-bit into
# fp32, another block size), load reads the saved records for this rank's pieces into temporaries
# (_Decoding: the codes chunked, each parameter's scales whole, they are 1/64 of its fp32 bytes at
# block 256), turns them into fp32 values (dequantized) and writes them through the view's
# write_piece, which quantizes them into 8-bit state. to_torch dequantizes.


class _Decoding:
    """Temporaries for this rank's pieces in a checkpoint's other optimizer-state format (`saved_block`:
    0 fp32, else 8-bit blocks), filled by dcp.load, then decoded into the live state: [Note: 8-bit checkpoints]."""

    def __init__(self, part: ShardedPart, saved_block: int):
        self.part, self.saved_block = part, saved_block
        dtype = torch.uint8 if saved_block else torch.float32
        self.pieces = {
            (pc.param, pc.param_offset, kind): torch.empty(pc.numel, dtype=dtype)
            for pc in part.pieces
            for kind in part.kinds[pc.param]
        }
        # 8-bit: each parameter's scales whole (every rank reads the blocks its pieces need, wherever they lie)
        self.scales = {
            (i, kind): torch.empty(num_blocks(_numel(tuple(p.shape)), saved_block))
            for i, (_, p) in enumerate(part.params)
            for kind in part.kinds[i]
            if saved_block
        }

    def piece_view(self, pc, kind: str) -> torch.Tensor:
        return self.pieces[(pc.param, pc.param_offset, kind)]

    def entries(self, view: CheckpointView) -> dict[str, Any]:
        """The "optim" entry of the load's state dict, in the saved format."""
        chunks = _Chunks(view, self.part, self, block=self.saved_block)
        out = {}
        for i, (name, _) in enumerate(self.part.params):
            out[name] = {kind: chunks.chunked(i, kind) for kind in self.part.kinds[i]}
            for kind in self.part.kinds[i] if self.saved_block else ():
                out[name][scale_kind(kind)] = self.scales[(i, kind)]
        return out

    def write(self) -> None:
        """After dcp.load: every piece's moments as fp32 values, written into the live state."""
        for pc in self.part.pieces:
            for kind in self.part.kinds[pc.param]:
                values = self.piece_view(pc, kind)
                if self.saved_block:
                    scales = self.scales[(pc.param, kind)]
                    index = (torch.arange(pc.numel) + pc.param_offset) // self.saved_block
                    values = code_of(kind)[values.long()] * scales[index]  # quant.dequantize's product
                self.part.write_piece(pc, kind, values.to(self.part.device))


def groups_by_name(view: CheckpointView) -> list[dict]:
    """The optimizer's param_groups with each parameter given by its name."""
    part = view.trainable
    return [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [part.params[part.index(p)][0] for p in g["params"]],
        }
        for g in view.param_groups
    ]


def small_state(view: CheckpointView) -> dict[str, Any]:
    """What is the same on every rank and small: step counts, param_groups by parameter name, the
    loss scaler. Rank 0 writes it beside DCP's files (zerofast.json, as JSON), with the caller's `extra`."""
    return {
        "steps": view.step_counts(),
        "param_groups": groups_by_name(view),
        "loss_scaler": dict(view.loss_scaler_state()),
    }


def finish_load(view: CheckpointView, small: dict[str, Any]) -> None:
    """After the master and moments were written (by dcp.load or from_torch): step counts,
    hyper-parameters and loss scale from small_state() ("loss_scaler" None: ours stays), then the
    parameters synced from the master (view.sync_params_from_master)."""
    view.set_step_counts(small["steps"])
    saved_group_of = {n: g for g in small["param_groups"] for n in g["params"]}
    part = view.trainable
    for group in view.param_groups:
        saved = saved_group_of[part.params[part.index(group["params"][0])][0]]
        # JSON keeps tuples (betas, ZeroMuon's ns_coefficients) as lists
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"})
    if small["loss_scaler"] is not None:
        view.load_loss_scaler_state(small["loss_scaler"])
    view.sync_params_from_master()


# --- binding to the optimizer: ZeroAdam.state_dict / load_state_dict ------------------------------


def state_dict(opt: Checkpointable) -> dict[str, Any]:
    """ZeroAdam.state_dict(): tensors() and "zerofast", small_state() as JSON bytes, one opaque item
    for DCP ([Note: safe checkpoints])."""
    view = opt.checkpoint_view
    view.facts.check_not_pipelined("ZeroAdam.state_dict()")
    return {**tensors(view.model, view), "zerofast": safe.dumps(small_state(view), "ZeroAdam.state_dict()")}


def load_state_dict(opt: Checkpointable, loaded: dict[str, Any]) -> None:
    """ZeroAdam.load_state_dict(): after dcp.load filled a state_dict() of this optimizer."""
    if not isinstance(loaded, dict) or not isinstance(loaded.get("zerofast"), bytes) or "optim" not in loaded:
        raise ValueError(
            "ZeroAdam.load_state_dict: pass the dict from this optimizer's state_dict() after "
            "torch.distributed.checkpoint.load filled it (or use zerofast.checkpoint.load)"
        )
    finish_load(
        opt.checkpoint_view,
        safe.loads(loaded["zerofast"], "ZeroAdam.load_state_dict: the state dict's 'zerofast' entry"),
    )
