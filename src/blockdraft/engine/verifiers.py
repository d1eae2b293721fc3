"""How a batch's verify step runs, per engine: every sequence's anchor + draft through the target, then each one's
cache keeps its accepted rows.

- `SlotVerifier` (the fast engine): one forward over [B, R] rows (models/fast_batch.py), the sequences' K/V in the
  slots of one BatchKV.
- `LoopVerifier` (any HF model, hybrid ones included): each sequence keeps its own cache (a TargetCache, or the
  HybridCache that rolls linear-attention states back) and verifies with `generate()`'s own forward, one sequence
  after another. No faster than one at a time, but requests interleave step by step (a short request is not stuck
  behind a long one) and a schedule applies, on every model the HF engine runs.
"""

from __future__ import annotations

import torch

from blockdraft.decoding.draft import Draft
from blockdraft.decoding.host_to_device import long_tensor
from blockdraft.models.fast_batch import BatchKV, forward_batch
from blockdraft.models.fast_target import FastTarget
from blockdraft.models.static_cache import StaticTargetCache
from blockdraft.models.target import Target, TargetCache

Verified = list[tuple[torch.Tensor, torch.Tensor | None]]  # per sequence: logits [n, V], taps [1, n, *]


class SlotVerifier:
    """The fast engine's batched verify over cache slots."""

    def __init__(self, target: FastTarget, slots: int) -> None:
        self.target = target
        self.store = BatchKV(target, slots)

    def load(self, slot: int, cache: StaticTargetCache) -> None:
        self.store.load(slot, cache)

    def move(self, source: int, dest: int) -> None:
        self.store.move(source, dest)

    def forward(self, anchors: list[int], drafts: list[Draft], starts: list[int],
                tap_layers: tuple[int, ...] | None) -> Verified:
        device = self.target.device
        rows, batch = 1 + max(len(d) for d in drafts), len(drafts)
        ids = torch.zeros(batch, rows, dtype=torch.long, device=device)
        positions = torch.zeros(batch, rows, dtype=torch.long, device=device)
        own = torch.eye(rows, dtype=torch.bool, device=device).repeat(batch, 1, 1)
        for b, (anchor, draft, start) in enumerate(zip(anchors, drafts, starts)):
            n = len(draft) + 1
            ids[b, :n] = torch.cat([long_tensor([anchor], device), draft.tokens])
            positions[b] = start
            positions[b, :n] = draft.positions(start, device)
            own[b, :n, :n] = draft.tree_mask(0, device)[0, 0]
        logits, taps = forward_batch(self.target, self.store, ids, positions, own, tap_layers)
        return [(logits[b, : len(d) + 1], None if taps is None else taps[b : b + 1, : len(d) + 1])
                for b, d in enumerate(drafts)]

    def keep(self, slot: int, start: int, draft: Draft, rows: torch.Tensor | None, produced: int) -> None:
        """Commit: the first `produced` rows of a chain, or the tree's accepted `rows`."""
        if rows is None:
            self.store.lengths[slot] = start + produced
        else:
            self.store.compact(slot, start, rows)


class LoopVerifier:
    """Any target: a cache per sequence and `generate()`'s forward, sequence by sequence."""

    def __init__(self, target: Target, slots: int) -> None:
        self.target = target
        self.caches: list[TargetCache | None] = [None] * slots

    def load(self, slot: int, cache: TargetCache) -> None:
        self.caches[slot] = cache

    def move(self, source: int, dest: int) -> None:
        self.caches[dest], self.caches[source] = self.caches[source], None

    def forward(self, anchors: list[int], drafts: list[Draft], starts: list[int],
                tap_layers: tuple[int, ...] | None) -> Verified:
        device = self.target.device
        verified: Verified = []
        for slot, (anchor, draft, start) in enumerate(zip(anchors, drafts, starts)):
            cache = self.caches[slot]
            assert cache is not None
            ids = torch.cat([long_tensor([anchor], device), draft.tokens]).unsqueeze(0)
            mask = None if draft.is_chain else draft.tree_mask(len(cache), device)
            out = self.target.forward(ids, draft.positions(start, device), cache, tap_layers, attention_mask=mask)
            verified.append((out.logits[0], out.taps))
        return verified

    def keep(self, slot: int, start: int, draft: Draft, rows: torch.Tensor | None, produced: int) -> None:
        cache = self.caches[slot]
        assert cache is not None
        if rows is None:
            cache.crop(start + produced)
        else:
            cache.compact(start, rows)
