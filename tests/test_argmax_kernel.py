"""The split argmax kernels (decoding/argmax_kernel.py) against torch.argmax, which they replace in the fused steps.

They run on a GPU, or on a CPU under Triton's interpreter (conftest sets `TRITON_INTERPRET=1`); the tests skip where
neither is available. Chunks are shrunk so that small vocabularies still split over several programs a row.
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding import argmax_kernel
from blockdraft.decoding.argmax_kernel import greedy_picks, kernel_argmax
from blockdraft.models.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16-64 columns, 8 programs a row: several chunks a row at vocabularies of a few hundred."""
    monkeypatch.setattr(argmax_kernel, "CHUNK_RANGE", (16, 64))
    monkeypatch.setattr(argmax_kernel, "PROGRAMS_A_ROW", 8)


@pytest.mark.parametrize("rows, vocab, dtype", [(1, 300, torch.bfloat16), (37, 257, torch.float32),
                                                (16, 130, torch.bfloat16), (3, 9, torch.float32)])
def test_the_kernels_pick_torchs_argmax_first_column_among_ties(rows: int, vocab: int, dtype: torch.dtype) -> None:
    """Every row's pick equals torch.argmax's (the first column holding the maximum), with many exact ties (values
    rounded to halves), a maximum tied across chunk borders, rows past a merging program's block, a partial last
    chunk, and a row that is -inf throughout."""
    generator = torch.Generator().manual_seed(rows * 1000 + vocab)
    logits = (2 * torch.randn(rows, vocab, generator=generator)).round() / 2
    logits[0, [vocab // 2, vocab - 1, 5 % vocab]] = logits.max() + 1  # one tie spans chunks: the first column wins
    if rows > 1:
        logits[1] = float("-inf")
    logits = logits.to(dtype).to(DEVICE)
    assert argmax_kernel.chunk_size(vocab) < vocab or vocab < 16, "one chunk a row: not a merge test"
    picks = kernel_argmax(logits)
    assert picks.dtype == torch.int64
    assert torch.equal(picks.cpu(), logits.cpu().float().argmax(dim=-1))
    assert int(picks[0]) == min(vocab // 2, vocab - 1, 5 % vocab)


def test_greedy_picks_keeps_torchs_argmax_where_the_kernels_do_not_run() -> None:
    """Off a GPU, for a strided view and for more than two dimensions: torch's own argmax."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    assert not argmax_kernel.kernel_runs(torch.device("cpu"))
    assert torch.equal(greedy_picks(logits), logits.argmax(dim=-1))
    wide = torch.randn(3, 100, generator=torch.Generator().manual_seed(3)).to(DEVICE)[:, ::2]
    assert torch.equal(greedy_picks(wide), wide.argmax(dim=-1))
    batch = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert torch.equal(greedy_picks(batch), batch.argmax(dim=-1))
