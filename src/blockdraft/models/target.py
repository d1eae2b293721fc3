"""Target: one interface over any Hugging Face causal LM for speculative decoding.

It runs forwards that also return the drafter's taps (the OUTPUT of decoder layer L, which is HF's
`hidden_states[L + 1]`), exposes the raw input embedding and the LM head the drafter shares, and owns the
KV-cache operations the decode loop needs (crop after a rejected chain, gather-compact after a tree walk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from blockdraft.errors import BlockdraftError
from blockdraft.models.hybrid import HybridCache
from blockdraft.models.target_cache import TargetCache

if TYPE_CHECKING:
    from blockdraft.synthetic_acceptance import SyntheticAcceptance

# Attention implementations that take an arbitrary (tree) mask; flash-attention kernels only know causal masks.
TREE_ATTENTION = ("sdpa", "eager")
# HF layer types that keep a recurrent (linear-attention / conv) state, which a crop cannot roll back.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})


@dataclass
class TargetOutput:
    """Logits for the requested rows and, when asked for, the concatenated taps of every input row."""

    logits: torch.Tensor
    taps: torch.Tensor | None


class Target:
    """A Hugging Face causal LM seen the way the decode loop needs it."""

    engine = "hf"  # which forward runs: HF's own ("hf") or FastTarget's ("fast")
    # What the engines may ask of a target (HF's forward: none of it; the fast engine's: all of it):
    static_cache = False  # its cache is fixed buffers: reserved up front, its graphs captured on them
    batch_slots = False  # its sequences' caches live in the slots of one batch store (`engine.verifiers.SlotVerifier`)
    packs_prompts = False  # with batch slots: several prompts prefill as one forward
    use_graphs = False  # its forwards replay CUDA graphs (captured at each new shape)
    fused = False  # it runs greedy steps as fused graphs (`decoding.fused_steps`)
    row_masks = False  # a forward's tree mask may be the new rows' own [t, t] (the cache's columns are implied)
    # Benchmarks only: its greedy verdicts follow a dialled acceptance profile, not its picks (`synthetic_acceptance`)
    synthetic: SyntheticAcceptance | None = None

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        text = model.config.get_text_config(decoder=True)
        self.num_layers: int = text.num_hidden_layers
        self.hidden_size: int = text.hidden_size
        self.max_positions: int | None = getattr(text, "max_position_embeddings", None)
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.vocab_size: int = self.lm_head.weight.shape[0]
        self.embedding_weight: torch.Tensor = model.get_input_embeddings().weight
        self.layer_types: list[str] = get_layer_types_and_kwargs(text)[0]

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    def new_cache(self) -> TargetCache:
        """A cache that can undo rejected rows; hybrid targets roll their linear-attention states back by per-position
        states (default) or snapshot + replay (models/hybrid.py)."""
        if RECURRENT_LAYER_TYPES.intersection(self.layer_types):
            return HybridCache(self.model)
        return TargetCache(self.model)

    def warm_prefill(self, tap_layers: tuple[int, ...] | None) -> None:
        """What a server's warm-up prepares for prefills: nothing here (HF's forward runs eagerly; FastTarget
        captures its prefill graphs)."""

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
        with cache.running(input_ids, attention_mask):
            mask = None if attention_mask is None else self.tree_masks(attention_mask, positions, cache)
            out = self.model(
                input_ids=input_ids,
                position_ids=positions.unsqueeze(0),
                past_key_values=cache.hf,
                use_cache=True,
                attention_mask=mask,
                output_hidden_states=tap_layers is not None,
                logits_to_keep=1 if last_logits_only else 0,
            )
        taps = None
        if tap_layers is not None:
            taps = torch.cat([out.hidden_states[layer + 1] for layer in tap_layers], dim=-1)
        return TargetOutput(logits=out.logits, taps=taps)

    def check_tree_attention(self) -> str:
        """The attention implementation, if it can verify a tree (an arbitrary mask); else a user error."""
        impl = self.model.config._attn_implementation
        if impl not in TREE_ATTENTION:
            raise BlockdraftError(
                f"the target runs attn_implementation={impl!r}, which cannot take a tree mask; load it with "
                "attn_implementation='sdpa' (or 'eager') for --method ddtree, or use --method dflash"
            )
        return impl

    def tree_masks(
        self, mask: torch.Tensor, positions: torch.Tensor, cache: TargetCache
    ) -> torch.Tensor | dict[str, torch.Tensor | None]:
        """A [1, 1, t, len(cache) + t] bool mask in the form each layer type's attention reads it.

        HF hands a 4D mask to attention unchanged, so here: sliding layers (whose cache holds only the last
        window - 1 positions) get the matching columns and the window; eager attention adds its mask, so it
        gets 0 / -inf. Models with several layer types take a dict keyed by layer type.
        """
        impl = self.check_tree_attention()
        t = positions.shape[0]
        cache_len = mask.shape[-1] - t
        masks: dict[str, torch.Tensor | None] = {}
        for kind, layer in zip(self.layer_types, cache.hf.layers):
            if kind in masks:
                continue
            if kind == "sliding_attention":
                stored = layer.keys.shape[-2]
                keys = torch.cat([torch.arange(cache_len - stored, cache_len, device=mask.device), positions])
                visible = mask[..., cache_len - stored :] & (positions[:, None] - keys[None, :] < layer.sliding_window)
            elif kind == "full_attention":
                visible = mask
            elif kind == "linear_attention":
                masks[kind] = None  # no mask: the hybrid cache makes linear attention follow the tree itself
                continue
            else:
                raise BlockdraftError(
                    f"the target has {kind!r} layers; tree verification supports full, sliding-window and linear "
                    "attention only, use --method dflash"
                )
            if impl == "eager":
                visible = torch.zeros(visible.shape, dtype=self.dtype, device=mask.device).masked_fill(
                    ~visible, torch.finfo(self.dtype).min
                )
            masks[kind] = visible
        return next(iter(masks.values())) if len(masks) == 1 else masks
