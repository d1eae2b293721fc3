"""The speculation schedule: cost interpolation, the choice per batch size, files, and vLLM's dynamic-SD settings."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from blockdraft.engine.acceptance import AcceptanceProfile
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.cost_table import CostTable
from blockdraft.engine.schedule import Estimate, Schedule, ScheduleEntry, choose, estimate, expected_tokens_per_s, render
from blockdraft.errors import BlockdraftError

RATES = [0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.15]


def costs(verify: dict, draft: dict, tree: dict | None = None) -> CostTable:
    return CostTable("cuda:0", "bfloat16", "tiny-target", "tiny-drafter", 512, verify, draft, tree or {})


def vllm_accepts(ranges: list[list[int]]) -> None:
    """vLLM 0.33's rules (vllm/v1/spec_decode/dynamic/utils.py: validate_and_normalize_dynamic_sd_schedule)."""
    assert isinstance(ranges, list) and ranges
    for entry in ranges:
        assert len(entry) == 3 and all(isinstance(v, int) for v in entry)
        start, end, k = entry
        assert 0 < start <= end and k >= 0
    assert [r[0] for r in ranges] == sorted(r[0] for r in ranges)
    for before, after in pairwise(ranges):
        assert after[0] > before[1], "ranges overlap"
    assert ranges[0][0] == 1


def vllm_lookup(ranges: list[list[int]], max_num_seqs: int, num_speculative_tokens: int) -> list[int]:
    """vLLM's dense batch size -> K table (build_dynamic_sd_schedule_lookup): gaps and the tail carry the last K,
    and every K is clamped to num_speculative_tokens, which must be > 0."""
    assert max_num_seqs > 0 and num_speculative_tokens > 0
    dense = [0] * (max_num_seqs + 1)
    next_batch, last = 1, None
    for start, end, k in sorted(ranges):
        if start > next_batch and last is not None:
            for b in range(next_batch, min(start, max_num_seqs + 1)):
                dense[b] = min(num_speculative_tokens, last)
        for b in range(max(start, next_batch), min(end, max_num_seqs) + 1):
            dense[b] = min(num_speculative_tokens, k)
        next_batch, last = max(next_batch, end + 1), k
        if next_batch > max_num_seqs:
            break
    for b in range(next_batch, max_num_seqs + 1):
        dense[b] = min(num_speculative_tokens, last)
    return dense


def vllm_k(schedule: Schedule, batch: int) -> int:
    """K that vLLM should run at `batch`: the chain chosen, or the best chain where a DDTree was chosen."""
    entry = max((e for e in schedule.entries if e.batch <= batch), key=lambda e: e.batch, default=schedule.entries[0])
    chains = [e for e in entry.estimates if e.candidate.method != "ddtree"]
    best = max(e.tokens_per_s for e in chains)
    return next(e for e in chains if e.tokens_per_s == best).candidate.draft_tokens


