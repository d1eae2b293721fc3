"""Responses written by the target itself, cached on disk and resumable.

A drafter learns to predict the target, so it trains on the target's own answers (the paper's recipe), not on
someone else's. Generation is batched HF `generate` with left padding (`batched_generation`). Each rank appends
finished samples to its own JSONL file after every batch; a rerun (after a kill, or with more ranks) skips every id
already in any file.
A prompt may be answered at several temperatures (a greedy answer plus sampled ones: more distinct contexts from a
small prompt set); the record id says which (`response_id`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import GenerationConfig

from blockdraft.models.target import Target
from blockdraft.train.batched_generation import generate_batch
from blockdraft.train.data import Sample, TokenizedPrompt

CACHE_GLOB = "responses-*.jsonl"


@dataclass(frozen=True)
class Worker:
    """Which rank of how many does this part of a generation job, and whom it tells how far it got
    (`on_start`: rows left in the whole job; `on_batch`: rows just done, times world)."""

    rank: int = 0
    world: int = 1
    on_start: Callable[[int], None] | None = None
    on_batch: Callable[[int], None] | None = None


def response_id(prompt_id: str, temperature: float, draw: int = 1) -> str:
    """The cache id of a prompt's answer at a temperature: the prompt id for the greedy one (as caches always held),
    `<id>@T<temperature>` for a sampled one, `<id>@T<temperature>#<draw>` for the second and later at the same one."""
    if temperature == 0:
        return prompt_id
    return f"{prompt_id}@T{temperature:g}" + (f"#{draw}" if draw > 1 else "")


def read_records(folder: Path, pattern: str) -> list[dict[str, Any]]:
    """Every complete JSON line of the folder's files matching `pattern`, file by file in name order (a line cut by a
    kill is ignored: appending resumes after it, see `open_for_append`)."""
    records = []
    for file in sorted(folder.glob(pattern)):
        for line in file.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_cache(folder: Path) -> dict[str, Sample]:
    """Every complete record in the cache files, by id."""
    return {r["id"]: Sample(r["id"], r["input_ids"], r["loss_start"]) for r in read_records(folder, CACHE_GLOB)}


def open_for_append(file: Path) -> TextIO:
    """Append mode after cutting a partial last line, so the next record starts on a line of its own."""
    if file.exists():
        data = file.read_bytes()
        if data and not data.endswith(b"\n"):
            file.write_bytes(data[: data.rfind(b"\n") + 1])
    return file.open("a", encoding="utf-8")


def left_pad(prompts: list[TokenizedPrompt], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one batch (ids, attention mask), as batched `generate` takes them."""
    width = max(len(p.ids) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p.ids):] = torch.tensor(p.ids)
        mask[row, width - len(p.ids):] = 1
    return ids.to(device), mask.to(device)


def _response(new_tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first EOS (what follows is padding)."""
    for i, token in enumerate(new_tokens):
        if token in eos_ids:
            return new_tokens[: i + 1]
    return new_tokens


@torch.no_grad()
def regenerate(
    target: Target,
    prompts: list[TokenizedPrompt],
    folder: Path,
    *,
    max_length: int,
    response_tokens: int,
    batch_size: int,
    temperature: float,
    eos_ids: tuple[int, ...],
    pad_id: int,
    seed: int,
    worker: Worker = Worker(),
    draw: int = 1,
) -> int:
    """Generate responses for this rank's share of the prompts not yet cached; returns how many it wrote.

    Prompt i belongs to rank i % world whatever the cache holds, so ranks reading the cache while others write
    to it never split the work differently. Prompts leaving fewer than two tokens of room under `max_length` are
    skipped (nothing to learn from them).
    """
    folder.mkdir(parents=True, exist_ok=True)
    done = read_cache(folder)
    rank, world = worker.rank, worker.world
    pending = [p for p in prompts[rank::world]
               if response_id(p.id, temperature, draw) not in done and len(p.ids) <= max_length - 2]
    pending.sort(key=lambda p: len(p.ids))
    if worker.on_start:
        worker.on_start(len(pending) * world)
    eos = set(eos_ids)
    written = 0
    with open_for_append(folder / f"responses-{rank:03d}.jsonl") as out:
        for first in range(0, len(pending), batch_size):
            batch = pending[first : first + batch_size]
            ids, mask = left_pad(batch, pad_id, target.device)
            config = GenerationConfig(
                max_new_tokens=min(response_tokens, max_length - ids.shape[1]),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=None,
                top_k=None,
                eos_token_id=list(eos_ids) or None,
                pad_token_id=pad_id,
            )
            torch.manual_seed(seed + first * world + rank)  # sampled responses: a distinct stream per batch
            generated = generate_batch(target.model, ids, mask, config)
            for row, prompt in enumerate(batch):
                response = _response(generated[row, ids.shape[1]:].tolist(), eos)
                record = {"id": response_id(prompt.id, temperature, draw), "input_ids": prompt.ids + response,
                          "loss_start": len(prompt.ids), "temperature": temperature}
                out.write(json.dumps(record) + "\n")
            out.flush()
            written += len(batch)
            if worker.on_batch:
                worker.on_batch(len(batch) * world)
    return written
