"""The delta-rule kernels (`kernels.delta_rule`) against the PyTorch rule they replace (`fast.delta_net`): a
verify's outputs along each row's path (chains and trees, from a committed state) and a commit's state after the
accepted path. On a CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.fast.delta_net import advance_state, advance_state_counted, path_delta_rule, path_layout
from blockdraft.kernels.delta_rule import (advance_state_kernel, delta_rule_runs, leaf_walks, path_delta_rule_kernel,
                                          walk_lanes)
from blockdraft.kernels.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(not kernel_available(DEVICE),
                                  reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")


def ancestors(parents: list[int]) -> torch.Tensor:
    own = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            own[i, p] = True
            p = parents[p]
    return own


def rule_inputs(batch: int, heads: int, t: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    """A verify's q, k (l2-normed), v, decay g (<= 0), beta and committed state, on DEVICE."""
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, heads, t, dk, generator=generator), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, heads, t, dv, generator=generator)
    g, beta = -torch.rand(batch, heads, t, generator=generator), torch.rand(batch, heads, t, generator=generator)
    state = torch.randn(batch, heads, dk, dv, generator=generator)
    return [x.to(DEVICE) for x in (q, k, v, g, beta, state)]


def test_each_leaf_walks_its_path_root_first() -> None:
    """The kernel's walks: the leaves first, in row order, each as its ancestors-or-self (padded with row 0) with its
    depth, and the count of leaves. A chain is one walk; a tree whose branches interleave, as a best-first search pops
    them, has a walk per leaf, and every row lies on one."""
    chain = ancestors([-1, 0, 1, 2]).unsqueeze(0)
    walks = leaf_walks(chain)
    assert walks.counts.tolist() == [1] and walks.depths.tolist() == [[4, 0, 0, 0]]
    assert walks.paths[0, 0].tolist() == [0, 1, 2, 3]
    shape = [-1, -1, 0, 1, 2, 0, 3, 5, 2, 6]  # two roots; the branches interleaved
    walks = leaf_walks(ancestors(shape).unsqueeze(0))
    assert walks.counts.tolist() == [4] and walks.depths[0].tolist() == [3, 3, 3, 4] + [0] * 6
    paths = [walks.paths[0, leaf, :n].tolist() for leaf, n in enumerate(walks.depths[0, :4].tolist())]
    assert paths == [[0, 2, 4], [0, 5, 7], [0, 2, 8], [1, 3, 6, 9]]
    assert walks.paths[0, 0].tolist() == [0, 2, 4] + [0] * 7
    assert set().union(*paths) == set(range(len(shape)))
    assert walk_lanes(192, 33) == 21 and walk_lanes(64 * 192, 33) == 1 and walk_lanes(4, 3) == 3


@needs_kernel
@pytest.mark.parametrize("shape", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 3, 2, -1], [-1, -1, 0, 1, 2, 0, 3, 5, 2, 6]])
def test_kernel_matches_the_rule(shape: list[int]) -> None:
    batch, t = 2, len(shape)
    own = ancestors(shape).unsqueeze(0).expand(batch, t, t)
    parents, _ = path_layout(own, 4)
    args = [*rule_inputs(batch, 3, t, 16, 40, seed=len(shape)), parents.to(DEVICE)]
    with torch.inference_mode():
        assert delta_rule_runs(args[1], args[5])
        want = path_delta_rule(*args)
        got = path_delta_rule_kernel(*args[:6], leaf_walks(own.to(DEVICE)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    path = torch.tensor([0, 1, 3], device=DEVICE)  # a root-to-node path of both shapes
    parts = [x[:, :, path] for x in args[1:5]]
    with torch.inference_mode():
        want_state = advance_state(*parts, args[5])
        got_state = advance_state_kernel(*parts, args[5].clone())
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    count = torch.tensor(2, device=DEVICE)  # a fused step's accepted rows, on the device
    with torch.inference_mode():
        want_counted = advance_state_counted(*parts, args[5], count)
        got_counted = advance_state_kernel(*parts, args[5].clone(), count)
    torch.testing.assert_close(got_counted, want_counted, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want_counted, advance_state(*[x[:, :, :2] for x in parts], args[5]))


@needs_kernel
def test_kernel_walks_each_sequence_own_tree() -> None:
    """A batch whose sequences verify different trees (a chain, a wide tree, a deep one): every row's output is its
    own path's, the rows on several paths included, however the leaves share lanes."""
    shapes = [[-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 1, 2], [-1, 0, 1, 1, 3, 0]]
    own = torch.stack([ancestors(shape) for shape in shapes])
    parents, _ = path_layout(own, 4)
    args = rule_inputs(len(shapes), 2, 6, 8, 64, seed=7)
    with torch.inference_mode():
        want = path_delta_rule(*args, parents.to(DEVICE))
        walks = leaf_walks(own.to(DEVICE))
        for lanes in (None, 1, 2):  # every leaf its own lane; one lane for all; two taking turns
            got = path_delta_rule_kernel(*args, walks, lanes)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
