"""zerofast's release, in a module of its own: what a checkpoint records (zerofast/checkpoint/io.py)
reads it without importing the package root."""

__version__ = "0.1.0"
