"""How a batch's verify step runs, per engine: every sequence's anchor + draft through the target, then each one's
cache keeps its accepted rows.

- `SlotVerifier` (the fast engine): one forward over [B, R] rows (fast/batch.py, CUDA graphs per batch
  bucket on a GPU), the sequences' K/V in the slots of one BatchKV; a lone sequence runs the batch-1 path (static
  cache, CUDA graphs). The rows are packed with a few whole-batch copies, not per-sequence ones. Prompts joining
  together are prefilled in one packed forward (`fast_target.pack_prompts`), then copied into their slots.
- `LoopVerifier` (any HF model, hybrid ones included): each sequence keeps its own cache (a TargetCache, or the
  HybridCache that rolls linear-attention states back) and verifies with `generate()`'s own forward, one sequence
  after another. No faster than one at a time, but requests interleave step by step (a short request is not stuck
  behind a long one) and a schedule applies, on every model the HF engine runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from blockdraft.decoding.draft import Draft
from blockdraft.fast.batch import BatchForward, BatchKV
from blockdraft.fast.target import FastTarget, fixed_mask, pack_prompts
from blockdraft.models.host_to_device import long_tensor
from blockdraft.fast.static_cache import StaticTargetCache
from blockdraft.models.target import Target
from blockdraft.models.target_cache import TargetCache


@dataclass
class Verified:
    """A verify forward's results: per sequence its logits [n, V] and taps [1, n, *]; `logits` [B, R, V] too when
    every sequence's rows are rows of that one tensor (the batched forward), so the greedy picks of the whole batch
    take one argmax instead of one per sequence."""

    rows: list[tuple[torch.Tensor, torch.Tensor | None]]
    logits: torch.Tensor | None = None
    taps: torch.Tensor | None = None  # [B, R, *] when every sequence's taps are rows of it

    def detached(self, logit_rows: set[int]) -> "Verified":
        """The taps, and the logits of the sequences in `logit_rows`, copied out of the forward's buffers (a graph's
        outputs are overwritten by its next replay, or another graph's in the same memory pool): what a step in
        flight keeps when a join runs forwards before its read. Other sequences' logits are dropped."""
        whole = None if self.taps is None else self.taps.clone()
        if whole is not None:
            taps = [whole[b : b + 1, : rows.shape[0]] for b, (rows, _) in enumerate(self.rows)]
        else:
            taps = [None if tap is None else tap.clone() for _, tap in self.rows]
        return Verified([(logits.clone() if b in logit_rows else logits.new_empty(logits.shape[0], 0), tap)
                         for b, ((logits, _), tap) in enumerate(zip(self.rows, taps))], taps=whole)


