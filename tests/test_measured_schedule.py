"""The measured schedule: phases that time every candidate on the server's own steps, the choice they make, and a
decoder that keeps every sequence's batch-1 ids while the method changes under it."""

from __future__ import annotations

from collections import Counter

import pytest

from blockdraft.decoding.generate import generate
from blockdraft.engine import measured
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.measured import MeasuredSchedule, bucket_label, bucket_of
from blockdraft.engine.acceptance import AcceptanceProfile
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.cost_table import CostTable
from blockdraft.engine.schedule import choose, Schedule
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.fast.target import FastTarget

from conftest import make_drafter, make_target_model

CHAIN, TREE = Candidate("dflash", 3), Candidate("ddtree", budget=4)


def table(choice_at_1: str = "ddtree@4") -> Schedule:
    """A table choosing the tree alone and AR at batch 2 and up (extra rows cost 9x in a batch)."""
    flat, steep = {1: 1.0, 4: 1.0, 5: 1.0}, {1: 1.0, 4: 9.0, 5: 9.0}
    costs = CostTable(device="cpu", dtype="float32", target="t", drafter="d", context_tokens=64,
                      verify_s={1: flat, 2: steep, 4: steep}, draft_s={1: 0.1, 2: 0.1, 4: 0.1})
    schedule = choose(costs, AcceptanceProfile([0.9, 0.8, 0.7, 0.6, 0.5], {4: 3.5}), [AR, CHAIN, TREE], [1, 2, 4])
    assert schedule.pick(1).label == choice_at_1 and schedule.pick(2) == AR
    return schedule


def serve(schedule: MeasuredSchedule, batch: int, steps: int, rate: dict[Candidate, float],
          slow: dict[int, float] | None = None) -> list[Candidate]:
    """Run `steps` steps of `batch` sequences; each step commits 10 tokens in 10 / rate seconds (step i takes
    `slow[i]` times that when given)."""
    picked = []
    for i in range(steps):
        candidate = schedule.pick(batch)
        picked.append(candidate)
        schedule.observe(batch, candidate, 10 / rate[candidate] * (slow or {}).get(i, 1.0), 10)
    return picked


def phase_steps(candidates: int) -> int:
    return measured.PHASE_ROUNDS * candidates * measured.RUN_STEPS


@pytest.fixture(autouse=True)
def phase_at_once(monkeypatch) -> None:
    """Buckets start measuring at their first step (the delay has its own test)."""
    monkeypatch.setattr(measured, "FIRST_PHASE_AT", 0)


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert [bucket_label(b) for b in (1, 2, 4, 64)] == ["batch 1", "batch 2", "batch 3-4", "batch 33-64"]


def test_a_phase_times_every_candidate_and_keeps_the_fastest() -> None:
    said: list[str] = []
    schedule = MeasuredSchedule(table(), said.append)
    rates = {AR: 100.0, CHAIN: 150.0, TREE: 80.0}
    run, rounds = measured.RUN_STEPS, measured.ELIMINATE_AFTER
    picked = serve(schedule, 1, rounds * 3 * run, rates)
    # the table's choice first, then the others in its order, in runs of RUN_STEPS, round after round
    assert picked[:3 * run] == [TREE] * run + [CHAIN] * run + [AR] * run
    assert all(picked.count(c) == rounds * run for c in (AR, CHAIN, TREE))
    # steps that never vary leave no doubt: the slower two leave the phase, which ends
    assert not schedule.buckets[1].plan
    assert serve(schedule, 1, 50, rates) == [CHAIN] * 50
    assert said == ["schedule measured at batch 1: dflash/3 (was ddtree@4); tokens/s of the server's own steps: "
                    "dflash/3 150, ar 100, ddtree@4 80"]
    # other buckets are measured on their own (starting from batch 1's choice)
    assert serve(schedule, 3, 1, rates) == [CHAIN] and schedule.buckets[4].plan


