"""DFlash-2 drafters (block convolutions + candidate selector): published configs parse, weights load under the
published names, the pieces match the authors' reference (dflash 0.1.0) function for function, whole decodes match
its loop step for step, and the selector walk stays lossless (T=0 equal to AR; T>0 chi-square on the target's
exact distribution)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from blockdraft.config import parse_draft_config
from blockdraft.decoding.dflash2 import DFlash2Proposer, walk
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.fast.target import FastTarget
from blockdraft.models.loading import load_drafter, save_drafter
from blockdraft.models.target import Target

from conftest import VOCAB, drafter_raw_config, make_drafter, make_target_model
from test_parity import random_prompts
from test_sampling import exact_joint, p_value, sample_counts

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
dflash_model = pytest.importorskip("dflash.model")


@pytest.mark.parametrize("name,block,shape", [
    ("dflash2_qwen38_27b", 8, (2, 16, 256, 16)),
    ("dflash2_muse_glimmer_30b", 16, (2, 16, 256, 16)),
])
def test_published_dflash2_configs_parse(name: str, block: int, shape: tuple[int, ...]) -> None:
    cfg = parse_draft_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)
    assert cfg.block_size == block and cfg.dflash2 is not None
    d = cfg.dflash2
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == shape


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("selector_top_k"), r"`dflash_config.selector_top_k` is missing"),
    (lambda d: d.update(conv_kernel_size=0), r"`dflash_config.conv_kernel_size`=0 is not a positive integer"),
    (lambda d: d.update(conv_group_size=5), r"`dflash_config.conv_group_size`=5 must divide hidden_size=32"),
    (lambda d: d.update(selector_top_k=VOCAB + 1), r"`dflash_config.selector_top_k`=97 exceeds vocab_size=96"),
])
def test_bad_dflash2_fields_are_named(edit, message: str) -> None:
    raw = drafter_raw_config("dflash2")
    edit(raw["dflash_config"])
    with pytest.raises(BlockdraftError, match=message):
        parse_draft_config(raw)


def test_weights_load_under_the_published_names(tmp_path: Path) -> None:
    drafter = make_drafter("dflash2")
    names = set(drafter.state_dict())
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    loaded = load_drafter(save_drafter(drafter, tmp_path / "d2", dtype=torch.float32))
    assert loaded.cfg.dflash2 == drafter.cfg.dflash2
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_block_convolution_is_the_references() -> None:
    drafter = make_drafter("dflash2")
    conv = drafter.layers[0].attention_conv
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    ours, delta = conv.prepare(x)
    dynamic = conv.kernel_projection(x).view(2, 6, 2, conv.taps, conv.groups)
    expected = dflash_model._grouped_dynamic_convolve(x, dynamic[..., 0, :, :], conv.base_kernel[0], conv.group_size)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.finish(x, delta), dflash_model._grouped_dynamic_convolve(
        x, dynamic[..., 1, :, :], conv.base_kernel[1], conv.group_size), rtol=1e-5, atol=1e-5)
    # causal along the block: changing a later row never changes an earlier one
    later = x.clone()
    later[:, 4:] += 1.0
    torch.testing.assert_close(conv.prepare(later)[0][:, :4], ours[:, :4])


def strong_selector(variant: str = "dflash2", **kwargs: int) -> DFlashDrafter:
    """make_drafter's DFlash-2 drafter with codebooks large enough that edges, not unary logits, decide the walk."""
    drafter = make_drafter(variant, **kwargs)
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.mul_(6)
        drafter.candidate_selector.successor_codebook.mul_(6)
    return drafter


def reference_drafter(drafter: DFlashDrafter):  # noqa: ANN201
    """dflash 0.1.0's DFlash2DraftModel on the same weights (its codebooks are Embeddings: `.weight`)."""
    ref = dflash_model.DFlash2DraftModel(Qwen3Config(**drafter.cfg.to_dict())).eval()
    state = {(f"{k}.weight" if k.endswith("_codebook") else k): v for k, v in drafter.state_dict().items()}
    result = ref.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and all("rotary" in k for k in result.missing_keys)
    return ref


