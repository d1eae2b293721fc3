"""The grouped one-token attention step and static-cache generation write exactly what stock `generate` writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AttentionInterface, GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)
from test_hybrid import FAMILIES, make_hybrid
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from blockdraft.train import batched_generation
from blockdraft.train.batched_generation import generate_batch, grouped_decode_attention
from blockdraft.train.data import TokenizedPrompt
from blockdraft.train.regenerate import left_pad


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3]), length=st.integers(1, 12),
       mask_kind=st.sampled_from(["bool", "float", "none"]), seed=st.integers(0, 2**16))
def test_a_one_token_step_equals_sdpa(kv_heads: int, group: int, length: int, mask_kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, dim = 3, 8
    q = torch.randn(b, kv_heads * group, 1, dim, generator=gen)
    k = torch.randn(b, kv_heads, length, dim, generator=gen)
    v = torch.randn(b, kv_heads, length, dim - 2 * (seed % 2), generator=gen)  # odd seeds: V narrower, as in MLA
    visible = torch.rand(b, 1, 1, length, generator=gen) > 0.3
    visible[..., -1] = True  # the new token always sees itself
    mask = {"bool": visible, "float": torch.where(visible, 0.0, -1e9), "none": None}[mask_kind]
    module = _Attn(group)
    ours, _ = grouped_decode_attention(module, q, k, v, mask, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == stock.shape == (b, 1, kv_heads * group, v.shape[-1])
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


def test_longer_queries_and_softcapping_take_the_stock_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, object]] = []

    def stock(module: object, query: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        calls.append((query.shape[2], kwargs.get("softcap")))
        return query.transpose(1, 2), None

    monkeypatch.setattr(batched_generation, "sdpa_attention_forward", stock)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    grouped_decode_attention(_Attn(2), q, k, v, None)
    grouped_decode_attention(_Attn(2), q[:, :, :1], k, v, None, softcap=30.0)
    grouped_decode_attention(_Attn(2), q[:, :, :1], k, v, None)
    assert calls == [(5, None), (1, 30.0)]


def _left_padded(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = [TokenizedPrompt(str(row), torch.randint(3, vocab, (n,)).tolist()) for row, n in enumerate(lengths)]
    return left_pad(prompts, 0, torch.device("cpu"))


def _spy(steps: list[int]):  # noqa: ANN202
    def spy(module: torch.nn.Module, query: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        steps.append(query.shape[2])
        return grouped_decode_attention(module, query, *args, **kwargs)
    return spy


@pytest.mark.parametrize("family", ["llama", "qwen3-sliding"])
@pytest.mark.parametrize("lengths", [[5, 9, 2], [6, 6]])
def test_generation_writes_what_stock_generate_writes(family: str, lengths: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, attn_implementation="sdpa")
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, use_sliding_window=True, sliding_window=6,
                                             max_window_layers=1, **common)).eval()
    ids, mask = _left_padded(lengths, 97)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    stock = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    steps: list[int] = []
    monkeypatch.setitem(AttentionInterface._global_mapping, batched_generation.IMPLEMENTATION, _spy(steps))
    assert torch.equal(generate_batch(model, ids, mask, config), stock)
    assert steps.count(1) == 11 * 3  # every one-token step of every layer went through the grouped attention
    assert model.config._attn_implementation == "sdpa" and config.cache_implementation is None


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_targets_generate_as_stock_too(family: str) -> None:
    """Linear-attention layers keep their own state; only the attention layers take the grouped step."""
    model = make_hybrid(family)
    ids, mask = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    stock = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(generate_batch(model, ids, mask, config), stock)
