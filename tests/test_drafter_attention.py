"""Drafter attention semantics as the public references define them.

Which layers slide, which are causal and with what window follow vLLM 0.33's `_resolve_layer_attention` table and
the authors' dflash 0.1.0 (`Qwen3DFlashAttention.__init__`), which agree where both read a field; the variants only
vLLM defines (use_swa, swa_window_size, attention sinks, value scale, partial rotary) run in our drafter and are
checked against their definitions here, and in decoding against AR (lossless) and the eager drafter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from blockdraft.config import parse_draft_config
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter, apply_rope, sink_attention
from blockdraft.fast.drafter import fast_drafter_problem
from blockdraft.models.target import Target

from conftest import drafter_raw_config, make_target_model

FULL, SLIDING = "full_attention", "sliding_attention"


def resolved(edit) -> tuple[tuple[str, ...], tuple[bool, ...], tuple[int | None, ...]]:
    raw = drafter_raw_config("all_full")
    raw.pop("layer_types")
    edit(raw)
    cfg = parse_draft_config(raw)
    n = cfg.num_hidden_layers
    return cfg.layer_types, cfg.layer_causal, tuple(cfg.layer_window(i) for i in range(n))


def test_vllm_table_layer_types_given() -> None:
    # layer_types given: the declared kinds run; causal exactly the sliding ones; use_swa does not add layers.
    for use_swa in (False, True):
        kinds, causal, windows = resolved(lambda r: r.update(
            layer_types=[SLIDING, FULL], use_sliding_window=True, sliding_window=7,
            dflash_config={**r["dflash_config"], "use_swa": use_swa},
        ))
        assert kinds == (SLIDING, FULL) and causal == (True, False) and windows == (7, None)


def test_vllm_table_use_swa_without_sliding_layers_slides_every_layer_non_causal() -> None:
    for declared in (None, [FULL, FULL]):
        kinds, causal, windows = resolved(lambda r: r.update(
            dflash_config={**r["dflash_config"], "use_swa": True, "swa_window_size": 5},
            **({} if declared is None else {"layer_types": declared}),
        ))
        assert kinds == (SLIDING, SLIDING) and causal == (False, False) and windows == (5, 5)


def test_vllm_table_no_layer_types_no_swa_is_full_bidirectional() -> None:
    kinds, causal, windows = resolved(lambda r: None)
    assert kinds == (FULL, FULL) and causal == (False, False) and windows == (None, None)


def test_missing_layer_types_derive_as_transformers_does() -> None:
    # Qwen3Config: sliding from max_window_layers on, when use_sliding_window and a window are set.
    kinds, causal, windows = resolved(lambda r: r.update(use_sliding_window=True, sliding_window=9, max_window_layers=1))
    assert kinds == (FULL, SLIDING) and causal == (False, True) and windows == (None, 9)
    kinds, _, _ = resolved(lambda r: r.update(use_sliding_window=False, sliding_window=9, max_window_layers=1))
    assert kinds == (FULL, FULL)


def test_swa_window_size_wins_over_sliding_window() -> None:
    _, _, windows = resolved(lambda r: r.update(
        layer_types=[SLIDING, FULL], use_sliding_window=True, sliding_window=7,
        dflash_config={**r["dflash_config"], "swa_window_size": 3},
    ))
    assert windows == (3, None)


@pytest.mark.parametrize("where", ["is_causal", "dflash_config.is_causal", "dflash_config.causal"])
def test_causal_override_from_each_field(where: str) -> None:
    def edit(r: dict) -> None:
        r.update(layer_types=[SLIDING, FULL], use_sliding_window=True, sliding_window=4)
        if where == "is_causal":
            r["is_causal"] = True
        else:
            r["dflash_config"][where.split(".")[1]] = True

    _, causal, _ = resolved(edit)
    assert causal == (True, True)


def test_disagreeing_causal_fields_are_refused() -> None:
    raw = drafter_raw_config("all_full")
    raw["is_causal"] = True
    raw["dflash_config"]["causal"] = False
    with pytest.raises(BlockdraftError, match=r"`is_causal`=true, `dflash_config.causal`=false disagree"):
        parse_draft_config(raw)


def test_use_swa_without_a_window_is_refused() -> None:
    raw = drafter_raw_config("all_full")
    raw["dflash_config"]["use_swa"] = True
    with pytest.raises(BlockdraftError, match="swa_window_size"):
        parse_draft_config(raw)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(v_head_dim=16), "`v_head_dim`=16"),
        (lambda r: r.update(is_neox_style=False), "`is_neox_style`=False"),
        (lambda r: r["dflash_config"].update(use_aux_hidden_state=False), "`use_aux_hidden_state`=False"),
        (lambda r: r.update(target_hidden_size=64), "`target_hidden_size`=64"),
        (lambda r: r.update(draft_vocab_size=32), "`draft_vocab_size`=32"),
        (lambda r: r.update(architectures=["DFlash2DraftModel"]), "DFlash-2"),
        (lambda r: r["dflash_config"].update(conv_kernel_size=4), "`dflash_config.conv_group_size` is missing; a DFlash-2"),
        (lambda r: r.update(partial_rotary_factor=0.0), "partial_rotary_factor"),
    ],
)
def test_fields_without_defined_semantics_are_refused_by_name(edit, message: str) -> None:
    raw = drafter_raw_config("all_full")
    edit(raw)
    with pytest.raises(BlockdraftError, match=message):
        parse_draft_config(raw)


def test_harmless_values_of_refused_fields_pass() -> None:
    raw = drafter_raw_config("all_full")
    raw.update(v_head_dim=8, is_neox_style=True, target_hidden_size=32, draft_vocab_size=raw["vocab_size"])
    parse_draft_config(raw)


def test_errors_name_the_field_where_it_lives() -> None:
    raw = drafter_raw_config("all_full")
    raw["mask_token_id"] = raw["dflash_config"].pop("mask_token_id") + 1000
    with pytest.raises(BlockdraftError, match=r"`mask_token_id`=1095 is outside") as err:
        parse_draft_config(raw)
    assert "dflash_config.mask_token_id" not in str(err.value)
    raw = drafter_raw_config("all_full")
    del raw["dflash_config"]["mask_token_id"]
    with pytest.raises(BlockdraftError, match=r"`dflash_config.mask_token_id` is missing"):
        parse_draft_config(raw)


def speculators_config() -> dict:
    """A speculators-format DFlash config around the tiny drafter's geometry."""
    inner = drafter_raw_config("all_full")
    dflash = inner.pop("dflash_config")
    for name in ("architectures", "num_target_layers"):
        inner.pop(name)
    return {
        "speculators_model_type": "dflash",
        "transformer_layer_config": inner,
        "mask_token_id": dflash["mask_token_id"],
        "aux_hidden_state_layer_ids": [t + 1 for t in dflash["target_layer_ids"]],
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 5}], "verifier": {"name_or_path": "t"}},
    }


