"""The delta-rule kernels (`kernels.delta_rule`) against the PyTorch rule they replace (`fast.delta_net`): a
verify's outputs along each row's path (chains and trees, from a committed state) and a commit's state after the
accepted path. On a CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.fast.delta_net import advance_state, advance_state_counted, path_delta_rule, path_layout
from blockdraft.kernels.delta_rule import advance_state_kernel, delta_rule_runs, path_delta_rule_kernel, visit_order
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


def test_rows_are_visited_depth_first() -> None:
    """The kernel's row order: a preorder (every row after its parent, each subtree's rows together), the search's
    index order among siblings; a chain keeps its own order. In a pop-ordered tree only a branch point restarts."""
    chain = ancestors([-1, 0, 1, 2]).unsqueeze(0)
    assert visit_order(path_layout(chain, 4)[0], chain).tolist() == [[0, 1, 2, 3]]
    shape = [-1, -1, 0, 1, 2, 0, 3, 5, 2, 6]  # two roots; the branches interleaved as a best-first search pops them
    own = ancestors(shape).unsqueeze(0)
    order = visit_order(path_layout(own, 4)[0], own)[0].tolist()
    assert order == [0, 2, 4, 8, 5, 7, 1, 3, 6, 9]
    restarts = sum(shape[row] != previous for previous, row in zip([-1, *order], order))
    assert restarts == 3 < sum(shape[row] != row - 1 for row in range(len(shape))) == 9


@needs_kernel
@pytest.mark.parametrize("shape", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 3, 2, -1], [-1, -1, 0, 1, 2, 0, 3, 5, 2, 6]])
def test_kernel_matches_the_rule(shape: list[int]) -> None:
    generator = torch.Generator().manual_seed(len(shape))
    batch, heads, t, dk, dv = 2, 3, len(shape), 16, 40
    own = ancestors(shape).unsqueeze(0).expand(batch, t, t)
    parents, _ = path_layout(own, 4)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, heads, t, dk, generator=generator), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, heads, t, dv, generator=generator)
    g, beta = -torch.rand(batch, heads, t, generator=generator), torch.rand(batch, heads, t, generator=generator)
    state = torch.randn(batch, heads, dk, dv, generator=generator)
    args = [x.to(DEVICE) for x in (q, k, v, g, beta, state, parents)]
    with torch.inference_mode():
        assert delta_rule_runs(args[1], args[5])
        want = path_delta_rule(*args)
        got = path_delta_rule_kernel(*args, own.to(DEVICE))
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
