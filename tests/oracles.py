"""Shared pieces of the multi-rank tests: the data each rank sees, and the single-process oracle."""
from __future__ import annotations

import torch

from zerofast.models import make_gpt, random_batch

# lr 1e-3: Adam's first steps move each element by about lr * sign(g), so an element whose true
# gradient is ~0 (pure rounding noise, whose sign depends on summation order) moves by up to lr in a
# direction no two reduction orders agree on; at lr 1e-2 that alone reached 1.6e-5 on 3 ranks.
# eps 1e-6 for the same reason: an element whose gradient is near eps (an embedding row of a token
# absent from the batch, ~1e-9) is updated by lr * g / (|g| + eps), whose relative error is that of
# g itself; with eps 1e-8 and 4 ranks that reached 2.07e-5 (the engine and the reference stage
# agreed bitwise there; only the single-process summation order differed).
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
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


class Quirky(torch.nn.Module):
    """The tiny GPT (tied embeddings) plus the awkward cases: a frozen parameter, a parameter used
    only in even steps (on every rank), and one used only on rank 0 (odd numel, 7)."""

    def __init__(self):
        super().__init__()
        self.gpt = make_gpt("tiny")
        g = torch.Generator().manual_seed(1)
        self.frozen = torch.nn.Parameter(torch.randn(5, generator=g), requires_grad=False)
        self.sometimes = torch.nn.Linear(16, 16)
        self.rank0_only = torch.nn.Parameter(torch.randn(7, generator=g))
        self.register_buffer("probe", torch.randn(4, 16, generator=g))
        self.cfg = self.gpt.cfg

    def forward(self, x, y, step: int, rank: int) -> torch.Tensor:
        """The loss (the root's forward uses `rank0_only` and `frozen` itself)."""
        _, loss = self.gpt(x, y)
        loss = loss + 1e-2 * self.frozen.sum()
        if step % 2 == 0:
            loss = loss + 0.1 * self.sometimes(self.probe).pow(2).mean()
        if rank == 0:
            loss = loss + 0.1 * self.rank0_only.pow(2).sum()
        return loss


def two_groups(model: torch.nn.Module) -> list[dict]:
    """Matrices in one group, vectors (biases, norms, rank0_only) in another with its own lr and wd."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "lr": 1e-3, "weight_decay": 0.1},
            {"params": [p for p in trainable if p.dim() < 2], "lr": 2e-3, "weight_decay": 0.0}]


def make_scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def single_process_quirky(world: int, steps: int, groups: bool, scheduler: bool) -> dict[str, torch.Tensor]:
    """The oracle for Quirky: one process, the loss averaged over what each rank would compute."""
    model = Quirky()
    params = two_groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    sched = make_scheduler(opt) if scheduler else None
    for step in range(steps):
        total = sum(model(*rank_batch(model, step, r), step, r) for r in range(world)) / world
        total.backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class TwiceMLP(torch.nn.Module):
    """No tied weights (so stage 3 moves exactly 3Φ), one block called twice per forward, and an
    odd-sized head: embedding -> block -> block (again) -> head."""

    def __init__(self, vocab=37, width=24):
        super().__init__()
        torch.manual_seed(2)
        self.emb = torch.nn.Embedding(vocab, width)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
        self.head = torch.nn.Linear(width, vocab)
        self.cfg = type("Cfg", (), {"vocab_size": vocab, "block_size": 8})()

    def forward(self, x, y):
        h = self.emb(x)
        h = self.block(h)
        h = self.block(h)  # the same module twice
        return None, torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def single_process(model_fn, world: int, steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on one process over every rank's batch, for a model returning (_, loss)."""
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(steps):
        total = sum(model(*rank_batch(model, step, r))[1] for r in range(world)) / world
        total.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