def test_speculators_format_converts_with_vllms_mapping() -> None:
    cfg = parse_draft_config(speculators_config())
    assert cfg.target_layer_ids == (0, 2, 3) and cfg.mask_token_id == 95
    assert cfg.layer_causal == (False, False)
    spec = speculators_config()
    spec["sliding_window_non_causal"] = False
    assert parse_draft_config(spec).layer_causal == (True, True)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(speculators_model_type="dflash2"), "DFlash-2"),
        (lambda s: s.update(speculators_model_type="eagle3"), "'eagle3' speculator"),
        (lambda s: s.pop("transformer_layer_config"), "without a `transformer_layer_config`"),
        (lambda s: s.update(aux_hidden_state_layer_ids=[0, 2]), "aux_hidden_state_layer_ids"),
        (lambda s: s.update(sample_from_anchor=True), "sample_from_anchor"),
    ],
)
def test_speculators_format_errors_name_the_format(edit, message: str) -> None:
    spec = speculators_config()
    edit(spec)
    with pytest.raises(BlockdraftError, match=message):
        parse_draft_config(spec)


def test_partial_rope_rotates_the_first_dims_only() -> None:
    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 2), torch.randn(1, 3, 2)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 2:], x[..., 2:])
    rotated = x[..., :2] * cos.unsqueeze(1) + torch.cat([-x[..., 1:2], x[..., 0:1]], -1) * sin.unsqueeze(1)
    assert torch.allclose(out[..., :2], rotated)