def test_the_walk_is_the_references_selector() -> None:
    drafter = strong_selector()
    selector = drafter.candidate_selector
    g = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(1, 5, 32, generator=g), torch.randn(1, 5, VOCAB, generator=g) * 3
    expected = reference_drafter(drafter).candidate_selector.select(hidden, logits, torch.tensor([7]), 0.0)[0][0]
    unary, candidates = logits[0].topk(selector.top_k, dim=-1)
    tokens, q = walk(selector.edge_scores(candidates, unary, hidden[0], 7), candidates, SamplingParams(), None, VOCAB)
    assert tokens.tolist() == expected.tolist() and q is None


def test_the_walk_follows_its_predecessor_not_each_positions_argmax() -> None:
    """Edge scores that favour a different candidate after each predecessor: the walk takes the path, which
    per-position argmax (DFlash's chain) would not."""
    candidates = torch.tensor([[10, 11, 12], [20, 21, 22]])
    scores = torch.zeros(2, 3, 3)
    scores[0, 0] = torch.tensor([0.0, 5.0, 1.0])  # from the anchor: candidate 1 (token 11)
    scores[1, 1] = torch.tensor([0.0, 0.0, 9.0])  # after candidate 1: candidate 2 (token 22)
    scores[1, 0] = torch.tensor([9.0, 0.0, 0.0])  # after candidate 0 it would have been token 20
    tokens, _ = walk(scores, candidates, SamplingParams(), None, 30)
    assert tokens.tolist() == [11, 22]
    _, q = walk(scores, candidates, SamplingParams(1.0), torch.Generator().manual_seed(0), 30)
    assert q is not None and q.shape == (2, 30) and torch.allclose(q.sum(-1), torch.ones(2))
    assert set(q[0].nonzero().flatten().tolist()) <= {10, 11, 12}


def test_decodes_match_the_references_loop_step_for_step() -> None:
    """Same weights and prompts: ids and per-step acceptance lengths equal dflash 0.1.0's `dflash_generate` with its
    DFlash2DraftModel (so every draft matched), at T=0."""
    import time

    model, drafter = make_target_model("qwen3"), strong_selector()
    ref = reference_drafter(drafter)
    target = Target(model)
    proposer = build_proposer("dflash", target, drafter)
    assert isinstance(proposer, DFlash2Proposer)
    timer, dflash_model._cuda_time = dflash_model._cuda_time, time.perf_counter
    try:
        for prompt in random_prompts(4, 3):
            ours = generate(target, prompt, proposer, max_new_tokens=30)
            stats = dflash_model.dflash_generate(ref, model, torch.tensor([prompt]), 30, None, return_stats=True)
            assert ours.token_ids == stats.output_ids[0, len(prompt):].tolist()
            assert ours.acceptance_lengths == stats.acceptance_lengths
    finally:
        dflash_model._cuda_time = timer


@pytest.mark.parametrize("engine", [Target, FastTarget])
def test_dflash2_equals_ar(engine) -> None:  # noqa: ANN001
    target = engine(make_target_model("qwen3"))
    proposer = build_proposer("dflash", target, make_drafter("dflash2"))
    for prompt in random_prompts(5, 4):
        for n in (1, 7, 25):
            ar = generate(target, prompt, None, max_new_tokens=n)
            spec = generate(target, prompt, proposer, max_new_tokens=n, stop_token_ids=(5,))
            assert spec.token_ids == generate(target, prompt, None, max_new_tokens=n, stop_token_ids=(5,)).token_ids
            assert len(ar.token_ids) == n


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9, top_k=4)])
def test_dflash2_sampling_matches_target(params: SamplingParams) -> None:
    """The walk proposes from only its top 3 of 5 tokens, and q is not the target's: still the target's law."""
    model = make_target_model("qwen3", seed=3, vocab=5)
    target = Target(model)
    proposer = DFlash2Proposer(make_drafter("dflash2", seed=3, vocab=5), target)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3


def test_doctor_static_names_the_dflash2_traps() -> None:
    from blockdraft.doctor.static_checks import check_pair

    target = make_target_model("qwen3").config.to_dict()
    raw = drafter_raw_config("dflash2")
    assert not [f for f in check_pair(parse_draft_config(raw), target) if "DFlash-2" in f.message]
    raw.update(architectures=["DFlashDraftModel"])
    raw["dflash_config"].update(selector_top_k=1)
    found = {(f.severity, f.field) for f in check_pair(parse_draft_config(raw), target)}
    assert {("error", "architectures"), ("warning", "dflash_config.selector_top_k")} <= found


