"""Prompt text / chat messages / ids -> token ids, and the stop tokens a tokenizer implies."""

from __future__ import annotations

from typing import Any

from blockdraft.errors import BlockdraftError


def encode_text(text: str, tokenizer: Any) -> list[int]:
    """Plain completion text, tokenized as-is (special tokens from the tokenizer's own settings)."""
    if tokenizer is None:
        raise BlockdraftError("--prompt needs a tokenizer but the target folder has none; pass --prompt-ids 1,2,3")
    return list(tokenizer(text)["input_ids"])


def encode_messages(messages: list[dict], tokenizer: Any, thinking: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
    """Chat messages (and the functions the model may call, `tools`) through the tokenizer's chat template, with the
    assistant turn opened.

    Thinking is off by default: published drafters are trained on non-thinking responses, and a mode mismatch
    halves acceptance.
    """
    if tokenizer is None:
        raise BlockdraftError("--messages needs a tokenizer but the target folder has none; pass --prompt-ids 1,2,3")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise BlockdraftError('messages must be a JSON list of {"role": ..., "content": ...} objects')
    if getattr(tokenizer, "chat_template", None) is None:
        raise BlockdraftError("the target's tokenizer has no chat template; pass --prompt TEXT instead of messages")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, enable_thinking=thinking, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    """`1,2,3` -> [1, 2, 3]; errors name `option`, the flag the list came from."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise BlockdraftError(f"{option} {text!r} must be comma-separated integers like 1,2,3") from None
    if not ids or min(ids) < 0:
        raise BlockdraftError(f"{option} must hold at least one non-negative integer")
    return ids


def stop_tokens(tokenizer: Any, generation_eos: int | list[int] | None, extra: list[int]) -> tuple[int, ...]:
    """EOS ids from the generation config and tokenizer, plus the user's --stop-token-ids."""
    ids: list[int] = list(extra)
    if isinstance(generation_eos, int):
        ids.append(generation_eos)
    elif isinstance(generation_eos, list):
        ids.extend(generation_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


class IncrementalDecoder:
    """Committed token chunks -> the text each chunk adds, for streaming.

    It decodes everything so far and returns the new suffix, so tokens that only make sense together (merged
    bytes, leading spaces) come out right.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, new: list[int]) -> str:
        self.ids.extend(new)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.text = full[len(self.text):], full
        return piece