def test_only_a_clearly_slower_candidate_leaves_the_phase() -> None:
    """Steps whose committed tokens vary: a candidate 5% slower stays for every round, one 40% slower leaves."""
    schedule = MeasuredSchedule(table(), None)
    rates = {AR: 60.0, CHAIN: 100.0, TREE: 95.0}
    run, picked = measured.RUN_STEPS, []
    for i in range((2 * measured.PHASE_ROUNDS + measured.ELIMINATE_AFTER) * run):
        candidate = schedule.pick(1)
        picked.append(candidate)
        tokens = 4 + 3 * (i % 3)  # 4, 7, 10 tokens, in turn
        schedule.observe(1, candidate, tokens / rates[candidate] * (1.2 if i % 2 else 0.8), tokens)
    assert picked.count(AR) == measured.ELIMINATE_AFTER * run
    assert picked.count(CHAIN) == picked.count(TREE) == measured.PHASE_ROUNDS * run
    assert not schedule.buckets[1].plan
    assert schedule.pick(1) == CHAIN


def test_a_new_bucket_starts_from_the_nearest_measured_choice_and_measures_later(monkeypatch) -> None:
    monkeypatch.setattr(measured, "FIRST_PHASE_AT", 32)
    schedule = MeasuredSchedule(table(), None)
    rates = {AR: 100.0, CHAIN: 150.0, TREE: 80.0}
    assert serve(schedule, 1, 32, rates) == [TREE] * 32  # nothing measured yet: the table's choice
    serve(schedule, 1, phase_steps(3), rates)
    assert schedule.buckets[1].choice == CHAIN
    # batch 3-4: the table says AR, batch 1 (the nearest measured) says the chain, until its own phase; the tree,
    # predicted at 0.39x AR there, is not measured (PRIOR_FLOOR)
    picked = serve(schedule, 4, 32 + phase_steps(2), rates)
    assert picked[:32] == [CHAIN] * 32 and {*picked[32:]} == {AR, CHAIN}
    assert schedule.buckets[4].choice == CHAIN


def test_a_close_call_keeps_the_current_choice_and_says_it_once() -> None:
    said: list[str] = []
    schedule = MeasuredSchedule(table(), said.append)
    rates = {AR: 100.0, CHAIN: 101.0, TREE: 99.5}
    serve(schedule, 1, phase_steps(3), rates)
    assert serve(schedule, 1, 10, rates) == [TREE] * 10
    assert said == ["schedule measured at batch 1: ddtree@4; tokens/s of the server's own steps: dflash/3 101, "
                    "ar 100, ddtree@4 100"]
    serve(schedule, 1, 2 * measured.PHASE_EVERY, rates)
    assert len(said) == 1  # later phases that change nothing say nothing


def test_phases_come_at_doubling_gaps_and_remember_the_earlier_ones() -> None:
    """Phases start at a bucket's steps 0, FIRST_GAP, 3 x FIRST_GAP, ... (each gap doubling, up to PHASE_EVERY);
    each folds into running totals, so one phase against a long record does not flip the choice, but a lasting
    change in the workload does."""
    schedule = MeasuredSchedule(table(), None)
    fast_chain = {AR: 100.0, CHAIN: 150.0, TREE: 80.0}
    starts = []
    for i in range(4 * measured.PHASE_EVERY):
        between_phases = not schedule.buckets.get(1, None) or not schedule.buckets[1].plan
        candidate = schedule.pick(1)
        if between_phases and schedule.buckets[1].plan:
            starts.append(i)
        schedule.observe(1, candidate, 10 / fast_chain[candidate], 10)
    gaps = [measured.FIRST_GAP * 2**k for k in range(10)]
    expected = [0]
    for gap in gaps:
        expected.append(expected[-1] + min(gap, measured.PHASE_EVERY))
    assert starts == [s for s in expected if s < 4 * measured.PHASE_EVERY]
    slow_chain = {AR: 100.0, CHAIN: 50.0, TREE: 80.0}
    serve(schedule, 1, phase_steps(3), slow_chain)
    assert schedule.pick(1) == CHAIN  # one phase of a slow chain against four of a fast one
    serve(schedule, 1, 12 * measured.PHASE_EVERY, slow_chain)
    assert schedule.pick(1) == AR


