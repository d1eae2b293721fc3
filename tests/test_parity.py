"""Parity with the authors' reference (`dflash==0.1.0`): same weights and prompts -> same ids and the same
per-step acceptance lengths at T=0."""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target

from conftest import VOCAB, drafter_raw_config, make_drafter, make_target_model

dflash_model = pytest.importorskip("dflash.model")


@pytest.fixture(autouse=True)
def cpu_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference times with torch.cuda.synchronize; on CPU use a plain clock (timing only, no semantics)."""
    import time

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def reference_run(drafter: DFlashDrafter, model: torch.nn.Module, prompt: list[int], n: int, stops: list[int] | None):
    """Run the reference package's own loop on the same weights."""
    from transformers import Qwen3Config

    ref = dflash_model.DFlashDraftModel(Qwen3Config(**drafter.cfg.to_dict())).eval()
    result = ref.load_state_dict(drafter.state_dict(), strict=False)
    assert not result.unexpected_keys and all("rotary" in k for k in result.missing_keys)
    stats = dflash_model.dflash_generate(ref, model, torch.tensor([prompt]), n, stops, return_stats=True)
    return stats.output_ids[0, len(prompt):].tolist(), stats.acceptance_lengths


def compare(model: torch.nn.Module, drafter: DFlashDrafter, prompts: list[list[int]], n: int, stops=None) -> tuple[int, float]:
    """Identical runs / total, and our mean tau over the prompts."""
    target = Target(model)
    proposer = DFlashProposer(drafter, target)
    same, taus = 0, []
    for prompt in prompts:
        ours = generate(target, prompt, proposer, max_new_tokens=n, stop_token_ids=tuple(stops or ()))
        ids, lengths = reference_run(drafter, model, prompt, n, stops)
        assert ours.token_ids == ids, f"ids differ for prompt {prompt}"
        assert ours.acceptance_lengths == lengths, f"acceptance lengths differ for prompt {prompt}"
        same += 1
        taus.append(ours.stats.tau)
    return same, sum(taus) / len(taus)


def random_prompts(k: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(k)]


@pytest.mark.parametrize("variant", ["all_full", "mixed_swa", "block_in_dflash_config"])
def test_random_weights_parity(variant: str) -> None:
    same, _ = compare(make_target_model("qwen3"), make_drafter(variant), random_prompts(6, 1), 40)
    assert same == 6


def test_parity_with_stop_tokens() -> None:
    model = make_target_model("qwen3")
    prompt = [5, 6, 7]
    full = generate(Target(model), prompt, None, max_new_tokens=30).token_ids
    same, _ = compare(model, make_drafter("all_full"), [prompt], 30, stops=[full[10]])
    assert same == 1


def test_config_scales_parity() -> None:
    from blockdraft.config import parse_draft_config

    raw = drafter_raw_config("all_full")
    raw["dflash_config"].update(input_embedding_scale=1.5, output_multiplier=0.8, final_logit_softcapping=5.0)
    drafter = DFlashDrafter(parse_draft_config(raw))
    drafter.load_state_dict(make_drafter("all_full").state_dict())
    same, _ = compare(make_target_model("qwen3"), drafter.eval(), random_prompts(3, 2), 30)
    assert same == 3


@pytest.mark.parametrize("kind", ["full", "swa"])
def test_trained_pair_parity(trained_pairs: dict, kind: str) -> None:
    """A drafter trained by `blockdraft train` (tau well above 1): every run identical to the reference."""
    import trained_pair

    from blockdraft.models.loading import load_drafter, load_target

    target_dir, drafter_dir = trained_pairs[kind]
    target, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    drafter = load_drafter(drafter_dir, target)
    prompts = [p.ids for p in trained_pair.prompts(7, 12)]
    same, tau = compare(target.model, drafter, prompts, 64)
    assert same == len(prompts)
    assert tau > 2.0
    print(f"parity {kind}: {same}/{len(prompts)} runs identical, tau {tau:.2f}")


# Attention variants the authors' dflash 0.1.0 defines too (it reads top-level `is_causal`, `layer_types` and the
# window transformers leaves in `sliding_window`): same ids and acceptance lengths as the reference.
REFERENCE_VARIANTS = {
    "sliding_bidirectional": dict(
        layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=5, is_causal=False
    ),
    "all_sliding_causal": dict(layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=4),
    "full_causal": dict(layer_types=["full_attention"] * 2, is_causal=True),
}


@pytest.mark.parametrize("variant", sorted(REFERENCE_VARIANTS))
def test_attention_variants_parity(variant: str) -> None:
    from blockdraft.config import parse_draft_config

    raw = drafter_raw_config("all_full")
    raw.update(REFERENCE_VARIANTS[variant])
    drafter = DFlashDrafter(parse_draft_config(raw))
    drafter.load_state_dict(make_drafter("all_full").state_dict())
    same, _ = compare(make_target_model("qwen3"), drafter.eval(), random_prompts(4, 3), 40)
    assert same == 4
