"""Hybrid targets (Gated DeltaNet linear attention + full attention): rejected drafts roll back exactly, by either
strategy (snapshot + replay, per-position states), so speculative decoding equals the target's own greedy decode
and the cache after a rejection equals a clean AR cache over the committed tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer, Draft, ProposerBase
from blockdraft.decoding.generate import generate
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.hybrid import DEFAULT_STRATEGY, STRATEGIES, HybridCache, tree_linear_attention, tree_parents
from blockdraft.models.loading import load_target
from blockdraft.models.target import Target
from blockdraft.models.target_cache import TargetCache

from conftest import HIDDEN, TARGET_LAYERS, VOCAB, make_drafter
from test_ddtree import scattered_path_tree
from test_lossless import hf_greedy

# Two linear-attention layers, then full attention, then linear: the drafter taps (0, 2, 3) see both kinds.
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
PROMPTS = [[3, 14, 15, 9, 26], [7], [40, 2, 2, 71, 5, 33, 90, 12, 8, 61, 19]]


def make_hybrid(family: str, seed: int = 0, vocab: int = VOCAB, layer_types: list[str] = LAYER_TYPES
                ) -> torch.nn.Module:
    """A tiny random hybrid target with the conftest sizes, so conftest's drafters fit it."""
    common = dict(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
        tie_word_embeddings=False, layer_types=layer_types, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_num_key_heads=2, linear_value_head_dim=8, linear_num_value_heads=4,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "qwen3_5":
        model_cls, config = Qwen3_5ForCausalLM, Qwen3_5TextConfig(**common)
    elif family == "qwen3_5_moe":
        model_cls, config = Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**common, **moe)
    else:
        model_cls, config = Qwen3NextForCausalLM, Qwen3NextConfig(**common, **moe)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    for p in model.parameters():  # as in conftest: varied greedy choices rather than a constant token
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    return model


FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def with_strategy(target: Target, strategy: str) -> Target:
    """`target`, its new caches rolling back by `strategy` (Target itself always builds the default); the latest
    one stays readable as `target.last_cache`."""

    def new_cache() -> HybridCache:
        target.last_cache = HybridCache(target.model, strategy)
        return target.last_cache

    target.new_cache = new_cache
    return target


@pytest.fixture(scope="module", params=[(f, s) for f in FAMILIES for s in STRATEGIES], ids="-".join)
def hybrid(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, Target]:
    family, strategy = request.param
    model = make_hybrid(family)
    return model, with_strategy(Target(model), strategy)


class OracleProposer(ProposerBase):
    """Proposes the target's true continuation with draft `step % (slots + 1)` made wrong (none when that is
    `slots`): the steps cycle through rejection at every depth and the full accept, so every rollback runs."""

    name = "oracle"
    tap_layers = (0,)
    build_s = 0.0

    def __init__(self, truth: list[int], slots: int) -> None:
        self.truth = truth
        self.slots = slots
        self.step = 0

    def reset(self) -> None:
        self.step = 0

    def add_context(self, taps: torch.Tensor) -> None: ...

    def observe(self, tokens: list[int]) -> None: ...

    def propose(self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator) -> Draft:
        tokens = self.truth[start + 1 : start + 1 + min(self.slots, max_depth)]
        wrong, self.step = self.step % (self.slots + 1), self.step + 1
        if wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % (VOCAB - 1)
        return Draft.chain(torch.tensor(tokens, dtype=torch.long))


def test_hybrid_target_gets_a_hybrid_cache(hybrid) -> None:
    model, target = hybrid
    cache = Target(model).new_cache()
    assert isinstance(cache, HybridCache) and cache.strategy == DEFAULT_STRATEGY
    assert "linear_attention" in target.layer_types


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_hybrid_loads_with_taps(family: str, tmp_path) -> None:
    """A saved checkpoint of each hybrid model type loads as a user's would: same logits, taps from linear and
    attention layers, the embedding and LM head the drafter shares, a hybrid cache."""
    model = make_hybrid(family)
    model.save_pretrained(tmp_path)
    target, tokenizer = load_target(str(tmp_path), torch.device("cpu"), torch.float32)
    assert type(target.model) is type(model) and tokenizer is None
    assert isinstance(target.new_cache(), HybridCache)
    ids, taps = torch.tensor([PROMPTS[2]]), (0, 2, 3)
    out = target.forward(ids, torch.arange(ids.shape[1]), target.new_cache(), taps)
    ref = model(ids, output_hidden_states=True)
    assert (out.logits - ref.logits).abs().max() < 1e-5
    assert (out.taps - torch.cat([ref.hidden_states[layer + 1] for layer in taps], dim=-1)).abs().max() < 1e-5
    assert torch.equal(target.lm_head.weight, model.lm_head.weight)
    assert torch.equal(target.embedding_weight, model.get_input_embeddings().weight)
    assert DFlashProposer(make_drafter("all_full"), target).tap_layers == taps


