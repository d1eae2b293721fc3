"""Which sequences and anchors each micro-batch holds: a pure function of (seed, micro-batch number, rank).

Nothing here keeps state, so a resumed run given the same micro-batch counter gets bit-for-bit the batch the
killed run would have seen next. Anchors are re-drawn every epoch (the paper's recipe: random anchors beat fixed
block boundaries) from a generator keyed by (seed, epoch, sample index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from blockdraft.train.data import Sample


@dataclass(frozen=True)
class DraftBatch:
    """Right-padded sequences [b, T] with their lengths and anchors [b, n] (padding anchors are invalid)."""

    sample_ids: list[str]
    input_ids: torch.Tensor
    lengths: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor

    def to(self, device: torch.device) -> "DraftBatch":
        return DraftBatch(self.sample_ids, self.input_ids.to(device), self.lengths.to(device),
                          self.anchors.to(device), self.anchor_valid.to(device))

    @property
    def tokens(self) -> int:
        """Sequence tokens in the batch (padding excluded)."""
        return int(self.lengths.sum())


def right_pad(rows: list[list[int]], width: int) -> torch.Tensor:
    """[len(rows), width] long tensor of the rows, zero-padded on the right."""
    out = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def draw_anchors(sample: Sample, count: int, seed: int, epoch: int, index: int) -> list[int]:
    """Up to `count` distinct anchor positions in the response, each leaving at least one token to predict."""
    candidates = np.arange(sample.start, len(sample.ids) - 1)
    rng = np.random.default_rng([seed, epoch, index])
    chosen = rng.choice(candidates, size=min(count, candidates.size), replace=False)
    return sorted(int(a) for a in chosen)


@dataclass(frozen=True)
class BatchPlan:
    """Epoch-wise shuffled, rank-sharded micro-batches; every rank gets the same number per epoch (DDP needs it).

    With `pad_width`, every batch is padded to that many positions and `anchors_per_seq` anchors, so compiled
    kernels see one shape instead of recompiling per batch.
    """

    samples: list[Sample]
    batch_size: int
    anchors_per_seq: int
    seed: int
    rank: int = 0
    world: int = 1
    pad_width: int | None = None

    @property
    def per_rank(self) -> int:
        return len(self.samples) // self.world

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.per_rank / self.batch_size)

    def indices(self, micro_batch: int) -> tuple[int, list[int]]:
        """(epoch, sample indices) of this rank's `micro_batch`-th micro-batch since the start of training."""
        epoch, k = divmod(micro_batch, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
        mine = order[self.rank :: self.world][: self.per_rank]
        return epoch, [int(i) for i in mine[k * self.batch_size : (k + 1) * self.batch_size]]

    def batch(self, micro_batch: int) -> DraftBatch:
        """The padded micro-batch with its anchors for this epoch."""
        epoch, chosen = self.indices(micro_batch)
        picked = [self.samples[i] for i in chosen]
        anchors = [draw_anchors(s, self.anchors_per_seq, self.seed, epoch, i) for s, i in zip(picked, chosen)]
        width = self.pad_width or max(len(s.ids) for s in picked)
        n = self.anchors_per_seq if self.pad_width else max(len(a) for a in anchors)
        valid = torch.arange(n) < torch.tensor([len(a) for a in anchors]).unsqueeze(1)
        lengths = torch.tensor([len(s.ids) for s in picked])
        return DraftBatch([s.id for s in picked], right_pad([s.ids for s in picked], width), lengths,
                          right_pad(anchors, n), valid)
