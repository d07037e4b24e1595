"""`python -m zerofast.checkpoint info|export ...`: inspect a checkpoint, or export its model as one
safetensors file, in one process without a process group."""
from __future__ import annotations

import argparse
import os
import sys

from .export import export
from .io import MANIFEST, info, latest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerofast.checkpoint", description="Inspect or export a zerofast checkpoint.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="the model as one safetensors file, streamed tensor by tensor")
    e.add_argument("path", help="a checkpoint, or a folder of them (its latest complete one)")
    e.add_argument("out")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    i = sub.add_parser("info", help="how the checkpoint was saved and what it holds")
    i.add_argument("path", help="a checkpoint, or a folder of them (its latest complete one)")
    args = p.parse_args(argv)
    path = args.path
    if not os.path.isfile(os.path.join(path, MANIFEST)) and latest(path) is not None:
        path = latest(path)  # a folder of checkpoints: its latest complete one
    try:
        if args.command == "export":
            export(path, args.out, args.dtype)
            print(f"wrote {args.out}")
        else:
            print(info(path))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
