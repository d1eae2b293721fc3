"""Target taps (the OUTPUT of layer L = HF `hidden_states[L + 1]`) for training batches.

By default the frozen target runs under no_grad on every batch: no disk, any target size, and the taps always
match the target. For small targets whose forward is a large share of the step, `precompute_taps` writes them
once to safetensors shards (resumable: finished shards are skipped) and `StoredTaps` reads them back.
Soft labels (`--distill-topk`) come from the same online forward: the target's top-K next-token probabilities at
every position.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target
from blockdraft.train.batches import DraftBatch, right_pad
from blockdraft.train.data import Sample
from blockdraft.train.objective import SoftLabels

SHARD_SAMPLES = 256


@dataclass(frozen=True)
class Features:
    """What the target gives a training batch: taps [b, T, k * hidden] and, when distilling, its soft labels."""

    taps: torch.Tensor
    soft: SoftLabels | None = None


@torch.no_grad()
def compute_features(target: Target, input_ids: torch.Tensor, lengths: torch.Tensor, tap_layers: tuple[int, ...],
                     topk: int = 0) -> Features:
    """Concatenated taps of right-padded sequences (padding rows are garbage, never read), and with topk > 0 the
    target's top-k next-token probabilities at every position (its logits over all positions exist only here)."""
    mask = (torch.arange(input_ids.shape[1], device=input_ids.device) < lengths.unsqueeze(1)).long()
    out = target.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False,
                       logits_to_keep=0 if topk else 1)
    taps = torch.cat([out.hidden_states[layer + 1] for layer in tap_layers], dim=-1)
    if not topk:
        return Features(taps)
    values, ids = out.logits.topk(topk, dim=-1)
    return Features(taps, SoftLabels(ids, values.float().softmax(-1)))


def compute_taps(target: Target, input_ids: torch.Tensor, lengths: torch.Tensor,
                 tap_layers: tuple[int, ...]) -> torch.Tensor:
    """The taps alone (see `compute_features`)."""
    return compute_features(target, input_ids, lengths, tap_layers).taps


class TapSource(Protocol):
    """Where a batch's taps (and soft labels) come from."""

    def __call__(self, batch: DraftBatch) -> Features: ...


class OnlineTaps:
    """Taps (and with topk > 0 soft labels) from the frozen target, computed for each batch."""

    def __init__(self, target: Target, tap_layers: tuple[int, ...], topk: int = 0) -> None:
        self.target = target
        self.tap_layers = tap_layers
        self.topk = topk

    def __call__(self, batch: DraftBatch) -> Features:
        return compute_features(self.target, batch.input_ids, batch.lengths, self.tap_layers, self.topk)


def _tap_key(tap_layers: tuple[int, ...]) -> str:
    return ",".join(map(str, tap_layers))


def precompute_taps(
    target: Target,
    samples: list[Sample],
    tap_layers: tuple[int, ...],
    folder: Path,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    on_shard: Callable[[int], None] | None = None,
) -> None:
    """Write taps of every sample into shards of SHARD_SAMPLES samples; shard j is this rank's when j % world == rank."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(rank, -(-len(samples) // SHARD_SAMPLES), world):
        path = folder / f"taps-{shard:05d}.safetensors"
        chunk = samples[shard * SHARD_SAMPLES : (shard + 1) * SHARD_SAMPLES]
        if not path.exists():
            tensors: dict[str, torch.Tensor] = {}
            for first in range(0, len(chunk), batch_size):
                part = chunk[first : first + batch_size]
                lengths = torch.tensor([len(s.ids) for s in part], device=target.device)
                ids = right_pad([s.ids for s in part], int(lengths.max())).to(target.device)
                taps = compute_taps(target, ids, lengths, tap_layers)
                for row, s in enumerate(part):
                    tensors[s.id] = taps[row, : len(s.ids)].cpu().contiguous()
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"tap_layers": _tap_key(tap_layers)})
            os.replace(tmp, path)
        if on_shard:
            on_shard(len(chunk) * world)


class StoredTaps:
    """Taps read back from `precompute_taps` shards, padded into a batch on the training device."""

    def __init__(self, folder: Path, tap_layers: tuple[int, ...], device: torch.device) -> None:
        self.device = device
        self.where: dict[str, Path] = {}
        for path in sorted(folder.glob("taps-*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                stored = (f.metadata() or {}).get("tap_layers")
                if stored != _tap_key(tap_layers):
                    raise BlockdraftError(
                        f"{path} holds taps of layers [{stored}] but the drafter uses {list(tap_layers)}; "
                        f"delete {folder} or pass --taps {stored}"
                    )
                self.where.update((key, path) for key in f.keys())

    def __call__(self, batch: DraftBatch) -> Features:
        rows = []
        for sample_id in batch.sample_ids:
            with safe_open(str(self.where[sample_id]), framework="pt") as f:
                rows.append(f.get_tensor(sample_id))
        return Features(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(self.device))
