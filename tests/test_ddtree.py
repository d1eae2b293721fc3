"""DDTree: the tree builder is exactly the top-n prefixes, verification is lossless on any tree, the cache after
a tree step equals a clean AR cache (sliding-window layers included), and a large enough tree beats the chain."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

import blockdraft.decoding.ddtree as ddtree_mod
from blockdraft.decoding.ddtree import DDTreeProposer, build_tree
from blockdraft.decoding.draft import DFlashProposer, Draft
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.decoding.verify import walk
from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target

from conftest import DRAFTER_VARIANTS, HIDDEN, TARGET_LAYERS, VOCAB, make_drafter, make_target_model

# ---------------------------------------------------------------- the builder


def brute_force_scores(log_probs: torch.Tensor) -> list[float]:
    """Scores of every finite-score prefix of every length, best first."""
    slots, vocab = log_probs.shape
    scores = []
    for depth in range(1, slots + 1):
        for prefix in itertools.product(range(vocab), repeat=depth):
            score = sum(log_probs[i, t].item() for i, t in enumerate(prefix))
            if score > -math.inf:
                scores.append(score)
    return sorted(scores, reverse=True)


def tree_scores(draft: Draft, log_probs: torch.Tensor) -> list[float]:
    """Score of each node's prefix, checking on the way that the tree is well formed."""
    tokens = draft.tokens.tolist()
    scores: list[float] = []
    seen = set()
    for node, (parent, depth, token) in enumerate(zip(draft.parents, draft.depths, tokens)):
        assert -1 <= parent < node, "parents come before children"
        assert depth == (1 if parent == -1 else draft.depths[parent] + 1)
        assert (parent, token) not in seen, "no duplicate child"
        seen.add((parent, token))
        scores.append((0.0 if parent == -1 else scores[parent]) + log_probs[depth - 1, token].item())
    return scores


@st.composite
def distributions(draw: st.DrawFn) -> torch.Tensor:
    """[L, V] log-probabilities; integer logits make ties common, and some tokens may have probability 0."""
    slots, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    logits = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=slots * vocab, max_size=slots * vocab)))
    logits = logits.view(slots, vocab).double()
    dead = torch.tensor(draw(st.lists(st.booleans(), min_size=slots * vocab, max_size=slots * vocab))).view(slots, vocab)
    dead[:, 0] = False  # every depth keeps at least one possible token
    return torch.log_softmax(logits.masked_fill(dead, -math.inf), dim=-1)


@settings(max_examples=150, deadline=None)
@given(log_probs=distributions(), budget=st.integers(1, 40))
def test_builder_is_the_n_best_prefixes(log_probs: torch.Tensor, budget: int) -> None:
    draft = build_tree(log_probs, budget)
    best = brute_force_scores(log_probs)[:budget]
    got = tree_scores(draft, log_probs)
    assert len(got) == len(best)
    assert sorted(got, reverse=True) == pytest.approx(best, abs=1e-9)
    assert got == sorted(got, reverse=True), "pop order is best first"


def test_builder_float32_on_a_large_vocabulary() -> None:
    """Only the top min(n, V) tokens of a depth are needed: rank r at depth d is the r-th best token."""
    log_probs = torch.log_softmax(torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    draft = build_tree(log_probs, 64)
    assert len(draft) == 64
    order = log_probs.argsort(dim=-1, descending=True)
    depth1 = [t for t, p in zip(draft.tokens.tolist(), draft.parents) if p == -1]
    assert depth1 == order[0, : len(depth1)].tolist()
    assert draft.tokens[0] == order[0, 0]


@pytest.mark.parametrize("budget", [0, -3, None, 2.5])
def test_budget_must_be_a_positive_integer(budget) -> None:
    target = Target(make_target_model("qwen3"))
    with pytest.raises(BlockdraftError, match="--budget"):
        DDTreeProposer(make_drafter(), target, budget)
    with pytest.raises(BlockdraftError, match="--budget"):
        build_proposer("ddtree", target, make_drafter(), budget)
    with pytest.raises(BlockdraftError, match="--budget"):
        build_tree(torch.zeros(2, 3), budget)


@settings(max_examples=40, deadline=None)
@given(parent_choices=st.lists(st.integers(0, 10**6), max_size=12), cache_len=st.integers(0, 5))
def test_tree_mask_is_ancestors_and_self(parent_choices: list[int], cache_len: int) -> None:
    parents: list[int] = []
    for i, choice in enumerate(parent_choices):
        parents.append(choice % (i + 1) - 1)
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == -1 else depths[p] + 1)
    draft = Draft(tokens=torch.zeros(len(parents), dtype=torch.long), parents=parents, depths=depths)
    mask = draft.tree_mask(cache_len, torch.device("cpu"))[0, 0]
    n = len(parents) + 1
    assert mask.shape == (n, cache_len + n) and mask[:, :cache_len].all()
    for row in range(n):
        lineage, node = {0}, row - 1
        while node >= 0:
            lineage.add(node + 1)
            node = parents[node]
        assert {j for j in range(n) if mask[row, cache_len + j]} == lineage


