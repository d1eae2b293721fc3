"""Static checks on published drafter configs against matching and mismatching targets."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from blockdraft.config import DraftConfig, parse_draft_config
from blockdraft.doctor.static_checks import Finding, check_pair, is_hybrid_target
from blockdraft.errors import BlockdraftError

QWEN3_4B_DRAFTER: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "block_size": 16,
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}
QWEN3_4B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
}
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}

QWEN36_DRAFTER: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 5,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 17408,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "use_sliding_window": True,
    "sliding_window": 2048,
    "num_target_layers": 64,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16},
}
QWEN36_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "vocab_size": 248320,
        "eos_token_id": 248046,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
        "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": 1,
    },
    "vision_config": {"hidden_size": 1152, "depth": 27},
}


def drafter(base: dict[str, Any], **changes: Any) -> DraftConfig:
    """A copy of a published config with top-level or `dflash_config.*` fields changed."""
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            raw["dflash_config"][key] = value
        elif value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return parse_draft_config(raw)


def target36(**changes: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(QWEN36_27B)
    cfg["text_config"].update(changes)
    return cfg


def by_field(findings: list[Finding], field: str) -> list[Finding]:
    return [f for f in findings if f.field == field]


def severities(findings: list[Finding], field: str) -> list[str]:
    return [f.severity for f in by_field(findings, field)]


def test_healthy_qwen3_4b_pair_is_clean() -> None:
    assert check_pair(drafter(QWEN3_4B_DRAFTER), QWEN3_4B, vllm_num_speculative_tokens=15) == []


def test_healthy_qwen36_pair_has_no_errors_or_warnings() -> None:
    findings = check_pair(drafter(QWEN36_DRAFTER), QWEN36_27B, sglang_num_draft_tokens=16)
    assert {f.severity for f in findings} == {"info"}
    assert {f.field for f in findings} == {"layer_types", "partial_rotary_factor", "model_type"}
    sliding = by_field(findings, "layer_types")[0]
    assert "V2 model runner" in sliding.fix and "no global --attention-backend" in sliding.fix
    hybrid = by_field(findings, "model_type")[0]
    assert "[1, 16, 46, 61]" in hybrid.message  # layer 31 is a full-attention layer
    assert "--mamba-radix-cache-strategy defaults to auto" in hybrid.fix
    assert "--mamba-scheduler-strategy extra_buffer" not in hybrid.fix


def test_every_finding_names_its_cost_and_fix() -> None:
    broken = drafter(QWEN3_4B_DRAFTER, vocab_size=None, mask_token_id=248070, rope_theta=10000)
    findings = check_pair(broken, QWEN36_27B, vllm_num_speculative_tokens=16, chat_template="<think>")
    assert findings and all(f.message and f.cost and f.fix for f in findings)
    assert findings == sorted(findings, key=lambda f: ["error", "warning", "info"].index(f.severity))


def test_hidden_size_mismatch() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER), QWEN3_8B)
    assert severities(findings, "hidden_size") == ["error"]
    assert "2560" in findings[0].message and "4096" in findings[0].message


def test_wrong_family_target() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER), QWEN36_27B)
    for field in ("hidden_size", "num_target_layers", "vocab_size"):
        assert severities(findings, field) == ["error"], field


def test_qwen3_mask_id_on_qwen36_vocabulary_is_an_error() -> None:
    findings = check_pair(drafter(QWEN36_DRAFTER, mask_token_id=151669), QWEN36_27B)
    (mask,) = by_field(findings, "dflash_config.mask_token_id")
    assert mask.severity == "error"
    assert "248070" in mask.fix
    assert "1-2%" in mask.cost


def test_unusual_mask_id_within_family_is_a_warning() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, mask_token_id=151643), QWEN3_4B)
    assert severities(findings, "dflash_config.mask_token_id") == ["warning"]
    findings = check_pair(drafter(QWEN36_DRAFTER, mask_token_id=248071), QWEN36_27B)
    assert severities(findings, "dflash_config.mask_token_id") == ["warning"]


@pytest.mark.parametrize("mask", [248070, 248077])
def test_every_published_qwen35_mask_id_is_clean(mask: int) -> None:
    """z-lab's Qwen3.6 drafters mask with 248070, its Qwen3.5-4B-DFlash with 248077: both are published ids."""
    assert not by_field(check_pair(drafter(QWEN36_DRAFTER, mask_token_id=mask), QWEN36_27B), "dflash_config.mask_token_id")


def test_published_qwen35_4b_drafter_is_judged_clean() -> None:
    """z-lab's Qwen3.5-4B-DFlash config, verbatim, on its 32-layer Qwen3.5-4B target: no error and no warning (the
    infos say what an engine must honour: its sliding layers, its own rotary factor, taps on linear layers)."""
    raw = json.loads((Path(__file__).parent / "fixtures" / "configs" / "qwen35_4b_dflash.json").read_text())
    target = target36(hidden_size=2560, num_hidden_layers=32,
                      layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)])
    findings = check_pair(parse_draft_config(raw), target)
    assert [f for f in findings if f.severity != "info"] == []


