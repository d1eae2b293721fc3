"""A request's committed tokens -> the text a client may see, with vLLM's stop rules (v1/engine/detokenizer.py).

- A stop token (EOS unless ignore_eos, or one of `stop_token_ids`) ends the output and is counted in usage but not
  decoded; `stop_reason` names it only when the user asked for it (EOS gives None, as in vLLM).
- Stop strings are matched on the decoded text after every token, so a stop spread over several tokens (or over
  two verify steps) is found at the token that completes it; the text is cut before the stop string, and the
  tokens after that one are dropped from the output and from usage.
- While streaming, text that could still turn out to be the start of a stop string is held back, as is a trailing
  partial UTF-8 character, so a client never sees text that is later taken back.
- Text is decoded as the ids come by the tokenizers library's `DecodeStream` where the tokenizer has a Rust backend
  and does no space clean-up (one step a token, 2.5-3x faster than two windowed decodes a commit on the embedded
  tokenizer: benchmarks/RESULTS.md, 2026-12-03; at batch 64 that work runs for every sequence each step), else by
  decoding a few ids of context around the new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

_PARTIAL = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to
_WINDOW = 6  # tokens of context kept when decoding incrementally (vLLM's prefix offset does the same)


@dataclass(frozen=True)
class StopRules:
    """`token_ids`: every id that ends the output; `reported_ids`: those stop_reason names; `strings`: stop strings."""

    token_ids: frozenset[int] = frozenset()
    reported_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()


def held_back(text: str, strings: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class OutputText:
    """One request's output: kept ids, text, and why it finished (None while it runs)."""

    def __init__(self, tokenizer: Any, rules: StopRules) -> None:
        self.tokenizer = tokenizer
        self.rules = rules
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._text_ids: list[int] = []
        self._backend = _streaming_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._prefix = 0  # decode window start
        self._read = 0  # ids already turned into self.text
        self._sent = 0  # characters of self.text already released

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, tokens: list[int]) -> tuple[str, list[int]]:
        """One committed chunk -> (text now safe to release, ids kept from it)."""
        kept: list[int] = []
        for token in tokens:
            if self.finished:
                break
            self.token_ids.append(token)
            kept.append(token)
            if token in self.rules.token_ids:
                self.finish_reason = "stop"
                self.stop_reason = token if token in self.rules.reported_ids else None
                break
            self._text_ids.append(token)
            if self.rules.strings:
                before = len(self.text)
                self._decode()
                self._match(before)
        if not self.rules.strings:
            self._decode()
        return self._release(), kept

    def finish(self, reason: str) -> str:
        """End the output (`reason` unless a stop already ended it); the text not yet released.

        Unless a stop string cut it, the final text is one decode of every kept id, exactly what `generate` prints.
        """
        if self.finish_reason is None:
            self.finish_reason = reason
        if self.tokenizer is not None and not isinstance(self.stop_reason, str):
            self.text = self.tokenizer.decode(self._text_ids, skip_special_tokens=True)
        rest = self.text[self._sent:]
        self._sent = len(self.text)
        return rest

    def _decode(self) -> None:
        """Extend self.text by the ids not yet read: through the stream, or decoding a few ids of context so merges
        and spaces come out right; a trailing partial character waits for the next token."""
        if self.tokenizer is None or self._read == len(self._text_ids):
            return
        if self._stream is not None:
            for token in self._text_ids[self._read:]:
                self.text += self._stream.step(self._backend, token) or ""
            self._read = len(self._text_ids)
            return
        decode = self.tokenizer.decode
        prefix = decode(self._text_ids[self._prefix:self._read], skip_special_tokens=True)
        full = decode(self._text_ids[self._prefix:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith(_PARTIAL):
            self.text += full[len(prefix):]
            self._prefix = max(self._read, len(self._text_ids) - _WINDOW)
            self._read = len(self._text_ids)

    def _match(self, before: int) -> None:
        """The stop string that completes earliest in the new text (list order breaks ties)."""
        best: tuple[int, int, str] | None = None
        for stop in self.rules.strings:
            index = self.text.find(stop, max(0, before - len(stop) + 1))
            if index != -1 and (best is None or index + len(stop) < best[0]):
                best = (index + len(stop), index, stop)
        if best is not None:
            self.text = self.text[: best[1]]
            self.finish_reason = "stop"
            self.stop_reason = best[2]

    def _release(self) -> str:
        if self.finished:
            visible = len(self.text)
        else:
            stable = self.text.rstrip(_PARTIAL)
            visible = len(stable) - held_back(stable, self.rules.strings)
        if visible <= self._sent:
            return ""
        piece = self.text[self._sent:visible]
        self._sent = visible
        return piece


def _streaming_backend(tokenizer: Any) -> Any:
    """The tokenizer's Rust `tokenizers.Tokenizer` where `DecodeStream` decodes exactly as `tokenizer.decode` does
    (a fast tokenizer without clean-up of spaces around punctuation, which the stream does not apply), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def commit_work(tokenizer: Any) -> Callable[[], Callable[[list[int]], bool]]:
    """New per-sequence commit hooks doing the server's text work on each commit (incremental detokenizing), so
    `tune` times a step as the server runs it: at batch 64 on the H200 that work was a large share of a step."""
    def new() -> Callable[[list[int]], bool]:
        output = OutputText(tokenizer, StopRules())

        def on_commit(tokens: list[int]) -> bool:
            output.push(tokens)
            return False

        return on_commit

    return new
