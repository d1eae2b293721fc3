"""Batched decoding to the end: every prompt through one batch decoder, new ones joining as others finish, and the
warm-up that decodes at every batch bucket before anything is timed or served."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from blockdraft.decoding.draft import Proposer
from blockdraft.decoding.generate import GenerationResult
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.batch_sizes import bucket_sizes
from blockdraft.engine.sequence import Request, Sequence
from blockdraft.models.target import Target


def generate_batch(target: Target, prompts: list[list[int]], new_proposer: Callable[[], Proposer | None],
                   batch_size: int, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                   stop_token_ids: tuple[int, ...] = (), seed: int = 0) -> Iterator[tuple[int, GenerationResult]]:
    """Decode every prompt with up to `batch_size` at a time, new ones joining (prefilled together) as soon as
    some finish; yields (prompt index, result) in finishing order. Each prompt's ids equal `generate()`'s on it
    alone with `seed`."""
    yield from decode_batch(BatchDecoder(target, new_proposer, batch_size), prompts, max_new_tokens, sampling,
                            stop_token_ids, seed)


def decode_batch(decoder: BatchDecoder, prompts: list[list[int]], max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), stop_token_ids: tuple[int, ...] = (),
                 seed: int = 0) -> Iterator[tuple[int, GenerationResult]]:
    """`generate_batch` on a decoder of one's own (one warmed before, whose graphs the decode then reuses)."""
    pending = list(enumerate(prompts))
    owner: dict[int, int] = {}
    while pending or decoder.running:
        joining, pending = pending[: decoder.free], pending[decoder.free :]
        seqs = decoder.join_many([Request(ids, max_new_tokens, sampling, stop_token_ids, seed) for _, ids in joining])
        for (index, _), seq in zip(joining, seqs):
            if seq.done:
                yield index, seq.result()
            else:
                owner[id(seq)] = index
        for seq in decoder.step():
            yield owner.pop(id(seq)), seq.result()


def warm_buckets(decoder: BatchDecoder, prompt_ids: list[int], tokens: int,
                 prepare: Callable[[Sequence], None] | None = None,
                 done: Callable[[int, float], None] | None = None) -> None:
    """Decode `tokens` tokens of the prompt at every batch bucket the decoder's graphs are captured for (1, 2, 4,
    ... its max_seqs sequences at once), so that what each size first meets (compiling, tuning, graph
    capture) is paid here and not by the decodes that follow; `prepare` sees each joined sequence first (a
    schedule's warm-up picks its candidate there); `done` hears each size and its seconds."""
    for size in bucket_sizes(decoder.max_seqs):
        began = time.perf_counter()
        for seq in decoder.join_many([Request(prompt_ids, tokens)] * size):
            if prepare is not None:
                prepare(seq)
        while decoder.running:
            decoder.step()
        if done is not None:
            done(size, time.perf_counter() - began)