def test_mask_outside_target_vocabulary() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, vocab_size=None, mask_token_id=248070), QWEN3_4B)
    (mask,) = by_field(findings, "dflash_config.mask_token_id")
    assert mask.severity == "error" and "outside the target vocabulary" in mask.message


class FakeTokenizer:
    """The four tokenizer members the checks use: ids 0..99, 90 special, 91 added, 100+ unused rows."""

    all_special_ids = [90]
    added_tokens_decoder = {90: "<|endoftext|>", 91: "<|mask|>"}
    chat_template = "{% if enable_thinking %}<think>{% endif %}{{ messages }}"

    def __len__(self) -> int:
        return 100

    def convert_ids_to_tokens(self, i: int) -> str | None:
        return f"word{i}" if i < 100 else None


TINY_DRAFTER = {
    **QWEN3_4B_DRAFTER,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "vocab_size": 128,
    "num_target_layers": 8,
    "dflash_config": {"mask_token_id": 91, "target_layer_ids": [1, 2, 3, 4, 5]},
}
TINY_TARGET = {**QWEN3_4B, "hidden_size": 32, "num_hidden_layers": 8, "vocab_size": 128}


@pytest.mark.parametrize(("mask", "warned"), [(90, False), (91, False), (120, False), (7, True)])
def test_mask_token_kind_with_a_tokenizer(mask: int, warned: bool) -> None:
    findings = check_pair(drafter(TINY_DRAFTER, mask_token_id=mask), TINY_TARGET, tokenizer=FakeTokenizer())
    masks = by_field(findings, "dflash_config.mask_token_id")
    assert [f.severity for f in masks] == (["warning"] if warned else [])
    if warned:
        assert "'word7'" in masks[0].message


def test_mask_token_kind_with_a_real_tokenizer() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2, "the": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<|endoftext|>", "<|mask|>"])  # ids 4, 5
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    for mask, warned in ((3, True), (5, False), (100, False)):
        findings = check_pair(drafter(TINY_DRAFTER, mask_token_id=mask), TINY_TARGET, tokenizer=tokenizer)
        assert bool(by_field(findings, "dflash_config.mask_token_id")) == warned, mask


def test_taps_past_the_last_layer() -> None:
    past_the_end = drafter(QWEN3_4B_DRAFTER, num_target_layers=None, target_layer_ids=[1, 9, 17, 25, 40])
    findings = check_pair(past_the_end, QWEN3_4B)
    assert severities(findings, "dflash_config.target_layer_ids") == ["error"]


def test_drafter_trained_on_a_different_depth() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, num_target_layers=40), QWEN3_4B)
    assert severities(findings, "num_target_layers") == ["error"]


def test_taps_from_a_known_wrong_formula_and_the_last_layer() -> None:
    findings = check_pair(drafter(QWEN36_DRAFTER, target_layer_ids=[1, 17, 33, 49, 63]), QWEN36_27B)
    taps = by_field(findings, "dflash_config.target_layer_ids")
    assert [f.severity for f in taps] == ["warning", "warning"]
    assert "[1, 16, 31, 46, 61]" in taps[0].message
    assert "post-norm" in taps[1].message


def test_taps_off_by_one_look_like_layer_inputs() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, target_layer_ids=[2, 10, 18, 26, 34]), QWEN3_4B)
    (taps,) = by_field(findings, "dflash_config.target_layer_ids")
    assert taps.severity == "warning" and "layer input" in taps.message


def test_explicit_unusual_taps_stand_and_default_rule_is_reported() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, target_layer_ids=[3, 10, 17, 24, 31]), QWEN3_4B)
    assert severities(findings, "dflash_config.target_layer_ids") == ["info"]
    raw = copy.deepcopy(QWEN3_4B_DRAFTER)
    del raw["dflash_config"]["target_layer_ids"]
    findings = check_pair(parse_draft_config(raw), QWEN3_4B)
    (rule,) = by_field(findings, "dflash_config.target_layer_ids")
    assert rule.severity == "info" and "[1, 9, 17, 25, 33]" in rule.message


@pytest.mark.parametrize("changes", [{"use_sliding_window": False}, {"sliding_window": None}])
def test_sliding_layers_without_a_window_are_refused(changes: dict) -> None:
    with pytest.raises(BlockdraftError, match="sliding_attention but .* so they have no window .* trained window"):
        drafter(QWEN36_DRAFTER, **changes)


@pytest.mark.parametrize("layer_types", [None, ["full_attention"] * 5])
def test_sliding_layers_lost_from_the_config_are_a_warning_with_their_cost(layer_types: list | None) -> None:
    findings = check_pair(drafter(QWEN36_DRAFTER, layer_types=layer_types), QWEN36_27B)
    (lost,) = by_field(findings, "layer_types")
    assert lost.severity == "warning" and "every layer runs full attention" in lost.message
    assert "4.43 -> 1.13" in lost.cost and "restore layer_types" in lost.fix
    assert ("is absent" if layer_types is None else "lists no sliding layer") in lost.message


