"""Lossless at T=0: DFlash output ids equal the target's own greedy ids, for several families and drafters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.models.target import Target

from conftest import DRAFTER_VARIANTS, VOCAB, make_drafter, make_target_model

prompts = st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=24)


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode with HF generate: the ground truth, independent of our loop."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        eos_token_id=None, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("variant", sorted(DRAFTER_VARIANTS))
def test_dflash_equals_ar(family: str, variant: str) -> None:
    model = make_target_model(family)
    target = Target(model)
    proposer = DFlashProposer(make_drafter(variant), target)

    @settings(max_examples=12, deadline=None)
    @given(prompt=prompts, n=st.integers(1, 30))
    def check(prompt: list[int], n: int) -> None:
        ar = generate(target, prompt, None, max_new_tokens=n)
        spec = generate(target, prompt, proposer, max_new_tokens=n)
        assert spec.token_ids == ar.token_ids
        assert len(spec.token_ids) == n
        assert sum(spec.acceptance_lengths) + 1 == n

    check()


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families(family: str) -> None:
    model = make_target_model(family)
    target = Target(model)
    proposer = DFlashProposer(make_drafter("mixed_swa"), target)
    for seed in range(3):
        prompt = torch.randint(0, VOCAB - 1, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        assert generate(target, prompt, proposer, max_new_tokens=20).token_ids == hf_greedy(model, prompt, 20)


def test_ar_loop_matches_hf_generate() -> None:
    model = make_target_model("qwen3")
    target = Target(model)
    prompt = [3, 14, 15, 9, 26]
    assert generate(target, prompt, None, max_new_tokens=25).token_ids == hf_greedy(model, prompt, 25)


def test_stop_tokens_cut_the_output() -> None:
    model = make_target_model("qwen3")
    target = Target(model)
    prompt = [3, 14, 15, 9, 26]
    full = generate(target, prompt, None, max_new_tokens=25).token_ids
    stop = full[7]
    first = full.index(stop)
    proposer = DFlashProposer(make_drafter("all_full"), target)
    for p in (None, proposer):
        res = generate(target, prompt, p, max_new_tokens=25, stop_token_ids=(stop,))
        assert res.token_ids == full[: first + 1]
        assert res.stopped_on == stop
