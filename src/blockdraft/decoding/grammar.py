"""Structured outputs: a grammar (JSON, a JSON schema, a regex, a choice, EBNF) masks the target's distribution at
every verified position, through xgrammar (pinned, vLLM's default backend).

A verify row's mask is the grammar's state after its path: the committed tokens, then the drafted ones from the
anchor down to it. The matcher walks the draft's tree depth first, filling each row's mask, accepting a child's token
on the way down and rolling it back on the way up; a drafted token the grammar forbids cuts its subtree (its rows keep
the raw logits: no accepted path reaches them, since its parent's mask forbids it). After the walk the matcher holds
the committed tokens again, and the step's kept tokens are accepted into it. The target then picks from masked rows,
so a drafted token the grammar forbids ends acceptance there, and the output is what the target alone would produce
under the grammar.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from collections.abc import Callable
from typing import Any

import torch

from blockdraft.errors import BlockdraftError

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: `kind` one of KINDS, `source` its text (a schema's JSON, a regex, the choices as a
    JSON list, EBNF; empty for any JSON)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BlockdraftError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - pinned in pyproject.toml
        raise BlockdraftError("structured outputs need xgrammar: pip install xgrammar==0.2.8") from exc
    return xgrammar


@lru_cache(maxsize=8)
def _compiler(tokenizer: Any, vocab: int) -> Any:
    xgr = _xgrammar()
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))


def parse_grammar(spec: GrammarSpec) -> Any:
    """The spec as xgrammar's Grammar, with no tokenizer involved: cheap, so the server checks each request's
    grammar with it before queueing (the token masks are compiled by the engine). A spec xgrammar cannot read is a
    BlockdraftError naming why."""
    grammar = _xgrammar().Grammar
    try:
        if spec.kind == "json":
            return grammar.builtin_json_grammar()
        if spec.kind == "json_schema":
            return grammar.from_json_schema(spec.source, strict_mode=True)
        if spec.kind == "regex":
            return grammar.from_regex(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            return grammar.from_ebnf("root ::= " + " | ".join(json.dumps(str(c)) for c in choices))
        return grammar.from_ebnf(spec.source)
    except Exception as exc:  # xgrammar reports bad input as RuntimeError or ValueError with a message
        reason = re.sub(r"^\[[^\]]*\] \S+: ", "", str(exc).strip().splitlines()[0])  # its log prefix: time, file
        raise BlockdraftError(f"the {spec.kind} cannot be compiled: {reason}") from None


def compile_grammar(spec: GrammarSpec, tokenizer: Any, vocab: int) -> Any:
    """The spec's token masks compiled for this tokenizer and a target of `vocab` logits (xgrammar caches them)."""
    return _compiler(tokenizer, vocab).compile_grammar(parse_grammar(spec))


class GrammarState:
    """One sequence's grammar matcher over its committed tokens: each verify's row masks, then its kept tokens."""

    def __init__(self, compiled: Any, vocab: int) -> None:
        xgr = _xgrammar()
        self.xgr = xgr
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """The bitmask [1 + n, words] (int32, on the host) of a verify's rows: the anchor's, then each drafted
        node's (`tokens`, `parents`: the draft's, parents first)."""
        bitmask = self.xgr.allocate_token_bitmask(1 + len(tokens), self.vocab)
        bitmask.fill_(-1)  # every token allowed: the rows no accepted path can reach
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        stack: list[tuple[int, int]] = [(-1, 0)]  # (node, depth accepted into the matcher to reach it)
        depth = 0
        while stack:
            node, at = stack.pop()
            self.matcher.rollback(depth - at)
            depth = at
            if node >= 0:
                if not self.matcher.accept_token(tokens[node]):
                    continue
                depth += 1
            if self.matcher.is_terminated():  # a stop token ended the grammar: only stop tokens follow
                self._stops_only(bitmask, node + 1)
                continue
            self.matcher.fill_next_token_bitmask(bitmask, node + 1)
            stack.extend((child, depth) for child in reversed(children.get(node, [])))
        self.matcher.rollback(depth)
        return bitmask

    def _stops_only(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` allows the grammar's stop tokens alone."""
        bitmask[row] = 0
        for token in self.matcher.stop_token_ids:
            bit = token % 32
            bitmask[row, token // 32] |= -(1 << 31) if bit == 31 else 1 << bit  # int32 words

    def path_filter(self) -> Callable[[tuple[int, ...], int], bool]:
        """A tree search's test of a candidate child: may `token` follow the committed tokens and then `path` (the
        tokens from the anchor's child down to the parent)? Each path's mask is computed once per search, the matcher
        left where it was."""
        masks: dict[tuple[int, ...], torch.Tensor | None] = {}

        def allowed(path: tuple[int, ...], token: int) -> bool:
            if path not in masks:
                masks[path] = self._mask_after(path)
            mask = masks[path]
            return mask is not None and bool((int(mask[token // 32]) >> (token % 32)) & 1)

        return allowed

    def _mask_after(self, path: tuple[int, ...]) -> torch.Tensor | None:
        """The allowed-token bitmask row after `path` (None: the path itself leaves the grammar)."""
        accepted = 0
        for token in path:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        mask = None
        if accepted == len(path):
            bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
            if self.matcher.is_terminated():
                self._stops_only(bitmask, 0)
            else:
                self.matcher.fill_next_token_bitmask(bitmask, 0)
            mask = bitmask[0]
        self.matcher.rollback(accepted)
        return mask

    def accept(self, tokens: list[int]) -> None:
        """The committed tokens of a step (each one the grammar allowed; after the grammar ended, its stop tokens)."""
        for token in tokens:
            if self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} was committed against the grammar")

    def apply(self, logits: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """The verify's logits [1 + n, V] (float32, a new tensor) with each row's disallowed tokens at -inf."""
        out = logits.float().clone()
        self.xgr.apply_token_bitmask_inplace(out, self.masks(tokens, parents).to(out.device), vocab_size=self.vocab)
        return out
