"""Staging: an asynchronous save's copy of one rank's state ([Note: asynchronous save] in background.py)."""

from __future__ import annotations

import torch

from ..quant import block_slice, num_blocks
from .view import CheckpointView

__all__ = ["Staging"]


class Staging:
    """What save(..., blocking=False) copies on the caller's thread and the writer thread then writes
    through the same DCP state dict as a blocking save (dcp.tensors with `staged`). Made by the first
    save and refilled by every later one, never reallocated: the fp32 master and the flat buffers of
    this rank's shard holding its optimizer state, at the shard's own offsets (a piece's view is the
    same slice as in the live state), and the model's buffers (forwards may change them: BatchNorm's
    statistics). Frozen parameters are written from the live state: step() never changes them. On a
    GPU the copy is pinned host memory, so the device-to-host copies run at full speed and the writer
    reads host memory. Size: 3 x 4 bytes per owned element plus the buffers (nbytes())."""

    def __init__(self):
        self.flat: dict[str, torch.Tensor] = {}  # by the shard's buffer name ("master", "exp_avg", ...)
        self.buffers: dict[str, torch.Tensor] = {}
        self.buffer_of = lambda kind: kind  # the part's, once copied
        self.block = 0  # the part's state_block, once copied

    def _host(self, device: torch.device, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")

    def copy_from(self, view: CheckpointView) -> None:
        """Copy in the trainable part's master and each flat buffer its kinds live in, once (the caller
        has quiesced the optimizer; synchronize() waits for a GPU's copies)."""
        part = view.trainable
        self.block = part.state_block
        numel = part.layout.shard_numel(view.facts.shard_rank)
        names = {"master"} | {part.buffer_of(k) for i in range(len(part.params)) for k in part.saved_kinds(i)}
        with torch.no_grad():
            for name in sorted(names):
                size, dtype = numel, torch.float32
                if self.block and name.endswith("_scale"):
                    size = num_blocks(numel, self.block)
                elif self.block and name != "master":
                    dtype = torch.uint8  # 8-bit moments, as stored
                out = self.flat.get(name)
                if out is None or out.numel() != size or out.dtype != dtype:
                    out = self.flat[name] = self._host(part.device, (size,), dtype)
                for pc in part.pieces:  # a buffer by any kind it holds: the same memory
                    out[self._range(pc, name)].copy_(part.piece_view(pc, name), non_blocking=True)
        self.buffer_of = part.buffer_of
        self._device = part.device

    def _range(self, pc, name: str) -> slice:
        """Where a piece's values of the buffer `name` sit in it: its elements, or its blocks' scales."""
        if self.block and name.endswith("_scale"):
            return block_slice(pc.state_offset, pc.numel, self.block)
        return slice(pc.state_offset, pc.state_offset + pc.numel)

    def buffer(self, key: str, live: torch.Tensor) -> torch.Tensor:
        """The copy of the model's buffer `key` (made or refilled now)."""
        out = self.buffers.get(key)
        if out is None or out.shape != live.shape or out.dtype != live.dtype:
            out = self.buffers[key] = self._host(live.device, live.shape, live.dtype)
        with torch.no_grad():
            out.copy_(live.detach(), non_blocking=True)
        return out

    def synchronize(self) -> None:
        """Wait for the device-to-host copies (no-op on the CPU)."""
        if getattr(self, "_device", torch.device("cpu")).type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def piece_view(self, pc, kind: str) -> torch.Tensor:
        # by the shard's own buffer: [Note: Muon's momentum in exp_avg's slot] in zerofast/optim/state.py
        name = self.buffer_of(kind)
        return self.flat[name][self._range(pc, name)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.flat.values(), *self.buffers.values()])