def check_vllm(schedule: Schedule, max_num_seqs: int) -> dict:
    out = schedule.vllm_settings(max_num_seqs)
    config = out["speculative_config"]
    assert set(config) == {"num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
    ranges = config["num_speculative_tokens_per_batch_size"]
    vllm_accepts(ranges)
    assert ranges[-1][1] == max_num_seqs
    assert all(b[0] == a[1] + 1 for a, b in pairwise(ranges)), "ranges leave a gap"
    assert config["num_speculative_tokens"] >= max(k for _, _, k in ranges), "vLLM would clamp a K"
    json.dumps(config)  # pasteable
    dense = vllm_lookup(ranges, max_num_seqs, config["num_speculative_tokens"])
    assert dense[1:] == [vllm_k(schedule, b) for b in range(1, max_num_seqs + 1)]
    return out


# --- costs -----------------------------------------------------------------------------------------------------


def test_verify_time_exact_at_measured_points_and_linear_between() -> None:
    table = costs({2: {1: 1.0, 9: 3.0}, 8: {1: 2.0, 5: 3.0, 9: 6.0}}, {2: 0.5, 8: 1.1})
    assert table.verify_time(2, 1) == 1.0
    assert table.verify_time(8, 5) == 3.0
    assert table.verify_time(2, 5) == pytest.approx(2.0)
    assert table.verify_time(8, 7) == pytest.approx(4.5)
    # rows first at both neighbouring batch sizes (2.0 at b=2, 4.5 at b=8), then batch
    assert table.verify_time(5, 7) == pytest.approx(2.5 + (4.5 - 2.5) * 3 / 6)
    along = [table.verify_time(b, 1) for b in range(2, 9)]
    assert along == pytest.approx([1.0 + (b - 2) / 6 for b in range(2, 9)])
    assert table.draft_time(2) == 0.5
    assert table.draft_time(4) == pytest.approx(0.7)


@pytest.mark.parametrize(("batch", "rows", "words"), [
    (16, 1, ["batch sizes 2..8", "batch size 16 is outside", "--batch-sizes"]),
    (1, 1, ["batch size 1 is outside", "--batch-sizes"]),
    (8, 12, ["row counts 1..9 at batch size 8", "row count 12 is outside", "--rows"]),
])
def test_verify_time_outside_the_grid_names_what_to_measure(batch: int, rows: int, words: list[str]) -> None:
    table = costs({2: {1: 1.0, 9: 3.0}, 8: {1: 2.0, 9: 6.0}}, {2: 0.5})
    with pytest.raises(BlockdraftError) as err:
        table.verify_time(batch, rows)
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(BlockdraftError, match=r"drafter batch size 9 is outside.*--batch-sizes"):
        table.draft_time(9)


def test_cost_table_round_trips(tmp_path: Path) -> None:
    table = costs({1: {1: 0.01, 33: 0.0125}, 64: {1: 0.03, 33: 0.31}}, {1: 0.002, 64: 0.011}, {32: 3e-4})
    table.save(tmp_path / "costs.json")
    assert json.loads((tmp_path / "costs.json").read_text())["format"] == "blockdraft-cost-table/1"
    again = CostTable.load(tmp_path / "costs.json")
    assert again == table
    assert again.verify_time(64, 33) == 0.31 and again.tree_build_s == {32: 3e-4}
    assert again.commit_time(64) == 0.0  # not measured: nothing
    table.commit_s = {1: 1e-4, 64: 2.1e-3}
    table.trees_s = {1: {32: 3e-4}, 64: {32: 4e-3}}
    table.save(tmp_path / "costs.json")
    again = CostTable.load(tmp_path / "costs.json")
    assert again == table and again.commit_time(64) == 2.1e-3 and again.commit_time(32) == pytest.approx(1e-4 + 2e-3 * 31 / 63)
    with pytest.raises(BlockdraftError, match="commit batch size 128 is outside"):
        again.commit_time(128)


def test_cost_table_round_trips_each_candidates_commit_cost(tmp_path: Path) -> None:
    table = costs({1: {1: 0.01, 33: 0.0125}, 64: {1: 0.03, 33: 0.31}}, {1: 0.002, 64: 0.011})
    table.commit_by_candidate_s = {"ddtree@32": {1: 1e-3, 64: 0.0}, "dflash/15": {64: 2e-3}, "dflash/3": {1: 4e-4}}
    table.save(tmp_path / "costs.json")
    data = json.loads((tmp_path / "costs.json").read_text())
    assert list(data["commit_by_candidate_s"]) == ["dflash/3", "dflash/15", "ddtree@32"]  # fewest rows first
    assert data["commit_by_candidate_s"]["ddtree@32"] == {"1": 1e-3, "64": 0.0}
    assert CostTable.load(tmp_path / "costs.json") == table
    del data["commit_by_candidate_s"]  # a table from before it was measured
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert CostTable.load(tmp_path / "old.json").commit_by_candidate_s == {}


def test_commit_time_is_the_candidates_own_where_measured() -> None:
    table = costs({1: {1: 0.01, 33: 0.02}, 16: {1: 0.02, 33: 0.05}}, {1: 0.002, 16: 0.004})
    tree, chain = Candidate("ddtree", budget=32), Candidate("dflash", 7)
    assert table.commit_time(4, tree) == 0.0  # neither measured
    table.commit_s = {1: 1e-4, 16: 4e-4}
    table.commit_by_candidate_s = {"ddtree@32": {1: 1e-3, 4: 2e-3, 16: 5e-3}}
    assert table.commit_time(4, tree) == 2e-3 and table.commit_time(16, tree) == 5e-3
    assert table.commit_time(10, tree) == pytest.approx(2e-3 + 3e-3 * 6 / 12)
    assert table.commit_time(16, chain) == 4e-4 == table.commit_time(16, AR) == table.commit_time(16)  # AR's
    with pytest.raises(BlockdraftError, match=r"ddtree@32 commit batch sizes 1\.\.16; .*batch size 32 is outside"):
        table.commit_time(32, tree)
    table.commit_by_candidate_s["ddtree@32"] = {4: 2e-3, 16: 5e-3}
    with pytest.raises(BlockdraftError, match="commit batch size 1 is outside"):
        table.commit_time(1, tree)  # not AR's in place of its own outside its range
    assert table.commit_time(1, chain) == 1e-4


def test_device_time_is_verify_draft_and_trees() -> None:
    table = costs({4: {1: 0.010, 8: 0.012, 33: 0.020}}, {4: 0.003}, {32: 0.001})
    assert table.device_time(4, AR) == 0.010
    assert table.device_time(4, Candidate("dflash", 7)) == pytest.approx(0.015)
    assert table.device_time(4, Candidate("ddtree", budget=32)) == pytest.approx(0.020 + 0.003 + 4 * 0.001)
    with pytest.raises(BlockdraftError, match="row count 65 is outside"):
        table.device_time(4, Candidate("ddtree", budget=64))


def _mutate(data: dict, path: list[str], value: object) -> None:
    for key in path[:-1]:
        data = data[key]
    if value is _DELETE:
        del data[path[-1]]
    else:
        data[path[-1]] = value


_DELETE = object()


@pytest.mark.parametrize(("path", "value", "field"), [
    (["verify_s", "64", "33"], -1, "verify_s['64']['33'] = -1 must be a positive number of seconds"),
    (["verify_s", "64", "33"], "fast", "verify_s['64']['33']"),
    (["verify_s"], {}, "verify_s"),
    (["draft_s", "x"], 0.1, "a key of draft_s = 'x'"),
    (["tree_build_s", "32"], None, "tree_build_s['32']"),
    (["commit_s"], {"1": -0.5}, "commit_s['1'] = -0.5 must be a number of seconds >= 0"),
    (["trees_s"], {"4": {"32": 0}}, "trees_s['4']['32'] = 0 must be a positive number of seconds"),
    (["commit_by_candidate_s"], {"dflash/x": {"1": 0.1}}, "a key of commit_by_candidate_s = 'dflash/x'"),
    (["commit_by_candidate_s"], {"ar": {"1": 0.1}}, "a key of commit_by_candidate_s = 'ar' must be a speculative"),
    (["commit_by_candidate_s"], {"ddtree@32": {"1": -0.5}},
     "commit_by_candidate_s['ddtree@32']['1'] = -0.5 must be a number of seconds >= 0"),
    (["commit_by_candidate_s"], {"ddtree@32": {}}, "commit_by_candidate_s['ddtree@32'] = {} must be a non-empty"),
    (["commit_by_candidate_s"], [], "commit_by_candidate_s = [] must be an object"),
    (["context_tokens"], -5, "context_tokens"),
    (["device"], _DELETE, "device"),
    (["format"], "blockdraft-cost-table/0", "format"),
])
def test_malformed_cost_table_names_the_field(tmp_path: Path, path: list[str], value: object, field: str) -> None:
    file = tmp_path / "x.json"
    costs({1: {1: 0.01, 33: 0.0125}, 64: {1: 0.03, 33: 0.31}}, {1: 0.002}, {32: 3e-4}).save(file)
    data = json.loads(file.read_text())
    _mutate(data, path, value)
    file.write_text(json.dumps(data))
    with pytest.raises(BlockdraftError) as err:
        CostTable.load(file)
    message = str(err.value)
    assert "\n" not in message and field in message and message.startswith(f"cost table {file}")
    assert "blockdraft tune" in message


def test_unreadable_cost_table_files(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="does not exist"):
        CostTable.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BlockdraftError, match="not valid JSON"):
        CostTable.load(tmp_path / "bad.json")


