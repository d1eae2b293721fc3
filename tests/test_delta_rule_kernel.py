"""The verify's delta-rule kernel (`kernels.delta_rule`) against the PyTorch rule it replaces
(`fast.delta_net.path_delta_rule`): the same outputs and the same kept state per row, for chains and trees, from a
committed state. On a CPU it runs under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.fast.delta_net import path_delta_rule, path_layout
from blockdraft.kernels.delta_rule import path_delta_rule_kernel, path_delta_rule_runs
from blockdraft.kernels.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")


def ancestors(parents: list[int]) -> torch.Tensor:
    own = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            own[i, p] = True
            p = parents[p]
    return own


@pytest.mark.parametrize("shape", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 3, 2, -1]])
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
    want_kept = torch.full((batch, t + 2, heads, dk, dv), float("nan"), device=DEVICE)
    got_kept = want_kept.clone()
    with torch.inference_mode():
        assert path_delta_rule_runs(args[0], got_kept)
        want = path_delta_rule(*args, want_kept)
        got = path_delta_rule_kernel(*args, got_kept)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kept, want_kept, rtol=1e-5, atol=1e-5, equal_nan=True)
