"""Helpers that reach into an optimizer's internals for what the tests assert on: its layout, the
parameter storage and stage-3 unit buffers that exist now (through zerofast.optim.zero_adam.parts_of),
every tensor storage it holds, and the fp32 master assembled from the pieces each rank holds."""

from __future__ import annotations

import torch
import torch.distributed as dist


def full_master(per_rank_pieces: list[list[tuple]], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Assemble the fp32 master from each rank's pieces [(name, offset into the flat parameter, values)]."""
    out = {n: torch.full((int(torch.tensor(s).prod().item()) if s else 1,), float("nan")) for n, s in shapes.items()}
    for pieces in per_rank_pieces:
        for name, offset, values in pieces:
            out[name][offset : offset + values.numel()] = values
    return {n: t.view(shapes[n]) for n, t in out.items()}


def layout_of(opt):
    """The optimizer's layout of its trainable parameters, as its checkpoint view gives it."""
    return opt.checkpoint_view.trainable.layout


def param_bytes(opt) -> int:
    """Parameter storage that exists now (stage 3: shards and the units gathered at the moment)."""
    return opt.report().memory.materialized_params


def gathered_bytes(opt) -> int:
    """Bytes of stage 3's unit buffers that exist now (the shards not counted)."""
    from zerofast.optim.zero_adam import parts_of

    return sum(b.untyped_storage().nbytes() for part in parts_of(opt).units.buffers.parts for b in part.buffers)


def unit_bytes(opt) -> list[int]:
    """Each stage-3 unit's gathered size in bytes (its trainable and frozen buckets)."""
    from zerofast.optim.zero_adam import parts_of

    parts = parts_of(opt).units.buffers.parts
    return [
        sum(
            p.buffers[p.bucket_of[u]].numel() * p.buffers[p.bucket_of[u]].element_size()
            for p in parts
            if p.bucket_of[u] is not None
        )
        for u in range(len(parts_of(opt).units.state))
    ]


def held_tensor_bytes(root) -> int:
    """Bytes of every distinct tensor storage the optimizer holds from Python: a walk through its
    attributes, containers and the objects they hold, stopping at the model (whose parameters are
    views of the optimizer's own buffers) and at process groups. Independent of report()."""
    import torch.nn as nn

    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, dist.ProcessGroup, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(n for ptr, n in storages.items() if ptr)


def state_snapshot(model, opt) -> dict:
    """Everything a step leaves behind, rank-local: the parameters (gathered), the fp32 master and
    the moments as this rank's pieces, the step counts and the loss scale."""
    with opt.gathered_params():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    view = opt.checkpoint_view
    return dict(
        params=params,
        **{k: view.trainable.state_pieces(k) for k in ("master", "exp_avg", "exp_avg_sq")},
        steps=view.step_counts(),
        scale=opt.loss_scale,
    )


def snapshot_differs(a: dict, b: dict) -> list[str]:
    """What differs, bitwise, between two state_snapshot()s: parameter names, then state kinds."""
    bad = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        if not all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a[kind], b[kind])):
            bad.append(kind)
    if a["steps"] != b["steps"] or a["scale"] != b["scale"]:
        bad.append("steps/scale")
    return bad
