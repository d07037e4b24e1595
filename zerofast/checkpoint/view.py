"""CheckpointView: all a checkpoint reads and writes of an optimizer, bound once (binding.py) and
handed out as `opt.checkpoint_view`; the package never reads the optimizer's attributes. It says per
parameter which state it holds (Adam's exp_avg and exp_avg_sq, or a ZeroMuon matrix's momentum_buffer),
so no reader asks the optimizer's class. Nothing of zerofast.optim is imported: the optimizer depends
on the checkpoint, never the other way round, and the command-line readers (info, export, to_torch) run
without the compiled extension the optimizer loads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from ..layout import Layout, Piece
from ..quant import code_of, dequantize, scale_kind

__all__ = ["CheckpointView", "Checkpointable", "Facts", "ScalerState", "ShardedPart"]


class ScalerState(TypedDict):
    """fp16's dynamic loss scale as plain data, as torch.amp.GradScaler keeps it."""

    scale: float
    growth_tracker: int  # clean steps in a row since the scale last changed
    enabled: bool  # False without fp16 loss scaling: the scale is 1 and stays


@dataclass(frozen=True)
class Facts:
    """The optimizer's configuration and ranks, as a checkpoint needs them."""

    rank: int  # among every data-parallel rank (the save's and load's group)
    world_size: int
    group: dist.ProcessGroup
    stage: int
    partition: str
    precision: str  # "fp32", "bf16" or "fp16"
    shard_rank: int  # among the ranks sharing the state, which its layout is cut for
    shard_size: int  # ([Note: hybrid sharding] in zerofast/topology.py; the world when flat)
    shard_group: dist.ProcessGroup
    # Pipeline parallelism: the ranks holding the other stages' parts at this rank's place (None: none).
    pp_group: dist.ProcessGroup | None = None

    def check_not_pipelined(self, what: str) -> None:
        """opt.state_dict() of a pipelined model: its one "zerofast" entry is per stage (its step counts
        and groups name this stage's parameters), of which DCP would keep one rank's."""
        if self.pp_group is not None:
            raise NotImplementedError(
                f'{what}: a model cut into pipeline stages (a "pp" mesh dim) is saved with zerofast.checkpoint.save '
                "(which joins every stage's small state), not through opt.state_dict() and dcp.save"
            )


