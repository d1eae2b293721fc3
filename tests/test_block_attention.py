"""The compact-mask attention kernel (kernels/block_attention.py) against `decode_attention` under `attention_bias`,
the fast engine's reference: chains, trees and sliding windows, GQA folds, sequences of different committed lengths
reading their own slots of one cache, and garbage (NaN) in the cache past each sequence's keys.

It runs on a GPU, or on a CPU under Triton's interpreter (conftest sets TRITON_INTERPRET=1 there; `make test`
installs Triton); the tests skip where neither is available."""

from __future__ import annotations

import pytest
import torch

from blockdraft.kernels.block_attention import block_attention, block_attention_runs
from blockdraft.fast.ops import attention_bias, decode_attention
from blockdraft.kernels.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def random_tree(t: int, generator: torch.Generator) -> torch.Tensor:
    """[t, t] ancestor-or-self mask of a random tree whose row 0 is the root (the anchor)."""
    own = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        own[i] |= own[parent]
    return own


def reference(q: torch.Tensor, cache: torch.Tensor, length: int, positions: torch.Tensor, own: torch.Tensor,
              window: int | None, groups: int, scale: float = 0.125) -> torch.Tensor:
    """One sequence's attention by the engine's reference: q [1, G, groups * t, d] over the first length + t keys
    of its slot of `cache` [2, 1, G, capacity, d], under the dense mask of `own` [t, t] and `positions` [t]."""
    keys = length + own.shape[-1]
    bias = attention_bias(torch.tensor(length, device=DEVICE), torch.arange(keys, device=DEVICE), positions, own,
                          window, groups, torch.float32)
    return decode_attention(q, cache[0, :, :, :keys], cache[1, :, :, :keys], bias, scale)


@pytest.mark.parametrize("dtype, split_keys, merge, programs", [
    (torch.float32, 64, False, 512), (torch.bfloat16, 64, False, 512), (torch.float32, 256, False, 512),
    (torch.float32, 64, True, 512), (torch.bfloat16, 256, True, 512),
    (torch.float32, 64, False, 8), (torch.float32, 64, True, 24),  # budgets that leave 1-3 splits a sequence
])
@pytest.mark.parametrize("t, groups, window, tree", [(1, 4, None, False), (16, 2, None, False), (33, 4, None, True),
                                                     (5, 1, 8, False), (9, 2, 12, True), (64, 2, None, True)])
def test_the_kernel_is_decode_attention_under_the_dense_mask(t: int, groups: int, window: int | None, tree: bool,
                                                              dtype: torch.dtype, split_keys: int,
                                                              merge: bool, programs: int) -> None:
    generator = torch.Generator().manual_seed(t * 10 + groups)
    heads, d, slots, capacity = 2, 24, 5, 320
    lengths = [0, 37, 150, 255][: 3 if t > 32 else 4]
    seq = [3, 0, 4, 1][: len(lengths)]
    cache = torch.randn(2, slots, heads, capacity, d, generator=generator)
    for b, slot in enumerate(seq):  # past each sequence's keys: garbage the kernel must never read
        cache[:, slot, :, lengths[b] + t :] = float("nan")
    cache = cache.to(DEVICE, dtype)
    q = torch.randn(len(lengths), heads, groups * t, d, generator=generator).to(DEVICE, dtype)
    own = torch.stack([random_tree(t, generator) if tree else torch.ones(t, t, dtype=torch.bool).tril()
                       for _ in lengths]).to(DEVICE)
    positions = torch.stack([length + torch.arange(t) if not tree else length + own_b.sum(1).cpu() - 1
                             for length, own_b in zip(lengths, own)]).to(DEVICE)
    with torch.inference_mode():
        got = block_attention(q, cache[0], cache[1], torch.tensor(seq, device=DEVICE),
                              torch.tensor(lengths, device=DEVICE), own, positions, window, 0.125, split_keys,
                              merge, programs)
    for b, (slot, length) in enumerate(zip(seq, lengths)):
        want = reference(q[b : b + 1], cache[:, slot : slot + 1], length, positions[b], own[b], window, groups)
        assert torch.isfinite(got[b]).all()
        scale = want.abs().max().item()
        assert (got[b].double() - want[0].double()).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1.0), b