# --- acceptance and candidates ---------------------------------------------------------------------------------


def test_profile_from_vllm_counters() -> None:
    profile = AcceptanceProfile.from_counters(200, [160, 120, 60], "vllm scrape")
    assert profile.per_position == [0.8, 0.6, 0.3]
    assert profile.chain_tau(0) == 1.0 and profile.chain_tau(2) == pytest.approx(2.4)
    with pytest.raises(BlockdraftError, match=r"4-token chain.*per_position has 3"):
        profile.chain_tau(4)


@pytest.mark.parametrize(("build", "field"), [
    (lambda: AcceptanceProfile.from_counters(0, [1, 0], "m"), "drafts"),
    (lambda: AcceptanceProfile.from_counters(10, [12, 3], "m"), "accepted_per_pos[0]"),
    (lambda: AcceptanceProfile([0.5, 1.5], {}, "m"), "per_position[1]"),
    (lambda: AcceptanceProfile([0.5], {8: 0.4}, "m"), "tree_tau[8]"),
    (lambda: AcceptanceProfile([0.5], {4: 6.0}, "m"), "tree_tau[4]"),
    (lambda: AcceptanceProfile([0.5], {0: 2.0}, "m"), "a key of tree_tau"),
])
def test_profile_validation_names_the_field(build, field: str) -> None:
    with pytest.raises(BlockdraftError) as err:
        build()
    assert field in str(err.value) and "\n" not in str(err.value)


