"""Each emitted token's logprobs come from the target's own verify row for it: equal (to float tolerance) to the
log-softmax of the target's forward over the prompt and the tokens before it, for AR, DFlash and DDTree, greedy and
sampled, alone and in a batch, cut with the tokens at stops and budgets."""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.logprobs import TokenLogprobs
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.sequence import Request
from blockdraft.errors import BlockdraftError
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model

PROMPTS = [[3, 14, 15, 9, 26], [7, 1], [40, 2, 2, 71, 5, 33, 90, 12]]
TOP = 3


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_target_model("qwen3")


def check(model: torch.nn.Module, prompt: list[int], tokens: list[int], logprobs: list[TokenLogprobs] | None,
          top: int = TOP) -> None:
    """The logprobs of `tokens` equal the target's own log-softmax at each position, top tokens included."""
    assert logprobs is not None and [lp.token for lp in logprobs] == tokens
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    want = torch.log_softmax(logits, dim=-1)
    for j, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(want[j, tokens[j]].item(), abs=1e-4)
        values, indices = want[j].topk(top)
        assert [i for i, _ in lp.top] == indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def proposers(target: Target) -> list:
    drafter = make_drafter("all_full")
    return [None, DFlashProposer(drafter, target), DDTreeProposer(drafter, target, 6)]


@pytest.mark.parametrize("engine", ["hf", "fast"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_reports_the_targets_own_logprobs(model, engine: str, temperature: float) -> None:
    target = Target(model) if engine == "hf" else FastTarget(model, fused=True)
    sampling = SamplingParams(temperature, logprobs=TOP)
    for proposer in proposers(target):
        for prompt in PROMPTS:
            sink: list[TokenLogprobs] = []
            seen: list[int] = []

            def on_commit(tokens: list[int]) -> bool:
                seen.extend(tokens)
                assert len(sink) == len(seen)  # filled before the hook sees the chunk
                return False

            result = generate(target, prompt, proposer, 14, sampling, seed=5, on_commit=on_commit, logprobs_out=sink)
            assert result.logprobs is sink
            check(model, prompt, result.token_ids, result.logprobs)
            plain = generate(target, prompt, proposer, 14, SamplingParams(temperature), seed=5)
            assert plain.token_ids == result.token_ids and plain.logprobs is None  # logprobs change nothing


def test_stops_cut_the_logprobs_with_the_tokens(model) -> None:
    target = Target(model)
    sampling = SamplingParams(logprobs=0)
    free = generate(target, PROMPTS[0], None, 12, sampling)
    stop = free.token_ids[4]
    cut = generate(target, PROMPTS[0], DFlashProposer(make_drafter("all_full"), target), 12, sampling,
                   stop_token_ids=(stop,))
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    check(model, PROMPTS[0], cut.token_ids, cut.logprobs, top=0)
    assert all(lp.top == () for lp in cut.logprobs)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_a_batch_reports_each_sequences_logprobs(model, method: str) -> None:
    """Three at a time with joins and leaves, a greedy and a sampled sequence side by side, one without logprobs."""
    target = FastTarget(model, fused=True)
    drafter = make_drafter("all_full")

    def proposer():
        return {"ar": None, "dflash": DFlashProposer(drafter, target), "ddtree": DDTreeProposer(drafter, target, 6)}[
            method]

    decoder = BatchDecoder(target, proposer, 3)
    sinks = [[] for _ in range(4)]
    requests = [Request(PROMPTS[0], 10, SamplingParams(logprobs=2), logprobs_out=sinks[0]),
                Request(PROMPTS[1], 6, SamplingParams(1.0, logprobs=2), seed=3, logprobs_out=sinks[1]),
                Request(PROMPTS[2], 12, SamplingParams()),
                Request(PROMPTS[0] + [4], 8, SamplingParams(logprobs=2), logprobs_out=sinks[3])]
    seqs = decoder.join_many(requests[:3])
    while decoder.running:
        decoder.step()
        if decoder.free and len(seqs) < 4:
            seqs += decoder.join_many(requests[3:])
    for request, seq, sink in zip(requests, seqs, sinks):
        if request.sampling.logprobs is None:
            assert seq.result().logprobs is None
            continue
        assert seq.result().logprobs is sink
        check(model, request.prompt_ids, seq.tokens, sink, top=2)


def test_out_of_range_logprobs_are_refused() -> None:
    with pytest.raises(BlockdraftError, match="logprobs 21 must be in 0..20"):
        SamplingParams(logprobs=21)
