"""Per-position rollback of hybrid targets: which forwards record states, which row sets a recorded state can
serve, what it costs in memory; losslessness of both strategies is tested in test_hybrid.py."""

from __future__ import annotations

import pytest
import torch

from blockdraft.models.hybrid import STRATEGIES, HybridCache
from blockdraft.models.hybrid_states import PositionStates
from blockdraft.models.target import Target

from test_hybrid import PROMPTS, ar_cache, assert_same_states, make_hybrid, with_strategy


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_hybrid("qwen3_5")


def test_a_recorded_state_serves_only_root_paths() -> None:
    states = PositionStates(parents=[-1, 0, 0, 1, 2])  # root 0; 1 and 2 its children; 3 under 1, 4 under 2
    for path in ([0], [0, 1], [0, 1, 3], [0, 2, 4]):
        assert states.holds(torch.tensor(path))
    for rows in ([], [1, 3], [0, 2, 3], [0, 1, 2], [0, 3]):
        assert not states.holds(torch.tensor(rows, dtype=torch.long))


def test_only_verifies_record_and_the_rollback_frees_them(model: torch.nn.Module) -> None:
    """The prefill and one-row forwards keep no per-position states; a verify of t rows keeps t recurrent states
    per linear layer (the strategy's memory cost) until its rollback."""
    cache = HybridCache(model, "per_position")
    target = Target(model)
    target.forward(torch.tensor([PROMPTS[0]]), torch.arange(5), cache)
    assert cache.recorded is None
    target.forward(torch.tensor([[1]]), torch.tensor([5]), cache)
    assert cache.recorded is None
    target.forward(torch.tensor([[1, 2, 3, 4]]), torch.arange(6, 10), cache)
    state = cache.linear[0].recurrent_states[0]
    assert cache.recorded.nbytes() == 4 * len(cache.linear) * state.numel() * state.element_size()
    cache.crop(8)
    assert cache.recorded is None and cache.replayed_tokens == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dropping_a_whole_verify(model: torch.nn.Module, strategy: str) -> None:
    """Keeping none of a verify's rows (no recorded state ends there) restores the state from before it."""
    target = with_strategy(Target(model), strategy)
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPTS[0]]), torch.arange(5), cache)
    target.forward(torch.tensor([[1, 2, 3]]), torch.arange(5, 8), cache)
    cache.crop(5)
    assert cache.replayed_tokens == 0
    assert_same_states(cache, ar_cache(target, PROMPTS[0], 5))


def test_unknown_strategy_is_refused(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="replay, per_position"):
        HybridCache(model, "checkpoint")
