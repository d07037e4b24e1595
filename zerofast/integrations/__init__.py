"""Thin adapters of zerofast's public API onto training frameworks; each checks at import that its
host still has what it overrides, reads and calls (hosts.py)."""
