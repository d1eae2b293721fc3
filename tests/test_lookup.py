"""Prompt lookup in DDTree's trees: the n-gram index finds what a scan of the context finds, a merged tree holds the
chain within the budget, and decoding with it stays the target's own output (T=0 ids, T>0 distribution)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdraft.bench.runner import MethodSpec
from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import Draft
from blockdraft.decoding.fused_steps import fused_steps
from blockdraft.decoding.generate import generate
from blockdraft.decoding.lookup import MAX_NGRAM, MIN_NGRAM, LookupTreeProposer, NgramIndex, merge_chain
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model
from test_sampling import V, exact_joint, p_value, sample_counts


def scanned_chain(tokens: list[int], length: int) -> list[int]:
    """The chain by a scan: the latest earlier occurrence of the longest suffix of MAX_NGRAM..MIN_NGRAM tokens."""
    for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + length]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(1, 5), max_size=10), st.integers(0, 6))
def test_the_index_finds_what_a_scan_finds(tokens: list[int], pieces: list[int], length: int) -> None:
    """Fed in pieces of any size, after every piece."""
    index = NgramIndex()
    at = 0
    for size in [*pieces, len(tokens)]:
        index.extend(tokens[at : at + size])
        at = min(at + size, len(tokens))
        assert index.chain(length) == scanned_chain(tokens[:at], length)


@st.composite
def trees(draw: st.DrawFn) -> tuple[Draft, list[int]]:
    """A tree in pop order (each node after its parent, no two siblings with one token) over tokens 0..3."""
    parents: list[int] = []
    tokens: list[int] = []
    for _ in range(draw(st.integers(0, 12))):
        parent = draw(st.integers(-1, len(parents) - 1))
        taken = {t for p, t in zip(parents, tokens) if p == parent}
        free = [t for t in range(4) if t not in taken]
        if not free:
            continue
        parents.append(parent)
        tokens.append(draw(st.sampled_from(free)))
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long), parents=parents, depths=depths), tokens


def paths(draft: Draft) -> list[tuple[int, ...]]:
    """Each node's tokens from the anchor down, checking that parents come first and depths add up."""
    tokens = draft.tokens.tolist()
    out: list[tuple[int, ...]] = []
    for node, (parent, depth) in enumerate(zip(draft.parents, draft.depths)):
        assert -1 <= parent < node
        assert depth == (1 if parent < 0 else draft.depths[parent] + 1)
        out.append((() if parent < 0 else out[parent]) + (tokens[node],))
    assert len(set(out)) == len(out), "no two nodes on one path"
    return out


@settings(max_examples=300, deadline=None)
@given(trees(), st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(0, 6))
def test_a_merged_tree_holds_the_chain_in_the_budget(tree: tuple[Draft, list[int]], chain: list[int],
                                                     spare: int) -> None:
    """The chain is a path from the anchor; the tree's nodes kept are its chain nodes and its first-popped others;
    the result fits the budget (the tree's size, or more)."""
    draft, tokens = tree
    budget = max(len(draft), len(chain)) + spare
    merged = merge_chain(draft, tokens, chain, budget)
    before, after = paths(draft), paths(merged)
    assert len(merged) <= budget
    assert all(tuple(chain[: i + 1]) in after for i in range(len(chain)))
    on_chain = [p for p in before if p == tuple(chain[: len(p)])]
    others = [p for p in before if p not in on_chain]
    kept = [p for p in after if p in before]
    assert set(on_chain) <= set(kept)
    assert [p for p in kept if p not in on_chain] == others[: len(kept) - len(on_chain)]
    added = len(after) - len(kept)
    assert len(kept) == len(before) or len(after) == budget, "a node is dropped only to make room"
    assert added == len(chain) - len(on_chain)
    if not added:
        assert merged is draft


PROMPTS = [[3, 14, 15, 9, 3, 14, 15, 9, 3, 14], [1], [7, 7, 7, 2, 90, 41, 5, 5, 12, 60, 33, 7, 7, 2]]


@pytest.mark.parametrize("variant", ["all_full", "mixed_swa"])
def test_lookup_trees_decode_the_targets_own_ids(variant: str) -> None:
    """At T=0, every budget and chain length, with prompts that repeat themselves (so chains are found)."""
    target = Target(make_target_model("qwen3"))
    for budget, lookup in ((1, 4), (4, 2), (8, 15), (16, 6)):
        proposer = LookupTreeProposer(make_drafter(variant), target, budget, lookup)
        for prompt in PROMPTS:
            expected = generate(target, prompt, None, max_new_tokens=24).token_ids
            result = generate(target, prompt, proposer, max_new_tokens=24)
            assert result.token_ids == expected, (budget, lookup, prompt)
            assert all(d <= budget for d in result.draft_lengths)


def test_lookup_trees_on_the_fast_engine_decode_its_ar_ids() -> None:
    """Its fused greedy steps (the chain searched and merged on the device) and its step-by-step path (merged trees
    smaller than the budget included) decode its AR ids, with the same acceptance."""
    model, drafter = make_target_model("qwen3"), make_drafter("all_full")
    runs = []
    for fused in (True, False):
        target = FastTarget(model, fused=fused)
        proposer = LookupTreeProposer(drafter, target, 8, 4)
        assert (fused_steps(target, proposer) is not None) == fused
        for prompt in PROMPTS:
            result = generate(target, prompt, proposer, max_new_tokens=24)
            assert result.token_ids == generate(target, prompt, None, max_new_tokens=24).token_ids
            runs.append(result.acceptance_lengths)
    assert runs[: len(PROMPTS)] == runs[len(PROMPTS) :]


def test_a_looping_target_is_drafted_by_its_chains() -> None:
    """A tiny random target falls into loops; its random drafter does not predict them, the lookup chain does: with
    the same budget the chain's trees accept more."""
    target = Target(make_target_model("qwen3", seed=1))
    prompt = [5, 17, 9, 33, 5, 17, 9, 33, 5, 17]
    plain = generate(target, prompt, DDTreeProposer(make_drafter("all_full"), target, 16), max_new_tokens=64)
    looked = generate(target, prompt, LookupTreeProposer(make_drafter("all_full"), target, 16, 8), max_new_tokens=64)
    assert looked.token_ids == plain.token_ids
    assert looked.stats.tau > plain.stats.tau


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9, top_k=4)])
def test_lookup_trees_sample_the_targets_distribution(params: SamplingParams) -> None:
    """At T>0 a lookup chain is one more deterministic branch: sample-and-match down the tree stays exact."""
    model = make_target_model("qwen3", seed=3, vocab=V)
    target = Target(model)
    proposer = LookupTreeProposer(make_drafter("all_full", seed=3, vocab=V), target, 4, 2)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3


def test_lookup_is_refused_off_ddtree_and_below_zero() -> None:
    target = Target(make_target_model("qwen3"))
    with pytest.raises(BlockdraftError, match="--lookup 4 .* --method ddtree, not dflash"):
        build_proposer("dflash", target, make_drafter(), lookup=4)
    with pytest.raises(BlockdraftError, match="--lookup -1 must be an integer >= 0"):
        build_proposer("ddtree", target, make_drafter(), 8, lookup=-1)
    assert type(build_proposer("ddtree", target, make_drafter(), 8, lookup=0)) is DDTreeProposer
    assert MethodSpec("ddtree", 31, None, 15).label == "ddtree@31+lookup15"
