"""Logprobs in vLLM 0.33's response layout: the chat `content` list and the completions arrays.

Each emitted token's candidates are vLLM's: the emitted token first, then the position's most likely tokens not
already listed; chat shows the first `top_logprobs` of them, completions the first `logprobs` + 1 (keyed by token
text, as OpenAI's). A token's text is its id decoded alone, with the leading spaces a SentencePiece tokenizer's
decode strips put back (vLLM's `convert_ids_list_to_tokens`), or "token_id:<id>" with `return_tokens_as_token_ids`
(or with no tokenizer). Log-probabilities below -9999 are written as -9999.0, as vLLM does for -inf.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from blockdraft.decoding.logprobs import TokenLogprobs
from blockdraft.serve.protocol import ChatLogProb, ChatLogProbs, ChatLogProbsContent, CompletionLogProbs

FLOOR = -9999.0


class TokenTexts:
    """Token ids as the text a logprob entry names them by (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = None if as_ids else tokenizer
        self.marker = _space_marker(self.tokenizer) if self.tokenizer is not None else None
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        text = self.cache.get(token)
        if text is None:
            text = self.tokenizer.decode([token]) or ""
            if self.marker is not None:
                raw = self.tokenizer.convert_ids_to_tokens(token) or ""
                markers = len(raw) - len(raw.lstrip(self.marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                text = " " * missing + text if missing > 0 else text
            self.cache[token] = text
        return text


@lru_cache(maxsize=4)
def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer (its decode strips a leading one); read
    once per tokenizer, not per request (its JSON runs to megabytes for a large vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return next((sub.get("replacement", "▁") for sub in subs if sub.get("type") == "Metaspace"), None)


def candidates(entry: TokenLogprobs) -> list[tuple[int, float]]:
    """The emitted token, then the position's most likely tokens not already listed."""
    seen = {entry.token}
    listed = [(entry.token, entry.logprob)]
    for token, logprob in entry.top:
        if token not in seen:
            seen.add(token)
            listed.append((token, logprob))
    return listed


def chat_logprobs(entries: list[TokenLogprobs], top: int, texts: TokenTexts) -> ChatLogProbs:
    """Chat's `logprobs`: each token with its log-probability, bytes and first `top` candidates."""
    def item(token: int, logprob: float) -> ChatLogProb:
        text = texts(token)
        return ChatLogProb(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode("utf-8", "replace")))

    content = []
    for entry in entries:
        own = item(entry.token, entry.logprob)
        content.append(ChatLogProbsContent(**own.model_dump(), top_logprobs=[
            item(token, logprob) for token, logprob in candidates(entry)[:top]]))
    return ChatLogProbs(content=content)


def completion_logprobs(entries: list[TokenLogprobs], top: int, texts: TokenTexts, offset: int
                        ) -> CompletionLogProbs:
    """Completions' `logprobs` arrays; `offset` is the text offset of the first token (the text already sent)."""
    tokens = [texts(entry.token) for entry in entries]
    offsets = [offset + sum(len(text) for text in tokens[:i]) for i in range(len(tokens))]
    return CompletionLogProbs(  # every field given: a stream's chunks drop the fields never set
        text_offset=offsets, tokens=tokens,
        token_logprobs=[None if entry.logprob is None else max(entry.logprob, FLOOR) for entry in entries],
        top_logprobs=[None if entry.logprob is None else  # an echoed prompt's first token: nothing predicts it
                      {texts(token): max(logprob, FLOOR) for token, logprob in candidates(entry)[: top + 1]}
                      for entry in entries])
