"""Exact rollback for hybrid targets (Gated DeltaNet linear attention + full attention: Qwen3.5, Qwen3-Next).

A linear-attention layer folds every token into one recurrent state, so a rejected draft cannot be cropped out
of it. Keeping a state per position would need the per-token kernel (HF's chunked kernel returns only the
final state), so the cache instead snapshots the linear-attention states before each verify forward and, when
a step keeps fewer rows than it verified, restores the snapshot and replays the kept tokens through the target.
The cost is one extra target forward over the committed tokens on every step with a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from blockdraft.models.target import TargetCache


@dataclass
class _Snapshot:
    """The cache as it was before the last forward, and what that forward appended."""

    base: int
    input_ids: torch.Tensor
    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]


class HybridCache(TargetCache):
    """A TargetCache whose crop and compact also roll linear-attention states back, exactly."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        # The replay needs no logits: the decoder alone skips the LM head.
        self.decoder = model.get_decoder()
        self.linear = [layer for layer in self.hf.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.snapshot: _Snapshot | None = None
        self.replayed_tokens = 0  # tokens re-run by rollbacks since creation: the rollback's whole cost

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Settle, then remember the linear-attention states and the ids this forward is about to append."""
        self.settle()

        def copy(state: torch.Tensor | None) -> torch.Tensor | None:
            return None if state is None else state.clone()

        self.snapshot = _Snapshot(
            base=len(self),
            input_ids=input_ids,
            conv=[copy(layer.conv_states[0]) for layer in self.linear],
            recurrent=[copy(layer.recurrent_states[0]) for layer in self.linear],
        )

    def crop(self, length: int) -> None:
        """Keep the first `length` positions: the last forward's rows [0, length - base) stay."""
        base = self.snapshot.base if self.snapshot else 0
        self._keep_rows(torch.arange(length - base, device=self.hf_device))

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) followed by the last forward's rows `keep`, re-run at base, base + 1, ..."""
        if self.snapshot is None or self.snapshot.base != base:
            raise ValueError(f"compact(base={base}) must follow a forward that started at that base")
        self._keep_rows(keep)

    @property
    def hf_device(self) -> torch.device:
        return self.decoder.get_input_embeddings().weight.device

    def _keep_rows(self, rows: torch.Tensor) -> None:
        """Make the cache hold [0, base) + the last forward's `rows`, as if only those had ever been run."""
        snap = self.snapshot
        appended = snap.input_ids.shape[-1] if snap else 0
        if snap is None or torch.equal(rows.cpu(), torch.arange(appended)):
            return  # every appended row kept, in order: the forward already left the exact state
        self.hf.crop(-(len(self) - snap.base))  # attention KV back to base (linear states are restored next)
        for layer, conv, recurrent in zip(self.linear, snap.conv, snap.recurrent):
            layer.conv_states[0] = conv
            layer.recurrent_states[0] = recurrent
        self.snapshot = None  # the restored tensors are now the live state; a second rollback has nothing to use
        if rows.numel() == 0:
            return
        ids = snap.input_ids[:, rows.to(snap.input_ids.device)]
        positions = torch.arange(snap.base, snap.base + rows.numel(), device=ids.device).unsqueeze(0)
        self.decoder(input_ids=ids, position_ids=positions, past_key_values=self.hf, use_cache=True)
        self.replayed_tokens += rows.numel()
