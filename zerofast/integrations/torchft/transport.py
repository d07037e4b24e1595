"""torchft's checkpoint transport without pickle ([Note: replica groups on torchft] in
zerofast/integrations/torchft/__init__.py: the transport)."""

from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist
from torchft.checkpointing.transport import CheckpointTransport

from ...errors import LayoutMismatchError

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
_MAX_HEADER = 64 << 20  # bytes: a header is the structure of a state dict, never its data


class SafeTransport(CheckpointTransport):
    """torchft's checkpoint transport without pickle: a JSON header, then each tensor's bytes, over
    torchft's process group (the replicas' ranks). See [Note: replica groups on torchft]."""

    def __init__(self, pg: dist.ProcessGroup, timeout: datetime.timedelta):
        self._pg, self._timeout = pg, timeout

    def metadata(self) -> str:
        return "zerofast-safe-transport"

    def disallow_checkpoint(self) -> None:
        pass  # send_checkpoint returns once every byte is sent: nothing reads the state after it

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        tensors: list[torch.Tensor] = []
        header = json.dumps({"step": step, "state": _encode(state_dict, tensors)}).encode()
        works = []
        length = torch.tensor([len(header)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8).clone()  # owns its bytes while in flight
        payloads = [length, body] + [_bytes_of(t) for t in tensors]
        for dst in dst_ranks:
            for tag, payload in enumerate(payloads):
                works.append(self._pg.send([payload], dst, tag=tag))
        for w in works:
            w.wait(timeout)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        if metadata != self.metadata():
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: the peer sends its state with {metadata!r}, not "
                f"{self.metadata()!r}: every replica group must use SafeTransport"
            )
        length = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([length], src_rank, tag=0).wait(timeout)
        n = int(length.item())
        if not 0 < n <= _MAX_HEADER:
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: a state header of {n} bytes from rank {src_rank}"
            )
        body = torch.empty(n, dtype=torch.uint8)
        self._pg.recv([body], src_rank, tag=1).wait(timeout)
        header = json.loads(body.numpy().tobytes())
        if header.get("step") != step:
            raise LayoutMismatchError(
                f"zerofast.integrations.torchft: the state received is of step {header.get('step')}, not {step}"
            )
        specs: list[tuple[torch.dtype, list[int]]] = []
        state = _decode(header["state"], specs)
        received = []
        for i, (dtype, shape) in enumerate(specs):
            t = torch.empty(shape, dtype=dtype)
            self._pg.recv([_bytes_of(t)], src_rank, tag=2 + i).wait(timeout)
            received.append(t)
        return _fill(state, received)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def _encode(value, tensors: list):
    """JSON-able: tensors replaced by their place in `tensors`, tuples as lists."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"__tensor__": len(tensors) - 1, "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"zerofast.integrations.torchft: state keys must be strings; got {list(value)!r}")
        return {k: _encode(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"zerofast.integrations.torchft: a state value of type {type(value).__name__} cannot be sent "
        f"(tensors, numbers, strings, lists and dicts can)"
    )


def _decode(value, specs: list):
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = _DTYPES.get(value.get("dtype"))
        shape = value.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise LayoutMismatchError(f"zerofast.integrations.torchft: a tensor described as {value!r}")
        specs.append((dtype, shape))
        return _Slot(len(specs) - 1)
    if isinstance(value, dict):
        return {k: _decode(v, specs) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, specs) for v in value]
    return value


class _Slot:
    def __init__(self, index: int):
        self.index = index


def _fill(value, tensors: list):
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    return value