def test_partial_rotary_factor_builds_frequencies_over_the_rotated_part() -> None:
    raw = drafter_raw_config("all_full")
    raw.update(partial_rotary_factor=0.5, rope_theta=10000.0)
    drafter = DFlashDrafter(parse_draft_config(raw))
    cos, _ = drafter.rope(torch.zeros(1, 1, 32), torch.arange(3))
    assert cos.shape[-1] == 4
    expected = 1.0 / 10000.0 ** (torch.arange(0, 4, 2).float() / 4)
    assert torch.allclose(drafter.rotary_emb.inv_freq, expected)


def test_sink_attention_is_softmax_with_an_extra_logit() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.rand(3, 5) > 0.3
    mask[:, 0] = True
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, enable_gqa=True)
    assert torch.allclose(sink_attention(q, k, v, mask, 0.5, torch.full((4,), -float("inf"))), plain, atol=1e-6)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    out = sink_attention(q, k, v, mask, 0.5, sinks)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.5
    weights = scores.masked_fill(~mask, -float("inf")).exp()
    denominator = weights.sum(-1, keepdim=True) + sinks.exp().view(1, 4, 1, 1)
    assert torch.allclose(out, (weights / denominator) @ v.repeat_interleave(2, 1), atol=1e-5)


VARIANTS = {
    "sinks": lambda r: r["dflash_config"].update(attention_sink_bias=True),
    "value_scale": lambda r: r["dflash_config"].update(attention_value_scale=0.5),
    "partial_rope": lambda r: r.update(partial_rotary_factor=0.5),
    "use_swa": lambda r: r["dflash_config"].update(use_swa=True, swa_window_size=4),
    "swa_bidirectional": lambda r: r.update(
        layer_types=[SLIDING, FULL], use_sliding_window=True, sliding_window=4, is_causal=False
    ),
}


def variant_drafter(name: str) -> DFlashDrafter:
    raw = drafter_raw_config("all_full")
    VARIANTS[name](raw)
    drafter = DFlashDrafter(parse_draft_config(raw))
    torch.manual_seed(7)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    return drafter.eval()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_drafters_are_lossless(name: str) -> None:
    target = Target(make_target_model("qwen3"))
    drafter = variant_drafter(name)
    prompt = [3, 9, 27, 11]
    ar = generate(target, prompt, None, max_new_tokens=24).token_ids
    assert generate(target, prompt, DFlashProposer(drafter, target), max_new_tokens=24).token_ids == ar


@pytest.mark.parametrize("name", ["sinks", "value_scale", "partial_rope"])
def test_variants_the_static_drafter_path_does_not_run_fall_back(name: str) -> None:
    assert fast_drafter_problem(variant_drafter(name)) is not None
    assert fast_drafter_problem(variant_drafter("use_swa")) is None


def drafter_output(drafter: DFlashDrafter) -> torch.Tensor:
    """The drafter's hidden states for one fixed block over a fixed random context."""
    from blockdraft.models.drafter import DrafterContextCache

    generator = torch.Generator().manual_seed(3)
    taps = torch.randn(1, 10, 3 * 32, generator=generator)
    block = torch.randn(1, 6, 32, generator=generator)
    cache = DrafterContextCache(drafter)
    with torch.no_grad():
        drafter.extend_context(cache, taps)
        return drafter(block, torch.arange(10, 16), cache)


@pytest.mark.parametrize("name", ["value_scale", "partial_rope", "sinks"])
def test_each_variant_field_is_read(name: str) -> None:
    """The same weights without the field give other drafter states: the field is not silently dropped."""
    drafter = variant_drafter(name)
    plain = DFlashDrafter(parse_draft_config(drafter_raw_config("all_full")))
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if "sink" not in k})
    assert not torch.allclose(drafter_output(drafter), drafter_output(plain.eval()), atol=1e-4)


def test_round_trip_keeps_the_semantics() -> None:
    for name in VARIANTS:
        cfg = variant_drafter(name).cfg
        again = parse_draft_config(copy.deepcopy(cfg.to_dict()))
        assert (again.layer_types, again.layer_causal, again.sliding_window) == (
            cfg.layer_types, cfg.layer_causal, cfg.sliding_window), name
