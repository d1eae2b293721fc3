"""Training inputs: prompts (to be answered by the target) or given conversations, as token ids.

Prompt files and built-in sets go through `blockdraft.prompt_sets` (ShareGPT, Spec-Bench `turns`, `prompt`,
`messages`, `prompt_ids`); a `.txt` file holds blank-line separated documents. Chat prompts use the target's
template with thinking off, exactly as `blockdraft generate` encodes them, so the drafter trains on what it will see.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.prompt_sets import SHAREGPT_ROLES, load_prompt_set
from blockdraft.errors import BlockdraftError
from blockdraft.prompting import encode_messages, encode_text


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt ready for the target: its id (for resumable caches) and token ids."""

    id: str
    ids: list[int]


@dataclass(frozen=True)
class Sample:
    """One training sequence: prompt + response ids; the loss covers positions >= start (the response)."""

    id: str
    ids: list[int]
    start: int


def _documents(path: Path) -> list[str]:
    return [d.strip() for d in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if d.strip()]


def _encode_user_text(text: str, tokenizer: Any) -> list[int]:
    """A text prompt as a user turn when the target is a chat model, else as plain text."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return encode_messages([{"role": "user", "content": text}], tokenizer)
    return encode_text(text, tokenizer)


def load_prompts(source: str, tokenizer: Any, limit: int | None = None) -> list[TokenizedPrompt]:
    """Prompts from a file or built-in set, tokenized; `.txt` files: one prompt per blank-line separated paragraph."""
    path = Path(source).expanduser()
    if path.suffix == ".txt":
        if not path.is_file():
            raise BlockdraftError(f"--prompts {source} does not exist; pass a .jsonl/.json/.txt file or a built-in set")
        docs = _documents(path)[:limit]
        return [TokenizedPrompt(f"{path.stem}:{i}", _encode_user_text(d, tokenizer)) for i, d in enumerate(docs)]
    prompts = []
    for item in load_prompt_set(source, limit=limit):
        if item.prompt_ids is not None:
            ids = list(item.prompt_ids)
        elif item.messages is not None:
            ids = encode_messages(item.messages, tokenizer)
        else:
            ids = encode_text(item.prompt, tokenizer)
        prompts.append(TokenizedPrompt(item.id, ids))
    return prompts


def _messages(record: dict[str, Any]) -> list[dict[str, str]] | None:
    """A record's chat as role/content messages (ShareGPT `conversations`, `messages`, or `prompt` + `response`)."""
    if isinstance(record.get("conversations"), list):
        return [{"role": SHAREGPT_ROLES.get(t.get("from", ""), "user"), "content": t.get("value", "")}
                for t in record["conversations"] if isinstance(t, dict)]
    if isinstance(record.get("messages"), list):
        return record["messages"]
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    return None


def _records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise BlockdraftError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}); fix the file") from None
    if not isinstance(data, list):
        raise BlockdraftError(f"{path}: expected a JSON list of conversations")
    return data


def _conversation_sample(sample_id: str, messages: list[dict[str, str]], tokenizer: Any) -> Sample | None:
    """The first assistant turn as the response, everything before it as the prompt (as the target would see it)."""
    turn = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if turn is None or turn == 0:
        return None
    prompt_ids = encode_messages(messages[:turn], tokenizer)
    render = dict(tokenize=False, enable_thinking=False)
    prefix = tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, **render)
    full = tokenizer.apply_chat_template(messages[: turn + 1], add_generation_prompt=False, **render)
    reply = full[len(prefix):] if full.startswith(prefix) else messages[turn]["content"] + (tokenizer.eos_token or "")
    response = tokenizer(reply, add_special_tokens=False)["input_ids"]
    return Sample(sample_id, prompt_ids + list(response), len(prompt_ids))


def load_given_samples(source: str, tokenizer: Any, max_length: int, limit: int | None = None) -> list[Sample]:
    """`--no-regenerate`: train on responses already in the data (assistant turns, or whole `.txt` documents)."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise BlockdraftError(
            f"--prompts {source} is not a file; --no-regenerate needs a .jsonl/.json file with assistant turns or a .txt corpus"
        )
    if tokenizer is None:
        raise BlockdraftError("--no-regenerate needs the target's tokenizer, and the target folder has none")
    if path.suffix == ".txt":
        samples = []
        for i, doc in enumerate(_documents(path)[:limit]):
            ids = encode_text(doc, tokenizer)
            samples += [Sample(f"{path.stem}:{i}:{j}", ids[j : j + max_length], 1) for j in range(0, len(ids), max_length)]
        return samples
    samples = []
    for i, record in enumerate(_records(path)[:limit]):
        messages = _messages(record) if isinstance(record, dict) else None
        sample = _conversation_sample(str(record.get("id", f"{path.stem}:{i}")), messages, tokenizer) if messages else None
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise BlockdraftError(
            f"{path} has no conversation with an assistant turn after a user turn; drop --no-regenerate to let the "
            "target write the responses"
        )
    return samples
