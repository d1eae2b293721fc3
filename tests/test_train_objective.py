"""The chunked weighted cross-entropy equals the one-shot loss, and the compiled layer stack and loss the eager ones,
in values and in gradients."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from hypothesis import given, settings
from hypothesis import strategies as st
from test_train_masks import B, HIDDEN, LAYOUTS, TAPS, _drafter

from blockdraft.train.masks import BlockLayout
from blockdraft.train.objective import (
    BlockObjective, block_targets, scored_loss, slot_weights, soft_scored_loss, weighted_cross_entropy,
)


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
        loss = weighted_cross_entropy(hidden, (labels,), weights, partial(scored_loss, head), vocab, max_logits=limit)
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


def test_compiled_chunk_loss_equals_eager_under_checkpointing_without_recompiling() -> None:
    """--compile's loss unit inside the checkpointed chunks: same loss and gradients as eager, and one capture
    serves every chunk and batch size (the row count is dynamic; a recompile per batch would cost minutes)."""
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(8, 30, bias=False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(scored_loss, backend=counter, dynamic=True)
    captures = []
    for rows in (37, 23, 52):
        hidden = torch.randn(rows, 8, generator=g, requires_grad=True)
        labels = torch.randint(0, 30, (rows,), generator=g)
        weights = torch.rand(rows, generator=g)
        results = []
        for unit in (scored_loss, compiled):
            head.zero_grad()
            hidden.grad = None
            loss = weighted_cross_entropy(hidden, (labels,), weights, partial(unit, head), 30, max_logits=300)
            loss.backward()
            results.append((loss.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        captures.append(counter.frame_count)
    assert captures[0] > 0 and len(set(captures)) == 1


def test_compiled_objective_loss_equals_eager_and_compiles_once() -> None:
    """The whole --compile objective (layer stack + loss unit) over batches of one padded shape but different
    numbers of scored slots: the eager loss and gradients, and nothing captured again after the first batch."""
    drafter = _drafter(LAYOUTS["full"]).float()
    head = torch.nn.Linear(HIDDEN, 50, bias=False).requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    counter = CompileCounterWithBackend("aot_eager")
    eager, compiled = BlockObjective(drafter, "sdpa"), BlockObjective(drafter, "sdpa", counter)
    layout = BlockLayout(torch.tensor([[1, 5, 6], [3, 4, 10]]), B, 12)
    captures = []
    for valid, lengths in (([[1, 1, 1], [1, 1, 1]], [16, 14]), ([[1, 1, 0], [1, 0, 0]], [16, 5])):
        ids = torch.randint(0, 49, (2, 16), generator=g)
        targets = block_targets(ids, torch.tensor(lengths), layout.anchors, torch.tensor(valid, dtype=torch.bool), 49,
                                slot_weights(B))
        taps = torch.randn(2, 12, TAPS * HIDDEN, generator=g)
        embeds = torch.randn(2, 3 * B, HIDDEN, generator=g)
        results = []
        for objective in (eager, compiled):
            drafter.zero_grad()
            loss = objective(taps, embeds, layout, targets, head)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        captures.append(counter.frame_count)
    assert captures[0] > 0 and len(set(captures)) == 1


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 30), k=st.integers(1, 5), max_logits=st.integers(1, 200), seed=st.integers(0, 99))
def test_soft_label_loss_is_cross_entropy_against_the_distribution(rows: int, k: int, max_logits: int,
                                                                   seed: int) -> None:
    """-sum p_i log q(i) over the K labelled tokens, chunked or not; with one token of probability 1 it is the hard
    loss."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 20, bias=False).double()
    hidden = torch.randn(rows, 8, generator=g, dtype=torch.double)
    ids = torch.stack([torch.randperm(20, generator=g)[:k] for _ in range(rows)])
    probs = torch.rand(rows, k, generator=g, dtype=torch.double).softmax(-1)
    weights = torch.rand(rows, generator=g, dtype=torch.double)
    loss = weighted_cross_entropy(hidden, (ids, probs), weights, partial(soft_scored_loss, head), 20,
                                  max_logits=max_logits)
    log_q = torch.log_softmax(head(hidden), -1)
    expected = (-(probs * log_q.gather(-1, ids)).sum(-1) * weights).sum() / weights.sum()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-9, atol=1e-9)
    hard = weighted_cross_entropy(hidden, (ids[:, 0],), weights, partial(scored_loss, head), 20)
    one_hot = weighted_cross_entropy(hidden, (ids[:, :1], torch.ones(rows, 1, dtype=torch.double)), weights,
                                     partial(soft_scored_loss, head), 20)
    torch.testing.assert_close(hard, one_hot, rtol=1e-12, atol=1e-12)
