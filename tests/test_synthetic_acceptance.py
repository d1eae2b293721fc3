"""Dialled acceptance (`synthetic_acceptance`): the profile parses as stated, the dialled picks accept at the stated
rates for chains and trees whatever the target picked, and every decode path (step by step, fused steps, device
trees, the batch decoder) commits the dialled lengths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target_model

from blockdraft.decoding.ddtree import build_tree
from blockdraft.decoding.draft import Draft
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.decoding.verify import draft_picks, walk
from blockdraft.engine.decode_batch import generate_batch
from blockdraft.errors import BlockdraftError
from blockdraft.fast.target import FastTarget
from blockdraft.synthetic_acceptance import SyntheticAcceptance, conditional, rates_for_mean

from test_batched_decode import prompts


def test_a_mean_length_solves_for_one_rate_and_a_decay_for_falling_ones() -> None:
    flat = SyntheticAcceptance.parse("6.35", 15)
    assert flat.mean_length() == pytest.approx(6.35)
    assert len(set(flat.rates)) == 1
    falling = SyntheticAcceptance.parse("6.35,decay=0.95", 15)
    assert falling.mean_length() == pytest.approx(6.35)
    assert all(b == pytest.approx(a * 0.95) for a, b in zip(falling.rates, falling.rates[1:]))
    assert SyntheticAcceptance.parse("1", 15).rates == pytest.approx((0.0,) * 15, abs=1e-9)


def test_position_rates_and_a_probe_give_conditional_rates(tmp_path: Path) -> None:
    listed = SyntheticAcceptance.parse("0.8:0.4:0.1", 15)
    assert listed.rates == pytest.approx((0.8, 0.5, 0.25))
    assert listed.mean_length() == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"reference": {"per_position": [0.6, 0.3, 0.0, 0.0]}}))
    dial = SyntheticAcceptance.parse(f"{probe},siblings=0.2", 15)
    assert dial.rates == pytest.approx((0.6, 0.5, 0.0, 0.0)) and dial.siblings == 0.2
    assert conditional([1.0, 1.0]) == [1.0, 1.0]


@pytest.mark.parametrize("spec, names", [
    ("seven", "the mean acceptance length"), ("17", "between 1"), ("6.35,speed=2", "unknown option"),
    ("0.5:0.7", "must fall"), ("6.35,siblings=2", "siblings must be"), ("6,decay=0", "decay must be"),
    ("missing.json", "not a `doctor probe` JSON"), ("0.9:0.8,decay=0.9", "take no decay"),
])
def test_a_bad_profile_is_one_line_naming_the_field(spec: str, names: str) -> None:
    with pytest.raises(BlockdraftError, match="--synthetic-acceptance") as caught:
        SyntheticAcceptance.parse(spec, 15)
    assert names in str(caught.value) and "\n" not in str(caught.value)


def _chain_lengths(dial: SyntheticAcceptance, picks_agree: bool, n: int = 20000, depth: int = 15) -> torch.Tensor:
    """Tokens committed by `n` dialled chain steps of `depth` nodes (the target agreeing with every node, or with
    none)."""
    torch.manual_seed(0)
    ids = torch.randint(10, 1000, (n, depth + 1))
    picks = torch.cat([ids[:, 1:], ids[:, :1]], dim=1) if picks_agree else torch.zeros(n, depth + 1, dtype=torch.long)
    rows = torch.arange(depth + 1)
    parents = (rows - 1).clamp_min(0).expand(n, -1)
    dialled = dial.picks(picks, ids, parents, rows.expand(n, -1), (rows >= 1).expand(n, -1))
    accepted = (dialled[:, :-1] == ids[:, 1:]).long().cumprod(1).sum(1)
    return accepted + 1


@pytest.mark.parametrize("agree", [False, True])
def test_chains_commit_the_dialled_mean_whatever_the_target_picked(agree: bool) -> None:
    dial = SyntheticAcceptance.parse("6.35,decay=0.97", 15)
    lengths = _chain_lengths(dial, agree).double()
    error = lengths.std() / math.sqrt(len(lengths))
    assert abs(lengths.mean() - 6.35) < 4 * error
    first = (lengths >= 2).double().mean()
    assert first == pytest.approx(dial.rates[0], abs=0.01)


def test_siblings_take_their_stated_shares_and_padding_is_never_accepted() -> None:
    """An anchor with three children (tokens 5, 6, 7) and a padding row carrying 8: the r-th child is taken with
    c ((1 - c) s)^r, the padding row never."""
    dial = SyntheticAcceptance((0.5,), siblings=0.5)
    n = 40000
    torch.manual_seed(1)
    ids = torch.tensor([0, 5, 6, 7, 8]).expand(n, -1)
    parents = torch.zeros(n, 5, dtype=torch.long)
    depths = torch.tensor([0, 1, 1, 1, 1]).expand(n, -1)
    valid = torch.tensor([False, True, True, True, False]).expand(n, -1)
    picks = torch.full((n, 5), 6, dtype=torch.long)  # the target itself picks the second child
    anchor = dial.picks(picks, ids, parents, depths, valid)[:, 0]
    shares = [(anchor == token).double().mean().item() for token in (5, 6, 7, 8)]
    assert shares == pytest.approx([0.5, 0.125, 0.03125, 0.0], abs=0.01)
    rejected = anchor[~torch.isin(anchor, torch.tensor([5, 6, 7]))]
    assert set(rejected.tolist()) == {0}  # the target's 6 is a child's: the smallest free token instead


def test_host_drafts_of_different_shapes_are_dialled_together() -> None:
    """`draft_picks` pads a batch's drafts (a chain, a tree, AR) into one call; each walk then sees its own."""
    dial = SyntheticAcceptance((1.0, 1.0), siblings=0.5)
    chain = Draft.chain(torch.tensor([11, 12]))
    tree = Draft(tokens=torch.tensor([21, 22, 23]), parents=[-1, -1, 0], depths=[1, 1, 2])
    empty = Draft.empty(torch.device("cpu"))
    picks = [torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0, 0]), torch.tensor([3])]
    dialled = draft_picks(dial, [chain, tree, empty], picks)
    assert [walk(d, p.tolist(), d.tokens.tolist()).tokens for d, p in zip([chain, tree, empty], dialled)] == [
        [11, 12], [21, 23], []]
    assert dialled[2].tolist() == [3]