def test_launch_serves_dflash2_under_vllms_dflash_method() -> None:
    from blockdraft.doctor.launch import vllm_command

    plan = vllm_command("/d", "/t", parse_draft_config(drafter_raw_config("dflash2")))
    assert plan.speculative_config["method"] == "dflash" and any("DFlash2DraftModel" in note for note in plan.notes)


def test_the_selector_tree_holds_the_best_walks() -> None:
    """Against brute force: the tree's prefixes are exactly the `budget` best walk prefixes by summed edge
    log-probability (ties aside), every parent before its child, tokens the candidates on each path."""
    import itertools

    from blockdraft.decoding.dflash2 import build_selector_tree

    g = torch.Generator().manual_seed(5)
    positions, k, budget = 3, 3, 11
    candidates = torch.arange(positions * k).view(positions, k) + 10
    edges = torch.log_softmax(torch.randn(positions, k, k, generator=g) * 2, dim=-1)
    prefixes = {}
    for depth in range(1, positions + 1):
        for path in itertools.product(range(k), repeat=depth):
            previous, score = 0, 0.0
            for position, index in enumerate(path):
                score += float(edges[position, previous, index])
                previous = index
            prefixes[path] = score
    best = sorted(prefixes, key=prefixes.get, reverse=True)[:budget]
    draft = build_selector_tree(candidates, edges, budget)
    assert len(draft) == budget and all(p < i for i, p in enumerate(draft.parents))
    paths = []
    for node in range(len(draft)):
        tokens, at = [], node
        while at >= 0:
            tokens.append(int(draft.tokens[at]))
            at = draft.parents[at]
        path = tuple(int(t - 10 - position * k) for position, t in enumerate(reversed(tokens)))
        assert draft.depths[node] == len(path)
        paths.append(path)
    assert set(paths) == set(best)


@pytest.mark.parametrize("engine", [Target, FastTarget])
def test_selector_trees_equal_ar(engine) -> None:  # noqa: ANN001
    target = engine(make_target_model("qwen3"))
    for budget in (1, 5, 30):
        proposer = build_proposer("ddtree", target, strong_selector(), budget)
        assert type(proposer).__name__ == "SelectorTreeProposer"
        for prompt in random_prompts(4, 6):
            assert generate(target, prompt, proposer, max_new_tokens=20).token_ids == \
                generate(target, prompt, None, max_new_tokens=20).token_ids


def test_selector_tree_sampling_matches_target() -> None:
    model = make_target_model("qwen3", seed=3, vocab=5)
    target = Target(model)
    proposer = build_proposer("ddtree", target, make_drafter("dflash2", seed=3, vocab=5), 6)
    params = SamplingParams(0.8)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(architectures=["DFlashQwen3XPressModel"]), r"marks an XPress drafter .* XPressSpeculator"),
    (lambda r: r.update(xpress_rank=256), r"'xpress_rank' marks an XPress"),
])
def test_xpress_is_refused_with_the_vllm_method_that_serves_it(edit, message: str) -> None:
    raw = drafter_raw_config("all_full")
    edit(raw)
    with pytest.raises(BlockdraftError, match=message):
        parse_draft_config(raw)


def test_the_published_qwen38_dflash2_layout_runs_losslessly() -> None:
    """z-lab/Qwen3.8-27B-DFlash2's config as published (5 non-causal sliding layers, block 8, 2-tap convolutions
    over groups of 16, a rank-256 selector over the top 16) at a tiny width: loads, drafts its walk and its
    selector trees, and decodes the target's ids."""
    raw = json.loads((CONFIGS / "dflash2_qwen38_27b.json").read_text())
    raw |= {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "vocab_size": VOCAB, "num_target_layers": 4, "sliding_window": 6}
    raw["dflash_config"] |= {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2, 3]}
    cfg = parse_draft_config(raw, "qwen38-27b-dflash2 (tiny)")
    assert cfg.layer_types == ("sliding_attention",) * 5 and cfg.layer_causal == (False,) * 5
    drafter = DFlashDrafter(cfg)
    torch.manual_seed(11)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    target = Target(make_target_model("qwen3"))
    for method, budget in (("dflash", None), ("ddtree", 16)):
        proposer = build_proposer(method, target, drafter.eval(), budget)
        for prompt in random_prompts(3, 9):
            result = generate(target, prompt, proposer, max_new_tokens=30)
            assert result.token_ids == generate(target, prompt, None, max_new_tokens=30).token_ids
            assert max(result.acceptance_lengths) <= 8
