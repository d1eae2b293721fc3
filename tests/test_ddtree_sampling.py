"""DDTree at T>0 is lossless: sample-and-match down a branching tree draws exactly the target's sequences.

Same chi-square setup as test_sampling.py (5-token vocabulary, every 3-token continuation's exact probability);
the same test must reject the classic mistake of accepting deterministic tree children with min(1, p/q).
"""

from __future__ import annotations

import pytest
import torch

import blockdraft.decoding.generate as generate_mod
from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import Draft
from blockdraft.decoding.sampling import SamplingParams, probabilities, sample
from blockdraft.decoding.verify import Verdict
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model
from test_sampling import V, exact_joint, p_value, sample_counts

BUDGET = 8  # with 3 new tokens the tree is at most 2 deep: 8 nodes over 5 + 25 candidates branch at both depths


@pytest.fixture(scope="module")
def setup():
    model = make_target_model("qwen3", seed=3, vocab=V)
    target = Target(model)
    return model, target, DDTreeProposer(make_drafter("all_full", seed=3, vocab=V), target, BUDGET)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9, top_k=4)])
def test_ddtree_sampling_matches_target(setup, params: SamplingParams) -> None:
    model, target, proposer = setup
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3


def min_p_over_q_rule(draft: Draft, logits: torch.Tensor, sampling: SamplingParams, generator,
                      synthetic: object = None) -> Verdict:
    """Accept a deterministic child c with probability min(1, p(c)/q(c)), q(c) = 1: NOT lossless."""
    p = probabilities(logits, sampling)
    tokens = draft.tokens.tolist()
    accepted: list[int] = []
    node = -1
    while True:
        for child, (parent, token) in enumerate(zip(draft.parents, tokens)):
            if parent == node and torch.rand(1, generator=generator).item() < p[node + 1, token].item():
                accepted.append(child)
                node = child
                break
        else:
            return Verdict(accepted=accepted, tokens=[tokens[i] for i in accepted],
                           bonus=int(sample(p[node + 1], generator).item()))


def test_min_p_over_q_on_tree_children_is_caught(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    model, target, proposer = setup
    params = SamplingParams(1.0)
    monkeypatch.setattr(generate_mod, "verify", min_p_over_q_rule)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) < 1e-3