def _mean_length(lengths: list[int]) -> float:
    return sum(lengths) / len(lengths)


@pytest.mark.parametrize("method, fused", [("dflash", False), ("dflash", True), ("ddtree", True), ("ddtree", False)])
def test_every_decode_path_commits_the_dialled_lengths(method: str, fused: bool) -> None:
    """A random pair accepts next to nothing; dialled to all-or-nothing profiles it commits exactly what they say:
    only the bonus (rate 0); every drafted token of a chain, and a tree's path of first children (rate 1)."""
    drafter = make_drafter("all_full")
    depth = drafter.cfg.block_size - 1
    for rate in (1.0, 0.0):
        target = FastTarget(make_target_model(), fused=fused)
        target.synthetic = SyntheticAcceptance((rate,) * depth)
        proposer = build_proposer(method, target, drafter, 8 if method == "ddtree" else None)
        result = generate(target, prompts(1)[0], proposer, 1 + 3 * (depth + 1))
        steps = result.acceptance_lengths[:3]
        if rate == 0.0:
            assert steps == [1, 1, 1], (method, fused)
        elif method == "dflash":
            assert steps == [depth + 1] * 3, fused
        else:
            assert min(steps) >= 2, fused


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_dialled_steps_capture_as_graphs(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dial runs inside the captured verify (`graph_emulation` refuses what a GPU's capture refuses): fused steps
    at batch 1 and the batch decoder's graphs commit the dialled lengths. An indexed assignment of a Python `True`
    in the dial was a copy from the host, and stopped an 8B server's DFlash start (H100, 2026-12-08)."""
    from graph_emulation import emulate_graphs

    emulate_graphs(monkeypatch)
    drafter = make_drafter("all_full")
    depth = drafter.cfg.block_size - 1
    budget = 8 if method == "ddtree" else None
    target = FastTarget(make_target_model(), fused=True)
    target.use_graphs = True
    target.synthetic = SyntheticAcceptance((1.0,) * depth)
    result = generate(target, prompts(1)[0], build_proposer(method, target, drafter, budget), 1 + 3 * (depth + 1))
    lengths = result.acceptance_lengths[:3] + [r.acceptance_lengths[0] for _, r in generate_batch(
        target, prompts(3), lambda: build_proposer(method, target, drafter, budget), 3, max_new_tokens=2 * (depth + 1))]
    if method == "dflash":
        assert lengths == [depth + 1] * 6
    else:
        assert min(lengths) >= 2


@pytest.mark.parametrize("method", ["dflash", "ddtree", "schedule"])
def test_a_dialled_server_engine_warms_up_on_captured_graphs(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`blockdraft serve --synthetic-acceptance`'s start: the batched engine's warm-up (prefill graphs, each batch
    bucket from two contexts, batch 1 on fused steps, each method a schedule may pick) captures the dialled verify,
    as the 8B server's did not."""
    from graph_emulation import emulate_graphs
    from test_measured_schedule import table

    from blockdraft.engine.measured import MeasuredSchedule
    from blockdraft.engine.switching import SwitchingProposer
    from blockdraft.serve.batched import BatchedEngine

    emulate_graphs(monkeypatch)
    drafter = make_drafter("all_full")
    target = FastTarget(make_target_model(), fused=True)
    target.use_graphs = True
    target.synthetic = SyntheticAcceptance.parse("3.0", drafter.cfg.block_size - 1)
    if method == "schedule":  # AR, a 3-token chain and a 4-node tree, each warmed
        engine = BatchedEngine(target, lambda: SwitchingProposer(drafter, target, 4), None, 2,
                               MeasuredSchedule(table()), max_model_len=160)
    else:
        engine = BatchedEngine(target, lambda: build_proposer(method, target, drafter, 8 if method == "ddtree" else
                                                              None), None, 2, max_model_len=160)
    engine.warm_up([3, 4, 5])


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_the_batch_decoder_commits_the_dialled_mean(method: str) -> None:
    """A chain at the dialled mean; trees (their device search, batched) above it: later siblings add acceptance."""
    drafter = make_drafter("all_full")
    target = FastTarget(make_target_model())
    target.synthetic = SyntheticAcceptance.parse("3.0", drafter.cfg.block_size - 1)
    lengths: list[int] = []
    budget = 16 if method == "ddtree" else None
    for _, result in generate_batch(target, prompts(4) * 6, lambda: build_proposer(method, target, drafter, budget),
                                    4, max_new_tokens=48):
        lengths += result.acceptance_lengths[:-1]  # the last step may be cut at max_new_tokens
    mean = _mean_length(lengths)
    assert 2.4 < mean < 3.6 if method == "dflash" else 3.0 < mean < 6.0, mean


def test_sampled_decoding_is_refused_not_silently_dialled() -> None:
    target = FastTarget(make_target_model())
    target.synthetic = SyntheticAcceptance((0.5,))
    with pytest.raises(BlockdraftError, match="temperature 0"):
        generate(target, prompts(1)[0], None, 4, SamplingParams(temperature=0.8))
    assert rates_for_mean(2.0, 1, 1.0) == pytest.approx([1.0])


def test_a_tree_commits_the_length_the_dial_predicts() -> None:
    """`tree_length`, what the schedule and the acceptance table weigh a DDTree step by, is what dialled steps of the
    tree the dial's scores build commit on average (siblings included); one node is the chain's first rate."""
    dial = SyntheticAcceptance.parse("4,decay=0.95", 15)
    assert dial.tree_length(1) == pytest.approx(1 + dial.rates[0])
    torch.manual_seed(2)
    log_probs = torch.randn(15, 64).log_softmax(-1)
    n = 6000
    for budget in (8, 32):
        tree = build_tree(log_probs, budget, synthetic=dial)
        dialled = draft_picks(dial, [tree] * n, [torch.zeros(len(tree) + 1, dtype=torch.long)] * n)
        lengths = torch.tensor([1.0 + len(walk(tree, p.tolist(), tree.tokens.tolist()).tokens) for p in dialled],
                               dtype=torch.float64)
        error = lengths.std() / math.sqrt(n)
        assert abs(lengths.mean() - dial.tree_length(budget)) < 4 * error, budget
    assert dial.mean_length(8) < dial.tree_length(8) < dial.tree_length(32)  # siblings add to a chain of as many nodes
    assert dial.unconditional()[:2] == pytest.approx([dial.rates[0], dial.rates[0] * dial.rates[1]])
