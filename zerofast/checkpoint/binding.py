"""checkpoint_view(): the optimizer's parts bound into a CheckpointView (view.py) once, at construction.
It reads them by attribute (zerofast/optim/builder.py's Parts, the step's rest in zerofast/optim/step.py)
and imports nothing of zerofast.optim: the optimizer depends on this package, never the reverse."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .view import CheckpointView, Facts, ScalerState, ShardedPart

__all__ = ["checkpoint_view"]


def checkpoint_view(parts, stepper, param_groups: list[dict]) -> CheckpointView:
    """The parts as zerofast.checkpoint reads and writes them (view.py). stepper: the step's rest
    (quiesce_state, sync_params_from_master); param_groups: the front's own list (torch.optim's),
    which a load updates in place."""
    plan, topo, shard, rule = parts.plan, parts.topology, parts.shard, parts.rule
    tp = parts.grads.tp  # the checkpoint names a DTensor parameter, whole ([Note: tensor parallelism])
    load_pieces = shard.load_pieces
    if tp is not None:

        def load_pieces(kind, full, load=shard.load_pieces):
            load(kind, {i: tp.local_part(i, t) for i, t in full.items()})

    trainable = ShardedPart(
        params=tuple(zip(parts.names, tp.params if tp is not None else parts.params)),
        kinds=tuple(rule.state_kinds(i) for i in range(len(parts.params))),
        layout=parts.layout,
        pieces=tuple(shard.pieces),
        dtype=torch.float32,
        device=shard.device,
        piece_view=shard.piece_view,
        write_piece=shard.write_piece,
        load_pieces=load_pieces,
        buffer_of=shard.storage_of,
        state_block=plan.state_block if plan.quantized_state else 0,
        local_geometry=tp.local_geometry() if tp is not None else None,
    )
    return CheckpointView(
        model=parts.model,
        facts=Facts(  # with tensor parallelism every rank of the mesh saves and loads together
            *(
                (topo.rank, topo.world, topo.group)
                if topo.model_group is None
                else (
                    dist.get_rank(topo.model_group),
                    dist.get_world_size(topo.model_group),
                    topo.model_group,
                )
            ),
            plan.stage,
            plan.partition,
            plan.mixed_precision or "fp32",
            topo.shard_rank,
            topo.shard_size,
            topo.shard_group,
            topo.pp_group,
        ),
        trainable=trainable,
        frozen=_frozen_view(parts),
        param_groups=param_groups,
        step_counts=shard.step_counts,
        set_step_counts=shard.set_step_counts,
        loss_scaler_state=lambda: _scaler_state(parts.scaler),
        load_loss_scaler_state=lambda state: _load_scaler_state(parts.scaler, state),
        quiesce=stepper.quiesce_state,
        sync_params_from_master=stepper.sync_params_from_master,
        flat_state=lambda: _flat_state(parts),
        steps_taken=lambda: parts.comm.where.step,
        set_steps_taken=lambda step: setattr(parts.comm.where, "step", int(step)),
    )


def _flat_state(parts) -> dict[str, torch.Tensor]:
    """Every flat tensor of this rank's state, by name (CheckpointView.flat_state)."""
    shard = parts.shard
    # Stages 1-2: every parameter, whole; stage 3: the parameters' shard below (its gathered buffers
    # hold no storage at rest).
    out = {} if parts.plan.params_sharded else {f"param_buffers.{i}": b for i, b in enumerate(shard.param_buffers)}
    for name in ("param_shard", "master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        out[name] = getattr(shard, name)
    if parts.frozen is not None:
        out["frozen_shard"] = parts.frozen.shard
    return {k: v for k, v in out.items() if v.numel()}


def _frozen_view(parts) -> ShardedPart | None:
    fz, tp = parts.frozen, parts.grads.tp
    if fz is None:
        return None
    named = parts.frozen_named  # the model's (DTensors named whole, as the trainable part's)
    load_pieces = fz.load_pieces
    if tp is not None:

        def load_pieces(full, load=fz.load_pieces):
            load({i: tp.narrow(named[i][1], t) for i, t in full.items()})

    return ShardedPart(
        params=tuple(named),
        kinds=((),) * len(named),
        layout=fz.layout,
        pieces=tuple(fz.pieces),
        dtype=fz.dtype,
        device=fz.device,
        piece_view=lambda pc, kind: fz.piece_view(pc),  # its values, whatever the kind: it has no state
        write_piece=lambda pc, kind, values: fz.piece_view(pc).copy_(values.reshape(-1)),
        load_pieces=lambda kind, full: load_pieces(full),
        buffer_of=lambda kind: "master",
        local_geometry=tuple(tp.geometry(p) for _, p in named) if tp is not None else None,
    )


def _scaler_state(scaler) -> ScalerState:
    return ScalerState(scale=scaler.scale, growth_tracker=scaler.growth_tracker, enabled=scaler.enabled)


def _load_scaler_state(scaler, state: ScalerState) -> None:
    if scaler.enabled and state["enabled"]:
        scaler.scale, scaler.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