def test_candidates() -> None:
    assert (AR.label, AR.rows) == ("ar", 1)
    assert (Candidate("dflash", 7).label, Candidate("dflash", 7).rows) == ("dflash/7", 8)
    assert (Candidate("ddtree", budget=32).label, Candidate("ddtree", budget=32).rows) == ("ddtree@32", 33)
    for bad in (lambda: Candidate("eagle"), lambda: Candidate("dflash", 0), lambda: Candidate("ddtree"),
                lambda: Candidate("ar", 3), lambda: Candidate("dflash", 3, 8)):
        with pytest.raises(BlockdraftError):
            bad()


@pytest.mark.parametrize("candidate", [AR, Candidate("dflash", 1), Candidate("dflash", 15),
                                       Candidate("ddtree", budget=8), Candidate("ddtree", budget=128)])
def test_a_candidate_reads_back_from_its_label(candidate: Candidate) -> None:
    assert Candidate.from_label(candidate.label) == candidate


@pytest.mark.parametrize("label", ["", "AR", "dflash", "dflash/0", "dflash/07", "dflash/3/", "ddtree@", "ddtree@-4",
                                   "ddtree/32", "dflash@3", " ar", "eagle/3", 3, None])
def test_a_bad_label_names_itself_and_the_accepted_forms(label: object) -> None:
    with pytest.raises(BlockdraftError) as err:
        Candidate.from_label(label)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message and f"candidate label {label!r}" in message
    assert all(form in message for form in ("'ar'", "'dflash/N'", "'ddtree@N'"))


def test_expected_tokens_per_s_adds_draft_and_tree_costs() -> None:
    table = costs({4: {1: 0.010, 8: 0.012, 33: 0.020}}, {4: 0.003}, {32: 0.001})
    profile = AcceptanceProfile(RATES, {32: 5.0, 16: 4.0}, "m")
    assert expected_tokens_per_s(table, profile, AR, 4) == pytest.approx(4 / 0.010)
    dflash = 4 * (1 + sum(RATES)) / (0.012 + 0.003)
    assert expected_tokens_per_s(table, profile, Candidate("dflash", 7), 4) == pytest.approx(dflash)
    tree = 4 * 5.0 / (0.020 + 0.003 + 4 * 0.001)
    assert expected_tokens_per_s(table, profile, Candidate("ddtree", budget=32), 4) == pytest.approx(tree)
    # a budget whose build time was not measured costs nothing extra on the host
    rows17 = costs({4: {1: 0.010, 17: 0.015}}, {4: 0.003})
    assert expected_tokens_per_s(rows17, profile, Candidate("ddtree", budget=16), 4) == pytest.approx(16 / 0.018)
    with pytest.raises(BlockdraftError, match="budget 8"):
        expected_tokens_per_s(rows17, profile, Candidate("ddtree", budget=8), 4)
    # the batch's trees built together, where measured, instead of batch x one tree
    table.trees_s = {1: {32: 0.001}, 8: {32: 0.0018}}
    together = 4 * 5.0 / (0.020 + 0.003 + 0.001 + 0.0008 * 3 / 7)
    assert expected_tokens_per_s(table, profile, Candidate("ddtree", budget=32), 4) == pytest.approx(together)
    table.trees_s = {8: {32: 0.0018}}
    with pytest.raises(BlockdraftError, match="tree batch size 4 is outside"):
        expected_tokens_per_s(table, profile, Candidate("ddtree", budget=32), 4)


