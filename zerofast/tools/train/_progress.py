"""Rank 0's progress bar on stderr (Progress; the fault exit reads line_open), and the words for where an
offloaded optimizer state lives and what its I/O cost (placement, io_cost) for the bar and the closing report."""

from __future__ import annotations

import sys
import time

from ..quantities import format_bytes


def placement(offload) -> str:
    """Where the state of an OffloadReport lives, in words: "on disk" or "in host memory"."""
    return {"disk": "on disk", "host": "in host memory"}.get(offload.state, "on the device")


def io_cost(offload) -> str:
    """The last step's I/O of an OffloadReport: bytes read + written and their rate (disk only)."""
    moved = offload.read_bytes + offload.write_bytes
    return f"{format_bytes(moved)} r+w per step at {offload.io_bandwidth / 1e6:,.0f} MB/s"


class Progress:
    """A one-line progress bar on rank 0 (stderr), with loss and tokens/s; with an offloaded state,
    where it lives and (on disk) the last step's I/O."""

    line_open = False  # the bar's line is drawn and not yet ended: exit_on_fault starts a new one

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.start = total, enabled, time.perf_counter()
        self.drawn = 0  # the length of the line last drawn: a shorter one pads over its end

    def update(self, step: int, loss: float, tokens_per_s: float, offload=None) -> None:
        """offload: the optimizer's OffloadReport with --offload, else None."""
        if not self.enabled:
            return
        width = 30
        done = int(width * (step + 1) / max(1, self.total))
        bar = "#" * done + "." * (width - done)
        state = ""
        if offload is not None:
            state = f"  state {placement(offload)}" + (f": {io_cost(offload)}" if offload.state == "disk" else "")
        line = f"[{bar}] {step + 1}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s{state}"
        sys.stderr.write("\r" + line.ljust(self.drawn))
        self.drawn = len(line)
        Progress.line_open = step + 1 != self.total
        if not Progress.line_open:
            sys.stderr.write("\n")
        sys.stderr.flush()