def test_a_candidate_measured_clearly_slower_runs_once_a_phase_until_it_catches_up() -> None:
    """After a first phase measuring AR at 0.67x and the tree at 0.53x the chain (under OUTGROWN), a phase gives
    each one run; one whose rate comes back within OUTGROWN is measured in full again."""
    schedule = MeasuredSchedule(table(), None)
    rates = {AR: 100.0, CHAIN: 150.0, TREE: 80.0}
    serve(schedule, 1, measured.FIRST_GAP, rates)
    assert schedule.buckets[1].choice == CHAIN
    run = measured.RUN_STEPS
    catching_up = {AR: 400.0, CHAIN: 150.0, TREE: 80.0}
    picked = serve(schedule, 1, 3 * run, catching_up)
    assert picked[:run] == [CHAIN] * run and Counter(picked) == {CHAIN: run, AR: run, TREE: run}
    assert schedule.buckets[1].plan == []  # only the choice left to run in full: the phase ends there
    serve(schedule, 1, 2 * measured.FIRST_GAP - 3 * run + 1, catching_up)
    assert schedule.buckets[1].brief == {TREE}
    assert schedule.buckets[1].plan.count(AR) >= (measured.ELIMINATE_AFTER - 1) * run


def test_the_first_step_of_a_run_and_a_stalled_step_are_not_counted() -> None:
    schedule = MeasuredSchedule(table(), None)
    run = measured.RUN_STEPS
    # every run's first step is 3x slower (the previous run's queued work) and one chain step stalls on a capture
    first_steps = {i: 3.0 for i in range(0, phase_steps(3), run)}
    stalled = {**first_steps, 2 * run + 3: 20.0}
    serve(schedule, 1, phase_steps(3), {AR: 100.0, CHAIN: 150.0, TREE: 80.0}, stalled)
    assert schedule.buckets[1].measured == pytest.approx({AR: 100.0, CHAIN: 150.0, TREE: 80.0})


def test_counting_says_which_picked_steps_the_phase_counts() -> None:
    """What the decoder asks before a join runs while a step flies: only a counted step needs its own time."""
    schedule = MeasuredSchedule(table(), None)
    counted = []
    for _ in range(2 * measured.RUN_STEPS):
        candidate = schedule.pick(1)
        counted.append(schedule.counting(1))
        schedule.observe(1, candidate, 0.01, 1)
    assert counted == ([False] + [True] * (measured.RUN_STEPS - 1)) * 2
    assert not schedule.counting(64)  # nothing picked there


def test_a_step_that_never_reports_leaves_the_phase_consistent() -> None:
    schedule = MeasuredSchedule(table(), None)
    schedule.pick(1)  # the step failed: no observe
    serve(schedule, 1, phase_steps(3), {AR: 100.0, CHAIN: 150.0, TREE: 80.0})
    assert schedule.pick(1) == CHAIN


def test_a_measured_schedule_keeps_every_sequence_lossless(monkeypatch) -> None:
    monkeypatch.setattr(measured, "RUN_STEPS", 2)
    monkeypatch.setattr(measured, "PHASE_ROUNDS", 2)
    monkeypatch.setattr(measured, "PHASE_EVERY", 16)
    monkeypatch.setattr(measured, "FIRST_GAP", 16)
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    said: list[str] = []
    schedule = MeasuredSchedule(table(), said.append)
    decoder = BatchDecoder(target, lambda: SwitchingProposer(drafter, target, 4), 4, schedule)
    prompt_sets = [[(5 * i + j) % 90 + 2 for j in range(3 + i)] for i in range(3)]
    seqs = [decoder.join(ids, 48) for ids in prompt_sets[:1]]
    for _ in range(20):
        decoder.step()
    seqs += [decoder.join(ids, 30) for ids in prompt_sets[1:]]
    while decoder.running:
        decoder.step()
    assert {key for key in schedule.buckets} >= {1, 4}
    assert any(line.startswith("schedule measured at batch 1: ") for line in said)
    assert {n > 0 for n in seqs[0].draft_lengths} == {True, False}  # it drafted in some steps and not in others
    for seq, ids in zip(seqs, prompt_sets):
        assert seq.tokens == generate(target, ids, None, seq.max_new_tokens).token_ids