def test_merging_in_the_last_split_is_the_combine_launch_and_leaves_its_counts_zero() -> None:
    """The merging variant (each row block's last split merges, counted atomically) gives the two-launch kernel's
    output exactly, and leaves every count at zero, as the next launch (a graph's replay) needs."""
    from blockdraft.kernels.skinny_gemm import zeroed_counters

    generator = torch.Generator().manual_seed(7)
    lengths, t, groups, heads, d = [70, 3, 300], 2, 4, 2, 16
    cache = torch.randn(2, 3, heads, 320, d, generator=generator).to(DEVICE)
    q = torch.randn(3, heads, groups * t, d, generator=generator).to(DEVICE)
    own = torch.ones(3, t, t, dtype=torch.bool).tril().to(DEVICE)
    positions = torch.tensor(lengths).unsqueeze(1) + torch.arange(t)
    args = (q, cache[0], cache[1], torch.arange(3, device=DEVICE), torch.tensor(lengths, device=DEVICE), own,
            positions.to(DEVICE), None, 0.25, 64)
    with torch.inference_mode():
        two_launches = block_attention(*args)
        for _ in range(2):
            assert torch.equal(block_attention(*args, merge=True), two_launches)
            assert not zeroed_counters(DEVICE, 1).any()


def test_counters_a_larger_shape_outgrows_stay_alive_for_the_graphs_captured_on_them() -> None:
    """`zeroed_counters` grows for a shape that needs more counts (a wide product's weights-first tiles), and keeps the
    buffer it replaced: a CUDA graph captured on it holds its address, not a reference."""
    from blockdraft.kernels import skinny_gemm

    old = skinny_gemm.zeroed_counters(DEVICE, 1)
    new = skinny_gemm.zeroed_counters(DEVICE, old.numel() + 1)
    assert new.numel() > old.numel() and not new.any()
    assert any(kept is old for kept in skinny_gemm._OUTGROWN)
    assert skinny_gemm.zeroed_counters(DEVICE, 1) is new


def test_it_runs_only_where_it_can() -> None:
    q = torch.zeros(1, 1, 1, 8, device=DEVICE)
    with torch.no_grad():
        assert block_attention_runs(q, q)
        assert not block_attention_runs(q.to(torch.int32), q.to(torch.int32))
        assert not block_attention_runs(q, q.to(torch.float16))
    assert not block_attention_runs(q, q)  # autograd on: the reference


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("t, groups", [(1, 4), (16, 2), (33, 1), (5, 3)])
def test_merged_heads_are_the_output_transposed_as_o_proj_reads_it(t: int, groups: int, merge: bool) -> None:
    """With `merged_heads` the kernel (either way of merging its splits) stores [B, t, heads * d]: exactly
    `merge_heads` of its own [B, G, groups * t, d] output, with no transpose kernel after it."""
    from blockdraft.fast.ops import merge_heads

    generator = torch.Generator().manual_seed(t + groups)
    lengths, kv_heads, d = [0, 40, 130], 2, 16
    cache = torch.randn(2, 3, kv_heads, 256, d, generator=generator).to(DEVICE)
    q = torch.randn(3, kv_heads, groups * t, d, generator=generator).to(DEVICE)
    own = torch.ones(3, t, t, dtype=torch.bool).tril().to(DEVICE)
    positions = (torch.tensor(lengths).unsqueeze(1) + torch.arange(t)).to(DEVICE)
    args = (q, cache[0], cache[1], torch.arange(3, device=DEVICE), torch.tensor(lengths, device=DEVICE), own,
            positions, None, 0.25, 64, merge)
    with torch.inference_mode():
        got = block_attention(*args, merged_heads=True)
        want = merge_heads(block_attention(*args), kv_heads * groups, t)
    assert got.shape == (3, t, kv_heads * groups * d) and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("launch", [(8, 3), (4, 2)])
