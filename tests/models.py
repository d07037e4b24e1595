"""The toy models the tests train: Quirky (the tiny GPT plus the awkward cases), TwiceMLP (a block
called twice), Nested (shaped like most real models), hf_gpt2 and tiny_llama (Hugging Face models from
a config, no download; WORDS and word_tokenizer: tiny_llama's vocabulary and its tokenizer), and
model_loss, the loss of any of them."""

from __future__ import annotations

import torch

from zerofast.tools.models import TitanLlama, make_gpt, titan_loss, titan_plan  # noqa: F401  (the tests' too)


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
    fields = dict(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config}))
