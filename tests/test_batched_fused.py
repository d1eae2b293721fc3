"""A lone greedy sequence in the batch decoder runs `generate()`'s fused steps (decoding/fused_steps.py: two graph
replays and one read a step on a GPU, the same functions eagerly on a CPU). Its ids, acceptance and draft lengths
stay its batch-1 ids across every way a lone stretch starts and ends: alone from its prefill, alone again when the
others leave, a join while a fused step flies, a hook that ends it, the last steps (step by step), a schedule's
method switches; a sampled lone sequence keeps the step-by-step path."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target_model

from blockdraft.decoding.fused_steps import AHEAD, FusedSteps
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.schedule import FixedPicks
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.fast.target import FastTarget

from test_batched_decode import prompts


class Reads(list):
    """Every fused step read, by the steps that ran it, and the steps in flight at each read (`in_flight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[int] = []


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Every fused step read, by the steps that ran it."""
    seen = Reads()
    read = FusedSteps.read

    def counted(self: FusedSteps, cache: object) -> tuple[int, list[int]]:
        seen.append(self)
        seen.in_flight.append(self.pending)
        return read(self, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedSteps, "read", counted)
    return seen


def _reference(model: torch.nn.Module, drafter: object, method: str, budget: int | None, prompt: list[int], n: int,
               lookup: int = 0, **kwargs: object) -> object:
    """`generate()` step by step (fused steps off) on its own target."""
    target = FastTarget(model, fused=False)
    proposer = None if method == "ar" else build_proposer(method, target, drafter, budget,  # type: ignore[arg-type]
                                                          lookup=lookup)
    return generate(target, prompt, proposer, n, **kwargs)  # type: ignore[arg-type]


def _same(seq: object, single: object, label: str) -> None:
    assert seq.tokens == single.token_ids, label  # type: ignore[attr-defined]
    assert seq.acceptance_lengths == single.acceptance_lengths, label  # type: ignore[attr-defined]
    assert seq.draft_lengths == single.draft_lengths, label  # type: ignore[attr-defined]


@pytest.mark.parametrize("pair,method,budget,lookup", [
    ("full", "ar", None, 0), ("full", "dflash", None, 0), ("full", "ddtree", 6, 0), ("swa", "ddtree", 40, 0),
    ("swa", "dflash", None, 0), ("full", "ddtree", 12, 6)])
def test_lone_stretches_run_fused_and_decode_their_batch_1_ids(trained_pairs: dict, pair: str, method: str,
                                                               budget: int | None, lookup: int, reads: Reads) -> None:
    """A alone from its prefill (fused); B joins while A's fused step flies (both batched); B leaves (A fused
    again, from a fresh layout); C joins while A's fused step flies and is done at its first token (A goes on
    fused); D joins (batched); D leaves; A's last steps go step by step. Every sequence gives `generate()`'s ids
    and lengths; with a lookup chain, each fused stretch starts its token history from the sequence's context."""
    from blockdraft.models.loading import load_drafter, load_target
    from trained_pair import prompts as trained_prompts

    target_dir, drafter_dir = trained_pairs[pair]
    loaded, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    model = loaded.model
    drafter = load_drafter(drafter_dir, loaded)
    target = FastTarget(model, fused=True)
    decoder = BatchDecoder(target, lambda: None if method == "ar" else build_proposer(method, target, drafter, budget,
                                                                                      lookup=lookup), max_seqs=4)
    items = [(p.ids * 3)[:40] if lookup else p.ids for p in trained_prompts(seed=5, count=4)]
    limits = [160, 14, 1, 20]
    a = decoder.join(items[0], limits[0])
    for _ in range(3):
        decoder.step()
    assert len(reads) == 3 and decoder.flight is not None and decoder.flight.fused is not None
    b = decoder.join(items[1], limits[1])  # while A's fused step flies: read before B's prefill
    while not b.done:
        decoder.step()
    lone_again = len(reads)
    for _ in range(2):
        decoder.step()
    assert len(reads) > lone_again  # A alone again: fused again
    c = decoder.join(items[2], limits[2])  # while A's fused step flies; done at its first token, it takes no slot
    assert c.done and len(decoder.running) == 1
    lone_again = len(reads)  # the step in flight was read at the join
    decoder.step()
    decoder.step()
    assert len(reads) == lone_again + 1  # A goes on fused, from the rows its last fused step laid out
    d = decoder.join(items[3], limits[3])
    while decoder.running:
        decoder.step()
    for seq, prompt, n, label in zip((a, b, c, d), items, limits, "abcd"):
        _same(seq, _reference(model, drafter, method, budget, prompt, n, lookup), label)
    assert max(reads.in_flight) == AHEAD  # a lone stretch launched its next step before reading this one
    if method != "ar":
        assert max(a.acceptance_lengths) > 2  # whole paths were committed, not only the anchor's bonus
        assert all(steps.drafter is decoder.drafting.lone_drafter() for steps in reads)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 6)])
def test_a_lone_sequence_that_stops_drops_the_step_launched_after_it(trained_pairs: dict, method: str,
                                                                     budget: int | None, reads: Reads) -> None:
    """A stop token read while A's next fused step flies: A finishes, that step is read and dropped, and B, alone
    after it, decodes its batch-1 ids."""
    from blockdraft.models.loading import load_drafter, load_target
    from trained_pair import prompts as trained_prompts

    target_dir, drafter_dir = trained_pairs["full"]
    loaded, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    model, drafter = loaded.model, load_drafter(drafter_dir, loaded)
    target = FastTarget(model, fused=True)
    decoder = BatchDecoder(target, lambda: build_proposer(method, target, drafter, budget), max_seqs=2)
    first, second = (p.ids for p in trained_prompts(seed=11, count=2))
    whole = _reference(model, drafter, method, budget, first, 80).token_ids
    stop = whole[12]
    a = decoder.join(first, 80, stop_token_ids=(stop,))
    while not a.done:
        decoder.step()
    assert a.tokens == whole[: whole.index(stop) + 1] and decoder.flight is None
    assert max(reads.in_flight) == AHEAD and reads[-1].pending == 0  # the step after A's stop was read, dropped
    b = decoder.join(second, 80)
    while decoder.running:
        decoder.step()
    _same(b, _reference(model, drafter, method, budget, second, 80), "b")


def test_a_hook_that_ends_a_lone_sequence_drops_its_fused_step_in_flight(reads: Reads) -> None:
    model, drafter = make_target_model("qwen3"), make_drafter("all_full")
    target = FastTarget(model, fused=True)
    decoder = BatchDecoder(target, lambda: build_proposer("ddtree", target, drafter, 8), 2)
    chunks: list[list[int]] = []

    def stop_after_three(tokens: list[int]) -> bool:
        chunks.append(tokens)
        return len(chunks) == 4  # the first token, then three steps' commits

    seq = decoder.join(prompts(1)[0], 40, on_commit=stop_after_three)
    finished = []
    while decoder.running:
        finished.extend(decoder.step())
    assert seq in finished and seq.ended_early and len(reads) == 4  # the fourth step flew when the hook ended it
    assert seq.tokens == [token for chunk in chunks for token in chunk]
    assert len(seq.acceptance_lengths) == len(seq.draft_lengths) == 3
    alone = _reference(model, drafter, "ddtree", 8, prompts(1)[0], 40)
    assert seq.tokens == alone.token_ids[: len(seq.tokens)]  # type: ignore[attr-defined]
    after = decoder.join(prompts(2)[1], 12)  # the next lone sequence lays its own rows out
    while decoder.running:
        decoder.step()
    _same(after, _reference(model, drafter, "ddtree", 8, prompts(2)[1], 12), "after")


@pytest.mark.parametrize("lookup", [0, 3])
def test_a_schedule_switching_methods_alone_runs_each_fused_and_stays_lossless(reads: Reads, lookup: int) -> None:
    """A lone sequence whose schedule switches every step among a chain, two trees and AR (an AR step defers its
    taps, so it keeps the step-by-step path) decodes what the same schedule decodes with fused steps off; with a
    lookup chain in the trees (each tree's fused steps start their token history afresh after another method's)."""
    model, drafter = make_target_model("qwen3"), make_drafter("all_full")
    plan = [Candidate("dflash", draft_tokens=3), Candidate("ddtree", budget=8), AR, Candidate("ddtree", budget=5)]

    class Rotating(FixedPicks):
        def __init__(self) -> None:
            self.steps = 0

        def pick(self, batch: int) -> Candidate:
            self.steps += 1
            return plan[self.steps % len(plan)]

    def run(fused: bool) -> object:
        target = FastTarget(model, fused=fused)
        decoder = BatchDecoder(target, lambda: SwitchingProposer(drafter, target, 8, lookup), 2,
                               schedule=Rotating())  # type: ignore[arg-type]
        seq = decoder.join(prompts(3)[2], 40)
        while decoder.running:
            decoder.step()
        return seq

    plain = run(False)
    assert not reads
    fused = run(True)
    assert {(steps.slots, steps.budget) for steps in reads} == {(3, None), (5, 8), (5, 5)}  # AR's steps: not fused
    assert {steps.lookup for steps in reads} == ({0, 3, 2} if lookup else {0})  # chain_room of each tree
    assert fused.tokens == plain.tokens and fused.acceptance_lengths == plain.acceptance_lengths  # type: ignore
    assert fused.draft_lengths == plain.draft_lengths  # type: ignore[attr-defined]
    assert 0 in plain.draft_lengths  # type: ignore[attr-defined]
    assert plain.tokens == generate(FastTarget(model), prompts(3)[2], None, 40).token_ids  # type: ignore


def test_a_sampled_lone_sequence_keeps_the_step_by_step_path(reads: Reads) -> None:
    model, drafter = make_target_model("qwen3"), make_drafter("all_full")
    target = FastTarget(model, fused=True)
    decoder = BatchDecoder(target, lambda: build_proposer("dflash", target, drafter), 2)
    sampled = SamplingParams(temperature=1.0)
    seq = decoder.join(prompts(1)[0], 20, sampling=sampled, seed=3)
    while decoder.running:
        decoder.step()
    assert not reads
    _same(seq, _reference(model, drafter, "dflash", None, prompts(1)[0], 20, sampling=sampled, seed=3), "sampled")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 12)])
def test_on_a_gpu_lone_requests_replay_fused_graphs_and_decode_their_batch_1_ids(method: str, budget: int | None,
                                                                                reads: Reads) -> None:
    """Graphs, not eager calls: a lone request, then a second that joins while the first's fused step flies."""
    model = make_target_model("qwen3").cuda()
    drafter = make_drafter("all_full").cuda()
    items = [[(3 * i + 1) % 60 + 1 for i in range(n)] for n in (5, 200)]
    cold = FastTarget(model, fused=False)
    expected = [generate(cold, p, build_proposer(method, cold, drafter, budget), 120).token_ids for p in items]
    target = FastTarget(model)
    decoder = BatchDecoder(target, lambda: build_proposer(method, target, drafter, budget), 2)
    first = decoder.join(items[0], 120)
    for _ in range(3):
        decoder.step()
    assert decoder.flight is not None and decoder.flight.fused is not None
    second = decoder.join(items[1], 120)
    while decoder.running:
        decoder.step()
    assert [first.tokens, second.tokens] == expected
    assert reads and target.use_graphs
