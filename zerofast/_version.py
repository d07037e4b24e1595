"""zerofast's release, apart so that checkpoint/io.py can record it without importing the package root."""

__version__ = "0.1.0"
