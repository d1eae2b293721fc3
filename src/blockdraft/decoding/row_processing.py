"""A verify's logits as the target alone would see them at each row: under the request's grammar, then with its
penalties (vLLM's order), each row with its own path. One function for every place a row is picked from: a prefill's
last row, `generate()`'s verify, a batch's verify."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from blockdraft.decoding.grammar import GrammarState
from blockdraft.decoding.penalties import penalize, row_outputs
from blockdraft.decoding.sampling import SamplingParams


def processed_rows(logits: torch.Tensor, tokens: list[int], parents: list[int], output: list[int],
                   prompt: list[int], sampling: SamplingParams, stops: AbstractSet[int],
                   grammar: GrammarState | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [1 + n, V] of a verify of drafted `tokens` (`parents`: each node's parent, -1 the anchor) after the
    committed `output`: under the grammar (what logprobs read, as vLLM's come after its bitmask), and those with the
    penalties too (what the target picks from). A prefill's last row is the case of no draft. Without a grammar or
    penalties, `logits` itself, twice."""
    if grammar is not None:
        logits = grammar.apply(logits, tokens, parents)
    if not sampling.penalties.active:
        return logits, logits
    return logits, penalize(logits, row_outputs(output, parents, tokens), prompt, sampling.penalties,
                            frozenset(stops))
