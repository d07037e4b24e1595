"""Rank 0's progress bar on stderr (Progress), and whether its line is still open, which the fault
exit reads so that its line starts on a new one."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on rank 0 (stderr), with loss and tokens/s."""

    line_open = False  # the bar's line is drawn and not yet ended: exit_on_fault starts a new one

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.start = total, enabled, time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * (step + 1) / max(1, self.total))
        bar = "#" * done + "." * (width - done)
        sys.stderr.write(f"\r[{bar}] {step + 1}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s")
        Progress.line_open = step + 1 != self.total
        if not Progress.line_open:
            sys.stderr.write("\n")
        sys.stderr.flush()
