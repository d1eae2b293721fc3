"""Published drafter config variants parse into one DraftConfig; bad fields fail with the field's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockdraft.config import (
    default_target_layer_ids,
    load_draft_config,
    parse_draft_config,
    sglang_num_draft_tokens,
    vllm_num_speculative_tokens,
)
from blockdraft.errors import BlockdraftError

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def raw(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_qwen3_4b_b16() -> None:
    cfg = load_draft_config(CONFIGS / "qwen3_4b_dflash_b16.json")
    assert cfg.block_size == 16 and cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and not cfg.taps_from_default_rule
    assert cfg.layer_types == ("full_attention",) * 5
    assert [cfg.layer_is_causal(i) for i in range(5)] == [False] * 5
    assert [cfg.layer_window(i) for i in range(5)] == [None] * 5
    assert cfg.hf_config().rope_parameters["rope_theta"] == 1000000


def test_qwen36_27b_sliding_and_full() -> None:
    cfg = parse_draft_config(raw("qwen36_27b_dflash"))
    assert cfg.block_size == 16 and cfg.mask_token_id == 248070
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61)
    assert [cfg.layer_is_causal(i) for i in range(5)] == [True, True, True, True, False]
    assert [cfg.layer_window(i) for i in range(5)] == [2048, 2048, 2048, 2048, None]
    assert cfg.hf_config().rope_parameters["rope_theta"] == 10000000


def test_default_taps_rule() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(30, 1) == [15]
    cfg = parse_draft_config(raw("default_taps"))
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.taps_from_default_rule


def test_block_size_location_and_default() -> None:
    top = raw("qwen3_4b_dflash_b16")
    inner = raw("qwen36_27b_dflash")
    assert parse_draft_config(top).block_size == 16
    inner["dflash_config"]["block_size"] = 10
    assert parse_draft_config(inner).block_size == 10
    del top["block_size"]
    assert parse_draft_config(top).block_size == 16


def test_causal_flags() -> None:
    cfg = parse_draft_config(raw("dflash_causal"))
    assert all(cfg.layer_is_causal(i) for i in range(5))
    top = raw("qwen36_27b_dflash")
    top["is_causal"] = False
    cfg = parse_draft_config(top)
    assert not any(cfg.layer_is_causal(i) for i in range(5))
    assert cfg.layer_window(0) == 2048


def test_sliding_layers_without_a_window_are_refused() -> None:
    r = raw("qwen36_27b_dflash")
    r["use_sliding_window"] = False
    with pytest.raises(BlockdraftError, match=r"layers \[0, 1, 2, 3\] are sliding_attention but use_sliding_window is false"):
        parse_draft_config(r)
    r = raw("qwen36_27b_dflash")
    del r["sliding_window"]
    with pytest.raises(BlockdraftError, match="no sliding_window is set"):
        parse_draft_config(r)


def test_optional_scales() -> None:
    cfg = parse_draft_config(raw("optional_scales"))
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (2.0, 0.5, 30.0)


def test_units() -> None:
    assert vllm_num_speculative_tokens(16) == 15
    assert sglang_num_draft_tokens(16) == 16


def test_round_trip() -> None:
    cfg = parse_draft_config(raw("qwen36_27b_dflash"))
    again = parse_draft_config(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda r: r.pop("dflash_config") and r.pop("architectures"), "not a DFlash drafter config"),
        (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda r: r["dflash_config"].update(mask_token_id=999999), "mask_token_id"),
        (lambda r: r.pop("hidden_size"), "hidden_size"),
        (lambda r: r.update(block_size=1), "block_size"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[1, 40]), "target_layer_ids"),
        (lambda r: r["dflash_config"].update(target_layer_ids="1,2"), "target_layer_ids"),
        (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
        (lambda r: r.update(layer_types=["full_attention"] * 4 + ["linear"]), "layer_types"),
        (lambda r: r.update(num_key_value_heads=5), "num_key_value_heads"),
        (lambda r: r["dflash_config"].update(selector_rank=8), "DFlash-2"),
        (lambda r: r.update(is_causal="yes"), "is_causal"),
    ],
)
def test_errors_name_the_field(edit, field: str) -> None:
    r = raw("qwen3_4b_dflash_b16")
    edit(r)
    with pytest.raises(BlockdraftError, match=field):
        parse_draft_config(r)


def test_no_taps_and_no_layer_count() -> None:
    r = raw("default_taps")
    r.pop("num_target_layers")
    with pytest.raises(BlockdraftError, match="target_layer_ids"):
        parse_draft_config(r)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="does not exist"):
        load_draft_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BlockdraftError, match="not valid JSON"):
        load_draft_config(tmp_path)
