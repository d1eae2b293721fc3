"""Target: one interface over any Hugging Face causal LM for speculative decoding.

It runs forwards that also return the drafter's taps (the OUTPUT of decoder layer L, which is HF's
`hidden_states[L + 1]`), exposes the raw input embedding and the LM head the drafter shares, and owns the
KV-cache operations the decode loop needs (crop after a rejected chain, gather-compact after a tree walk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel


@dataclass
class TargetOutput:
    """Logits for the requested rows and, when asked for, the concatenated taps of every input row."""

    logits: torch.Tensor
    taps: torch.Tensor | None


class TargetCache:
    """The target's KV cache with the two edits speculative decoding needs: crop and gather-compact."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.hf = DynamicCache(config=model.config)
        self.hf.activate_past_recording()

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        remove = len(self) - length
        if remove > 0:
            self.hf.crop(-remove)

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) followed by rows base + keep (in that order); drop everything else.

        A tree verify appends all nodes after `base`; the accepted path is scattered among them and must
        become contiguous so the next step sees exactly the committed sequence.
        """
        for layer in self.hf.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            offset = layer.keys.shape[-2] - layer.get_seq_length()
            index = torch.cat([torch.arange(base + offset, device=keep.device), keep + base + offset])
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = base + keep.numel()


class Target:
    """A Hugging Face causal LM seen the way the decode loop needs it."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        text = model.config.get_text_config(decoder=True)
        self.num_layers: int = text.num_hidden_layers
        self.hidden_size: int = text.hidden_size
        self.max_positions: int | None = getattr(text, "max_position_embeddings", None)
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.vocab_size: int = self.lm_head.weight.shape[0]
        self.embedding_weight: torch.Tensor = model.get_input_embeddings().weight

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    def new_cache(self) -> TargetCache:
        return TargetCache(self.model)

    def embed(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Raw input embeddings (no model-specific scaling): what the drafter is trained on."""
        out = F.embedding(ids, self.embedding_weight)
        return out * scale if scale != 1.0 else out

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetCache,
        tap_layers: tuple[int, ...] | None = None,
        last_logits_only: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run [1, t] ids at absolute positions [t] appending to the cache; taps for all t rows if asked.

        `attention_mask` is an optional [1, 1, t, len(cache) + t] boolean mask (True = visible) for trees.
        """
        out = self.model(
            input_ids=input_ids,
            position_ids=positions.unsqueeze(0),
            past_key_values=cache.hf,
            use_cache=True,
            attention_mask=attention_mask,
            output_hidden_states=tap_layers is not None,
            logits_to_keep=1 if last_logits_only else 0,
        )
        taps = None
        if tap_layers is not None:
            taps = torch.cat([out.hidden_states[layer + 1] for layer in tap_layers], dim=-1)
        return TargetOutput(logits=out.logits, taps=taps)
