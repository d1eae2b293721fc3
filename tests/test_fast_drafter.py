"""The static drafter path (FastDrafter: fixed buffers, device-built masks, CUDA-graph bookkeeping) gives the eager
drafter's logits on CPU through a decode-like sequence of extensions and passes, for full, sliding-window and
causal drafters; whole generations on the fast engine give the hf engine's ids and acceptance lengths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.fast import drafter as fast_drafter_mod
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.fast.drafter import FastDrafter
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import HIDDEN, make_drafter, make_target_model
from test_fast_target import _eager_capture, _EagerGraph, ids

# all_full: bidirectional full layers; mixed_swa: causal window-5 layers + a full one (window < context);
# swa_bidirectional: the same windows, not causal; causal: causal full layers.
VARIANTS = ["all_full", "mixed_swa", "swa_bidirectional", "causal"]


def drafter_for(variant: str) -> DFlashDrafter:
    """make_drafter's variants, plus the same weights under is_causal true / false."""
    base = {"swa_bidirectional": "mixed_swa", "causal": "all_full"}.get(variant, variant)
    drafter = make_drafter(base)
    if base == variant:
        return drafter
    rebuilt = DFlashDrafter(replace(drafter.cfg, is_causal=variant == "causal"))
    rebuilt.load_state_dict(drafter.state_dict())
    return rebuilt.eval()


def taps(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, 3 * HIDDEN, generator=torch.Generator().manual_seed(seed))


