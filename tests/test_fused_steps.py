"""Fused greedy steps (`decoding.fused_steps`): the device walk against the host walk, and whole decodes on the
trained pairs (all-full and sliding-window drafters) giving the step-by-step path's ids, acceptance and draft
lengths, with stop tokens, early ends and the switch back for the last steps. On a CPU the fused functions run
eagerly; the GPU runs them as graphs (tests/test_warm_decode.py's CUDA cases decode through them)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target_model
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdraft.decoding.ddtree import _tree_rows, build_tree
from blockdraft.kernels import argmax as argmax_kernel
from blockdraft.decoding import fused_steps as fused_steps_module
from blockdraft.kernels import walk as walk_kernel
from blockdraft.decoding.fused_steps import AHEAD, FusedSteps, device_walk, fused_steps
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.decoding.verify import walk
from blockdraft.kernels.walk import walk_rows
from blockdraft.fast.drafter import FastDrafter
from blockdraft.fast.target import FastTarget
from blockdraft.kernels.skinny_gemm import kernel_available
from blockdraft.fast.static_cache import SLOT_STEP

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the walk kernel's checks run


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 24), slots=st.integers(1, 6), follow=st.floats(0, 1))
def test_the_device_walk_commits_what_the_host_walk_commits(seed: int, budget: int, slots: int,
                                                            follow: float) -> None:
    """On random trees (and chains: budget 1 per depth), with target picks that follow the tree for a random
    while: the same committed count, and the path's rows in order."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 8
    log_probs = torch.log_softmax(torch.randn(slots, vocab, generator=gen) * 3, dim=-1)
    top = torch.topk(log_probs.unsqueeze(0), min(budget, vocab), dim=-1)
    host = torch.tensor([[slots, 5, 100]])
    ids, positions, own, shape = _tree_rows(top.values, top.indices, host, budget)
    draft = build_tree(log_probs, budget)
    count = int(shape[0, 0])
    assert count == len(draft)
    parent_rows = torch.cat([torch.zeros(1, dtype=torch.long), shape[0, 1 : 1 + budget] + 1])
    # the target picks the token of a random child of each row (or not), so paths of every length occur
    picks = torch.randint(0, vocab, (budget + 1,), generator=gen)
    for row in range(count + 1):
        children = [c + 1 for c in range(count) if int(parent_rows[c + 1]) == row]
        if children and torch.rand(1, generator=gen).item() < follow:
            picks[row] = ids[0, children[torch.randint(len(children), (1,), generator=gen).item()]]
    verdict = walk(draft, picks[: count + 1].tolist(), ids[0, 1 : 1 + count].tolist())
    committed, path = device_walk(ids[0], picks, own[0], parent_rows, positions[0], shape[0, 0], slots + 1)
    assert int(committed) == len(verdict.accepted) + 1
    assert path[: int(committed)].tolist() == [0] + [node + 1 for node in verdict.accepted]
    if kernel_available(KERNEL_DEVICE):  # the walk kernel writes what the fused step keeps of device_walk's
        result, anchor = torch.zeros(2 + len(path), dtype=torch.long), torch.zeros((), dtype=torch.long)
        kernel_path = torch.zeros(len(path), dtype=torch.long)
        on = [x.to(KERNEL_DEVICE) for x in (ids[0], picks, own[0], parent_rows, positions[0], shape[0, 0], result,
                                            anchor, kernel_path)]
        walk_rows(*on)
        assert torch.equal(on[-1].cpu(), path)
        assert on[-3].tolist() == [int(committed), count, *picks[path].tolist()]
        assert int(on[-2]) == int(picks[path[int(committed) - 1]])


@pytest.fixture(scope="module")
def pairs(trained_pairs: dict) -> dict:
    """Each trained pair's target model and drafter on the CPU, in float32."""
    from blockdraft.models.loading import load_drafter, load_target

    loaded = {}
    for name, (target_dir, drafter_dir) in trained_pairs.items():
        target, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
        loaded[name] = (target.model, load_drafter(drafter_dir, target))
    return loaded


def _decode(model: torch.nn.Module, drafter: object, method: str, fused: bool, prompt: list[int], n: int,
            **kwargs: object) -> tuple[list[int], list[int], list[int], int]:
    target = FastTarget(model, fused=fused)
    budget, lookup = kwargs.pop("budget", None), kwargs.pop("lookup", 0)
    proposer = None if method == "ar" else build_proposer(method, target, drafter, budget,  # type: ignore[arg-type]
                                                          lookup=lookup)  # type: ignore[arg-type]
    steps = fused_steps(target, proposer)
    reads = [0, 0]  # reads, and the most steps in flight at a read
    if steps is not None:
        read = steps.read

        def counted(cache: object) -> tuple[int, list[int]]:
            reads[0] += 1
            reads[1] = max(reads[1], steps.pending)
            return read(cache)

        steps.read = counted  # type: ignore[method-assign]
    result = generate(target, prompt, proposer, n, **kwargs)  # type: ignore[arg-type]
    return result.token_ids, result.acceptance_lengths, result.draft_lengths, reads[0], reads[1]