def test_ar_loop_matches_hf_generate(hybrid) -> None:
    model, target = hybrid
    for prompt in PROMPTS:
        assert generate(target, prompt, None, max_new_tokens=20).token_ids == hf_greedy(model, prompt, 20)


def test_dflash_equals_ar(hybrid) -> None:
    """A random drafter (rejections nearly every step) and an oracle (all acceptance lengths) stay lossless."""
    _, target = hybrid
    dflash = DFlashProposer(make_drafter("all_full"), target)
    for prompt in PROMPTS:
        ar = generate(target, prompt, None, max_new_tokens=24).token_ids
        oracle = OracleProposer(prompt + ar, slots=5)
        for proposer in (dflash, oracle):
            spec = generate(target, prompt, proposer, max_new_tokens=24)
            assert spec.token_ids == ar
        assert spec.acceptance_lengths[:6] == [1, 2, 3, 4, 5, 6]  # the oracle ran every rollback and a full accept
        assert (target.last_cache.replayed_tokens > 0) == (target.last_cache.strategy == "replay")


def linear_states(cache: TargetCache) -> list[torch.Tensor]:
    """Every state the next forward reads: conv and recurrent state per linear layer, K and V per attention layer."""
    cache.settle()
    out: list[torch.Tensor] = []
    for layer in cache.hf.layers:
        if hasattr(layer, "conv_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


def ar_cache(target: Target, tokens: list[int], prompt_len: int) -> TargetCache:
    """A clean AR run over `tokens`: prefill the prompt, then one token per forward."""
    cache = target.new_cache()
    target.forward(torch.tensor([tokens[:prompt_len]]), torch.arange(prompt_len), cache)
    for pos in range(prompt_len, len(tokens)):
        target.forward(torch.tensor([[tokens[pos]]]), torch.tensor([pos]), cache)
    return cache


def assert_same_states(cache: TargetCache, ref: TargetCache) -> None:
    assert len(cache) == len(ref)
    for got, want in zip(linear_states(cache), linear_states(ref), strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("kept", [0, 2, 4])
def test_state_after_rejection_equals_ar(hybrid, kept: int) -> None:
    """Verify [anchor] + 5 drafts whose draft `kept` is wrong; after the crop the cache (and the next forward)
    equal a clean AR run over prompt + anchor + the accepted drafts."""
    _, target = hybrid
    prompt = PROMPTS[0]
    seq = generate(target, prompt, None, max_new_tokens=8).token_ids  # seq[0] is the anchor
    draft = seq[1:6]
    draft[kept] = (draft[kept] + 1) % (VOCAB - 1)
    start = len(prompt)
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), torch.arange(start), cache)
    out = target.forward(torch.tensor([[seq[0], *draft]]), torch.arange(start, start + 6), cache)
    assert out.logits[0].argmax(-1).tolist()[: kept + 1] == seq[1 : kept + 2]  # the target rejects draft `kept`
    cache.crop(start + kept + 1)
    assert cache.replayed_tokens == (kept + 1 if cache.strategy == "replay" else 0)  # per_position picks a state

    ref = ar_cache(target, prompt + seq[: kept + 1], start)
    assert_same_states(cache, ref)
    bonus, pos = torch.tensor([[seq[kept + 1]]]), torch.tensor([start + kept + 1])
    assert (target.forward(bonus, pos, cache).logits - target.forward(bonus, pos, ref).logits).abs().max() < 1e-4


def test_full_accept_needs_no_replay(hybrid) -> None:
    _, target = hybrid
    prompt = PROMPTS[0]
    seq = generate(target, prompt, None, max_new_tokens=7).token_ids
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), torch.arange(5), cache)
    target.forward(torch.tensor([seq[:6]]), torch.arange(5, 11), cache)
    cache.crop(11)
    assert cache.replayed_tokens == 0
    assert_same_states(cache, ar_cache(target, prompt + seq[:6], 5))


