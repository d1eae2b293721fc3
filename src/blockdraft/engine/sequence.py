"""A sequence of a batched decode: the request it joined with, and everything `generate()` keeps for one (its ids,
proposer, sampling generator, step record), so that its ids in a batch are its batch-1 ids."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from blockdraft.decoding.draft import Draft, Proposer
from blockdraft.decoding.grammar import GrammarState
from blockdraft.decoding.generate import GenerationResult, OnCommit, until_stop
from blockdraft.decoding.logprobs import TokenLogprobs
from blockdraft.decoding.row_processing import processed_rows
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.metrics import SpecStats


@dataclass(frozen=True)
class Request:
    """What a sequence joins with: `generate()`'s arguments."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    on_commit: OnCommit | None = None
    logprobs_out: list[TokenLogprobs] | None = None  # `generate()`'s: filled before `on_commit` sees a chunk
    grammar: GrammarState | None = None  # structured output: what every token must match


@dataclass
class Sequence:
    """One request in the batch: its ids so far, limits, sampling and drafting state, and its step record."""

    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator
    stops: frozenset[int]
    proposer: Proposer | None
    on_commit: OnCommit | None
    tokens: list[int]
    ttft_s: float
    joined: float
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    stopped_on: int | None = None
    ended_early: bool = False
    finished: float | None = None
    pending: list[int] = field(default_factory=list)  # rows of the decoder's deferred taps: committed tokens not yet
    # in the drafter context (BatchDecoder._catch_up)
    logprobs: list[TokenLogprobs] | None = None  # each kept token's, where sampling asks for them
    prompt: list[int] = field(default_factory=list)  # its prompt ids (the repetition penalty reads them)
    grammar: GrammarState | None = None  # structured output: its matcher over the committed tokens

    @property
    def raw_greedy(self) -> bool:
        """Greedy on the target's raw logits: what the device-side picks (fused steps, device trees, the batch's
        one argmax) decide for it."""
        return self.sampling.raw_greedy and self.grammar is None

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or self.stopped_on is not None or self.ended_early

    def commit(self, committed: list[int], logprobs: list[TokenLogprobs] | None = None) -> list[int]:
        """Cut `committed` (and its tokens' `logprobs`) at the token budget and the first stop; record it; returns
        what was kept (for `on_commit`, which the decoder calls later, while the next step runs)."""
        committed, stopped_on = until_stop(committed, self.max_new_tokens - len(self.tokens), self.stops)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[: len(committed)])
        if self.grammar is not None:
            self.grammar.accept(committed)
        if stopped_on is not None:
            self.stopped_on = stopped_on
        self.tokens.extend(committed)
        self.acceptance_lengths.append(len(committed))
        if self.proposer:
            self.proposer.observe(committed)
        return committed

    def processed(self, logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify's logits [rows, V] for `draft` under the sequence's grammar (what logprobs read, as vLLM's come
        after its bitmask), and those as the target alone would pick from them: each row also with the penalties over
        its own output (the tokens so far and its drafted path), if any."""
        if self.grammar is None and not self.sampling.penalties.active:
            return logits, logits
        return processed_rows(logits, draft.tokens.tolist(), draft.parents, self.tokens, self.prompt, self.sampling,
                              self.stops, self.grammar)

    def result(self) -> GenerationResult:
        """What `generate()` returns for one sequence."""
        stats = SpecStats(
            method=self.proposer.name if self.proposer else "ar", num_prompts=1, prompt_tokens=self.prompt_len,
            generated_tokens=len(self.tokens), acceptance_lengths=list(self.acceptance_lengths),
            drafted_tokens=sum(self.draft_lengths), ttft_s=self.ttft_s,
            decode_s=(self.finished or time.perf_counter()) - self.joined - self.ttft_s,
        )
        return GenerationResult(token_ids=list(self.tokens), acceptance_lengths=list(self.acceptance_lengths),
                                stats=stats, stopped_on=self.stopped_on, draft_lengths=list(self.draft_lengths),
                                ended_early=self.ended_early, logprobs=self.logprobs)
