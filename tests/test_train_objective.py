"""The chunked weighted cross-entropy equals the one-shot loss, and the compiled layer stack the eager one, in
values and in gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_train_masks import B, HIDDEN, LAYOUTS, TAPS, _drafter

from blockdraft.train.masks import BlockLayout
from blockdraft.train.objective import BlockObjective, weighted_cross_entropy


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(2, 30), max_logits=st.integers(1, 200), seed=st.integers(0, 99))
def test_chunked_loss_and_gradients_equal_unchunked(rows: int, vocab: int, max_logits: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, vocab, bias=False).double()
    hidden = torch.randn(rows, 8, generator=g, dtype=torch.double, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(rows, generator=g, dtype=torch.double)

    def run(limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head.zero_grad()
        hidden.grad = None
        loss = weighted_cross_entropy(hidden, labels, weights, head, vocab, max_logits=limit)
        loss.backward()
        return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()

    whole, chunked = run(rows * vocab), run(max_logits)
    expected = (torch.nn.functional.cross_entropy(head(hidden), labels, reduction="none") * weights).sum() / weights.sum()
    torch.testing.assert_close(whole[0], expected.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["full", "causal-sliding"])
def test_compiled_layer_stack_equals_eager(kind: str) -> None:
    """--compile captures the same math: loss and gradients match the eager stack (aot_eager: the capture and
    autograd graph that inductor then turns into kernels)."""
    drafter = _drafter(LAYOUTS[kind]).float()
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(2, 12, TAPS * HIDDEN, generator=g)
    embeds = torch.randn(2, 3 * B, HIDDEN, generator=g)
    layout = BlockLayout(torch.tensor([[1, 5, 6], [3, 4, 10]]), B, 12)
    results = []
    for backend in (None, "aot_eager"):
        drafter.zero_grad()
        hidden = BlockObjective(drafter, "sdpa", backend).hidden(taps, embeds, layout)
        hidden.square().mean().backward()
        results.append((hidden.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
