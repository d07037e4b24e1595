"""`python -m zerofast.checkpoint info|export|upgrade ...`: info and export run in one process without a
process group and run no code from the checkpoint ([Note: safe checkpoints]); upgrade converts a
trusted checkpoint of an older zerofast."""

from __future__ import annotations

import argparse
import os
import sys

from .export import export
from .io import MANIFEST, info, latest, upgrade


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zerofast.checkpoint", description="Inspect or export a zerofast checkpoint."
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="the model as one safetensors file, streamed tensor by tensor")
    e.add_argument("path", help="a checkpoint, or a folder of them (its latest complete one)")
    e.add_argument("out")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    i = sub.add_parser("info", help="how the checkpoint was saved and what it holds")
    i.add_argument("path", help="a checkpoint, or a folder of them (its latest complete one)")
    u = sub.add_parser(
        "upgrade",
        help="convert a checkpoint of an older zerofast (its small state a pickle) to "
        "JSON; reading the pickle can run code: only for a checkpoint you trust",
    )
    u.add_argument("path")
    u.add_argument("--trust-pickle", action="store_true", help="say that you trust the checkpoint's origin")
    args = p.parse_args(argv)
    path = args.path
    try:
        if args.command == "upgrade":
            upgrade(path, trust_pickle=args.trust_pickle)
            print(f"upgraded {path}")
            return 0
        if not os.path.isfile(os.path.join(path, MANIFEST)) and latest(path) is not None:
            path = latest(path)  # a folder of checkpoints: its latest complete one
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