def test_a_candidate_predicted_far_slower_is_not_measured_but_ar_always_is() -> None:
    """At batch 2 the table predicts both speculative candidates at 0.37-0.39x AR: only AR runs there. At batch 1 it
    predicts AR at 0.31x the tree, and AR is measured anyway (and chosen, being the fastest on the steps)."""
    schedule = MeasuredSchedule(table(), None)
    assert {*serve(schedule, 2, phase_steps(3), {AR: 100.0, CHAIN: 150.0, TREE: 80.0})} == {AR}
    picked = serve(schedule, 1, phase_steps(3), {AR: 200.0, CHAIN: 150.0, TREE: 80.0})
    assert AR in picked and schedule.buckets[1].choice == AR


def flat_table() -> Schedule:
    """A table predicting every candidate alike at every batch size: PRIOR_FLOOR leaves nothing out."""
    flat = {1: 1.0, 4: 1.0, 5: 1.0}
    costs = CostTable(device="cpu", dtype="float32", target="t", drafter="d", context_tokens=64,
                      verify_s={1: flat, 2: flat, 4: flat}, draft_s={1: 0.1, 2: 0.1, 4: 0.1})
    return choose(costs, AcceptanceProfile([0.9, 0.8, 0.7, 0.6, 0.5], {4: 3.5}), [AR, CHAIN, TREE], [1, 2, 4])


def test_a_candidate_outgrown_at_a_smaller_batch_is_not_measured_at_larger_ones() -> None:
    """Measured at batch 1 at 0.6x the chain, the tree (more verify rows per sequence) is left out of batch 3-4's
    phases, which start from the chain; AR (fewer rows than the chain, at 0.33x) is measured there anyway, one run
    in the first phase (clearly slower at the nearest measured bucket)."""
    schedule = MeasuredSchedule(flat_table(), None)
    serve(schedule, 1, phase_steps(3), {AR: 50.0, CHAIN: 150.0, TREE: 90.0})
    assert schedule.buckets[1].choice == CHAIN
    picked = serve(schedule, 4, phase_steps(3), {AR: 100.0, CHAIN: 150.0, TREE: 200.0})
    assert TREE not in picked and picked.count(AR) == measured.RUN_STEPS and CHAIN in picked


def test_a_candidate_close_to_the_best_at_a_smaller_batch_is_still_measured() -> None:
    schedule = MeasuredSchedule(flat_table(), None)
    serve(schedule, 1, phase_steps(3), {AR: 50.0, CHAIN: 150.0, TREE: 130.0})
    picked = serve(schedule, 4, phase_steps(3), {AR: 100.0, CHAIN: 150.0, TREE: 200.0})
    assert TREE in picked and schedule.buckets[4].choice == TREE


def test_a_bucket_already_measured_drops_what_a_smaller_one_outgrew_at_its_next_phase() -> None:
    """Batch 3-4 measured first (all three); then batch 1 finds the tree at 0.5x the chain: batch 3-4's next phase
    leaves the tree out."""
    schedule = MeasuredSchedule(flat_table(), None)
    rates = {AR: 100.0, CHAIN: 150.0, TREE: 140.0}
    assert TREE in serve(schedule, 4, phase_steps(3), rates)
    serve(schedule, 1, phase_steps(3), {AR: 50.0, CHAIN: 150.0, TREE: 75.0})
    bucket = schedule.buckets[4]
    later = serve(schedule, 4, bucket.next_phase - bucket.steps + phase_steps(3), rates)
    assert TREE not in later and AR in later
