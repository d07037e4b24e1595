"""Every value a step reads back from the device to the host goes through here, named, so that a
test can count them (counting()) and a profile can find them.

[Note: host syncs]
On CUDA, reading a device value on the host (.item(), .tolist(), float(t), bool(t)) waits for
everything queued on the stream before it: the GPU runs dry while the host decides and then
launches the next kernels. step() reads what must decide something on the host, before the update:
  - "agreement": phase 2's one all_reduce(MAX) message ([Note: the step's agreement] in
    zerofast/optim/agreement.py). Always read: which parameters get an update, whether the ranks are
    in step, whether one failed, all decide on the host whether anything may be applied at all, and
    raising afterwards would be too late (nothing a step applies can be taken back).
  - "found_inf" (fp16's loss scaling only): whether any rank's gradient overflowed. The host needs it
    to skip the update on every rank, to leave the step counts (the bias corrections of the next
    update) alone and to back off the loss scale ([Note: loss scaling] in zerofast/optim/precision.py).
What goes the other way does not wait: the agreement's message is built on the host and copied
to the device from pinned memory without blocking (to_device), where a plain torch.tensor(...,
device="cuda") copies from pageable memory and synchronizes the stream first.
What is not read: the global gradient norm and the clip coefficient stay on the device and reach
the fused kernel as its grad_scale tensor ([Note: global gradient clipping] in
zerofast/optim/grads.py); clip_grad_value_'s bound is a device value too when a clip coefficient is
in it. So a step reads once (fp32 and bf16, with or without clipping) or twice (fp16).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

_counts: Counter | None = None  # reads by name while counting(), else None


def to_list(t: torch.Tensor, what: str) -> list:
    """t.tolist(), counted under `what`."""
    _count(what)
    return t.tolist()


def to_float(t: torch.Tensor, what: str) -> float:
    """A 1-element tensor's value, counted under `what`."""
    _count(what)
    return t.item()


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device`, without waiting for the device's stream (see above)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    # The caching host allocator keeps the pinned block until the copy, ordered on the stream, is done.
    return host.pin_memory().to(device, non_blocking=True)


def _count(what: str) -> None:
    if _counts is not None:
        _counts[what] += 1


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count the reads made inside the block, by name (tests, and anyone profiling a step)."""
    global _counts
    outer, _counts = _counts, Counter()
    try:
        yield _counts
    finally:
        if outer is not None:
            outer.update(_counts)
        _counts = outer
