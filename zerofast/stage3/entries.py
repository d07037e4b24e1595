"""Entry: one tensor the weight iterator (weights.py) hands out, the model's tensors it is made from
and how to make it. A module of its own so that the views making their own entries (PEFT's merged
weights: zerofast/integrations/peft_weights.py) and the iterator depend on it, not on each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..tensor_parallel import local_copy, whole_copy


@dataclass(frozen=True)
class Entry:
    """One tensor to hand out, made once every tensor it reads has storage."""

    needs: tuple[torch.Tensor, ...]  # the model's tensors it is made from
    make: Callable[[], torch.Tensor]  # a new tensor, the receiver's to keep
    modules: tuple[nn.Module, ...] = ()  # whose units to gather together if `needs` span several


def copy_of(t: torch.Tensor, gather_tp: bool = True) -> Entry:
    """The entry that hands out a copy of `t`: a DTensor's whole (gather_tp) or this rank's local
    tensor ([Note: tensor parallelism])."""
    return Entry((t,), lambda: whole_copy(t) if gather_tp else local_copy(t))
