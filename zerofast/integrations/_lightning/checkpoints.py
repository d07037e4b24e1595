"""The checkpoint folder ZeroStrategy writes: its layout (the names below) and _into_place, which renames
a complete folder over the old one."""

from __future__ import annotations

import os
import shutil

ZERO_DIR = "zerofast"  # <checkpoint>/zerofast: the sharded zerofast checkpoint
LIGHTNING_FILE = "lightning.ckpt"  # <checkpoint>/lightning.ckpt: Lightning's own state, by rank 0
WRITING = ".writing"  # the folder while it is written; renamed when complete


def _into_place(tmp: str, path: str) -> None:
    """Rename the complete folder `tmp` to `path`, replacing what is there (a folder: only after)."""
    old = path + ".replaced"
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            os.replace(path, old)
        else:
            os.remove(path)
    os.replace(tmp, path)
    if os.path.exists(old):
        shutil.rmtree(old)
