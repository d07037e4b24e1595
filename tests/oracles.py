"""Shared pieces of the multi-rank tests: the data each rank sees, and the single-process oracle."""
from __future__ import annotations

import torch

from zerofast.models import make_gpt, random_batch

# lr 1e-3: Adam's first steps move each element by about lr * sign(g), so an element whose true
# gradient is ~0 (pure rounding noise, whose sign depends on summation order) moves by up to lr in a
# direction no two reduction orders agree on; at lr 1e-2 that alone reached 1.6e-5 on 3 ranks.
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOCAL_BATCH = 2


def rank_batch(model, step: int, rank: int):
    """Rank `rank`'s batch at `step`: the same on every run, different on every rank."""
    cfg = model.cfg
    return random_batch(cfg, LOCAL_BATCH, cfg.block_size, seed=1000 * step + rank)


def global_batch(model, step: int, world: int):
    parts = [rank_batch(model, step, r) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def single_process_adamw(world: int, steps: int, size: str = "tiny", hyper=HYPER) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on one process over the concatenation of every rank's batch."""
    model = make_gpt(size)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **hyper)
    for step in range(steps):
        x, y = global_batch(model, step, world)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