@dataclass(frozen=True, eq=False)
class ShardedPart:
    """One sharded part of a rank's state: the trainable parameters (their fp32 master and
    optimizer state) or stage 3's frozen parameters (their values only: [Note: frozen parameters in
    stage 3] in zerofast/stage3/frozen.py). Parameter i is parameter i of `layout`; every rank's
    pieces follow from the layout, and this rank's values are live views."""

    params: tuple[tuple[str, nn.Parameter], ...]  # (name, parameter), index i: parameter i of the layout
    kinds: tuple[tuple[str, ...], ...]  # per parameter, its optimizer state by kind (() for frozen ones)
    layout: Layout  # every rank's pieces: layout.pieces(r)
    pieces: tuple[Piece, ...]  # this rank's (layout.pieces(facts.shard_rank))
    dtype: torch.dtype  # of the values: float32 (the master), or the frozen parameters' dtype
    device: torch.device
    # The live 1-D values of one of this rank's pieces by kind ("master" or one of `kinds`): writing
    # them writes the state (after the master: sync_params_from_master()). With 8-bit state a moment's
    # values are its uint8 code indices, and scale_kind(kind) gives its blocks' fp32 scales.
    piece_view: Callable[[Piece, str], torch.Tensor]
    # Write one of this rank's pieces of a kind from fp32 values (8-bit state: quantized).
    write_piece: Callable[[Piece, str, torch.Tensor], None]
    # Write this rank's pieces of a kind from whole tensors by parameter index.
    load_pieces: Callable[[str, Mapping[int, torch.Tensor]], None]
    # The flat buffer of the shard that holds a kind: kinds sharing one are copied once by an
    # asynchronous save ([Note: Muon's momentum in exp_avg's slot] in zerofast/optim/state.py).
    buffer_of: Callable[[str], str]
    # 0: fp32 state; else 8-bit state in blocks of this many elements of each parameter, every piece
    # starting at a block boundary ([Note: quantized state] in zerofast/quant.py).
    state_block: int = 0
    # Per parameter, a DTensor's (local shape, offsets in the whole tensor), or None for a plain one;
    # None: no DTensor at all ([Note: tensor parallelism] in zerofast/tensor_parallel.py).
    local_geometry: tuple | None = None

    @functools.cached_property
    def _index_of(self) -> dict[int, int]:
        return {id(p): i for i, (_, p) in enumerate(self.params)}

    def index(self, param: torch.Tensor) -> int | None:
        """The index of `param` in `params` (by identity), or None for any other tensor."""
        return self._index_of.get(id(param))

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.params]

    def saved_kinds(self, i: int) -> tuple[str, ...]:
        """The optimizer-state entries of parameter i in a checkpoint: its kinds, and with 8-bit
        state each moment's scales after it ([Note: 8-bit checkpoints] in dcp.py)."""
        if not self.state_block:
            return self.kinds[i]
        return tuple(k for kind in self.kinds[i] for k in (kind, scale_kind(kind)))

    def state_pieces(self, kind: str) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's part of `kind` ("master" or a kind of `kinds`), as (parameter name, offset into
        the flattened parameter, fp32 copy of the values) pieces; the ranks' pieces together cover
        every parameter holding `kind` once."""
        return [
            (self.params[pc.param][0], pc.param_offset, self.piece_values(pc, kind))
            for pc in self.pieces
            if kind == "master" or kind in self.kinds[pc.param]
        ]

    def piece_values(self, pc: Piece, kind: str) -> torch.Tensor:
        """One of this rank's pieces of `kind` as fp32 values, copied (8-bit state: dequantized)."""
        values = self.piece_view(pc, kind).detach()
        if self.state_block and kind != "master":
            scales = self.piece_view(pc, scale_kind(kind)).detach()
            return dequantize(values, scales, code_of(kind).to(values.device), self.state_block)
        return values.float().clone()


@dataclass(frozen=True, eq=False)
class CheckpointView:
    """What zerofast.checkpoint reads and writes of an optimizer (ZeroAdam, ZeroMuon): the model, the
    ranks, the sharded parts with their live views, the parameter groups, the step counts and the
    loss scale; and the two calls that bracket a read or write of the state outside step()."""

    model: nn.Module
    facts: Facts
    trainable: ShardedPart
    frozen: ShardedPart | None  # stage 3's sharded frozen parameters (None in stages 1 and 2)
    param_groups: list[dict]  # the optimizer's own list: a load writes the saved hyper-parameters into it
    step_counts: Callable[[], dict[str, int]]  # steps taken, per trainable parameter by name
    set_step_counts: Callable[[Mapping[str, int]], None]
    loss_scaler_state: Callable[[], ScalerState]
    # Restores loss_scaler_state() if loss scaling is on both here and where it came from.
    load_loss_scaler_state: Callable[[ScalerState], None]
    # Bring the state to rest, so that the shards alone are the state and nothing writes them: wait
    # for parameter gathers in flight (stages 1 and 2), release every gathered unit (stage 3).
    quiesce: Callable[[], None]
    # After the master was written (a load, at rest): the low-precision parameters become its
    # rounding, and (stages 1 and 2) every rank's full parameters are gathered from their owners.
    sync_params_from_master: Callable[[], None]
    # Every flat tensor of this rank's state by name (master, moments, 8-bit scales, parameters: whole
    # in stages 1-2, this rank's shard in stage 3; stage 3's frozen shard). At rest, copying into them
    # restores a peer's state of the same layout (a healing replica: zerofast/integrations/torchft.py).
    flat_state: Callable[[], dict[str, torch.Tensor]]
    # Steps counted (every step() that ended, but one its replication did not commit), and its setter
    # for a state copied from a peer.
    steps_taken: Callable[[], int]
    set_steps_taken: Callable[[int], None]


class Checkpointable(Protocol):
    """What zerofast.checkpoint takes as `opt`: an optimizer that has a checkpoint view."""

    @property
    def checkpoint_view(self) -> CheckpointView: ...
