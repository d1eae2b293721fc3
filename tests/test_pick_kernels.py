"""The decoding tail's pick kernels against the torch calls they replace: the log-softmax top-k
(kernels/top_k.py, DDTree's per-slot scores) and the split argmax (kernels/argmax.py, the fused
steps' greedy picks).

They run on a GPU, or on a CPU under Triton's interpreter (conftest sets `TRITON_INTERPRET=1`); the tests skip where
neither is available. The interpreter sorts slowly, so the chunk sizes are shrunk here to give several chunks a row
on small vocabularies (the kernels' logic does not depend on the size, only their speed does).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.kernels import argmax as argmax_kernel
from blockdraft.kernels import top_k as top_k_kernel
from blockdraft.kernels.argmax import greedy_picks, kernel_argmax
from blockdraft.kernels.top_k import chunk_size, kernel_top_k, library_top_k, log_softmax_top_k
from blockdraft.kernels.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernels need a GPU, or TRITON_INTERPRET=1 with Triton installed")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k chunks of 16-64 columns and merges of ~64 candidates; argmax chunks of 16-64 columns, 8 programs a
    row: several chunks a row at vocabularies of a few hundred."""
    monkeypatch.setattr(top_k_kernel, "CHUNK_RANGE", (16, 64))
    monkeypatch.setattr(top_k_kernel, "MERGED_CANDIDATES", 64)
    monkeypatch.setattr(argmax_kernel, "CHUNK_RANGE", (16, 64))
    monkeypatch.setattr(argmax_kernel, "PROGRAMS_A_ROW", 8)


def lowest_ids_first(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k best tokens by logit, lower ids first among equal logits: the order the kernels promise."""
    x = logits.float().cpu()
    return torch.tensor([sorted(range(x.shape[-1]), key=lambda j: (-x[r, j].item(), j))[:k] for r in range(x.shape[0])])


@pytest.mark.parametrize("rows, vocab, k, dtype", [(3, 300, 31, torch.float32), (2, 257, 64, torch.bfloat16),
                                                   (4, 50, 16, torch.float32), (1, 130, 1, torch.bfloat16),
                                                   (2, 9, 9, torch.float32), (5, 200, 128, torch.float32)])
def test_the_kernels_give_the_libraries_log_probabilities_and_the_best_tokens_ties_to_lower_ids(
        rows: int, vocab: int, k: int, dtype: torch.dtype) -> None:
    """Values equal to torch's log_softmax at the chosen tokens (to float rounding), sorted, largest first; the
    tokens are each row's best k by logit with ties (many in bf16, forced here by rounding) to the lower id, across
    chunk borders and a partial last chunk; a -inf logit never outranks a finite one."""
    generator = torch.Generator().manual_seed(rows * 1000 + vocab + k)
    logits = (4 * torch.randn(rows, vocab, generator=generator)).round() / 2
    logits[0, : vocab // 3] = float("-inf")
    logits = logits.to(dtype).to(DEVICE)
    assert -(-vocab // chunk_size(vocab, 1 << (k - 1).bit_length())) > 1 or vocab < 16, "one chunk: not a merge test"
    values, indices = kernel_top_k(logits, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64 and values.shape == (rows, k)
    assert torch.equal(indices.cpu(), lowest_ids_first(logits, k))
    reference = torch.log_softmax(logits.float(), dim=-1).gather(1, indices)
    finite = reference.isfinite()
    assert torch.equal(finite, values.isfinite())
    assert torch.allclose(values[finite], reference[finite], atol=1e-5, rtol=0)
    disordered = (values[:, :-1] < values[:, 1:]).nonzero().tolist()
    assert not disordered, [(r, c, values[r, c : c + 2].tolist(), indices[r, c : c + 2].tolist(),
                             logits[r, indices[r, c : c + 2]].tolist()) for r, c in disordered]


def test_rows_of_a_batch_of_slots_and_a_strided_view_come_back_in_the_inputs_shape() -> None:
    """[n, L, V] logits (a batch's slots), one of them a column-strided view, give [n, L, k] tables equal to the
    library's where no ties decide (random float32 logits)."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 400, generator=generator).to(DEVICE)
    values, indices = log_softmax_top_k(logits, 20, kernel=True)
    expected_values, expected_indices = library_top_k(logits, 20)
    assert values.shape == indices.shape == (2, 3, 20)
    assert torch.equal(indices, expected_indices)
    assert torch.allclose(values, expected_values, atol=1e-5, rtol=0)
    wide = torch.randn(3, 800, generator=generator).to(DEVICE)[:, ::2]
    values, indices = log_softmax_top_k(wide, 5, kernel=True)
    assert torch.equal(indices, library_top_k(wide, 5)[1])


def test_the_library_path_is_torchs_off_a_gpu_unless_the_kernel_is_forced() -> None:
    """Without `kernel`, a CPU (and any k above KERNEL_MAX_K) takes torch's top-k: the exact reference values."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    values, indices = log_softmax_top_k(logits, 10)
    expected = torch.topk(torch.log_softmax(logits, dim=-1), 10)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    assert not top_k_kernel.kernel_runs(torch.device("cpu"), 10)
    assert not top_k_kernel.kernel_runs(DEVICE, top_k_kernel.KERNEL_MAX_K + 1)


def test_the_choice_is_timed_once_per_power_of_two_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's trees give the top-k every count of sequences x slots: each is timed under its row count's power of
    two, which a server's warm-up at its batch buckets meets, so no live count is timed in the middle of traffic."""
    keys: list[tuple[object, ...]] = []
    monkeypatch.setattr(top_k_kernel, "kernel_runs", lambda device, k: True)
    monkeypatch.setattr(top_k_kernel, "kernel_wins", lambda kind, key, *rest: keys.append(key) and False)
    for rows in (15, 16, 45, 60, 1):
        log_softmax_top_k(torch.zeros(rows, 70), 8)
    assert keys == [(16, 70, 8, torch.float32), (16, 70, 8, torch.float32), (64, 70, 8, torch.float32),
                    (64, 70, 8, torch.float32), (1, 70, 8, torch.float32)]


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
