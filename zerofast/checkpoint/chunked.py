"""ChunkedTensor: the rectangular chunks of a tensor this rank holds (views of the live state), as
torch.distributed.checkpoint (DCP) saves and loads them.

A rank's flat range of a parameter is a few boxes of any shape ([Note: flat slices as chunks] in
dcp.py): a DTensor cannot describe them (one even block per rank and dimension), and ShardedTensor,
which could, is deprecated. DCP's planner calls DTensor's protocol on any value that has its methods
(torch.distributed._checkpointable._Checkpointable, torch 2.11 to 2.14 alike):
  __create_write_items__  one WriteItem per chunk, which DCP gathers into the metadata's
                          TensorStorageMetadata, one ChunkStorageMetadata per chunk;
  __create_chunk_list__   the chunks to load, filled by DCP's resharding from the saved chunks that
                          overlap them;
  __get_tensor_shard__    the chunk at given offsets (saving reads it, loading copies into it).
That is the metadata a ShardedTensor's shards gave DCP, so checkpoints written with ShardedTensor
(zerofast before this class) and with it load into each other's configurations.

It is a torch.Tensor (a wrapper subclass holding no storage) because DCP looks values up
(find_state_dict_object) and prepares them for loading (_init_state_dict) as tensors; any operation on
it is an error. torch 2.14's CheckpointableTensor protocol does not fit: its chunks are boxes of one
local tensor with the global tensor's dimensions, a flat range's are views of a 1-D buffer, and
torch 2.11 lacks it."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["ChunkedTensor"]


class ChunkedTensor(torch.Tensor):
    """A tensor of `shape` and `dtype` of which this rank holds `chunks`: [(offsets, tensor)], each
    tensor the box at those offsets (its shape the box's sizes, the same dtype), none overlapping
    (the ranks' chunks together cover the tensor once: DCP checks this when it saves)."""

    _chunks: list[tuple[torch.Size, torch.Tensor]]
    _at: dict[torch.Size, torch.Tensor]

    @staticmethod
    def __new__(
        cls, shape: tuple[int, ...], dtype: torch.dtype, chunks: list[tuple[tuple[int, ...], torch.Tensor]], device=None
    ) -> ChunkedTensor:
        shape = torch.Size(shape)
        for offsets, t in chunks:
            if len(offsets) != len(shape) or t.dim() != len(shape) or t.dtype != dtype:
                raise ValueError(
                    f"ChunkedTensor: a chunk at {tuple(offsets)} of {t.dtype} and shape {tuple(t.shape)} in a "
                    f"tensor of {dtype} and shape {tuple(shape)}"
                )
            if any(o < 0 or o + s > n for o, s, n in zip(offsets, t.shape, shape)):
                raise ValueError(
                    f"ChunkedTensor: the chunk at {tuple(offsets)} of shape {tuple(t.shape)} lies outside "
                    f"the tensor's shape {tuple(shape)}"
                )
        if device is None:
            device = chunks[0][1].device if chunks else torch.device("cpu")
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        out._chunks = [(torch.Size(o), t) for o, t in chunks]
        out._at = dict(out._chunks)
        return out

    @property
    def chunks(self) -> list[tuple[torch.Size, torch.Tensor]]:
        return list(self._chunks)

    def __repr__(self, *, tensor_contents=None) -> str:
        boxes = ", ".join(f"{tuple(o)}+{tuple(t.shape)}" for o, t in self._chunks)
        return f"ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, chunks=[{boxes}])"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"ChunkedTensor does not support {func}: it describes this rank's chunks of a tensor for "
            f"torch.distributed.checkpoint (its chunks are .chunks), it is not a tensor to compute with. "
            f"A ZeroAdam state_dict() holds these: code that moves or copies an optimizer's state cannot "
            f"take it (Hugging Face Accelerate's prepare() does: use "
            f"zerofast.integrations.accelerate.ZeroAccelerator; save with zerofast.checkpoint)"
        )

    # --- DCP's checkpointable protocol (torch.distributed._checkpointable._Checkpointable) ---------

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        properties = TensorProperties(
            dtype=self.dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.shape), properties=properties, size=self.shape
                ),
            )
            for offsets, t in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.shape) for offsets, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        found = self._at.get(index.offset) if index.offset is not None else None
        if found is None:
            raise ValueError(f"ChunkedTensor: no chunk of {index.fqn!r} at offsets {index.offset} on this rank")
        return found
