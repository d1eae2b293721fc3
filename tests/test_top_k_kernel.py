"""The log-softmax top-k kernels (decoding/top_k_kernel.py) against torch's log_softmax + topk they replace.

They run on a GPU, or on a CPU under Triton's interpreter (conftest sets `TRITON_INTERPRET=1`); the tests skip where
neither is available. The interpreter sorts slowly, so the chunk sizes are shrunk here to give several chunks a row
on small vocabularies (the kernels' logic does not depend on the size, only their speed does).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding import top_k_kernel
from blockdraft.decoding.top_k_kernel import chunk_size, kernel_top_k, library_top_k, log_softmax_top_k
from blockdraft.models.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16-64 columns, merges of ~64 candidates: several chunks a row at vocabularies of a few hundred."""
    monkeypatch.setattr(top_k_kernel, "CHUNK_RANGE", (16, 64))
    monkeypatch.setattr(top_k_kernel, "MERGED_CANDIDATES", 64)


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
    assert (values[:, :-1] >= values[:, 1:]).all()


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
