"""A small GPT (token + position embeddings, pre-norm blocks, an output head sharing the input embedding's
weight, so a tied parameter is always exercised) for demos, tests and benchmarks; TitanLlama, a Llama shaped as
torchtitan's, with its tensor-parallel plan (titan_plan), for tensor parallelism's tests, benchmark and --tp."""

from __future__ import annotations

import copy
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
        self.init_weights()

    def init_weights(self) -> None:
        """The initial values (from torch's RNG): what a model built on the meta device runs once ZeroAdam
        has sharded it ([Note: models built on the meta device] in zerofast/model_setup.py)."""
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):  # as LayerNorm builds them (no RNG): for a meta-built model
            nn.init.ones_(module.weight)
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


class _RMSNorm(nn.Module):
    """torchtitan's RMSNorm (in Python, so SequenceParallel runs it on DTensors)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape  # -1 heads: the local heads under ColwiseParallel
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.attention = _RMSNorm(dim), _Attention(dim, heads)
        self.ffn_norm, self.feed_forward = _RMSNorm(dim), _FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


# The main job's Llama sizes (--tp), named as the GPT's: "tiny" for tests, "small" (~7M parameters).
LLAMA_CONFIGS = {
    "tiny": dict(vocab=256, dim=16, heads=4, hidden=32, layers=2),
    "small": dict(vocab=256, dim=256, heads=8, hidden=768, layers=8),
}


class TitanLlama(nn.Module):
    """A Llama shaped as torchtitan's (tok_embeddings, layers[i].attention.wq..wo, feed_forward.w1..w3,
    attention_norm / ffn_norm, norm, output), the model whose tensor-parallel plan torchtitan
    publishes (titan_plan). Norm weights start away from 1 so that their gradients matter. As
    torchtitan's, its layers are a ModuleDict keyed by index and its ends may be None, so a pipeline
    cuts it into copies with layers removed that keep the original names (titan_cut)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 4, hidden: int = 32, layers: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim, heads, hidden) for i in range(layers)})
        self.norm = _RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name.endswith("norm.weight") else 0.2))
                if name.endswith("norm.weight"):
                    p.add_(1.0)
        self.vocab = vocab

    def forward(self, ids):
        h = self.tok_embeddings(ids) if self.tok_embeddings is not None else ids
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def titan_cut(model: TitanLlama, stage: int, stages: int) -> TitanLlama:
    """Pipeline stage `stage` of `stages`, cut as torchtitan cuts its Llama: a copy of the whole model
    with the other stages' layers deleted and the embedding (all but the first stage) and the norm
    and head (all but the last) set to None, so every parameter keeps its original name. The layers
    go to the stages in equal consecutive runs (their number must divide evenly)."""
    n = len(model.layers)
    if not (isinstance(stage, int) and isinstance(stages, int) and 0 <= stage < stages and n % stages == 0):
        raise ValueError(f"titan_cut: stage={stage!r} of stages={stages!r} must index {n} layers cut evenly")
    part = copy.deepcopy(model)
    per = n // stages
    for i in range(n):
        if not stage * per <= i < (stage + 1) * per:
            del part.layers[str(i)]
    if stage > 0:
        part.tok_embeddings = None
    if stage < stages - 1:
        part.norm = part.output = None
    return part


def titan_loss(model, ids) -> torch.Tensor:
    """Next-token cross entropy of TitanLlama over a batch of token ids (a float32 loss)."""
    logits = model(ids)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def titan_plan(
    model: TitanLlama, tp_mesh, sequence_parallel: bool = True, parallel_embedding: bool = True
) -> TitanLlama:
    """torchtitan's Llama plan over tp_mesh: the embedding Rowwise, q/k/v and w1/w3 Colwise, wo and w2
    Rowwise, the output Colwise (gathered), and with sequence_parallel the norms SequenceParallel
    (their weights Replicate DTensors with Partial gradients); without it the norms stay plain.
    parallel_embedding=False (without sequence_parallel) leaves the embedding a plain replicated
    module: what a whole-model torch.compile at stage 3 needs (docs/many-machines.md)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    if sp and not parallel_embedding:
        raise ValueError(
            "titan_plan: sequence_parallel=True shards the embedding's output; it needs parallel_embedding=True"
        )
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    if not parallel_embedding:
        del top["tok_embeddings"]
    if sp:
        top["norm"] = SequenceParallel()
    # A pipeline stage's part (titan_cut) lacks the ends other stages hold.
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, tp_mesh, plan)
    return model