@pytest.mark.parametrize("pair", ["full", "swa"])
@pytest.mark.parametrize("method,budget,lookup", [("ar", None, 0), ("dflash", None, 0), ("ddtree", 6, 0),
                                                  ("ddtree", 40, 0), ("ddtree", 6, 3), ("ddtree", 40, 15)])
def test_fused_steps_decode_as_the_step_by_step_path(pairs: dict, pair: str, method: str, budget: int | None,
                                                     lookup: int) -> None:
    """With a prompt-lookup chain too, searched and merged on the device (prompts that repeat themselves, so chains
    are found and accepted)."""
    from trained_pair import prompts

    model, drafter = pairs[pair]
    for prompt in prompts(seed=3, count=3):
        ids = (prompt.ids * 3)[: 40] if lookup else prompt.ids
        plain = _decode(model, drafter, method, False, ids, 53, budget=budget, lookup=lookup)
        fused = _decode(model, drafter, method, True, ids, 53, budget=budget, lookup=lookup)
        assert plain[3] == 0 and fused[3] > 0  # the fused steps ran, then the last steps took the other path
        assert fused[4] == AHEAD  # the next step launched before this one's read
        assert fused[:3] == plain[:3]
        if method != "ar":
            assert max(fused[1]) > 2  # whole paths were committed, not only the anchor's bonus


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 12)])
def test_fused_steps_walking_and_picking_with_the_kernels_decode_as_the_step_by_step_path(
        pairs: dict, method: str, budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk kernel and the argmax kernels in the fused steps (forced on a CPU: Triton's interpreter): the
    target's picks, the walk's path feeding the cache compaction, the taps and the next anchor, and a chain's
    drafted tokens give the step-by-step ids, acceptance and draft lengths."""
    from trained_pair import prompts

    if not kernel_available(torch.device("cpu")):
        pytest.skip("the kernels need Triton's interpreter here")
    monkeypatch.setattr(fused_steps_module, "walk_kernel_runs", lambda device, rows: True)
    monkeypatch.setattr(argmax_kernel, "kernel_runs", lambda device: True)
    monkeypatch.setattr(argmax_kernel, "CHUNK_RANGE", (16, 64))  # several programs a row of the small vocabulary
    calls: list[str] = []
    monkeypatch.setattr(fused_steps_module, "walk_rows", lambda *args: calls.append("walk") or walk_rows(*args))
    real_argmax = argmax_kernel.kernel_argmax
    monkeypatch.setattr(argmax_kernel, "kernel_argmax", lambda x: calls.append("argmax") or real_argmax(x))
    model, drafter = pairs["full"]
    for prompt in prompts(seed=4, count=2):
        plain = _decode(model, drafter, method, False, prompt.ids, 40, budget=budget)
        fused = _decode(model, drafter, method, True, prompt.ids, 40, budget=budget)
        assert fused[3] > 0 and fused[:3] == plain[:3]
    assert {"walk", "argmax"} <= set(calls)


def test_the_walk_kernel_lays_out_long_paths_over_tiles_of_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 40-row chain read four mask rows a tile: the kernel's count, path, picks and anchor are device_walk's,
    for paths that stop in the first tile, in a middle one and at the last row."""
    if not kernel_available(KERNEL_DEVICE):
        pytest.skip("the walk kernel needs a GPU or Triton's interpreter")
    monkeypatch.setattr(walk_kernel, "MASK_TILE_ELEMENTS", 256)
    rows = 40
    on = {"device": KERNEL_DEVICE}
    own = torch.ones(rows, rows, dtype=torch.bool, **on).tril()
    parent_rows = (torch.arange(rows, **on) - 1).clamp_min(0)
    positions = 7 + torch.arange(rows, **on)
    nodes = torch.tensor(rows - 1, **on)
    ids = torch.randint(0, 50, (rows,), generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    for follow in (2, 23, rows - 1):
        picks = torch.full((rows,), 99, **on)
        picks[:follow] = ids[1 : follow + 1]  # rows 1..follow are accepted
        count, path = device_walk(ids, picks, own, parent_rows, positions, nodes, rows)
        result, anchor = torch.zeros(2 + rows, dtype=torch.long, **on), torch.zeros((), dtype=torch.long, **on)
        kernel_path = torch.zeros(rows, dtype=torch.long, **on)
        walk_kernel.walk_rows(ids, picks, own, parent_rows, positions, nodes, result, anchor, kernel_path)
        assert int(count) == follow + 1 and int(result[0]) == follow + 1
        assert torch.equal(kernel_path, path) and torch.equal(result[2:], picks[path])
        assert int(anchor) == int(picks[follow])


def test_fused_steps_stop_on_a_stop_token_and_when_the_caller_ends(pairs: dict) -> None:
    from trained_pair import prompts

    model, drafter = pairs["full"]
    prompt = prompts(seed=5, count=1)[0].ids
    whole = _decode(model, drafter, "ddtree", False, prompt, 60, budget=12)[0]
    stop = whole[20]
    for fused in (False, True):
        ids = _decode(model, drafter, "ddtree", fused, prompt, 60, budget=12, stop_token_ids=(stop,))[0]
        assert ids == whole[: whole.index(stop) + 1]
        seen: list[list[int]] = []
        ended = _decode(model, drafter, "dflash", fused, prompt, 60,
                        on_commit=lambda c: seen.append(c) or len(seen) == 4)
        assert len(seen) == 4 and ended[0] == [t for chunk in seen for t in chunk]


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 12)])
def test_a_step_left_in_flight_by_a_stop_is_dropped_and_the_next_decode_is_its_own(pairs: dict, method: str,
                                                                                  budget: int | None) -> None:
    """A stop read while the next step flies ends the decode with that step unread; the same target and proposer
    then decode the next prompt exactly as a fresh step-by-step run does."""
    from trained_pair import prompts

    model, drafter = pairs["full"]
    first, second = (p.ids for p in prompts(seed=7, count=2))
    target = FastTarget(model, fused=True)
    proposer = None if method == "ar" else build_proposer(method, target, drafter, budget)
    whole = generate(target, first, proposer, 60).token_ids
    stop = whole[12]
    stopped = generate(target, first, proposer, 60, stop_token_ids=(stop,))
    assert stopped.token_ids == whole[: whole.index(stop) + 1]
    assert fused_steps(target, proposer).pending == 1  # the step launched ahead was never read
    after = generate(target, second, proposer, 60)
    fresh = _decode(model, drafter, method, False, second, 60, budget=budget)
    assert (after.token_ids, after.acceptance_lengths, after.draft_lengths) == fresh[:3]


