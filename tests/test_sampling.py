"""Sampling is lossless: DFlash at T>0 draws sequences from exactly the target's distribution.

On a 5-token vocabulary the exact probability of every 3-token continuation is computed from the target;
a chi-square test compares it with DFlash samples. The same test must reject a deliberately biased rule.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import blockdraft.decoding.verify as verify_mod
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.sampling import SamplingParams, probabilities
from blockdraft.decoding.verify import Verdict
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model

V = 5
PROMPT = [1, 3, 2]
N = 1500


def exact_joint(model: torch.nn.Module, params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """P(t1..tn) under the target with the sampling transform, by enumerating every prefix."""
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :]
        probs = probabilities(logits, params)
        out[seq] = float(torch.prod(probs[torch.arange(length), torch.tensor(seq)]))
    return out


def sample_counts(target: Target, proposer: DFlashProposer | None, params: SamplingParams, length: int) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(N):
        ids = tuple(generate(target, PROMPT, proposer, max_new_tokens=length, sampling=params, seed=seed).token_ids)
        counts[ids] = counts.get(ids, 0) + 1
    return counts


def p_value(counts: dict, exact: dict) -> float:
    """Chi-square p-value; cells expected below 5 are pooled, and an impossible sequence fails outright."""
    assert all(exact[k] > 0 for k in counts), "sampled a sequence the target gives probability 0"
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for k in sorted(exact):
        if exact[k] * N >= 5:
            observed.append(counts.get(k, 0))
            expected.append(exact[k] * N)
        else:
            pooled_obs += counts.get(k, 0)
            pooled_exp += exact[k] * N
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def biased_rule(draft, logits, sampling, generator) -> Verdict:
    """Accept with min(1, p/q) but resample the bonus from p instead of the residual: NOT lossless."""
    n = len(draft)
    p = probabilities(logits, sampling)
    q = draft.draft_probs
    idx = torch.arange(n)
    ratio = (p[idx, draft.tokens] / q[idx, draft.tokens]).clamp(max=1)
    ok = (torch.rand(n, generator=generator) < ratio).int().cumprod(0)
    accepted = int(ok.sum())
    bonus = int(torch.multinomial(p[accepted], 1, generator=generator))
    return Verdict(accepted=list(range(accepted)), tokens=draft.tokens[:accepted].tolist(), bonus=bonus)


@pytest.fixture(scope="module")
def setup():
    model = make_target_model("qwen3", seed=3, vocab=V)
    target = Target(model)
    proposer = DFlashProposer(make_drafter("all_full", seed=3, vocab=V), target)
    return model, target, proposer


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9, top_k=4)])
def test_dflash_sampling_matches_target(setup, params: SamplingParams) -> None:
    model, target, proposer = setup
    exact = exact_joint(model, params, 3)
    assert p_value(sample_counts(target, proposer, params, 3), exact) > 1e-3


def test_biased_rule_is_caught(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    model, target, proposer = setup
    params = SamplingParams(1.0)
    exact = exact_joint(model, params, 3)
    monkeypatch.setattr(verify_mod, "speculative_sample", biased_rule)
    assert p_value(sample_counts(target, proposer, params, 3), exact) < 1e-3
