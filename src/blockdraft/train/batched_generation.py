"""Batched `generate` for writing training text: one-token steps attend per K/V head group, on a static cache.

Regenerating answers is most of a training run's data cost, and HF's stock path spends it moving K/V, not computing:
with left padding there is an attention mask, and SDPA with a mask cannot take grouped K/V, so every decode step
copies each layer's K/V once per query head (x3 for SmolLM2) before reading it, and the dynamic cache re-copies all
of it to append one token. Measured on an H200, a 135M target at batch 1024 wrote 10.5 k tokens/s (97 ms a step)
where reading the weights and the cache once would take a few ms (benchmarks/RESULTS.md). Here a one-token step
multiplies each K/V head's group of query heads against that head's K/V directly (K/V read once, never copied),
into a static cache written in place. Prompt prefill and anything unusual (softcapping, attention sinks, position
biases) stays on the stock SDPA path. The arithmetic is attention's own, so answers are the target's; only float
rounding differs from the stock path.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AttentionInterface, GenerationConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "blockdraft_grouped_decode"
_STOCK_ONLY = ("softcap", "s_aux", "position_bias")  # attention variants the grouped step does not compute


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of [b, heads, 1, d] queries against [b, kv_heads, L, d] K/V; other shapes go to stock SDPA.

    HF orders query heads K/V-head-major (head i reads K/V head i // group), so a view groups them with no copy.
    The mask is SDPA's: boolean [b, 1, 1, L] (True = visible), an additive float mask, or None.
    """
    b, heads, q_len, dim = query.shape
    if q_len != 1 or dropout or any(kwargs.get(name) is not None for name in _STOCK_ONLY):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    grouped = query.view(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(2, 3)).float() * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)
    return out.view(b, 1, heads, value.shape[-1]), None  # V may be narrower than Q/K (MLA)


AttentionInterface.register(IMPLEMENTATION, grouped_decode_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


@torch.no_grad()
def generate_batch(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   config: GenerationConfig) -> torch.Tensor:
    """`model.generate` with the grouped decode step and a static cache; the model's own attention is restored after.

    Models whose attention is not pluggable (no AttentionInterface) generate as they are.
    """
    config = copy.deepcopy(config)
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    config.cache_implementation, config.disable_compile = "static", True
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    finally:
        model.set_attn_implementation(previous)