@pytest.mark.parametrize("method,budget,lookup", [("ar", None, 0), ("dflash", None, 0), ("ddtree", 12, 0),
                                                  ("ddtree", 12, 6)])
def test_buffers_that_grow_while_a_step_flies_keep_what_it_committed(pairs: dict, method: str,
                                                                     budget: int | None, lookup: int) -> None:
    """The buffers' first room (SLOT_STEP positions), a prompt of 230 and 60 new tokens: the target's and the
    drafter's buffers (and a lookup chain's token history) grow in the middle of the decode, with the next step
    launched before the last one's commit was read."""
    from trained_pair import prompts

    model, drafter = pairs["full"]
    prompt = (prompts(seed=9, count=1)[0].ids * 40)[:230]
    target = FastTarget(model, cache_slots=1, fused=True)
    proposer = None if method == "ar" else build_proposer(method, target, drafter, budget, lookup=lookup)
    if proposer is not None:
        chain = proposer.chain if method == "ddtree" else proposer
        chain._fast = FastDrafter(drafter, target, cache_slots=1)
    result = generate(target, prompt, proposer, 60)
    assert target.storage.slots > SLOT_STEP  # grown after the prefill: the decode crossed the first room
    if lookup:
        assert fused_steps(target, proposer).history.numel() > SLOT_STEP
    fresh = _decode(model, drafter, method, False, prompt, 60, budget=budget, lookup=lookup)
    assert (result.token_ids, result.acceptance_lengths, result.draft_lengths) == fresh[:3]


@torch.inference_mode()
def test_a_grown_buffer_keeps_the_rows_a_step_in_flight_committed_unread() -> None:
    """The host's lengths trail the device's while a step flies: room asked for then keeps `unread` rows more."""
    target = FastTarget(make_target_model("qwen3"), cache_slots=1)
    drafter = FastDrafter(make_drafter("all_full"), target, cache_slots=1)
    cache = target.new_cache()
    cache.advanced(200)
    drafter.advanced(200)
    for storage in (target.storage, drafter.storage):
        storage.kv[:, :, :, :210] = 1.0  # 200 read, 10 more committed by the step in flight
    cache.reserve(100, unread=10)
    drafter.room(310, unread=10)
    for storage in (target.storage, drafter.storage):
        assert storage.version == 1 and storage.slots >= 310
        assert bool((storage.kv[:, :, :, :210] == 1).all()) and not bool(storage.kv[:, :, :, 210:].any())


def test_fused_steps_apply_to_greedy_ar_chains_and_trees_on_the_fast_engine_only() -> None:
    model = make_target_model("qwen3")
    target = FastTarget(model, fused=True)
    assert isinstance(fused_steps(target, None), FusedSteps)
    assert fused_steps(target, None) is fused_steps(target, None)  # made once: its graphs stay warm
    assert isinstance(fused_steps(target, build_proposer("ddtree", target, make_drafter("all_full"), 8)), FusedSteps)
    assert fused_steps(target, build_proposer("dflash", target, make_drafter("dflash2"))) is None
    assert fused_steps(FastTarget(model, fused=False), None) is None
    sampled = SamplingParams(temperature=0.8)
    runs = [generate(FastTarget(model, fused=fused), [3, 4, 5], None, 12, sampling=sampled, seed=4).token_ids
            for fused in (False, True)]
    assert runs[0] == runs[1]
