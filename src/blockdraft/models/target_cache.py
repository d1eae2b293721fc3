"""The target's KV cache as speculative decoding edits it: crop after a rejected chain, gather-compact after a
tree walk (HybridCache adds the linear-attention states' rollback on top)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache, PreTrainedModel


class TargetCache:
    """The target's KV cache with the two edits speculative decoding needs: crop and gather-compact."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.hf = DynamicCache(config=model.config)
        self.hf.activate_past_recording()

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def settle(self) -> None:
        """Drop sliding-window entries no later query can see (HF keeps them until a crop, for rollback).

        Called before every forward: HF sizes its sliding masks as if only the last window - 1 were stored.
        """
        if len(self):
            self.hf.crop(0)

    @contextmanager
    def running(self, input_ids: torch.Tensor, tree_mask: torch.Tensor | None) -> Iterator[None]:
        """Around every forward that appends `input_ids`: settle first (hybrid caches snapshot and follow trees)."""
        self.settle()
        yield

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
