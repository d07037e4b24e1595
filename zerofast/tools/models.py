"""A small GPT (token + position embeddings, pre-norm blocks, tied output head) for demos, tests
and benchmarks. Its input embedding and output head share one weight, so a tied parameter is always
exercised."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level by default
    block_size: int = 64  # longest sequence
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


# Named sizes: "tiny" for tests, "small" (~6M parameters in ~100 tensors) for benchmarks and demos.
CONFIGS = {
    "tiny": GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16),
    "small": GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=256),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # No bias on q, k, v: softmax ignores a key bias, so its true gradient is zero and Adam would
        # turn rounding noise into lr-sized steps, which no two summation orders agree on.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def make_gpt(size: str = "tiny", seed: int = 0, **overrides) -> GPT:
    """A GPT of a named size, initialized from `seed` (the same on every rank)."""
    if size not in CONFIGS:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = CONFIGS[size]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    torch.manual_seed(seed)
    return GPT(cfg)


def random_batch(cfg: GPTConfig, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of random tokens (reproducible from `seed`)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
