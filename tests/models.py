"""The toy models the tests train: Quirky (the tiny GPT plus the awkward cases), TwiceMLP (a block
called twice), Nested (shaped like most real models), hf_gpt2 and tiny_llama (Hugging Face models from
a config, no download; WORDS and word_tokenizer: tiny_llama's vocabulary and its tokenizer), and
model_loss, the loss of any of them."""

from __future__ import annotations

import torch

from zerofast.tools.models import make_gpt


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


class Nested(torch.nn.Module):
    """A model shaped like most real ones, unlike our GPT: the blocks three levels down
    (`backbone.layers[i]`), the token embedding inside the backbone tied to an output head at the
    root, and a final norm between them. forward(x, y) -> (logits, loss), as the GPT's."""

    def __init__(self, vocab=48, width=16, layers=3, block_size=12):
        super().__init__()
        torch.manual_seed(3)
        self.cfg = type("Cfg", (), {"vocab_size": vocab, "block_size": block_size})()
        self.backbone = torch.nn.Module()
        self.backbone.embed = torch.nn.Embedding(vocab, width)
        self.backbone.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 2 * width),
                torch.nn.GELU(),
                torch.nn.Linear(2 * width, width),
            )
            for _ in range(layers)
        )
        self.backbone.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.backbone.embed.weight  # tied: used first and last

    def forward(self, x, y):
        h = self.backbone.embed(x)
        for layer in self.backbone.layers:
            h = h + layer(h)
        logits = self.head(self.backbone.norm(h))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def hf_gpt2(layers: int = 3):
    """A randomly initialised Hugging Face GPT-2 from a config (no download), dropout off so that
    runs are deterministic; forward(x, y) as our GPT's through `hf_loss`. None without transformers."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    torch.manual_seed(4)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=16,
        n_head=2,
        vocab_size=48,
        n_positions=12,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    model.cfg = type("Cfg", (), {"vocab_size": 48, "block_size": 12})()
    return model


def model_loss(model, x, y) -> torch.Tensor:
    """The loss of our GPT-shaped models (forward(x, y) -> (_, loss)) and of a Hugging Face causal LM."""
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return model(input_ids=x, labels=x).loss
    return model(x, y)[1]


WORDS = "the a cat dog sat ran on under mat log red blue big small".split()


def word_tokenizer():
    """A Hugging Face fast tokenizer over WORDS (one token a word, <pad> <unk> <s> </s> first):
    built in memory, no download; what the TRL launches tokenize their text with."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama(**config):
    """A 2-layer Hugging Face Llama over WORDS' 32-token vocabulary (width 32), built from its config
    with seed 0: random weights, no download. `config`: more LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **config,
        )
    )


class _RMSNorm(torch.nn.Module):
    """torchtitan's RMSNorm (in Python, so SequenceParallel runs it on DTensors)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class _Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape  # -1 heads: the local heads under ColwiseParallel
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _FeedForward(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(dim, hidden, bias=False), torch.nn.Linear(hidden, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.attention = _RMSNorm(dim), _Attention(dim, heads)
        self.ffn_norm, self.feed_forward = _RMSNorm(dim), _FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(torch.nn.Module):
    """A Llama shaped as torchtitan's (tok_embeddings, layers[i].attention.wq..wo, feed_forward.w1..w3,
    attention_norm / ffn_norm, norm, output), the model whose tensor-parallel plan torchtitan
    publishes (titan_plan). Norm weights start away from 1 so that their gradients matter."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 4, hidden: int = 32, layers: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_Block(dim, heads, hidden) for _ in range(layers))
        self.norm = _RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name.endswith("norm.weight") else 0.2))
                if name.endswith("norm.weight"):
                    p.add_(1.0)
        self.vocab = vocab

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def titan_loss(model, ids) -> torch.Tensor:
    """Next-token cross entropy of TitanLlama over a batch of token ids (a float32 loss)."""
    logits = model(ids)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)
    )


def titan_plan(model: TitanLlama, tp_mesh, sequence_parallel: bool = True) -> TitanLlama:
    """torchtitan's Llama plan over tp_mesh: the embedding Rowwise, q/k/v and w1/w3 Colwise, wo and w2
    Rowwise, the output Colwise (gathered), and with sequence_parallel the norms SequenceParallel
    (their weights Replicate DTensors with Partial gradients); without it the norms stay plain."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
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
