"""Thin adapters of zerofast's public API onto training frameworks."""
