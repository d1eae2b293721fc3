"""Requests the target writes itself (`--prompts self`), for a target without a prompt set of its own.

An instruct model given its chat template up to the opening of a user turn continues it with a user's request, drawn
from the requests it was tuned on (the Magpie method); its answers to them are then regenerated like any others, so
prompts and answers both come from the target. Each rank writes its share once into the run's data folder: a resumed
or relaunched run trains on the same requests, and a killed one continues where it stopped. The files hold one
`{"id", "messages"}` record per request, the format `--prompts` reads, so they join any other prompt file by `cat`;
ids name the seed (`self:<seed>:<rank>:<n>`), so sets written under other seeds join without one answer's cache entry
standing for another's request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target
from blockdraft.prompting import encode_messages
from blockdraft.train.batched_generation import generate_batch
from blockdraft.train.data import TokenizedPrompt
from blockdraft.train.regenerate import Worker, open_for_append, read_records

CACHE_GLOB = "self-prompts-*.jsonl"
TEMPERATURE, TOP_P = 1.0, 0.95
_SENTINEL = "\x00blockdraft-user-turn\x00"
_TRIES_PER_PROMPT = 10  # rows sampled per wanted request before giving up on a target that never ends a turn


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """The chat template's text before a user message's content (system prompt included): what the target continues."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise BlockdraftError(
            "--prompts self needs a chat target (its template says where a user turn begins); pass a prompt file instead"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False, enable_thinking=False)
    if _SENTINEL not in text:
        raise BlockdraftError("--prompts self: the target's chat template drops the user's text; pass a prompt file instead")
    return list(tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"])


def _finished_text(new_tokens: list[int], eos_ids: set[int], tokenizer: Any) -> str | None:
    """The request up to its end-of-turn token, or None when the target did not end it (cut off) or wrote nothing."""
    end = next((i for i, t in enumerate(new_tokens) if t in eos_ids), None)
    if end is None:
        return None
    text = tokenizer.decode(new_tokens[:end], skip_special_tokens=True).strip()
    return text or None


@torch.no_grad()
def write_self_prompts(
    target: Target,
    tokenizer: Any,
    folder: Path,
    count: int,
    *,
    max_tokens: int,
    batch_size: int,
    eos_ids: tuple[int, ...],
    seed: int,
    worker: Worker = Worker(),
) -> int:
    """Sample this rank's share of `count` requests that the target ends within `max_tokens`; returns how many it wrote.

    Rank r owns `count // world` requests, plus one when r < count % world. Requests cut off or empty are dropped
    and sampled again, up to ten rows per wanted request.
    """
    prefix, rank, world = user_turn_prefix(tokenizer), worker.rank, worker.world
    if not eos_ids:
        raise BlockdraftError("--prompts self needs the target's end-of-turn token; its tokenizer and config name none")
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"self-prompts-{rank:03d}.jsonl"
    share = count // world + (rank < count % world)
    have = len(read_records(folder, file.name))
    if worker.on_start:
        worker.on_start(max(0, share - have) * world)
    eos, written, tried = set(eos_ids), 0, 0
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
                              top_k=None, eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    with open_for_append(file) as out:
        while have < share:
            if tried >= _TRIES_PER_PROMPT * share:
                raise BlockdraftError(
                    f"--prompts self: the target ended only {written} of {tried} requests within {max_tokens} tokens; it "
                    "may not be a chat model (pass a prompt file) or need a larger --max-length"
                )
            rows = min(batch_size, _TRIES_PER_PROMPT * share - tried)
            torch.manual_seed(seed + rank + world * (have * 7919 + tried))
            ids = torch.tensor([prefix] * rows, device=target.device)
            generated = generate_batch(target.model, ids, torch.ones_like(ids), config)
            tried += rows
            for row in range(rows):
                text = _finished_text(generated[row, len(prefix):].tolist(), eos, tokenizer)
                if text is not None and have < share:
                    messages = [{"role": "user", "content": text}]
                    out.write(json.dumps({"id": f"self:{seed}:{rank}:{have}", "messages": messages}) + "\n")
                    have, written = have + 1, written + 1
                    if worker.on_batch:
                        worker.on_batch(world)
            out.flush()
    return written


def load_self_prompts(folder: Path, tokenizer: Any) -> list[TokenizedPrompt]:
    """The written requests as user turns through the chat template (as every prompt is), repeats dropped."""
    seen: set[str] = set()
    prompts = []
    for record in read_records(folder, CACHE_GLOB):
        text = record["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            prompts.append(TokenizedPrompt(record["id"], encode_messages(record["messages"], tokenizer)))
    return prompts