def test_taps_shifted_down_by_one_are_flagged_like_the_upward_shift() -> None:
    findings = check_pair(drafter(QWEN36_DRAFTER, target_layer_ids=[0, 15, 30, 45, 60]), QWEN36_27B)
    (taps,) = by_field(findings, "dflash_config.target_layer_ids")
    assert taps.severity == "warning" and "layer inputs instead of outputs (-1)" in taps.message
    assert "[1, 16, 31, 46, 61]" in taps.message


def test_rope_theta_mismatch_across_config_styles() -> None:
    old_style_target = {**QWEN36_27B["text_config"], "rope_parameters": None, "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "model_type": "qwen3_5_text"}
    assert not by_field(check_pair(drafter(QWEN36_DRAFTER), old_style_target), "rope_theta")
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, rope_theta=10000), QWEN3_4B)
    (theta,) = by_field(findings, "rope_theta")
    assert theta.severity == "warning" and "1e+06" in theta.fix
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, rope_theta=None), QWEN3_4B)
    assert severities(findings, "rope_theta") == ["warning"]


def test_rope_scaling_mismatch() -> None:
    yarn = {**QWEN3_4B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert severities(check_pair(drafter(QWEN3_4B_DRAFTER), yarn), "rope_scaling") == ["warning"]
    new_style = {**QWEN3_4B, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000, "factor": 4.0}}
    del new_style["rope_theta"]
    findings = check_pair(drafter(QWEN3_4B_DRAFTER, rope_scaling={"type": "yarn", "factor": 4.0}), new_style)
    assert not by_field(findings, "rope_scaling") and not by_field(findings, "rope_theta")


@pytest.mark.parametrize(
    ("vllm", "sglang", "field", "severity"),
    [
        (16, None, "num_speculative_tokens", "error"),
        (7, None, "num_speculative_tokens", "warning"),
        (None, 15, "speculative_num_draft_tokens", "warning"),
        (None, 17, "speculative_num_draft_tokens", "error"),
        (None, 8, "speculative_num_draft_tokens", "info"),
    ],
)
def test_block_size_units(vllm: int | None, sglang: int | None, field: str, severity: str) -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER), QWEN3_4B, vllm_num_speculative_tokens=vllm,
                          sglang_num_draft_tokens=sglang)
    (unit,) = findings
    assert (unit.field, unit.severity) == (field, severity)
    assert ("15" if vllm else "16") in unit.fix


def test_thinking_mode_hint() -> None:
    findings = check_pair(drafter(QWEN3_4B_DRAFTER), QWEN3_4B, chat_template="{{ '<think>\\n' }}")
    (hint,) = findings
    assert (hint.field, hint.severity) == ("chat_template", "info") and "enable_thinking" in hint.fix
    assert check_pair(drafter(QWEN3_4B_DRAFTER), QWEN3_4B, chat_template="{{ messages }}") == []


def test_linear_attention_taps_are_computed_for_a_flat_config_without_layer_types() -> None:
    import json
    from pathlib import Path

    target = json.loads((Path(__file__).parent / "fixtures" / "targets" / "qwen3_next_80b_a3b_instruct.json").read_text())
    assert "layer_types" not in target and target["full_attention_interval"] == 4
    findings = check_pair(drafter(QWEN36_DRAFTER, target_layer_ids=[1, 3, 7, 11, 46], num_target_layers=48), target)
    (hybrid,) = by_field(findings, "model_type")
    assert "taps [1, 46] are linear-attention layers" in hybrid.message and "may" not in hybrid.message


def test_published_hybrid_target_with_text_config() -> None:
    import json
    from pathlib import Path

    target = json.loads((Path(__file__).parent / "fixtures" / "targets" / "qwen36_27b.json").read_text())
    published = json.loads((Path(__file__).parent / "fixtures" / "configs" / "qwen36_27b_dflash.json").read_text())
    findings = check_pair(parse_draft_config(published), target)
    assert not [f for f in findings if f.severity == "error"]
    (hybrid,) = by_field(findings, "model_type")
    assert "taps [1, 16, 46, 61] are linear-attention layers" in hybrid.message


def test_hybrid_detection() -> None:
    assert is_hybrid_target(QWEN36_27B)
    assert is_hybrid_target({"model_type": "qwen3_next"})
    assert is_hybrid_target({"model_type": "custom", "layer_types": ["linear_attention", "full_attention"]})
    assert not is_hybrid_target(QWEN3_4B)
    assert not is_hybrid_target(None)


def test_target_config_without_geometry() -> None:
    with pytest.raises(BlockdraftError, match="hidden_size"):
        check_pair(drafter(QWEN3_4B_DRAFTER), {"model_type": "qwen3"})
