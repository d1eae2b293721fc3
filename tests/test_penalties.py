"""vLLM's sampling penalties with speculation on: each verify row penalized with its own history, so AR, DFlash and
DDTree give the ids of a plain loop that penalizes the target's logits token by token (written here from vLLM's
formulas, independently), alone and batched; sampling keeps the penalized distribution (chi-square)."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.penalties import Penalties, penalize, row_outputs
from blockdraft.decoding.sampling import SamplingParams, probabilities
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.sequence import Request
from blockdraft.errors import BlockdraftError
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model
from test_hybrid import OracleProposer

PROMPTS = [[3, 14, 15, 9, 26], [7, 1], [40, 2, 2, 71, 5, 33, 90, 12]]
STOPS = (5, 6)
CASES = {
    "frequency": Penalties(frequency=1.5),
    "presence": Penalties(presence=-1.0),
    "repetition": Penalties(repetition=1.7),
    "bias, min_tokens, bad words": Penalties(logit_bias=((11, 4.0), (12, -50.0)), min_tokens=6,
                                             bad_words=((13,), (20, 21))),
    "all": Penalties(frequency=0.4, presence=0.3, repetition=1.2, logit_bias=((11, 2.0),), min_tokens=3),
}


def reference_logits(row: torch.Tensor, prompt: list[int], output: list[int], p: Penalties) -> torch.Tensor:
    """One position's logits as vLLM's sampler processes them, token by token in plain Python."""
    out = row.float().clone()
    for word in p.bad_words:
        if len(word) <= len(output) + 1 and list(word[:-1]) == (output[len(output) - len(word) + 1:] if len(word) > 1
                                                                 else []):
            out[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        for stop in STOPS:
            out[stop] = float("-inf")
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in range(out.shape[0]):
        if token in output or token in prompt:
            out[token] = out[token] / p.repetition if out[token] > 0 else out[token] * p.repetition
        count = output.count(token)
        out[token] -= p.frequency * count + p.presence * (count > 0)
    return out


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int, p: Penalties) -> list[int]:
    output: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            row = model(torch.tensor([prompt + output])).logits[0, -1]
        token = int(reference_logits(row, prompt, output, p).argmax())
        output.append(token)
        if token in STOPS:
            break
    return output


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_target_model("qwen3")


def test_each_row_is_penalized_with_its_own_path(model) -> None:
    """A tree's rows: the anchor's history is the output so far, a node's adds its drafted path."""
    assert row_outputs([4, 5], [-1, 0, -1, 1], [7, 8, 9, 10]) == [[4, 5], [4, 5, 7], [4, 5, 7, 8], [4, 5, 9],
                                                                  [4, 5, 7, 8, 10]]
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    outputs = [[1, 2, 2], [1, 2, 2, 3], [13, 20]]
    got = penalize(logits, outputs, [30, 31], CASES["all"], STOPS)
    for r, output in enumerate(outputs):
        torch.testing.assert_close(got[r], reference_logits(logits[r], [30, 31], output, CASES["all"]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_speculation_is_exact_under_penalties(model, case: str) -> None:
    penalties = CASES[case]
    sampling = SamplingParams(penalties=penalties)
    drafter = make_drafter("all_full")
    for target in (Target(model), FastTarget(model, fused=True)):
        for prompt in PROMPTS:
            want = reference_greedy(model, prompt, 16, penalties)
            oracle = OracleProposer(prompt + want, slots=5)  # every acceptance length: deep rows decide too
            for proposer in (None, DFlashProposer(drafter, target), DDTreeProposer(drafter, target, 6), oracle):
                got = generate(target, prompt, proposer, 16, sampling, stop_token_ids=STOPS).token_ids
                assert got == want, (case, type(target).__name__, proposer and proposer.name)


def test_a_batch_penalizes_each_sequence_on_its_own(model) -> None:
    target = FastTarget(model, fused=True)
    drafter = make_drafter("all_full")
    decoder = BatchDecoder(target, lambda: DDTreeProposer(drafter, target, 6), 3)
    cases = [CASES["frequency"], CASES["repetition"], Penalties(), CASES["all"]]
    requests = [Request(prompt, 14, SamplingParams(penalties=p), STOPS)
                for prompt, p in zip(PROMPTS + [PROMPTS[0]], cases)]
    seqs = decoder.join_many(requests[:3])
    while decoder.running:
        decoder.step()
        if decoder.free and len(seqs) < 4:
            seqs += decoder.join_many(requests[3:])
    for request, seq, penalties in zip(requests, seqs, cases):
        assert seq.tokens == reference_greedy(model, request.prompt_ids, 14, penalties)


def test_sampling_keeps_the_penalized_distribution() -> None:
    """T=1 on a 5-token vocabulary with frequency, presence and repetition penalties: DFlash samples 3-token
    continuations with the penalized target's exact joint probabilities."""
    from test_sampling import PROMPT, V, p_value

    model = make_target_model("qwen3", vocab=V, seed=3)
    target = Target(model)
    penalties = Penalties(frequency=0.8, presence=0.4, repetition=1.5)
    params = SamplingParams(1.0, penalties=penalties)
    exact = {}
    for seq in itertools.product(range(V), repeat=3):
        prob = 1.0
        for j in range(3):
            with torch.no_grad():
                row = model(torch.tensor([PROMPT + list(seq[:j])])).logits[0, -1]
            logits = reference_logits(row, PROMPT, list(seq[:j]), Penalties(**{**penalties.__dict__}))
            prob *= float(probabilities(logits.unsqueeze(0), params)[0, seq[j]])
        exact[seq] = prob
    proposer = DFlashProposer(make_drafter("all_full", seed=3, vocab=V), target)
    counts: dict = {}
    from test_sampling import N

    for seed in range(N):
        ids = tuple(generate(target, PROMPT, proposer, 3, params, seed=seed).token_ids)
        counts[ids] = counts.get(ids, 0) + 1
    assert p_value(counts, exact) > 1e-3


def test_out_of_range_penalties_are_refused() -> None:
    with pytest.raises(BlockdraftError, match=r"\[-2, 2\]"):
        Penalties(frequency=3)
    with pytest.raises(BlockdraftError, match="repetition penalty 0 must be > 0"):
        Penalties(repetition=0)
