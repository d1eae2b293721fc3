"""The prefill's delta rule from flash-linear-attention: the adapter hands fla its layout ([B, t, H, d], q already
scaled, the state as initial state) and gives back the engine's, and a hybrid prefill takes fla only in half
precision on the kernels' device, never in the float32 runs the lossless tests check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockdraft.fast import hybrid_target
from blockdraft.fast.delta_net import chunked_delta_rule
from blockdraft.fast.hybrid_target import HybridUnits
from blockdraft.kernels import fla_delta_rule as adapter


def rule_inputs(heads: int = 3, dk: int = 8, dv: int = 5, tokens: int = 70) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(2, heads, tokens, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(2, heads, tokens, dv, generator=gen)
    g = -F.softplus(torch.randn(2, heads, tokens, generator=gen))
    beta = torch.rand(2, heads, tokens, generator=gen)
    state = torch.randn(2, heads, dk, dv, generator=gen) * 0.1
    return q / dk ** 0.5, k, v, g, beta, state


def library_in_its_layout(calls: list[dict]) -> adapter.Rule:
    """A stand-in for fla's function with its signature and layout, computing by the engine's rule."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
            initial_state: torch.Tensor, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append({"q": q.shape, "dtype": q.dtype, "scale": scale, "final": output_final_state})
        out, final = chunked_delta_rule(*(x.transpose(1, 2).float() for x in (q, k, v, g, beta)), initial_state)
        return out.transpose(1, 2).to(v.dtype), final

    return run


def test_the_adapter_hands_fla_its_layout_and_returns_ours() -> None:
    inputs = rule_inputs()
    calls: list[dict] = []
    out, final = adapter.fla_delta_rule(*inputs, torch.float32, rule=library_in_its_layout(calls))
    want_out, want_final = chunked_delta_rule(*inputs)
    assert calls == [{"q": (2, 70, 3, 8), "dtype": torch.float32, "scale": 1.0, "final": True}]
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(final, want_final)
    assert out.shape == inputs[2].shape and final.dtype == torch.float32


def test_half_precision_goes_in_as_the_models_dtype() -> None:
    inputs = rule_inputs()
    calls: list[dict] = []
    out, final = adapter.fla_delta_rule(*inputs, torch.bfloat16, rule=library_in_its_layout(calls))
    assert calls[0]["dtype"] == torch.bfloat16
    assert out.dtype == torch.float32 and final.dtype == torch.float32  # back in the engine's dtypes
    torch.testing.assert_close(out, chunked_delta_rule(*inputs)[0], atol=0.05, rtol=0.05)


def test_without_fla_the_adapter_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "library_rule", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install 'blockdraft\[gpu\]'"):
        adapter.fla_delta_rule(*rule_inputs(), torch.bfloat16)


@pytest.mark.parametrize(("rule_kernel", "dtype", "fla_used"), [
    (True, torch.bfloat16, True),  # a GPU's half-precision prefill: fla where the timing says so
    (True, torch.float32, False),  # float32: the engine's rule, the one the lossless tests check
    (False, torch.bfloat16, False),  # off the kernels' device
])
def test_a_prefill_takes_fla_only_in_half_precision_on_the_kernels_device(
        monkeypatch: pytest.MonkeyPatch, rule_kernel: bool, dtype: torch.dtype, fla_used: bool) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(hybrid_target, "library_rule", lambda: library_in_its_layout(calls))
    monkeypatch.setattr(hybrid_target, "fla_delta_rule",
                        lambda *args: adapter.fla_delta_rule(*args, rule=library_in_its_layout(calls)))
    chosen: list[tuple] = []

    def pick(kind: str, key: tuple, device: torch.device, options: dict) -> str:
        chosen.append((kind, key, list(options)))
        return "fla"

    monkeypatch.setattr(hybrid_target, "fastest", pick)
    inputs = rule_inputs()
    out, final = HybridUnits(compiled=False, rule_kernel=rule_kernel).prefill_rule(*inputs, dtype)
    assert bool(calls) == fla_used
    assert chosen == ([("prefill_delta_rule", (3, 70, 8, 5, dtype), ["fla", "ours"])] if fla_used else [])
    want_out, want_final = chunked_delta_rule(*inputs)
    tolerance = {"atol": 0.05, "rtol": 0.05} if fla_used else {}
    torch.testing.assert_close(out, want_out, **tolerance)
    torch.testing.assert_close(final, want_final, **tolerance)