def test_a_steps_host_work_counts_for_every_method_and_favours_committing_more() -> None:
    """commit_s is added to every candidate's step: AR, which wins on the device alone, loses once each step also
    pays the host work that a chain spreads over more tokens."""
    table = costs({64: {1: 0.002, 8: 0.010}}, {64: 0.002})
    profile = AcceptanceProfile([0.5, 0.5] + [0.0] * 5, {}, "m")  # a 7-token chain commits 2 per step
    chain = Candidate("dflash", 7)
    assert expected_tokens_per_s(table, profile, AR, 64) > expected_tokens_per_s(table, profile, chain, 64)
    table.commit_s = {64: 0.020}
    assert expected_tokens_per_s(table, profile, AR, 64) == pytest.approx(64 / 0.022)
    assert expected_tokens_per_s(table, profile, chain, 64) == pytest.approx(64 * 2 / 0.032)
    assert expected_tokens_per_s(table, profile, chain, 64) > expected_tokens_per_s(table, profile, AR, 64)


# --- choosing ---------------------------------------------------------------------------------------------------


def test_a_trees_own_host_work_can_hand_the_batch_to_the_chain() -> None:
    """DDTree@32 wins on device time with AR's host work counted for it, and loses to the chain once its own, larger
    host work is (what chose DDTree@32 at batch 9-16 of a server where it ran at 0.84x AR)."""
    table = costs({16: {1: 0.010, 8: 0.012, 33: 0.013}}, {16: 0.002})
    table.commit_s = {16: 0.001}
    profile = AcceptanceProfile(RATES, {32: 5.0}, "m")  # the 7-token chain commits 4.0 a step, the tree 5.0
    chain, tree = Candidate("dflash", 7), Candidate("ddtree", budget=32)
    assert choose(table, profile, [chain, tree], [16]).pick(16) == tree
    table.commit_by_candidate_s = {"dflash/7": {16: 0.002}, "ddtree@32": {16: 0.006}}
    assert estimate(table, profile, tree, 16).step_ms == pytest.approx(1000 * (0.013 + 0.002 + 0.006))
    assert estimate(table, profile, chain, 16).step_ms == pytest.approx(1000 * (0.012 + 0.002 + 0.002))
    assert choose(table, profile, [chain, tree], [16]).pick(16) == chain


