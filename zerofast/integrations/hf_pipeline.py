"""A Hugging Face causal LM cut into pipeline stages, as torchtitan cuts its models: each stage a copy of
the whole model with the other stages' layers deleted and the ends it does not own set to None, so every
parameter keeps its original name (a checkpoint of the pipelined run is one checkpoint of the model, and
`zerofast.checkpoint.export` of it loads with `from_pretrained`).

    part = cut_causal_lm(model, mesh["pp"].get_local_rank(), pp)      # a LlamaForCausalLM
    opt = ZeroAdam(part, stage=3, process_group=mesh)
    stage = ZeroPipelineStage(part, stage_index, pp, device, group=mesh["pp"].get_group())

The first stage takes token ids, the others the previous stage's hidden states; the last returns the
logits. The stage runs the layers as the model's own forward does (the causal mask from the model's
config through transformers' create_causal_mask, the rotary embedding from its own module), with no
padding mask and no cache: a training forward. Written and tested against transformers 5.24 (the
Makefile's HF_DEPS) on LlamaForCausalLM; another architecture is a NotImplementedError naming it, since
its forward may do more between the layers than this one repeats (Gemma scales its embeddings).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

__all__ = ["CausalLMStage", "cut_causal_lm"]


def _supported() -> tuple[type, ...]:
    from transformers import LlamaForCausalLM

    return (LlamaForCausalLM,)


class CausalLMStage(nn.Module):
    """One pipeline stage of a causal LM: `model` (the base model, its `layers` a ModuleDict keyed by
    the original indices, `embed_tokens` None but on the first stage, `norm` None but on the last) and
    `lm_head` (None but on the last), named as in the whole model."""

    def __init__(self, base: nn.Module, lm_head: nn.Module | None, config):
        super().__init__()
        self.model = base
        self.lm_head = lm_head
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        m = self.model
        h = m.embed_tokens(x) if m.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        position_embeddings = m.rotary_emb(h, position_ids=position_ids)
        for layer in m.layers.values():
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        if m.norm is not None:
            h = self.lm_head(m.norm(h))
        return h


def cut_causal_lm(model: nn.Module, stage: int, stages: int) -> CausalLMStage:
    """Pipeline stage `stage` of `stages` of a Hugging Face causal LM (LlamaForCausalLM): a copy with
    the other stages' decoder layers deleted, the embedding on the first stage only, the final norm and
    the head on the last only; every parameter keeps its name in `model`. The layers go to the stages in
    equal consecutive runs (their number must divide evenly). Tied embeddings are a ValueError: the
    first and the last stage would each train their own copy of the one tensor."""
    if not isinstance(model, _supported()):
        raise NotImplementedError(
            f"cut_causal_lm: model must be one of {', '.join(c.__name__ for c in _supported())} (the forwards it "
            f"repeats between the layers); got {type(model).__name__}"
        )
    n = len(model.model.layers)
    if not (
        isinstance(stage, int) and isinstance(stages, int) and 0 <= stage < stages and stages <= n and n % stages == 0
    ):
        raise ValueError(
            f"cut_causal_lm: stage={stage!r} of stages={stages!r} must index the model's {n} layers cut evenly"
        )
    if model.lm_head.weight is model.model.embed_tokens.weight and stages > 1:
        raise ValueError(
            "cut_causal_lm: the model ties lm_head.weight to model.embed_tokens.weight (tie_word_embeddings); "
            "the first and the last stage would each train a copy of it. Untie them (config.tie_word_embeddings="
            "False and a copy of the weight) or keep them on one stage"
        )
    whole = copy.deepcopy(model)
    base, per = whole.model, n // stages
    base.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers) if i // per == stage})
    if stage > 0:
        base.embed_tokens = None
    last = stage == stages - 1
    if not last:
        base.norm = None
    return CausalLMStage(base, whole.lm_head if last else None, whole.config)
