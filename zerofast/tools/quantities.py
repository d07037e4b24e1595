"""Quantities as people write and read them on a command line: parameter counts (7.5B), bandwidths
(400Gb/s), latencies (5us), and bytes and seconds printed back."""

from __future__ import annotations

import argparse
import re

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """A parameter count as people write it: 7000000, 7_000_000, 7e9, 7.5B, 350M, 1.2T, 125K."""
    s = text.strip().replace("_", "").replace(",", "")
    scale = 1
    if s[-1:].upper() in _SUFFIXES:
        scale, s = _SUFFIXES[s[-1].upper()], s[:-1]
    try:
        value = float(s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (try 7e9, 7.5B or 350M)") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}")
    if abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise argparse.ArgumentTypeError(f"not a whole number of parameters: {text!r} = {value}")
    return int(round(value))


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kKMGT]?)(B|b)(?:/s|ps)?\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)\s*$")
_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_rate(text: str) -> float:
    """A bandwidth as people write it, to bytes/s: 300GB/s, 400Gb/s (bits), 25 GB/s, 1.5e9B/s."""
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a bandwidth: {text!r} (try 300GB/s or 400Gb/s)")
    value = float(m.group(1)) * _PREFIX[m.group(2)]
    return value / 8 if m.group(3) == "b" else value


def parse_seconds(text: str) -> float:
    """A latency as people write it, to seconds: 5us, 10 us, 0.2ms, 1e-5s."""
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"not a latency: {text!r} (try 5us or 0.1ms)")
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def format_seconds(t: float) -> str:
    if t == 0:
        return "0"
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.1f} ms"
    return f"{t:.2f} s"


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