def test_expensive_drafting_chooses_ar_everywhere() -> None:
    rows = {1: 0.010, 2: 0.010, 8: 0.011, 33: 0.012}
    table = costs({1: rows, 64: {r: 4 * s for r, s in rows.items()}}, {1: 1.0, 64: 1.0})
    profile = AcceptanceProfile(RATES, {32: 6.0}, "m")
    candidates = [Candidate("dflash", 1), Candidate("dflash", 7), Candidate("ddtree", budget=32)]
    schedule = choose(table, profile, candidates, [1, 8, 64])
    assert [e.choice for e in schedule.entries] == [AR, AR, AR]
    assert all(e.gain == 1.0 for e in schedule.entries)
    out = check_vllm(schedule, 256)
    assert out["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 256, 0]]
    assert any("AR wins at every batch size" in n for n in out["notes"])


MEASURED_BATCH, MEASURED_ROWS = [1, 4, 16, 64, 256], [1, 2, 8, 16, 33]
WEIGHTS_S, ROW_S = 0.02, 1e-4  # a forward reads the weights (flat) until batch x rows of compute outgrows that


def roofline() -> CostTable:
    verify = {b: {r: max(WEIGHTS_S, b * r * ROW_S) for r in MEASURED_ROWS} for b in MEASURED_BATCH}
    draft = {1: 0.002, 256: 0.010}
    return costs(verify, draft, {15: 5e-5, 32: 1e-4})


def brute_force(table: CostTable, profile: AcceptanceProfile, candidates: list[Candidate], batch: int) -> str:
    """The fastest label straight from the measured numbers (every candidate's rows are measured)."""
    speeds = {"ar": batch / table.verify_s[batch][1]}
    draft = table.draft_s[1] + (table.draft_s[256] - table.draft_s[1]) * (batch - 1) / 255
    for c in candidates:
        if c.method == "dflash":
            tau, extra = 1 + sum(profile.per_position[: c.draft_tokens]), 0.0
        else:
            tau, extra = profile.tree_tau[c.budget], batch * table.tree_build_s[c.budget]
        speeds[c.label] = batch * tau / (table.verify_s[batch][c.rows] + draft + extra)
    return max(speeds, key=speeds.get)


def test_roofline_costs_speculate_at_small_batch_and_not_at_large() -> None:
    table = roofline()
    profile = AcceptanceProfile(RATES, {15: 4.4, 32: 5.2}, "m")
    candidates = [Candidate("dflash", 1), Candidate("dflash", 7), Candidate("ddtree", budget=15),
                  Candidate("ddtree", budget=32)]
    schedule = choose(table, profile, candidates, MEASURED_BATCH)
    labels = [e.choice.label for e in schedule.entries]
    assert labels == [brute_force(table, profile, candidates, b) for b in MEASURED_BATCH]
    assert schedule.entries[0].choice.method in ("dflash", "ddtree") and schedule.entries[0].gain > 2
    assert schedule.entries[-1].choice == AR
    out = check_vllm(schedule, 512)
    assert out["speculative_config"]["num_speculative_tokens_per_batch_size"][-1][1:] == [512, 0]
    if labels[0].startswith("ddtree"):
        assert any("no DDTree" in n for n in out["notes"])
    assert any("257..512 were not measured" in n for n in out["notes"])
    console = Console(record=True, width=160)
    console.print(render(schedule))
    text = console.export_text()
    assert render(schedule).row_count == len(MEASURED_BATCH)
    assert labels[0] in text and "runner-up" in text


def test_ties_go_to_the_cheaper_candidate() -> None:
    # dflash/1 doubles the step time and doubles tau: an exact tie with AR, so AR wins
    table = costs({2: {1: 0.25, 2: 0.25}}, {2: 0.25})
    schedule = choose(table, AcceptanceProfile([1.0], {}, "m"), [Candidate("dflash", 1)], [2])
    assert schedule.entries[0].choice == AR
    assert schedule.entries[0].runner_up.candidate == Candidate("dflash", 1)


@st.composite
def scenarios(draw):
    sizes = sorted(draw(st.sets(st.integers(1, 300), min_size=1, max_size=5)))
    positions = draw(st.integers(1, 8))
    rates = sorted(draw(st.lists(st.floats(0, 1), min_size=positions, max_size=positions)), reverse=True)
    budgets = sorted(draw(st.sets(st.integers(1, 40), max_size=3)))
    top = max([positions, *budgets]) + 1
    rows = sorted(set(draw(st.lists(st.integers(1, top), max_size=4))) | {1, top})
    seconds = st.floats(1e-4, 1.0)
    table = costs({b: {r: draw(seconds) for r in rows} for b in sizes}, {b: draw(seconds) for b in sizes},
                  {b: draw(st.floats(1e-6, 1e-2)) for b in budgets if draw(st.booleans())})
    profile = AcceptanceProfile(rates, {b: draw(st.floats(1.0, b + 1.0)) for b in budgets}, "random")
    candidates = [Candidate("dflash", n) for n in range(1, positions + 1)]
    candidates += [Candidate("ddtree", budget=b) for b in budgets]
    batches = draw(st.lists(st.integers(sizes[0], sizes[-1]), min_size=1, max_size=4))
    return table, profile, candidates, batches


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.integers(1, 400))
def test_choice_is_never_slower_than_any_candidate(scenario, max_num_seqs: int) -> None:
    table, profile, candidates, batches = scenario
    schedule = choose(table, profile, candidates, batches)
    assert [e.batch for e in schedule.entries] == sorted(set(batches))
    for entry in schedule.entries:
        chosen = expected_tokens_per_s(table, profile, entry.choice, entry.batch)
        assert chosen == entry.best.tokens_per_s
        for c in [AR, *candidates]:
            assert chosen >= expected_tokens_per_s(table, profile, c, entry.batch)
        assert entry.gain >= 1.0
    check_vllm(schedule, max_num_seqs)


