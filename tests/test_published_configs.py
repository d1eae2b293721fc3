"""Every published config.json that public sources quote (tests/fixtures/configs/SOURCES.md) parses as the
references run it, or is refused with its field named; the DFlash-2 ones: tests/test_dflash2.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockdraft.config import parse_draft_config
from blockdraft.errors import BlockdraftError

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
S, F = "sliding_attention", "full_attention"


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# name -> (block, mask, taps, layer kinds, causal per layer, window, (heads, kv heads, head_dim))
PARSED = {
    "qwen36_27b_dflash": (16, 248070, (1, 16, 31, 46, 61), (S,) * 4 + (F,), (True,) * 4 + (False,), 2048, (32, 8, 128)),
    "qwen36_35b_a3b_dflash_full": (16, 248070, (1, 10, 19, 28, 37), (F,) * 8, (False,) * 8, None, (32, 4, 128)),
    "qwen35_4b_dflash": (16, 248077, (1, 5, 9, 13, 17, 21, 25, 29), (S,) * 5 + (F,), (True,) * 5 + (False,), 4096,
                         (32, 8, 128)),
    "gemma4_31b_it_dflash": (16, 4, (1, 12, 23, 35, 46, 57), (S,) * 4 + (F,), (True,) * 4 + (False,), 2048,
                             (64, 8, 128)),
    # vLLM's `use_swa` table: no layer_types, every layer slides, non-causal.
    "mimo_v25_pro_fp4_dflash": (8, 151669, (0, 15, 31, 47, 69), (S,) * 5, (False,) * 5, 1024, (128, 8, 128)),
    # speculators format: taps = aux ids - 1; `sliding_window_non_causal: false` makes every layer causal (vLLM).
    "speculators_dflash_qwen36_35b_a3b": (16, 248070, (1, 10, 19, 28, 37), (F,) * 8, (True,) * 8, None, (32, 4, 128)),
    "speculators_dflash_llama_hd256": (16, 248077, (0, 9, 18, 27, 36), (F,) * 8, (True,) * 8, None, (16, 2, 256)),
}


@pytest.mark.parametrize("name", sorted(PARSED))
def test_published_configs_parse_as_the_references_run_them(name: str) -> None:
    block, mask, taps, kinds, causal, window, heads = PARSED[name]
    cfg = parse_draft_config(load(name), name)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (block, mask, taps)
    assert (cfg.layer_types, cfg.layer_causal, cfg.sliding_window) == (kinds, causal, window)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == heads


def test_qwen36_27b_published_layout() -> None:
    raw = load("qwen36_27b_dflash")
    assert "block_size" not in raw["dflash_config"] and raw["rope_theta"] == 10000000
    cfg = parse_draft_config(raw)
    assert cfg.hf_config().rope_parameters["rope_theta"] == 10000000


def test_mimo_variant_fields_are_all_read() -> None:
    cfg = parse_draft_config(load("mimo_v25_pro_fp4_dflash"))
    assert (cfg.partial_rotary_factor, cfg.value_scale, cfg.attention_sinks) == (0.5, 0.612, True)


def test_muse_glimmer_scales_would_be_read() -> None:
    raw = load("dflash2_muse_glimmer_30b")
    for name in ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"):
        raw["dflash_config"].pop(name, None)
    raw["architectures"] = ["DFlashDraftModel"]
    cfg = parse_draft_config(raw)
    assert cfg.output_multiplier == pytest.approx(0.19611613513818404) and cfg.final_logit_softcapping == 20.0


def test_yarn_rope_reaches_the_drafters_rotary_embedding() -> None:
    from blockdraft.models.drafter import rotary_embedding

    cfg = parse_draft_config(load("qwen36_35b_a3b_dflash_full"))
    assert rotary_embedding(cfg, cfg.hf_config()).rope_type == "yarn"


REFUSED = {  # the two DFlash-2 configs parse (tests/test_dflash2.py)
    "specforge_qwen35_27b_dflash": r"`dflash_config.mask_token_id` is null, as in a training template",
    "specforge_qwen35_35b_a3b_dflash": r"`dflash_config.mask_token_id` is null, as in a training template",
    "specforge_qwen3_8b_dflash": r"^specforge_qwen3_8b_dflash: `mask_token_id` is missing",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_configs_blockdraft_does_not_run_are_refused_by_name(name: str) -> None:
    with pytest.raises(BlockdraftError, match=REFUSED[name]):
        parse_draft_config(load(name), name)