def test_a_launch_of_other_warps_and_stages_attends_alike(launch: tuple[int, int]) -> None:
    """The split kernel launched with other warps and pipeline stages than Triton's defaults (the engine's chooser
    may pick one, `fast_ops.WIDE_LAUNCH`): the same attention, sequences of different lengths and a chain's rows.
    (The interpreter runs one program at a time whatever the launch: there this checks the plumbing; on a GPU, the
    variants.)"""
    generator = torch.Generator().manual_seed(sum(launch))
    lengths, kv_heads, groups, t, d = [3, 70, 200], 2, 4, 2, 16
    cache = torch.randn(2, 3, kv_heads, 256, d, generator=generator).to(DEVICE)
    q = torch.randn(3, kv_heads, groups * t, d, generator=generator).to(DEVICE)
    own = torch.ones(3, t, t, dtype=torch.bool).tril().to(DEVICE)
    positions = (torch.tensor(lengths).unsqueeze(1) + torch.arange(t)).to(DEVICE)
    args = (q, cache[0], cache[1], torch.arange(3, device=DEVICE), torch.tensor(lengths, device=DEVICE), own,
            positions, None, 0.25)
    with torch.inference_mode():
        torch.testing.assert_close(block_attention(*args, launch=launch), block_attention(*args), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("merge", [False, True])
def test_one_split_a_sequence_stores_the_output_with_no_combine_and_no_count(monkeypatch: pytest.MonkeyPatch,
                                                                             merge: bool) -> None:
    """Where the programs leave each sequence one split (the 8B shape's 64 sequences of one row), that split stores
    the output itself: no combine launch and no atomic count, either way of merging, and still the attention (a
    sequence with no committed key, one longer than a key block, a window)."""
    from blockdraft.kernels import flash_decode

    def no_combine(*_: object) -> None:
        raise AssertionError("the combine kernel ran for one split a sequence")

    monkeypatch.setattr(flash_decode, "_combine_kernel", type("NoLaunch", (), {"__getitem__": no_combine})())
    monkeypatch.setattr("blockdraft.kernels.block_attention.zeroed_counters", no_combine)
    generator = torch.Generator().manual_seed(11)
    lengths, kv_heads, groups, t, d, window = [0, 70, 150], 2, 4, 1, 16, 100
    cache = torch.randn(2, 3, kv_heads, 256, d, generator=generator).to(DEVICE)
    q = torch.randn(3, kv_heads, groups * t, d, generator=generator).to(DEVICE)
    own = torch.ones(3, t, t, dtype=torch.bool).to(DEVICE)
    positions = (torch.tensor(lengths).unsqueeze(1) + torch.arange(t)).to(DEVICE)
    with torch.inference_mode():
        got = block_attention(q, cache[0], cache[1], torch.arange(3, device=DEVICE),
                              torch.tensor(lengths, device=DEVICE), own, positions, window, 0.25, merge=merge,
                              programs=3 * kv_heads)
    for b, length in enumerate(lengths):
        keys = length + t
        bias = attention_bias(torch.tensor(length, device=DEVICE), torch.arange(keys, device=DEVICE), positions[b],
                              own[b], window, groups, torch.float32)
        want = decode_attention(q[b : b + 1], cache[0, b : b + 1, :, :keys], cache[1, b : b + 1, :, :keys], bias,
                                0.25)
        torch.testing.assert_close(got[b], want[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("block_rows", [32, 64])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("t, groups, window, tree", [(16, 4, None, False), (33, 4, None, True), (9, 2, 12, True)])
def test_taller_row_blocks_attend_alike(t: int, groups: int, window: int | None, tree: bool, merge: bool,
                                        block_rows: int) -> None:
    """A KV head's folded rows in 32- or 64-row blocks (each program reading its split's keys for all of them, not
    for 16): the attention of 16-row blocks and of the dense reference, with the last block part-filled (33 rows x 4
    query heads), trees, a window, sequences of different lengths and garbage past each one's keys."""
    generator = torch.Generator().manual_seed(t * 7 + groups + block_rows)
    heads, d, capacity = 2, 24, 320
    lengths, seq = [0, 41, 200], [2, 0, 1]
    cache = torch.randn(2, 3, heads, capacity, d, generator=generator)
    for b, slot in enumerate(seq):
        cache[:, slot, :, lengths[b] + t :] = float("nan")
    cache = cache.to(DEVICE)
    q = torch.randn(len(lengths), heads, groups * t, d, generator=generator).to(DEVICE)
    own = torch.stack([random_tree(t, generator) if tree else torch.ones(t, t, dtype=torch.bool).tril()
                       for _ in lengths]).to(DEVICE)
    positions = torch.stack([length + own_b.sum(1).cpu() - 1 for length, own_b in zip(lengths, own)]).to(DEVICE)
    args = (q, cache[0], cache[1], torch.tensor(seq, device=DEVICE), torch.tensor(lengths, device=DEVICE), own,
            positions, window, 0.125, 64, merge)
    with torch.inference_mode():
        got = block_attention(*args, block_rows=block_rows)
        torch.testing.assert_close(got, block_attention(*args), rtol=2e-5, atol=2e-5)
    for b, (slot, length) in enumerate(zip(seq, lengths)):
        want = reference(q[b : b + 1], cache[:, slot : slot + 1], length, positions[b], own[b], window, groups)
        torch.testing.assert_close(got[b], want[0], rtol=2e-5, atol=2e-5)


def test_a_row_block_is_a_power_of_two_the_kernel_takes() -> None:
    from blockdraft.kernels.block_attention import group_block_rows

    assert [group_block_rows(rows, 128) for rows in (1, 4, 16, 17, 48, 64, 132)] == [16, 16, 16, 32, 64, 64, 64]
    # a 256-wide head (the 27B shape's) holds 32 rows a program: 64 need more shared memory than an SM has
    assert [group_block_rows(rows, dim) for rows, dim in ((96, 256), (24, 256), (64, 64), (64, 24))] == [32, 32, 64, 64]
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="block_rows 48: use a power of two from 16 to 64"):
        block_attention(q, q, q, torch.zeros(1, dtype=torch.long, device=DEVICE),
                        torch.zeros(1, dtype=torch.long, device=DEVICE), torch.ones(1, 4, 4, dtype=torch.bool,
                                                                                       device=DEVICE),
                        torch.zeros(1, 4, dtype=torch.long, device=DEVICE), None, 1.0, block_rows=48)


@pytest.mark.parametrize("t, groups, offered", [(16, 4, "64-row blocks"), (5, 4, "32-row blocks"), (4, 4, None)])
def test_the_engine_times_tall_row_blocks_where_a_kv_head_has_more_rows_than_one_block(
        monkeypatch: pytest.MonkeyPatch, t: int, groups: int, offered: str | None) -> None:
    """`kernel_block_attention` offers the chooser the tall-row-block options (4 and 8 warps, 8 merging) exactly where a
    KV head's folded rows outgrow one 16-row block, and each of them attends as the default kernel does."""
    from blockdraft.fast import ops

    generator = torch.Generator().manual_seed(t)
    lengths, kv_heads, d = [3, 90], 2, 16
    cache = torch.randn(2, 2, kv_heads, 256, d, generator=generator).to(DEVICE)
    q = torch.randn(2, kv_heads, groups * t, d, generator=generator).to(DEVICE)
    own = torch.ones(2, t, t, dtype=torch.bool).tril().to(DEVICE)
    positions = (torch.tensor(lengths).unsqueeze(1) + torch.arange(t)).to(DEVICE)
    mask = ops.CompactMask.of(torch.arange(2, device=DEVICE), torch.tensor(lengths, device=DEVICE), own, positions,
                              lambda window: pytest.fail("the library's dense mask was built"))
    seen: dict[str, list[str]] = {}

    def choose(pick: str):
        def fastest(kind: str, key: object, device: torch.device, options: dict) -> str:
            seen[pick] = list(options)
            return pick if pick in options else next(iter(options))
        return fastest

    with torch.inference_mode():
        monkeypatch.setattr(ops, "fastest", choose("kernel"))
        want = ops.kernel_block_attention(ops.decode_attention, ops.merge_heads, q, cache[0], cache[1], 0.25, mask,
                                          None)
        tall = [name for name in seen["kernel"] if "row blocks" in name]
        if offered is None:
            assert not tall
            return
        assert tall == [f"kernel, {offered}", f"kernel, {offered}, 8 warps", f"kernel, {offered}, 8 warps, merging"]
        assert seen["kernel"][-1] == "library"
        for name in tall:
            monkeypatch.setattr(ops, "fastest", choose(name))
            got = ops.kernel_block_attention(ops.decode_attention, ops.merge_heads, q, cache[0], cache[1], 0.25, mask,
                                             None)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