class SlotVerifier:
    """The fast engine's verify: one forward over the slots of a BatchKV while two or more sequences run; a lone
    sequence runs `generate()`'s own batch-1 path (the target's static cache and CUDA graphs), so batch 1 keeps
    batch 1's speed. Its K/V move into slot 0 when a second sequence is about to join, and back when it is alone
    again (one copy of one sequence's cache each way)."""

    shares_forward = True  # one forward for the batch: packed prefills, device trees, a lone sequence's fused steps

    def __init__(self, target: FastTarget, slots: int) -> None:
        self.target = target
        self.store = BatchKV.for_target(target, slots)
        self.batched = BatchForward(target, self.store)
        self.single: StaticTargetCache | None = None  # the lone sequence's cache, on the batch-1 path

    def reserve(self, positions: int) -> None:
        """Every slot's K/V room for `positions` positions, now (a buffer that grows later drops its graphs)."""
        self.store.ensure(positions)

    def before_prefill(self) -> None:
        """A prefill is about to reuse the target's static cache: a lone sequence's K/V leave it for slot 0 (all the
        cache holds, so the rows a step still in flight wrote past its commit go too: the forward advanced the
        length over them, and that step's `keep` then sets slot 0's; a hybrid's verify rows go with its linear
        states, for that `keep` to commit)."""
        if self.single is not None:
            self.store.load(0, self.single, pending=True)
            self.single = None

    def prefill(self, first: int, prompts: list[list[int]],
                tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Several prompts (at most PREFILL_ROWS tokens in all) prefilled in one packed forward into the target's
        own cache, then each one's K/V into slots first..: each prompt's last-row logits [k, V] and taps [1, t, *]."""
        self.before_prefill()
        if not self.target.packs_prompts:
            return self._prefill_each(first, prompts, tap_layers)
        cache = self.target.new_cache()
        ids, positions, own, firsts = pack_prompts(prompts, self.target.device)
        hidden, taps = self.target.prefill(ids, positions, own, cache, tap_layers)
        lasts = long_tensor([start + len(prompt) - 1 for start, prompt in zip(firsts, prompts)], self.target.device)
        for b, (start, prompt) in enumerate(zip(firsts, prompts)):
            self.store.load(first + b, cache, start, len(prompt))
        contexts = None if taps is None else [taps[:, start : start + len(prompt)]
                                              for start, prompt in zip(firsts, prompts)]
        return self.target.lm_head(hidden[0, lasts]), contexts

    def _prefill_each(self, first: int, prompts: list[list[int]], tap_layers: tuple[int, ...] | None
                      ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """`prefill` one prompt per forward (a hybrid target: its linear attention would run packed prompts into each
        other)."""
        lasts, contexts = [], []
        for b, prompt in enumerate(prompts):
            cache = self.target.new_cache()
            n = len(prompt)
            ids = long_tensor(prompt, self.target.device).unsqueeze(0)
            hidden, taps = self.target.prefill(ids, torch.arange(n, device=self.target.device), None, cache,
                                               tap_layers)
            self.store.load(first + b, cache)
            lasts.append(hidden[0, -1])
            contexts.append(taps)
        return self.target.lm_head(torch.stack(lasts)), None if tap_layers is None else contexts

    def load(self, slot: int, cache: StaticTargetCache) -> None:
        if slot == 0:  # alone: stay where the prefill put it
            self.single = cache
        else:
            self.store.load(slot, cache)

    def move(self, source: int, dest: int) -> None:
        self.store.move(source, dest)

    def alone(self) -> StaticTargetCache:
        """The lone sequence's cache on the batch-1 path (back there from slot 0 when it is alone again)."""
        if self.single is None:
            self.single = self.target.new_cache()
            self.single.load_rows(self.store.kv[:, :, 0], self.store.lengths[0])
            if self.store.linear is not None and self.single.states is not None:
                self.single.states.load(0, self.store.linear, 0)
        return self.single

    def forward(self, anchors: list[int], drafts: list[Draft], starts: list[int],
                tap_layers: tuple[int, ...] | None) -> Verified:
        if len(drafts) == 1:
            return Verified([_forward_one(self.target, self.alone(), anchors[0], drafts[0], starts[0], tap_layers)])
        ids, positions, own = pack_rows(anchors, drafts, starts, self.target.device)
        logits, taps = self.batched(ids, positions, own, tap_layers)
        return Verified([(logits[b, : len(d) + 1], None if taps is None else taps[b : b + 1, : len(d) + 1])
                         for b, d in enumerate(drafts)], logits, taps)

    def forward_rows(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor,
                     tap_layers: tuple[int, ...] | None) -> Verified:
        """The verify of rows laid out on the device already (ddtree.DeviceTrees): ids and positions [B, R], own
        [B, R, R]; every sequence's R rows, padding included, and `logits` [B, R, V]."""
        if ids.shape[0] == 1:
            out = self.target.forward(ids, positions[0], self.alone(), tap_layers, attention_mask=own.unsqueeze(1))
            return Verified([(out.logits[0], out.taps)], out.logits)
        logits, taps = self.batched(ids, positions, own, tap_layers)
        return Verified([(logits[b], None if taps is None else taps[b : b + 1]) for b in range(ids.shape[0])], logits,
                        taps)

    def keep(self, slot: int, start: int, rows: torch.Tensor | None, produced: int) -> None:
        """Commit: the first `produced` rows of a chain, or the tree's accepted `rows`."""
        if self.single is not None:
            _keep_one(self.single, start, rows, produced)
        elif rows is None:
            self.store.keep_chain(slot, start, produced)
        else:
            self.store.compact(slot, start, rows)


def pack_rows(anchors: list[int], drafts: list[Draft], starts: list[int],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids and positions [B, R] and visibility [B, R, R] of each sequence's anchor + draft, padded to the longest.
    A padding row sits at its sequence's start and sees only itself; no real row sees it (chains: it comes after
    them; trees: it is nobody's ancestor)."""
    batch, rows = len(drafts), 1 + max(len(d) for d in drafts)
    if all(len(d) == rows - 1 and d.is_chain for d in drafts):  # chains of one length (AR: none): no padding
        host = long_tensor([anchors, starts], device)
        ids = host[0].unsqueeze(1)
        if rows > 1:
            ids = torch.cat([ids, torch.stack([d.tokens for d in drafts])], dim=1)
        causal = fixed_mask("tril", rows, device).expand(batch, rows, rows)
        return ids, host[1].unsqueeze(1) + _steps(rows, device), causal
    flat_ids = [b * rows + 1 + i for b, d in enumerate(drafts) for i in range(len(d))]
    positions = long_tensor([[start, *(start + depth for depth in d.depths), *[start] * (rows - 1 - len(d))]
                             for d, start in zip(drafts, starts)], device)
    ids = torch.zeros(batch * rows, dtype=torch.long, device=device)
    ids[::rows] = long_tensor(anchors, device)
    if flat_ids:
        ids.index_copy_(0, long_tensor(flat_ids, device), torch.cat([d.tokens for d in drafts]))
    if all(d.is_chain for d in drafts):
        return ids.view(batch, rows), positions, fixed_mask("tril", rows, device).expand(batch, rows, rows)
    up = long_tensor([[0, *(p + 1 for p in d.parents), *range(len(d) + 1, rows)] for d in drafts],
                     device)  # each row's parent; the root and padding rows: themselves
    own = torch.eye(rows, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    ancestor = torch.arange(rows, device=device).expand(batch, rows)
    for _ in range(max(max(d.depths, default=0) for d in drafts)):
        ancestor = up.gather(1, ancestor)
        own.scatter_(2, ancestor.unsqueeze(2), True)
    return ids.view(batch, rows), positions, own


@functools.lru_cache(maxsize=64)
def _steps(rows: int, device: torch.device) -> torch.Tensor:
    """0 .. rows - 1: a chain row's offset from its anchor's position."""
    return torch.arange(rows, device=device)


def _forward_one(target: Target, cache: TargetCache | StaticTargetCache, anchor: int, draft: Draft, start: int,
                 tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`generate()`'s verify forward for one sequence."""
    device = target.device
    ids = torch.cat([long_tensor([anchor], device), draft.tokens]).unsqueeze(0)
    mask = None if draft.is_chain else draft.tree_mask(len(cache), device)
    out = target.forward(ids, draft.positions(start, device), cache, tap_layers, attention_mask=mask)
    return out.logits[0], out.taps


def _keep_one(cache: TargetCache | StaticTargetCache, start: int, rows: torch.Tensor | None, produced: int) -> None:
    """`generate()`'s commit for one sequence: crop a chain, compact a tree."""
    if rows is None:
        cache.crop(start + produced)
    else:
        cache.compact(start, rows)


class LoopVerifier:
    """Any target: a cache per sequence and `generate()`'s forward, sequence by sequence."""

    shares_forward = False

    def __init__(self, target: Target, slots: int) -> None:
        self.target = target
        self.caches: list[TargetCache | None] = [None] * slots

    def reserve(self, positions: int) -> None:
        """Each sequence's cache grows with it: nothing to reserve."""

    def before_prefill(self) -> None:
        """Every sequence has a cache of its own: nothing to move."""

    def load(self, slot: int, cache: TargetCache) -> None:
        self.caches[slot] = cache

    def move(self, source: int, dest: int) -> None:
        self.caches[dest], self.caches[source] = self.caches[source], None

    def forward(self, anchors: list[int], drafts: list[Draft], starts: list[int],
                tap_layers: tuple[int, ...] | None) -> Verified:
        verified = Verified([])
        for slot, (anchor, draft, start) in enumerate(zip(anchors, drafts, starts)):
            cache = self.caches[slot]
            assert cache is not None
            verified.rows.append(_forward_one(self.target, cache, anchor, draft, start, tap_layers))
        return verified

    def keep(self, slot: int, start: int, rows: torch.Tensor | None, produced: int) -> None:
        cache = self.caches[slot]
        assert cache is not None
        _keep_one(cache, start, rows, produced)
