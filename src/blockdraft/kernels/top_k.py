"""The top k of each row's log-softmax in two Triton kernels: DDTree's per-slot scores without torch's ~16 launches.

A greedy DDTree step scores its tree with the drafter's log-probabilities and keeps each slot's best min(budget, V)
tokens. torch runs that as a float cast, a log_softmax and a radix top-k: ~16 kernels and ~57 us of device time in
a 1.5 ms DDTree@31 step of the embedded pair on the H200 (`profile_decode.py`, benchmarks/RESULTS.md, 2026-12-04),
where each launch inside the step's graph also costs its gap. Here one program per (row, chunk of the vocabulary)
takes its chunk's best KP (the power of two at or above k) as packed keys (the logit's bits made order-preserving,
then the token id: lower ids first among equal logits) with the chunk's softmax partials (max and sum of exp); one
program per row merges its chunks' candidates and partials and writes the k best log-probabilities, largest first,
and their tokens. `torch.topk(torch.log_softmax(logits.float(), -1), k)` stays the reference and the path where the
kernel does not run or was timed slower (`kernel_choice.kernel_wins`).

Each program keeps its best KP with Triton's bitonic top-k (`tl.topk`: runs of KP sorted, then halved by pairwise
maxima), not a sort of the whole chunk: with whole-chunk sorts the kernels took 66.5 us against the library's 71.0
at 15 x 49,152 and k = 31 on the H200, and 415 against 119 at a 151,936 vocabulary (benchmarks/RESULTS.md, 2026-12-04).
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.kernel_choice import kernel_wins
from blockdraft.kernels.skinny_gemm import gpu_kernels, triton

KERNEL_MAX_K = 128  # each chunk keeps KP >= k keys: beyond this the library's radix select is the better tool
MERGED_CANDIDATES = 1024  # a row's merge selects from about this many candidates: chunks are sized for it ...
CHUNK_RANGE = (1024, 8192)  # ... within these sizes (one program holds a chunk in registers)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _chunk_top_kernel(logits_ptr, keys_ptr, stats_ptr, V, stride_row, CHUNKS, CHUNK: tl.constexpr,
                          KP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = cols < V
        x = tl.load(logits_ptr + row * stride_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        most = tl.max(x, axis=0)
        shift = tl.where(most == float("-inf"), 0.0, most)
        total = tl.sum(tl.exp(x - shift), axis=0)
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 ties +0.0, as a float compare has it
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of these ints = the floats' order
        packed = (ordered.to(tl.int64) << 32) | (V - 1 - cols).to(tl.int64)
        lowest = tl.full((CHUNK,), -2147483648, tl.int32).to(tl.int64) << 32  # below every real key
        best = tl.topk(tl.where(inside, packed, lowest), KP)  # bitonic top-k: sorts runs of KP, not the chunk
        at = tl.arange(0, KP)
        tl.store(keys_ptr + (row * CHUNKS + chunk) * KP + at, best)
        tl.store(stats_ptr + (row * CHUNKS + chunk) * 2, most)
        tl.store(stats_ptr + (row * CHUNKS + chunk) * 2 + 1, total)

    @triton.jit
    def _merge_top_kernel(keys_ptr, stats_ptr, values_ptr, indices_ptr, V, K, CHUNKS, KP: tl.constexpr,
                          CANDIDATES: tl.constexpr, CHUNKS_P2: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.arange(0, CHUNKS_P2)
        most = tl.load(stats_ptr + (row * CHUNKS + chunk) * 2, mask=chunk < CHUNKS, other=float("-inf"))
        total = tl.load(stats_ptr + (row * CHUNKS + chunk) * 2 + 1, mask=chunk < CHUNKS, other=0.0)
        peak = tl.max(most, axis=0)
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        # a sum of exps, not of products: a product summed contracts into fused multiply-adds in the order each lane
        # meets them, and on the H200 lanes then held log totals an ulp apart, so two tied logits' log-probabilities
        # came out an ulp apart, out of order (2026-12-05); adds alone give every lane the same bits. A chunk with a
        # finite max sums at least exp(0) = 1; one without (padding, all -inf) adds exp(-inf) = 0 whatever its total
        log_total = tl.log(tl.sum(tl.exp(most - shift + tl.log(tl.maximum(total, 1.0))), axis=0))
        at = tl.arange(0, CANDIDATES)
        lowest = tl.full((CANDIDATES,), -2147483648, tl.int32).to(tl.int64) << 32
        keys = tl.load(keys_ptr + row * CHUNKS * KP + at, mask=at < CHUNKS * KP, other=0)
        best = tl.topk(tl.where(at < CHUNKS * KP, keys, lowest), KP)
        ordered = (best >> 32).to(tl.int32)
        x = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        token = V - 1 - (best - ((best >> 32) << 32))  # the low half: V - 1 - token, below 2**31
        kept = tl.arange(0, KP)
        tl.store(values_ptr + row * K + kept, (x - shift) - log_total, mask=kept < K)
        tl.store(indices_ptr + row * K + kept, token, mask=kept < K)


def kernel_runs(device: torch.device, k: int) -> bool:
    """Whether `log_softmax_top_k` may take the kernel on `device` (a GPU with Triton; a CPU only when forced)."""
    return gpu_kernels(device) and k <= KERNEL_MAX_K


def chunk_size(vocab: int, kp: int) -> int:
    """A chunk's columns: so that a row's merge selects from about MERGED_CANDIDATES keys, within CHUNK_RANGE, at least
    the KP kept, and no wider than the vocabulary's power of two."""
    low, high = CHUNK_RANGE
    wanted = power_of_two_at_least(-(-vocab * kp // MERGED_CANDIDATES))
    return max(kp, min(power_of_two_at_least(vocab), max(low, min(high, wanted))))


def kernel_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' (values, indices) [rows, k] for logits [rows, V] with unit column stride: the log-softmax's k
    largest values in float32, largest first, and their tokens (int64)."""
    rows, vocab = logits.shape
    kp = max(2, power_of_two_at_least(k))  # no one-element blocks (k = 1): the extra kept key is not stored
    chunk = chunk_size(vocab, kp)
    chunks = -(-vocab // chunk)
    keys = torch.empty(rows, chunks * kp, dtype=torch.int64, device=logits.device)
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
    values = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    _chunk_top_kernel[(rows, chunks)](logits, keys, stats, vocab, logits.stride(0), chunks, CHUNK=chunk, KP=kp,
                                      num_warps=4 if chunk <= 2048 else 8)
    candidates = power_of_two_at_least(chunks * kp)
    _merge_top_kernel[(rows,)](keys, stats, values, indices, vocab, k, chunks, KP=kp, CANDIDATES=candidates,
                               CHUNKS_P2=max(2, power_of_two_at_least(chunks)),
                               num_warps=4 if candidates <= 1024 else 8)
    return values, indices


def library_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: torch's log_softmax in float32, then its top-k."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.values, top.indices


def log_softmax_top_k(logits: torch.Tensor, k: int, kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest greedy log-probabilities of each row of `logits` [..., V] (float32, sorted, largest first) and
    their tokens: from the kernels where they run and were timed faster (`kernel` forces either path), else from
    torch."""
    *lead, vocab = logits.shape
    flat = logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if kernel is None:  # timed once per power of two of rows: a batch's trees meet every count of sequences x
        # slots, each a pause of ~0.1 s where first timed (2026-12-05), and a server warms its batch buckets only
        kernel = kernel_runs(logits.device, k) and kernel_wins(
            "log-softmax top-k", (power_of_two_at_least(flat.shape[0]), vocab, k, flat.dtype), flat.device,
            lambda: kernel_top_k(flat, k), lambda: library_top_k(flat, k))
    values, indices = kernel_top_k(flat, k) if kernel else library_top_k(flat, k)
    return values.view(*lead, k), indices.view(*lead, k)