# ------------------------------------------------------- targets with sliding windows / other attention


def sliding_target(family: str, attn: str = "sdpa", window: int = 4) -> torch.nn.Module:
    """A tiny target whose HF cache uses DynamicSlidingWindowLayer: Qwen3 mixed sliding/full, or Mistral."""
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
        tie_word_embeddings=False, sliding_window=window,
    )
    torch.manual_seed(0)
    if family == "qwen3":
        kinds = ["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2)
        model = Qwen3ForCausalLM(Qwen3Config(use_sliding_window=True, layer_types=kinds, **common))
    else:
        model = MistralForCausalLM(MistralConfig(**common))
    model.config._attn_implementation = attn
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


TARGETS = {
    "qwen3": lambda: make_target_model("qwen3"),
    "llama": lambda: make_target_model("llama"),
    "qwen3_sliding": lambda: sliding_target("qwen3"),
    "mistral_sliding": lambda: sliding_target("mistral"),
    "qwen3_sliding_eager": lambda: sliding_target("qwen3", "eager"),
}


def test_flash_attention_is_refused_for_trees() -> None:
    model = make_target_model("qwen3")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(BlockdraftError, match="attn_implementation='sdpa'"):
        DDTreeProposer(make_drafter(), Target(model), 16)


# ---------------------------------------------------------------- lossless


PROMPTS = [[3, 14, 15, 9, 26], [1], [7, 7, 7, 2, 90, 41, 5, 5, 12, 60, 33]]


@pytest.mark.parametrize("name", ["qwen3", "llama", "qwen3_sliding", "mistral_sliding"])
def test_ddtree_equals_ar(name: str) -> None:
    target = Target(TARGETS[name]())
    ar = [generate(target, p, None, max_new_tokens=20).token_ids for p in PROMPTS]
    variants = sorted(DRAFTER_VARIANTS) if name in ("qwen3", "llama") else ["mixed_swa"]
    for variant, budget in itertools.product(variants, (1, 4, 16, 64)):
        proposer = DDTreeProposer(make_drafter(variant), target, budget)
        for prompt, expected in zip(PROMPTS, ar):
            res = generate(target, prompt, proposer, max_new_tokens=20)
            assert res.token_ids == expected, (variant, budget, prompt)
            assert sum(res.acceptance_lengths) + 1 == 20
            assert max(res.acceptance_lengths) <= make_drafter(variant).cfg.block_size


def test_ddtree_stops_and_depth_limit() -> None:
    """max_new_tokens caps the tree depth; a stop token cuts the output like AR."""
    target = Target(make_target_model("qwen3"))
    proposer = DDTreeProposer(make_drafter("all_full"), target, 64)
    generate(target, PROMPTS[0], proposer, max_new_tokens=2)  # leaves drafter context behind
    draft = proposer.propose(5, len(PROMPTS[0]) + 1, 2, SamplingParams(), None)
    assert len(draft) == 64 and max(draft.depths) == 2
    assert len(proposer.propose(5, len(PROMPTS[0]) + 1, 0, SamplingParams(), None)) == 0
    full = generate(target, PROMPTS[0], None, max_new_tokens=25).token_ids
    stop = full[9]
    res = generate(target, PROMPTS[0], proposer, max_new_tokens=25, stop_token_ids=(stop,))
    assert res.token_ids == full[: full.index(stop) + 1] and res.stopped_on == stop


@pytest.mark.parametrize("variant", ["all_full", "mixed_swa"])
def test_top1_tree_reproduces_the_chain(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one candidate per depth (its argmax) and budget = slots, DDTree is DFlash: same ids and steps."""
    monkeypatch.setattr(
        ddtree_mod,
        "slot_log_probs",
        lambda logits, sampling: torch.full_like(logits, -math.inf).scatter(-1, logits.argmax(-1, keepdim=True), 0.0),
    )
    target = Target(make_target_model("qwen3"))
    drafter = make_drafter(variant)
    tree = DDTreeProposer(drafter, target, drafter.cfg.block_size - 1)
    chain = DFlashProposer(drafter, target)
    for prompt in PROMPTS:
        a = generate(target, prompt, chain, max_new_tokens=24)
        b = generate(target, prompt, tree, max_new_tokens=24)
        assert (b.token_ids, b.acceptance_lengths) == (a.token_ids, a.acceptance_lengths)


# ---------------------------------------------------------------- cache compaction


def greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    return generate(target, prompt, None, max_new_tokens=n).token_ids


def settled_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache.settle()
    return [(layer.keys, layer.values) for layer in cache.hf.layers]


def scattered_path_tree(seq: list[int]) -> Draft:
    """A tree holding the path seq[1..4] (seq[0] is the anchor) scattered among wrong siblings, parents first."""
    wrong = [(t + 1) % (VOCAB - 1) for t in seq]
    nodes = [
        (-1, wrong[1]), (-1, seq[1]), (0, seq[2]), (1, wrong[2]), (1, seq[2]), (4, seq[3]), (3, seq[3]),
        (5, wrong[4]), (5, seq[4]),
    ]
    parents = [p for p, _ in nodes]
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == -1 else depths[p] + 1)
    return Draft(tokens=torch.tensor([t for _, t in nodes]), parents=parents, depths=depths)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_cache_after_tree_step_equals_ar_cache(name: str) -> None:
    """A hand-made tree with the target's greedy path among wrong branches: the walk accepts the path; after
    compaction the cache, the logits and the taps equal a clean forward over the committed tokens."""
    target = Target(TARGETS[name]())
    prompt = PROMPTS[2]
    seq = greedy(target, prompt, 6)  # seq[0] is the anchor, seq[1:5] the path, seq[5] the bonus
    draft = scattered_path_tree(seq)
    assert not draft.is_chain

    taps = (0, 2, 3)
    cache = target.new_cache()
    start = len(prompt)
    target.forward(torch.tensor([prompt]), torch.arange(start), cache, taps)
    ids = torch.cat([torch.tensor([seq[0]]), draft.tokens]).unsqueeze(0)
    mask = draft.tree_mask(len(cache), target.device)
    out = target.forward(ids, draft.positions(start, target.device), cache, taps, attention_mask=mask)
    verdict = walk(draft, out.logits[0].argmax(-1).tolist(), draft.tokens.tolist())
    assert verdict.accepted == [1, 4, 5, 8] and verdict.bonus == seq[5]
    rows = torch.tensor([0] + [n + 1 for n in verdict.accepted])
    cache.compact(start, rows)
    assert len(cache) == start + 5

    ref_cache = target.new_cache()
    committed = prompt + seq[:5]
    ref = target.forward(torch.tensor([committed]), torch.arange(len(committed)), ref_cache, taps)
    for (k, v), (rk, rv) in zip(settled_kv(cache), settled_kv(ref_cache)):
        assert k.shape == rk.shape
        assert (k - rk).abs().max() < 1e-5 and (v - rv).abs().max() < 1e-5
    assert (out.logits[0, rows] - ref.logits[0, start:]).abs().max() < 1e-4
    assert (out.taps[0, rows] - ref.taps[0, start:]).abs().max() < 1e-4
    # the next step continues from the compacted cache exactly as from the clean one
    nxt = target.forward(torch.tensor([[seq[5]]]), torch.tensor([start + 5]), cache)
    ref_nxt = target.forward(torch.tensor([[seq[5]]]), torch.tensor([start + 5]), ref_cache)
    assert (nxt.logits - ref_nxt.logits).abs().max() < 1e-4


# ---------------------------------------------------------------- acceptance on a trained pair


@pytest.fixture(scope="session")
def trained_pair(trained_pairs: dict) -> tuple[Target, object]:
    """The tiny trained all-full (target, drafter) pair, loaded like a user would."""
    from blockdraft.models.loading import load_drafter, load_target

    target_dir, drafter_dir = trained_pairs["full"]
    target, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    return target, load_drafter(drafter_dir, target)


def test_tree_tau_beats_chain_tau(trained_pair) -> None:
    """A tree of 4(B-1) nodes beats the chain on average, one of 64 on every prompt; both stay lossless.

    Not per prompt at budget B-1: best-first may spend a small budget on siblings instead of the chain's deep
    nodes (on this pair 75% of budget-(B-1) trees lack part of the argmax chain), so it can lose to the chain.
    """
    from trained_pair import prompts

    target, drafter = trained_pair
    chain = DFlashProposer(drafter, target)
    slots = drafter.cfg.block_size - 1
    medium, large = DDTreeProposer(drafter, target, 4 * slots), DDTreeProposer(drafter, target, 64)
    chain_taus, medium_taus = [], []
    for prompt in prompts(seed=7, count=6):
        reference = generate(target, prompt.ids, chain, max_new_tokens=48)
        runs = [generate(target, prompt.ids, tree, max_new_tokens=48) for tree in (medium, large)]
        assert all(r.token_ids == reference.token_ids for r in runs)
        assert runs[1].stats.tau >= reference.stats.tau, prompt.id
        chain_taus.append(reference.stats.tau)
        medium_taus.append(runs[0].stats.tau)
    assert large.build_s > 0
    assert sum(chain_taus) / len(chain_taus) > 2.0, "the trained pair should accept well above 1"
    assert sum(medium_taus) > sum(chain_taus)


def test_trees_built_together_are_each_sequences_own_tree() -> None:
    """build_trees over a batch's [n, L, V] log-probs (each sequence its own slot count, one with none, ties in the
    scores) gives each sequence build_tree's tree on its own rows: tokens, parents, depths."""
    from blockdraft.decoding.ddtree import build_trees

    torch.manual_seed(3)
    log_probs = torch.randn(4, 6, 40).log_softmax(-1)
    log_probs[2, :, :5] = log_probs[2, :, :5].max()  # ties at the top
    slots = [6, 2, 5, 0]
    for budget in (1, 7, 30):
        together = build_trees(log_probs, slots, budget)
        for b, n in enumerate(slots):
            alone = build_tree(log_probs[b, :n], budget)
            assert torch.equal(together[b].tokens, alone.tokens), (budget, b)
            assert together[b].parents == alone.parents and together[b].depths == alone.depths, (budget, b)


@settings(max_examples=150, deadline=None)
@given(log_probs=distributions(), budget=st.integers(1, 40))
def test_the_device_search_finds_the_n_best_prefixes_too(log_probs: torch.Tensor, budget: int) -> None:
    """The tensor search (a beam per depth, run where the scores are on a GPU) on integer logits full of ties and
    impossible tokens: the n best prefixes, best first, every parent before its children."""
    from blockdraft.decoding.ddtree import build_trees

    draft = build_trees(log_probs.unsqueeze(0), [log_probs.shape[0]], budget, on_device=True)[0]
    best = brute_force_scores(log_probs)[:budget]
    got = tree_scores(draft, log_probs)
    assert len(got) == len(best)
    assert sorted(got, reverse=True) == pytest.approx(best, abs=1e-9)
    assert got == sorted(got, reverse=True)
    assert all(p < i and (p == -1 or draft.depths[p] + 1 == d) and (p != -1 or d == 1)
               for i, (p, d) in enumerate(zip(draft.parents, draft.depths)))


def test_the_device_search_builds_the_host_heaps_trees() -> None:
    """Without ties both searches order the same prefixes the same way: the same tokens, parents and depths for
    every sequence of a batch (its own slot count, one with none), at budgets from 1 to past L x k."""
    from blockdraft.decoding.ddtree import build_trees

    log_probs = (3 * torch.randn(5, 7, 60, generator=torch.Generator().manual_seed(5))).log_softmax(-1)
    slots = [7, 3, 0, 1, 6]
    for budget in (1, 2, 9, 33, 300):
        on_host = build_trees(log_probs, slots, budget, on_device=False)
        on_device = build_trees(log_probs, slots, budget, on_device=True)
        for b, (host, device) in enumerate(zip(on_host, on_device)):
            assert torch.equal(host.tokens, device.tokens), (budget, b)
            assert (host.parents, host.depths) == (device.parents, device.depths), (budget, b)


def test_trees_laid_out_on_the_device_are_the_host_heaps_trees_as_verify_rows() -> None:
    """`trees_on_device` (the batch decoder's and the fast engine's greedy DDTree steps): the host heap's trees, as
    the rows `pack_rows` lays out for them, padding past a tree's nodes included, and read back as those Drafts."""
    from blockdraft.decoding.ddtree import build_trees, trees_on_device
    from blockdraft.engine.verifiers import pack_rows

    slot_logits = 3 * torch.randn(5, 7, 60, generator=torch.Generator().manual_seed(6))
    log_probs = slot_logits.log_softmax(-1)
    slots, anchors, starts = [7, 3, 0, 1, 6], [11, 12, 13, 14, 15], [40, 3, 9, 0, 17]
    for budget in (1, 9, 33, 300):
        trees = trees_on_device(slot_logits, slots, budget, anchors, starts)
        on_host = build_trees(log_probs, slots, budget, on_device=False)
        rows = 1 + budget
        ids, positions, own = pack_rows(anchors, on_host, starts, torch.device("cpu"))
        logits = torch.randn(5, rows, 60)  # any verify result: the drafts read back must not depend on it
        drafts, _ = trees.verdicts(logits)
        for b, (host, device) in enumerate(zip(on_host, drafts)):
            n = 1 + len(host)
            assert torch.equal(device.tokens, host.tokens), (budget, b)
            assert (device.parents, device.depths) == (host.parents, host.depths), (budget, b)
            assert torch.equal(trees.ids[b, :n], ids[b, :n]) and torch.equal(trees.positions[b, :n], positions[b, :n])
            assert torch.equal(trees.own[b, :n, :n], own[b, :n, :n]), (budget, b)
            assert not trees.own[b, :n, n:].any(), "a node row sees padding"
