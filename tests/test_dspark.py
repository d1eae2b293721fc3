"""DSpark drafters (a DFlash backbone with vLLM 0.33's sequential Markov head): configs parse in both layouts,
weights load under the published names (vLLM's unused mask_embedding and confidence head are skipped), the Markov
chain conditions each position on the token before it, and drafting stays lossless (T=0 equal to AR; T>0
chi-square on the target's exact distribution); launch writes vLLM's method dspark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockdraft.config import parse_draft_config
from blockdraft.decoding.dspark import DSparkProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.fast.target import FastTarget
from blockdraft.models.loading import load_drafter, save_drafter
from blockdraft.models.target import Target

from conftest import VOCAB, drafter_raw_config, make_target_model
from test_parity import random_prompts
from test_sampling import exact_joint, p_value, sample_counts


def dspark_raw(anchor: bool = True, vocab: int = VOCAB, **fields: object) -> dict:
    raw = drafter_raw_config("all_full", vocab)
    raw.update(architectures=["Qwen3DSparkModel"], markov_rank=4, block_size=5, logit_scale=1.5, **fields)
    if not anchor:
        raw["sample_from_anchor"] = False
    return raw


def make_dspark(anchor: bool = True, seed: int = 0, vocab: int = VOCAB) -> DFlashDrafter:
    drafter = DFlashDrafter(parse_draft_config(dspark_raw(anchor, vocab)))
    torch.manual_seed(2000 + seed)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    return drafter.eval()


def test_both_layouts_parse_to_their_verify_blocks() -> None:
    anchor = parse_draft_config(dspark_raw(True))
    assert anchor.dspark is not None and anchor.dspark.sample_from_anchor and anchor.block_size == 6  # 5 rows, 5 drafts
    fill = parse_draft_config(dspark_raw(False))
    assert fill.dspark is not None and not fill.dspark.sample_from_anchor and fill.block_size == 5  # DFlash's layout
    assert anchor.to_dict()["block_size"] == 5  # written back as published
    raw = dspark_raw(True)
    raw.pop("block_size")
    raw.update(dspark_block_size=7, dspark_noise_token_id=3)
    raw["dflash_config"].pop("mask_token_id")
    cfg = parse_draft_config(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.dspark.logit_scale) == (8, 3, 1.5)


@pytest.mark.parametrize("fields,message", [
    ({"markov_rank": 0}, r"`markov_rank`=0 must be a positive integer"),
    ({"markov_head_type": "gated"}, r"`markov_head_type`='gated'"),
    ({"dspark_draft_topk": 8}, r"`dspark_draft_topk`"),
    ({"output_multiplier": 0.5}, r"`output_multiplier` on a DSpark drafter"),
    ({"architectures": ["Qwen3OmniDSparkModel"]}, r"multimodal \(Omni\) DSpark"),
])
def test_dspark_variants_blockdraft_does_not_run_are_named(fields: dict, message: str) -> None:
    raw = dspark_raw()
    raw.update(fields)
    with pytest.raises(BlockdraftError, match=message):
        parse_draft_config(raw)


def test_weights_load_under_the_published_names_and_vllms_unused_tensors_are_skipped(tmp_path: Path) -> None:
    drafter = make_dspark()
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= set(drafter.state_dict())
    folder = save_drafter(drafter, tmp_path / "ds", dtype=torch.float32)
    weights = load_file(str(folder / "model.safetensors"))
    weights.update({"mask_embedding": torch.zeros(32), "confidence_head.proj.weight": torch.zeros(1, 36),
                    "confidence_head.proj.bias": torch.zeros(1)})
    save_file(weights, str(folder / "model.safetensors"))
    loaded = load_drafter(folder)
    assert loaded.cfg.dspark == drafter.cfg.dspark and loaded.cfg.block_size == drafter.cfg.block_size
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_each_position_is_biased_by_the_token_drafted_before_it() -> None:
    """A Markov head whose bias after token t is +20 on every token u with u = t + 1 (mod 4): each drafted token
    steps by 1 (mod 4) from the one before it, which per-position logits alone could never do."""
    target = Target(make_target_model("qwen3"))
    drafter = make_dspark()
    with torch.no_grad():
        w1 = torch.zeros(VOCAB, 4)
        w2 = torch.zeros(VOCAB, 4)
        for token in range(VOCAB):  # rank 4: a token is coded by its residue mod 4
            w1[token, token % 4] = 1.0
        for token in range(VOCAB):
            w2[token, (token - 1) % 4] = 20.0  # after t (slot t % 4) favour every token u with u - 1 = t mod 4
        drafter.markov_head.markov_w1.weight.copy_(w1)
        drafter.markov_head.markov_w2.weight.copy_(w2)
    proposer = DSparkProposer(drafter, target)
    generate(target, [1, 2, 3], proposer, max_new_tokens=1)  # context for the pass
    draft = proposer.propose(10, 3, 5, SamplingParams(), None)
    steps = [(int(b) - int(a)) % 4 for a, b in zip([10] + draft.tokens.tolist()[:-1], draft.tokens.tolist())]
    assert len(draft) == 5 and steps == [1] * 5


@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("engine", [Target, FastTarget])
def test_dspark_equals_ar(engine, anchor: bool) -> None:  # noqa: ANN001
    target = engine(make_target_model("qwen3"))
    proposer = build_proposer("dflash", target, make_dspark(anchor))
    assert isinstance(proposer, DSparkProposer)
    for prompt in random_prompts(5, 7):
        for n in (1, 6, 23):
            expected = generate(target, prompt, None, max_new_tokens=n, stop_token_ids=(5,)).token_ids
            result = generate(target, prompt, proposer, max_new_tokens=n, stop_token_ids=(5,))
            assert result.token_ids == expected
            assert max(result.acceptance_lengths, default=1) <= proposer.drafter.cfg.block_size


def test_dspark_sampling_matches_target() -> None:
    model = make_target_model("qwen3", seed=3, vocab=5)
    target = Target(model)
    proposer = DSparkProposer(make_dspark(seed=3, vocab=5), target)
    params = SamplingParams(0.8, top_p=0.9)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3


def test_trees_over_dspark_are_refused_and_launch_writes_method_dspark() -> None:
    from blockdraft.doctor.launch import sglang_command, vllm_command

    drafter = make_dspark()
    with pytest.raises(BlockdraftError, match="ddtree over a DSpark drafter is not built"):
        build_proposer("ddtree", Target(make_target_model("qwen3")), drafter, 8)
    plan = vllm_command("/d", "/t", drafter.cfg)
    assert plan.speculative_config == {"method": "dspark", "model": "/d", "num_speculative_tokens": 5}
    with pytest.raises(BlockdraftError, match="DSpark drafter"):
        sglang_command("/d", "/t", drafter.cfg, None)
