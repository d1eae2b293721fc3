"""The DDTree tree kernel (kernels/tree_search.py) against the host heap and the tensor search it replaces.

It runs on a GPU, or on a CPU under Triton's interpreter (conftest sets `TRITON_INTERPRET=1` there; `make test`
installs Triton): the tests skip where neither is available. The engine's CPU path keeps the tensor search
(`tree_kernel.kernel_runs`); the last test forces the kernel into a fast-engine DDTree decode.
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding import ddtree
from blockdraft.decoding.ddtree import DDTreeProposer, best_prefixes, build_trees, trees_on_device
from blockdraft.decoding.generate import generate
from blockdraft.kernels.tree_search import tree_rows
from blockdraft.fast.target import FastTarget
from blockdraft.kernels.skinny_gemm import kernel_available

from conftest import make_drafter, make_target_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")


def tied_log_probs(n: int, slots: int, vocab: int, seed: int) -> torch.Tensor:
    """Log-probabilities rounded to quarters (many exact ties, as bf16 logits give) with some -inf entries."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = ((2 * torch.randn(n, slots, vocab, generator=generator)).log_softmax(-1) * 4).round() / 4
    log_probs[torch.rand(n, slots, vocab, generator=generator) < 0.1] = float("-inf")
    return log_probs.to(DEVICE)


@pytest.mark.parametrize("n, slots, vocab, budget", [(1, 15, 200, 32), (3, 7, 50, 16), (2, 4, 5, 40), (4, 6, 300, 64),
                                                     (2, 3, 8, 1), (1, 15, 900, 256)])
def test_the_kernel_pops_the_host_heaps_nodes_ties_included(n: int, slots: int, vocab: int, budget: int) -> None:
    """Node for node the heap's tree (parents, depths, [L, k] table indices, tokens), whatever the ties, the -inf
    scores (the tree stops short of the budget) and each sequence's own slot count (one with none)."""
    log_probs = tied_log_probs(n, slots, vocab, seed=n * 100 + budget)
    top = torch.topk(log_probs, min(budget, vocab), dim=-1)
    counts = [slots, 0, 1, slots - 2][:n]
    host = torch.tensor([[c, 7 + b, 50 * b] for b, c in enumerate(counts)], device=DEVICE)
    ids, positions, own, shape, table = tree_rows(top.values, top.indices, host, budget)
    for b, count in enumerate(counts):
        parents, depths, flat = (best_prefixes(top.values[b, :count].double().tolist(), budget) if count else
                                 ([], [], []))
        found = int(shape[b, 0])
        assert found == len(parents)
        assert shape[b, 1 : 1 + found].tolist() == parents
        assert shape[b, 1 + budget : 1 + budget + found].tolist() == depths
        assert table[b, :found].tolist() == flat
        assert ids[b, 1 : 1 + found].tolist() == top.indices[b].reshape(-1)[flat].tolist()
        assert ids[b, 0] == 7 + b and positions[b, 0] == 50 * b
        assert positions[b, 1 : 1 + found].tolist() == [50 * b + d for d in depths]


@pytest.mark.parametrize("budget", [1, 9, 33, 300])
def test_the_kernel_lays_out_the_tensor_searchs_rows(budget: int) -> None:
    """Without ties, `trees_on_device` with the kernel and with the tensor search give the same verify rows: ids
    (padding: the anchor), positions, the ancestor mask and the shape, padding included."""
    generator = torch.Generator().manual_seed(budget)
    logits = (3 * torch.randn(5, 7, 60, generator=generator)).to(DEVICE)
    slots, anchors, starts = [7, 3, 0, 1, 6], [11, 12, 13, 14, 15], [40, 3, 9, 0, 17]
    kernel = trees_on_device(logits, slots, budget, anchors, starts, kernel=True)
    tensors = trees_on_device(logits, slots, budget, anchors, starts, kernel=False)
    assert torch.equal(kernel.shape, tensors.shape)
    assert torch.equal(kernel.positions, tensors.positions)
    assert kernel.own.dtype == torch.bool and torch.equal(kernel.own, tensors.own)
    for b, anchor in enumerate(anchors):
        count = int(kernel.shape[b, 0])
        assert torch.equal(kernel.ids[b, : 1 + count], tensors.ids[b, : 1 + count])
        assert (kernel.ids[b, 1 + count :] == anchor).all()


def test_build_trees_searches_with_the_kernel_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_trees` on the device (sampled DDTree, large batches) with the kernel: the host heap's trees."""
    monkeypatch.setattr(ddtree, "kernel_runs", lambda device, budget: True)
    log_probs = tied_log_probs(4, 7, 60, seed=3)
    slots = [7, 3, 0, 5]
    for budget in (1, 9, 33):
        on_host = build_trees(log_probs, slots, budget, on_device=False)
        on_device = build_trees(log_probs, slots, budget, on_device=True)
        for host, device in zip(on_host, on_device):
            assert torch.equal(host.tokens, device.tokens)
            assert (host.parents, host.depths) == (device.parents, device.depths)


def test_a_fast_engine_ddtree_decode_with_the_kernel_is_lossless(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's rows through the fast engine's greedy DDTree step (its verify, walk and cache compaction): the
    ids of the target alone."""
    monkeypatch.setattr(ddtree, "kernel_runs", lambda device, budget: True)
    target = FastTarget(make_target_model("qwen3", seed=4).to(DEVICE))
    proposer = DDTreeProposer(make_drafter("all_full", seed=5).to(DEVICE), target, 6)
    for prompt in ([3, 17, 29, 41, 5], [1]):
        alone = generate(target, prompt, None, max_new_tokens=12).token_ids
        result = generate(target, prompt, proposer, max_new_tokens=12)
        assert result.token_ids == alone
        assert sum(result.acceptance_lengths) == len(alone) - 1
