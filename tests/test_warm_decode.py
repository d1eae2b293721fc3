"""warm_decode: a method's verify row counts, the fast target's graph lookup for smaller trees, and (on a GPU) no
graph captured by a decode inside the warmed context with the same ids as without warming."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target_model

from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.decoding.warm import warm_decode
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.fast.target import FastTarget
from blockdraft.fast.graphs import graphs_captured
from blockdraft.models.target import Target


def test_each_method_names_the_verify_rows_its_steps_take() -> None:
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    block = drafter.cfg.block_size
    assert build_proposer("dflash", target, drafter).verify_rows() == tuple(range(1, block + 1))
    assert build_proposer("dflash", target, drafter, draft_tokens=2).verify_rows() == (1, 2, 3)
    assert build_proposer("ddtree", target, drafter, budget=40).verify_rows() == (41,)
    assert SwitchingProposer(drafter, target, 24).verify_rows() == (*range(1, block + 1), 25)
    selector = make_drafter("dflash2")  # DFlash-2: its walk verifies as a chain, its trees as trees
    walk = build_proposer("dflash", target, selector)
    assert walk.verify_rows() == tuple(range(1, walk.chain.depth + 2))
    assert build_proposer("ddtree", target, selector, budget=9).verify_rows() == (10,)


def test_off_a_gpu_warming_captures_nothing_and_the_decode_is_unchanged() -> None:
    model = make_target_model("qwen3")
    drafter = make_drafter("all_full")
    for target in (FastTarget(model), Target(model)):
        proposer = build_proposer("ddtree", target, drafter, budget=6)
        before = generate(target, [3, 4, 5], proposer, 12).token_ids
        assert warm_decode(target, proposer, 64) == 0
        assert generate(target, [3, 4, 5], proposer, 12).token_ids == before


def test_warming_a_tree_times_the_top_k_of_every_slot_count_a_decode_meets(monkeypatch) -> None:
    """The steps near max_new_tokens draft fewer slots, each a top-k shape the kernel chooser times where first met:
    warming meets them all (the chooser spied, as on a GPU, where `top_k_runs` holds), so no decode times one."""
    from blockdraft.decoding import ddtree
    from blockdraft.kernels import top_k as top_k_kernel

    keys: list[tuple[object, ...]] = []
    monkeypatch.setattr(top_k_kernel, "kernel_runs", lambda device, k: True)
    monkeypatch.setattr(ddtree, "top_k_runs", lambda device, k: True)
    monkeypatch.setattr(top_k_kernel, "kernel_wins", lambda kind, key, *rest: keys.append(key) and False)
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    proposer = build_proposer("ddtree", target, drafter, budget=12)
    proposer.warm(64)
    depth = drafter.cfg.block_size - 1
    assert {key[0] for key in keys} == {1 << (slots - 1).bit_length() for slots in range(1, depth + 1)}
    warmed = set(keys)
    keys.clear()
    for new in range(1, 2 * depth):
        generate(target, [5, 6, 7], proposer, new)
    assert set(keys) <= warmed and len({key[0] for key in keys}) > 2  # the decodes' tails met several row buckets


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 40)])
def test_warming_reserves_the_target_cache_before_any_part_captures(monkeypatch, method: str,
                                                                    budget: int | None) -> None:
    """The target's K/V are reserved for every part of the warm-up (verify, drafter, fused steps, prefill) before
    the first part runs, which run in that order: a buffer that grows drops every graph captured on it. (A CPU
    captures nothing; on a GPU, test_after_warming_a_decode_inside_the_context_captures_no_graph covers the drafter's
    buffers too.)"""
    from blockdraft.decoding import fused_steps as fused

    target = FastTarget(make_target_model("qwen3"), cache_slots=16, fused=True)
    proposer = build_proposer(method, target, make_drafter("all_full"), budget)
    seen: list[tuple[str, int]] = []
    parts = [(target, "warm_verify"), (target, "warm_prefill"), (fused.FusedSteps, "warm")]
    if proposer is not None:
        parts.append((type(proposer), "warm"))
    for owner, name in parts:
        real = getattr(owner, name)
        label = "drafter" if owner is not target and owner is not fused.FusedSteps else name
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _label=label: (
            seen.append((_label, target.storage.version)), _real(*a))[1])
    warm_decode(target, proposer, 700)
    expected = ["warm_verify", *(["drafter"] if proposer else []), "warm", "warm_prefill"]
    assert [name for name, _ in seen] == expected
    assert {version for _, version in seen} == {target.storage.version} != {0}
    assert target.storage.slots >= 700 + 41 and target.storage.slots >= target.prefill_room


def test_warming_fused_steps_with_a_lookup_chain_sizes_its_history_before_the_first_capture(monkeypatch) -> None:
    """The token history a lookup chain's steps search grows before any of their graphs is captured (a buffer that
    grows drops every graph captured on it): each capture sees the buffers' last versions. (Captures recorded, not
    made: a CPU has no graphs.)"""
    from blockdraft.decoding.fused_steps import AHEAD, FusedSteps, fused_steps

    target = FastTarget(make_target_model("qwen3"), cache_slots=16, fused=True)
    proposer = build_proposer("ddtree", target, make_drafter("all_full"), 12, lookup=6)
    steps = fused_steps(target, proposer)
    steps.drafter.room(steps._draft_slots(700, AHEAD))  # the drafter's buffers, as warm_decode reserves them
    captures: list[tuple[int, ...]] = []
    monkeypatch.setattr(FusedSteps, "_graph", lambda self, graphs, cap, run: captures.append(
        self._storage_versions()))
    target.use_graphs = True
    steps.warm(700)
    assert len(captures) > 4 and set(captures) == {steps._storage_versions()}
    assert steps.history.numel() >= 700


def test_a_tree_without_its_own_graph_replays_a_captured_one_of_up_to_twice_its_rows() -> None:
    target = FastTarget(make_target_model("qwen3"))
    taps = (0, 2)
    for key in [(33, 256, taps), (65, 512, taps), (16, 256, taps), (40, 256, None)]:
        target._graphs[key] = object()  # only the keys are read: which graph a forward would replay
    assert target._captured_rows(20, 100, taps) == 33  # 33 <= 2 x 20, same capacity
    assert target._captured_rows(33, 100, taps) == 33
    assert target._captured_rows(16, 100, taps) == 16  # short forwards keep their power-of-two graphs
    assert target._captured_rows(12, 100, taps) == 12
    assert target._captured_rows(17, 100, taps) == 33
    assert target._captured_rows(30, 400, taps) == 30  # 65 > 2 x 30: its own graph
    assert target._captured_rows(30, 230, taps) == 30  # 230 + 33 needs capacity 512, where no 33-row graph is
    assert target._captured_rows(40, 420, taps) == 65  # 420 + 65 fits capacity 512's 65-row graph
    assert target._captured_rows(20, 100, None) == 40  # taps must match


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,budget,sampling,lookup", [
    ("ar", None, SamplingParams(), 0), ("dflash", None, SamplingParams(), 0), ("ddtree", 12, SamplingParams(), 0),
    ("ddtree", 20, SamplingParams(temperature=1.0), 0), ("ddtree", 12, SamplingParams(), 6)])
def test_after_warming_a_decode_inside_the_context_captures_no_graph(method: str, budget: int | None,
                                                                      sampling: SamplingParams, lookup: int) -> None:
    """A lookup chain's search and merge are captured in the fused steps' draft graph (the prompts repeat
    themselves every 20 tokens, so chains are found)."""
    model = make_target_model("qwen3").cuda()
    drafter = make_drafter("all_full").cuda()
    prompts = [[(3 * i + 1) % 60 + 1 for i in range(n)] for n in (5, 200, 300)]
    new = 180
    cold = FastTarget(model, fused=False)  # step by step and captured as met: the fused, warmed steps must agree
    cold_ids = [generate(cold, p, build_proposer(method, cold, drafter, budget, lookup=lookup), new, sampling,
                         seed=3).token_ids for p in prompts]
    target = FastTarget(model)
    proposer = build_proposer(method, target, drafter, budget, lookup=lookup)
    assert warm_decode(target, proposer, max(map(len, prompts)) + new) > 0
    generate(target, prompts[0], proposer, 2 * drafter.cfg.block_size, sampling)  # the tree search's own graphs
    before = graphs_captured()
    ids = [generate(target, p, proposer, new, sampling, seed=3).token_ids for p in prompts]
    assert graphs_captured() == before
    assert ids == cold_ids


def test_a_sequential_servers_warm_up_says_each_part_as_it_ends() -> None:
    """A cold GPU's warm-up of a hybrid target takes minutes: its parts are said as they end (a start that said
    nothing until its end looked hung, and one stopped at its limit told nothing of where the time went)."""
    from blockdraft.serve.sequential import SequentialEngine

    target = FastTarget(make_target_model("qwen3"), cache_slots=16, fused=True)
    proposer = build_proposer("dflash", target, make_drafter("all_full"))
    lines: list[str] = []
    SequentialEngine(target, proposer, None, 96).warm_up([3, 4, 5], lines.append)
    rows = len(proposer.verify_rows())
    assert [line.split(" up to 96 positions in ")[0] for line in lines] == [
        f"warm-up: verify graphs ({rows} row counts)", "warm-up: drafter graphs", "warm-up: fused steps",
        "warm-up: prefill graphs"]
    assert all(line.endswith(")") and " s (" in line for line in lines)  # seconds, then what they held