def test_compact_replays_scattered_rows(hybrid) -> None:
    """compact keeps rows out of order of appending (as a tree walk does): the kept tokens are re-run at base...
    (per_position too: rows that are not one path of the forward have no recorded state, so they replay)"""
    _, target = hybrid
    prompt = PROMPTS[2]
    start = len(prompt)
    ids = [5, 17, 60, 3, 44]
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), torch.arange(start), cache)
    target.forward(torch.tensor([ids]), torch.arange(start, start + 5), cache)
    cache.compact(start, torch.tensor([0, 2, 4]))
    assert cache.replayed_tokens == 3
    assert_same_states(cache, ar_cache(target, prompt + [ids[0], ids[2], ids[4]], start))


def test_only_the_last_forward_can_be_undone(hybrid) -> None:
    _, target = hybrid
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPTS[0]]), torch.arange(5), cache)
    target.forward(torch.tensor([[1, 2, 3]]), torch.arange(5, 8), cache)
    with pytest.raises(ValueError, match="only the last forward"):
        cache.crop(4)
    cache.crop(6)
    with pytest.raises(ValueError, match="only the last forward"):
        cache.crop(5)


def test_rollback_into_the_prefill(hybrid) -> None:
    """Cropping the prompt itself restarts the linear layers from scratch and re-runs the kept prefix."""
    _, target = hybrid
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPTS[2]]), torch.arange(len(PROMPTS[2])), cache)
    cache.crop(4)
    assert_same_states(cache, ar_cache(target, PROMPTS[2][:4], 4))


def test_tree_step_equals_ar(hybrid) -> None:
    """A hand-made tree with the greedy path among wrong branches: logits and taps of the path rows equal a
    clean forward over the committed tokens (linear attention followed each path, not the verify order), and
    after compaction so does the cache."""
    _, target = hybrid
    prompt = PROMPTS[2]
    seq = generate(target, prompt, None, max_new_tokens=6).token_ids  # anchor, 4 path tokens, bonus
    draft = scattered_path_tree(seq)
    taps, start = (0, 2, 3), len(prompt)
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), torch.arange(start), cache, taps)
    ids = torch.cat([torch.tensor([seq[0]]), draft.tokens]).unsqueeze(0)
    mask = draft.tree_mask(len(cache), target.device)
    assert tree_parents(mask) == [-1, *(p + 1 for p in draft.parents)]
    out = target.forward(ids, draft.positions(start, target.device), cache, taps, attention_mask=mask)
    rows = torch.tensor([0, 2, 5, 6, 9])
    assert out.logits[0, rows[:-1]].argmax(-1).tolist() == seq[1:5]
    cache.compact(start, rows)
    assert cache.replayed_tokens == (5 if cache.strategy == "replay" else 0)

    committed = prompt + seq[:5]
    ref_cache = target.new_cache()
    ref = target.forward(torch.tensor([committed]), torch.arange(len(committed)), ref_cache, taps)
    assert (out.logits[0, rows] - ref.logits[0, start:]).abs().max() < 1e-4
    assert (out.taps[0, rows] - ref.taps[0, start:]).abs().max() < 1e-4
    assert_same_states(cache, ar_cache(target, committed, start))


def test_ddtree_equals_ar(hybrid) -> None:
    _, target = hybrid
    drafter = make_drafter("all_full")
    for budget in (3, 12):
        tree = DDTreeProposer(drafter, target, budget)
        for prompt in PROMPTS:
            assert generate(target, prompt, tree, max_new_tokens=16).token_ids == hf_greedy(target.model, prompt, 16)
            assert (target.last_cache.replayed_tokens > 0) == (target.last_cache.strategy == "replay")


def test_trees_refused_through_other_recurrent_layers(hybrid) -> None:
    """Only Gated DeltaNet kernels are made path-aware: a target whose linear layers are not all of them is refused."""
    model, target = hybrid
    with pytest.raises(BlockdraftError, match="use --method dflash"):
        with tree_linear_attention(model, [-1, 0], linear_layers=len(target.new_cache().linear) + 1):
            pass


@pytest.mark.parametrize("family, method", [("qwen3_5", "dflash"), ("qwen3_next", "ddtree")])
def test_sampling_matches_the_target(family: str, method: str) -> None:
    """T=1 on a 5-token vocabulary: every rollback path keeps the joint distribution of 3 generated tokens."""
    from test_sampling import V, exact_joint, p_value, sample_counts

    model = make_hybrid(family, seed=3, vocab=V)
    target = Target(model)
    drafter = make_drafter("all_full", seed=3, vocab=V)
    proposer = DFlashProposer(drafter, target) if method == "dflash" else DDTreeProposer(drafter, target, 8)
    params = SamplingParams(1.0)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3
