"""Export: a checkpoint's model entry as one safetensors file, streamed chunk by chunk from DCP's
data files, in one process without a process group ([Note: streaming export])."""

from __future__ import annotations

import itertools
import json
import os
import struct
import zipfile
import zlib
from io import RawIOBase

import torch

__all__ = ["export"]

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def export(path: str, out: str, dtype: str = "fp32") -> None:
    """The model entry as one safetensors file, streamed: the header first (names, shapes, dtypes,
    offsets, all known from the checkpoint's metadata), then every saved chunk copied, a few MiB
    at a time, from its data file to its place in the output; no tensor is ever held whole, so
    memory stays a constant however large the model and its tensors are ([Note: streaming export]).
    dtype: "fp32" or "bf16" for the floating-point tensors."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"zerofast.checkpoint.export: dtype must be fp32 or bf16; got {dtype!r}")
    from . import safe  # here, not at import: see the package's lazy names (__init__.py)
    from .io import read_manifest

    read_manifest(path)  # every file checked, the metadata through the allowlist: [Note: safe checkpoints]
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    metadata = safe.read_metadata(os.path.join(path, ".metadata"))
    where = {(index.fqn, tuple(index.offset)): info for index, info in metadata.storage_data.items()}
    entries = [
        (k, md) for k, md in metadata.state_dict_metadata.items() if k.startswith("model.") and hasattr(md, "size")
    ]
    header, starts, offset = {}, {}, 0
    for key, md in entries:
        kept = want if md.properties.dtype.is_floating_point else md.properties.dtype
        nbytes = torch.Size(md.size).numel() * kept.itemsize
        header[key[len("model.") :]] = {
            "dtype": _SAFETENSORS_DTYPES[kept],
            "shape": list(md.size),
            "data_offsets": [offset, offset + nbytes],
        }
        starts[key] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = out + ".incomplete"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        base = f.tell()
        try:
            for key, md in entries:
                kept = want if md.properties.dtype.is_floating_point else md.properties.dtype
                for chunk in md.chunks:
                    info = where[(key, tuple(chunk.offsets))]
                    _copy_chunk(path, info, md, chunk, kept, f, base + starts[key])
        except (KeyError, StopIteration, IndexError, zipfile.BadZipFile) as err:  # metadata and data disagree
            raise ValueError(
                f"zerofast.checkpoint.export: {os.path.join(path, '.metadata')} and the data files "
                f"disagree ({type(err).__name__}: {err}): the checkpoint is damaged"
            ) from None
    os.replace(tmp, out)


# [Note: streaming export]
# DCP stores each saved chunk as one torch.save record (an uncompressed zip) at (offset, length) in
# a data file, its values in "<archive>/data/0", row-major, little-endian. A chunk is a box of the
# tensor; its trailing dimensions that span the whole tensor make runs contiguous in both the
# record and the output, so the copy is a loop over those runs, each read in blocks of at most
# _BLOCK bytes (converted to bf16 on the way when asked) and written at its offset in the output.
# The entry is stored, not compressed, so its bytes are read straight from the data file into one
# reused buffer (its CRC checked on the way): reading it through zipfile's reader instead held four
# copies of each block (+15.9 MiB measured with 4 MiB blocks, against +7.8 MiB this way).

_BLOCK = 4 << 20


class _FileSlice(RawIOBase):
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
    stored = md.properties.dtype
    shape, sizes, offsets = list(md.size), list(chunk.sizes), list(chunk.offsets)
    if getattr(info, "transform_descriptors", None):
        raise ValueError(
            f"zerofast.checkpoint.export: {info.relative_path} holds transformed data "
            f"({info.transform_descriptors}); export reads plain DCP records only"
        )
    with open(os.path.join(path, info.relative_path), "rb") as f:
        start, nbytes, crc = _values_of(f, info)
        numel = torch.Size(sizes).numel()
        if nbytes != numel * stored.itemsize:
            raise ValueError(
                f"zerofast.checkpoint.export: a chunk in {info.relative_path} holds "
                f"{nbytes} bytes, its box {numel * stored.itemsize}"
            )
        # The longest run contiguous in both: the trailing dimensions the box spans entirely, and one more.
        k = len(shape)
        while k > 0 and (k == len(shape) or sizes[k] == shape[k]):
            k -= 1
            if sizes[k] != shape[k]:
                break
        run = torch.Size(sizes[k:]).numel() if shape else 1
        strides = [torch.Size(shape[d + 1 :]).numel() for d in range(len(shape))]
        block = memoryview(bytearray(min(_BLOCK - _BLOCK % stored.itemsize, run * stored.itemsize)))
        f.seek(start)
        got_crc = 0
        for index in _row_major(sizes[:k]):
            flat = sum((offsets[d] + index[d]) * strides[d] for d in range(k)) + sum(
                offsets[d] * strides[d] for d in range(k, len(shape))
            )
            out.seek(out_base + flat * kept.itemsize)
            left = run * stored.itemsize
            while left:
                n = f.readinto(block[: min(left, len(block))])
                if not n:
                    raise ValueError(f"zerofast.checkpoint.export: {info.relative_path} ends inside a chunk")
                left -= n
                got_crc = zlib.crc32(block[:n], got_crc)
                if kept != stored:
                    out.write(torch.frombuffer(block[:n], dtype=stored).to(kept).view(torch.uint8).numpy())
                else:
                    out.write(block[:n])
        if got_crc != crc:
            raise ValueError(
                f"zerofast.checkpoint.export: a chunk in {info.relative_path} is damaged (its CRC "
                f"differs from the one stored with it)"
            )


def _values_of(f, info) -> tuple[int, int, int]:
    """(offset in f, bytes, CRC-32) of the values of the torch.save record at (info.offset, info.length)
    of the open data file f, checked to be stored uncompressed and little-endian."""
    record = zipfile.ZipFile(_FileSlice(f, info.offset, info.length))
    names = record.namelist()
    data = next(n for n in names if n.endswith("/data/0"))
    order = next((n for n in names if n.endswith("/byteorder")), None)
    if order is not None and record.read(order) != b"little":
        raise ValueError(f"zerofast.checkpoint.export: {info.relative_path} is big-endian")
    entry = record.getinfo(data)
    if entry.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"zerofast.checkpoint.export: {info.relative_path} holds compressed data")
    f.seek(info.offset + entry.header_offset)
    header = f.read(30)  # the entry's local header: its name and extra field come next, then the values
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"zerofast.checkpoint.export: {info.relative_path} has no zip entry where its directory says")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.offset + entry.header_offset + 30 + name_len + extra_len, entry.file_size, entry.CRC


def _row_major(sizes: list[int]):
    """Every index tuple of a box of `sizes`, in row-major order (one empty tuple for no dimensions)."""
    return itertools.product(*(range(n) for n in sizes))
