"""The batch decoder launches the next step before handing a step's commits to their hooks (the server's text work
then runs while the device verifies): hooks hear every chunk in order and after that launch, a hook that ends its
sequence drops only what the step in flight computed for it, and a join while a step flies keeps that step's
results out of the buffers the join's forwards write."""

from __future__ import annotations

import torch

from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.engine.batch import BatchDecoder
from blockdraft.fast.target import FastTarget

from conftest import make_drafter, make_target_model
from test_batched_decode import prompts


def pair() -> tuple[FastTarget, object]:
    return FastTarget(make_target_model("qwen3")), make_drafter("all_full")


def test_hooks_hear_a_step_after_the_next_step_is_launched() -> None:
    target, drafter = pair()
    decoder = BatchDecoder(target, lambda: build_proposer("dflash", target, drafter), 4)
    events: list[str] = []
    forward = decoder.verifier.forward

    def logged(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events.append("verify")
        return forward(*args, **kwargs)

    decoder.verifier.forward = logged  # type: ignore[method-assign]
    heard: dict[int, list[int]] = {0: [], 1: []}

    def hook(index: int):  # noqa: ANN202
        def on_commit(tokens: list[int]) -> bool:
            events.append(f"hook {index}")
            heard[index].extend(tokens)
            return False
        return on_commit

    first, second = prompts(2)
    seqs = [decoder.join(ids, 30, on_commit=hook(i)) for i, ids in enumerate((first, second))]
    events.clear()
    decoder.step()
    assert events == ["verify", "verify", "hook 0", "hook 1"]  # step 1 launched and read, step 2 launched, hooks
    events.clear()
    decoder.step()
    assert events == ["verify", "hook 0", "hook 1"]
    while decoder.running:
        decoder.step()
    assert decoder.flight is None
    for index, (seq, ids) in enumerate(zip(seqs, (first, second))):
        assert heard[index] == seq.tokens == generate(target, ids, build_proposer("dflash", target, drafter), 30).token_ids


def test_a_hook_that_ends_its_sequence_drops_the_step_in_flight_for_it_alone() -> None:
    target, drafter = pair()
    decoder = BatchDecoder(target, lambda: build_proposer("dflash", target, drafter), 4)
    chunks: list[list[int]] = []

    def stop_after_two(tokens: list[int]) -> bool:
        chunks.append(tokens)
        return len(chunks) == 3  # the first token, then two steps' commits: then a stop string, say

    first, second = prompts(2)
    ended = decoder.join(first, 40, on_commit=stop_after_two)
    other = decoder.join(second, 40)
    finished = []
    while decoder.running:
        finished.extend(decoder.step())
    assert ended.ended_early and ended in finished
    assert ended.tokens == [token for chunk in chunks for token in chunk]  # nothing of the dropped step kept
    assert len(ended.acceptance_lengths) == len(ended.draft_lengths) == 2
    alone = generate(target, first, build_proposer("dflash", target, drafter), 40)
    assert ended.tokens == alone.token_ids[: len(ended.tokens)]
    assert ended.acceptance_lengths == alone.acceptance_lengths[:2]
    assert other.tokens == generate(target, second, build_proposer("dflash", target, drafter), 40).token_ids


def test_a_join_copies_the_step_in_flight_out_of_the_forwards_buffers() -> None:
    """The flight's taps feed its sequences' drafter contexts at its read: after a join they must be a copy (a CUDA
    graph's outputs are overwritten by the join's replays), so scribbling over the originals changes nothing."""
    target, drafter = pair()
    decoder = BatchDecoder(target, lambda: build_proposer("dflash", target, drafter), 4)
    items = prompts(3)
    seqs = [decoder.join(ids, 24) for ids in items[:2]]
    decoder.step()
    flight = decoder.flight
    assert flight is not None and flight.verified.taps is not None
    original = flight.verified.taps
    seqs.append(decoder.join(items[2], 24))
    assert flight.join_s > 0  # the join ran while it flew
    assert all(taps.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
               for _, taps in flight.verified.rows if taps is not None)
    with torch.inference_mode():
        original.fill_(float("nan"))
    while decoder.running:
        decoder.step()
    for seq, ids in zip(seqs, items):
        alone = generate(target, ids, build_proposer("dflash", target, drafter), 24)
        assert seq.tokens == alone.token_ids
        assert seq.acceptance_lengths == alone.acceptance_lengths