# --- the schedule file and runtime lookups -----------------------------------------------------------------------


def entry(batch: int, winner: Candidate) -> ScheduleEntry:
    """AR at 100 tokens/s per sequence, and `winner` twice as fast."""
    estimates = [Estimate(AR, batch, 1.0, 10.0)]
    if winner != AR:
        estimates.append(Estimate(winner, batch, 2.0, 10.0))
    return ScheduleEntry(batch, tuple(estimates))


def small_schedule() -> Schedule:
    entries = [entry(32, AR), entry(2, Candidate("ddtree", budget=32)), entry(8, Candidate("dflash", 7))]
    return Schedule(entries, "tiny-target", None, "cuda:0", "bfloat16", 512, "m")


@pytest.mark.parametrize(("batch", "label"), [
    (1, "ddtree@32"), (2, "ddtree@32"), (7, "ddtree@32"), (8, "dflash/7"), (31, "dflash/7"), (32, "ar"), (999, "ar"),
])
def test_pick_uses_the_largest_scheduled_batch_size_at_or_below(batch: int, label: str) -> None:
    assert small_schedule().pick(batch).label == label


def test_pick_rejects_an_empty_batch() -> None:
    with pytest.raises(BlockdraftError, match="batch size 0"):
        small_schedule().pick(0)


def test_vllm_settings_for_a_mixed_schedule() -> None:
    out = check_vllm(small_schedule(), 64)
    # the DDTree at 2..7 becomes AR (no chain was offered there), dflash/7 at 8..31, AR from 32 on
    assert out["speculative_config"] == {"num_speculative_tokens": 7,
                                         "num_speculative_tokens_per_batch_size": [[1, 7, 0], [8, 31, 7], [32, 64, 0]]}
    assert any("1..7" in n and "ddtree@32" in n and "no DDTree" in n for n in out["notes"])
    # a max_num_seqs below some scheduled sizes drops them; below every one keeps the first
    assert check_vllm(small_schedule(), 4)["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 0]]
    assert check_vllm(small_schedule(), 1)["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 0]]


def test_schedule_round_trips(tmp_path: Path) -> None:
    profile = AcceptanceProfile(RATES, {15: 4.4, 32: 5.2}, "m")
    candidates = [Candidate("dflash", 7), Candidate("ddtree", budget=32)]
    schedule = choose(roofline(), profile, candidates, [1, 3, 64, 256])
    schedule.save(tmp_path / "schedule.json")
    data = json.loads((tmp_path / "schedule.json").read_text())
    assert data["format"] == "blockdraft-schedule/1"
    first = data["entries"][0]
    assert {"choice", "ar_tokens_per_s", "gain"} <= set(first)
    assert {"label", "tau", "step_ms", "tokens_per_s"} <= set(first["candidates"][0])
    assert Schedule.load(tmp_path / "schedule.json") == schedule
    assert small_schedule() == Schedule.from_json(small_schedule().to_json())


@pytest.mark.parametrize(("path", "value", "field"), [
    (["format"], "nope", "format"),
    (["entries"], [], "entries"),
    (["entries", 0, "choice"], "ar", "entries[0].choice"),
    (["entries", 0, "candidates", 1, "step_ms"], -3.0, "entries[0].candidates[1].step_ms"),
    (["entries", 0, "candidates", 1, "method"], "eagle", "entries[0].candidates[1].method"),
    (["entries", 0, "candidates", 1, "budget"], None, "entries[0].candidates[1]"),
    (["entries", 0, "candidates", 0], _DELETE, "AR"),
    (["entries", 1, "batch"], 2, "batch sizes"),
    (["target"], 3, "target"),
])
def test_malformed_schedule_names_the_field(tmp_path: Path, path: list, value: object, field: str) -> None:
    file = tmp_path / "s.json"
    small_schedule().save(file)
    data = json.loads(file.read_text())
    _mutate(data, path, value)
    file.write_text(json.dumps(data))
    with pytest.raises(BlockdraftError) as err:
        Schedule.load(file)
    message = str(err.value)
    assert "\n" not in message and field in message and message.startswith(f"schedule {file}"), message