class Lockstep:
    """The eager proposer and the static one over the same drafter and target, compared at every pass."""

    def __init__(self, variant: str) -> None:
        drafter = drafter_for(variant)
        target = FastTarget(make_target_model("qwen3"))
        self.eager = DFlashProposer(drafter, target, static=False)
        self.static = DFlashProposer(drafter, target)
        assert self.eager.fast is None and self.static.fast is not None
        self.static._fast = FastDrafter(drafter, target, cache_slots=8)  # 256 slots: run() outgrows them
        self.length = 0

    def extend(self, n: int) -> None:
        features = taps(n, self.length + n)
        self.eager.add_context(features)
        self.static.add_context(features)
        self.length += n

    def draft(self, slots: int, visible: int | None = None) -> None:
        anchor = ids(1, self.length)[0]
        expected = self.eager.slot_logits(anchor, self.length, slots, visible)
        got = self.static.slot_logits(anchor, self.length, slots, visible)
        assert got.shape == expected.shape == (slots, expected.shape[-1])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    def run(self) -> None:
        """Prefill, chain-like steps (full and short blocks), a long extension that grows the buffers, more steps."""
        self.extend(11)
        self.draft(5)
        for accepted, slots in ((1, 5), (6, 5), (3, 2), (2, 1), (5, 5)):
            self.extend(accepted)
            self.draft(slots)
            self.draft(min(slots, 2), slots)  # a draft capped below the block it sees (--draft-tokens)
        self.extend(250)
        self.draft(5)
        self.extend(4)
        self.draft(3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_path_matches_the_eager_drafter(variant: str) -> None:
    pair = Lockstep(variant)
    pair.run()
    assert pair.static.fast.storage.version > 0  # the 250-row extension outgrew the first 256 slots


def test_reset_empties_the_context_and_keeps_the_buffers() -> None:
    pair = Lockstep("mixed_swa")
    pair.run()
    kv = pair.static.fast.storage.kv
    pair.eager.reset()
    pair.static.reset()
    pair.length = 0
    pair.extend(7)
    pair.draft(5)
    assert pair.static.fast.storage.kv is kv


def test_proposers_over_one_drafter_share_its_packed_weights() -> None:
    pair = Lockstep("all_full")
    again = DFlashProposer(pair.static.drafter, pair.static.target)
    assert again.fast is not None and again.fast.layers is pair.static.fast.layers
    pair.run()  # the first proposer still drafts correctly next to the second


def counting_capture(counter: list[int]) -> Callable[[Callable[[], Any], torch.device], tuple[_EagerGraph, Any]]:
    """Stands in for fast_drafter.capture on CPU: replay re-runs the function into the captured outputs."""

    def capture(run: Callable[[], Any], device: torch.device) -> tuple[_EagerGraph, Any]:
        out = run()  # like the warm-up: writes only past the context

        def replay() -> None:
            new = run()
            if out is not None:
                out.copy_(new)

        counter.append(1)
        return _EagerGraph(replay), out

    return capture


@pytest.mark.parametrize("variant", ["mixed_swa", "all_full"])
def test_graph_path_pads_reuses_and_matches(monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    """Static inputs, padded extension rows, one pass graph per key capacity, re-capture after the buffers grow."""
    captures: list[int] = []
    monkeypatch.setattr(fast_drafter_mod, "capture", counting_capture(captures))
    pair = Lockstep(variant)
    fast = pair.static.fast
    fast.use_graphs = True
    pair.extend(11)  # longer than a block: eager
    pair.draft(5)
    assert len(captures) == 1
    pair.extend(3)  # padded to 4 rows
    pair.draft(2)
    pair.extend(4)  # reuses the 4-row graph
    pair.draft(5)
    assert len(captures) == 2 and sorted(fast._extend_graphs) == [4]
    pair.extend(250)  # grows the buffers: every graph is dropped
    assert not fast._extend_graphs and not fast._draft_graphs
    pair.extend(1)
    pair.draft(5)
    pair.extend(6)  # a whole block, padded to 8
    pair.draft(5)
    assert len(captures) == 5 and sorted(fast._extend_graphs) == [1, 8]


def recorded(proposer: Any, drafts: list[tuple[list[int], list[int]]]) -> Any:
    """The proposer, noting every draft's tokens and parents (trees built on the device included): random drafters
    are rarely accepted, so the drafts themselves are what shows the drafter path agrees inside the loop."""
    propose = proposer.propose

    def wrapped(*args: Any) -> Any:
        draft = propose(*args)
        drafts.append((draft.tokens.tolist(), draft.parents))
        return draft

    proposer.propose = wrapped
    if hasattr(proposer, "propose_on_device"):  # greedy DDTree on the fast engine: the tree read here, for the record
        on_device = proposer.propose_on_device

        def wrapped_on_device(*args: Any) -> Any:
            trees = on_device(*args)
            if trees is not None:
                count = int(trees.shape[0, 0])
                drafts.append((trees.ids[0, 1 : 1 + count].tolist(), trees.shape[0, 1 : 1 + count].tolist()))
            return trees

        proposer.propose_on_device = wrapped_on_device
    return proposer


@pytest.mark.parametrize("method,variant,budget", [
    ("dflash", "all_full", None), ("dflash", "mixed_swa", None), ("dflash", "causal", None),
    ("ddtree", "all_full", 12), ("ddtree", "mixed_swa", 8), ("ddtree", "swa_bidirectional", 12),
])
def test_generate_on_the_fast_engine_matches_hf(monkeypatch: pytest.MonkeyPatch, method: str, variant: str,
                                                budget: int | None) -> None:
    """Target and drafter graphs replayed by the eager stand-ins: every draft, the ids and the acceptance lengths
    equal the hf engine's."""
    monkeypatch.setattr(FastTarget, "_capture", _eager_capture)
    monkeypatch.setattr(fast_drafter_mod, "capture", counting_capture([]))
    model = make_target_model("qwen3")
    drafter = drafter_for(variant)
    fast = FastTarget(model)
    fast.use_graphs, fast.captures = True, []
    runs, drafts = [], []
    for target in (Target(model), fast):
        drafts.append([])
        proposer = recorded(build_proposer(method, target, drafter, budget), drafts[-1])
        chain = proposer if method == "dflash" else proposer.chain
        assert (chain.fast is not None) == (target is fast)
        runs.append([generate(target, ids(n, n), proposer, max_new_tokens=24) for n in (1, 6, 17)])
    assert drafts[1] == drafts[0]
    for hf, static in zip(*runs):
        assert static.token_ids == hf.token_ids
        assert static.acceptance_lengths == hf.acceptance_lengths
