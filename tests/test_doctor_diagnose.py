"""Ranking explanations for an observed fingerprint (synthetic fingerprints, pure functions)."""

from __future__ import annotations

import pytest

from blockdraft.doctor.diagnose import (
    HEALTHY,
    curve_distance,
    gain_deficit,
    rank_hypotheses,
    typical_causes,
    verdict,
)
from blockdraft.doctor.fingerprint import Fingerprint


def curve(tau: float, decay: float, k: int = 15) -> Fingerprint:
    """A geometric per-position curve p_i = a * decay**i scaled so that 1 + sum(p) = tau."""
    shape = [decay**i for i in range(k)]
    scale = (tau - 1.0) / sum(shape)
    return Fingerprint(tau, (tau - 1.0) / k, [scale * s for s in shape], 1000, k + 1, f"synthetic tau {tau}")


REFERENCE = curve(6.5, 0.85)
FAULTS = {
    "wrong mask id": Fingerprint(1.12, 0.008, [0.12] + [0.0] * 14, 1000, 16, "probe"),
    "SWA run as full attention": Fingerprint(1.35, 0.023, [0.25, 0.08, 0.02] + [0.0] * 12, 1000, 16, "probe"),
    "thinking-mode mismatch": curve(2.8, 0.6),
    "tap off by one": curve(6.1, 0.84),
}


def test_observed_close_to_reference_means_the_drafter_is_the_limit() -> None:
    observed = curve(6.3, 0.85)
    ranked = rank_hypotheses(observed, REFERENCE, FAULTS)
    assert ranked[0].name == HEALTHY
    assert verdict(observed, REFERENCE, FAULTS).startswith("the drafter is the limit")


def test_better_than_reference_is_still_the_drafter() -> None:
    assert gain_deficit(curve(7.0, 0.9), REFERENCE) < 0
    assert verdict(curve(7.0, 0.9), REFERENCE, FAULTS).startswith("the drafter is the limit")


@pytest.mark.parametrize(
    ("observed", "expected"),
    [
        (Fingerprint(1.14, 0.017, [0.139, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 762, 9, "vLLM log"), "wrong mask id"),
        (Fingerprint(1.4, 0.03, [0.27, 0.1, 0.03] + [0.0] * 12, 500, 16, "vLLM"), "SWA run as full attention"),
        (curve(2.6, 0.62), "thinking-mode mismatch"),
    ],
)
def test_deployment_fault_names_the_closest_fault(observed: Fingerprint, expected: str) -> None:
    ranked = rank_hypotheses(observed, REFERENCE, FAULTS)
    assert ranked[0].name == expected
    assert [h.distance for h in ranked] == sorted(h.distance for h in ranked)
    assert verdict(observed, REFERENCE, FAULTS).startswith(f"deployment fault, most likely {expected}")


def test_tau_only_fingerprints_compare_on_tau() -> None:
    sglang = Fingerprint(2.7, None, [], None, None, "sglang")
    ranked = rank_hypotheses(sglang, REFERENCE, FAULTS)
    assert ranked[0].name == "thinking-mode mismatch"
    assert ranked[0].curve_distance is None
    assert ranked[0].distance == pytest.approx(abs(2.7 - 2.8) / 5.5)


@pytest.mark.parametrize(
    ("tau", "cause"), [(1.14, "mask_token_id"), (5.0, "off by one"), (2.5, "thinking-mode mismatch")]
)
def test_without_fault_fingerprints_name_typical_causes(tau: float, cause: str) -> None:
    observed = Fingerprint(tau, None, [], None, None, "typed")
    reference = Fingerprint(6.0, None, [], None, None, "ref")
    text = verdict(observed, reference)
    assert text.startswith("deployment fault:") and "doctor static" in text
    assert cause in typical_causes(observed, reference) and typical_causes(observed, reference) in text


def test_a_reference_without_gain_blames_the_pairing() -> None:
    dead = Fingerprint(1.01, None, [], None, None, "probe")
    assert "drafter itself accepts almost nothing" in verdict(curve(1.5, 0.5), dead, FAULTS)


def test_curve_distance_pads_with_zeros_and_is_relative() -> None:
    assert curve_distance([0.5, 0.25], [0.5, 0.25, 0.25], scale=1.0) == pytest.approx(0.25)
    assert curve_distance([], [0.5], scale=1.0) is None
    assert curve_distance([0.2], [0.4], scale=0.5) == pytest.approx(0.4)


def test_a_server_drafting_fewer_tokens_is_compared_at_its_depth() -> None:
    """A 3-token server with taps one layer late: against the probes' whole 15-position curves its missing tail
    looked like the fault with the least tail acceptance (the wrong direction); at its own depth it is the fault it
    came from, and the reference's tau it is held to is the one of 3 drafted tokens."""
    reference = Fingerprint(2.15, None, [0.5, 0.3, 0.15] + [0.02] * 10, 500, 14, "probe")
    late = Fingerprint(1.98, None, [0.46, 0.27, 0.13] + [0.012] * 10, 500, 14, "probe")  # taps L+1
    early = Fingerprint(1.8, None, [0.43, 0.24, 0.12] + [0.001] * 10, 500, 14, "probe")  # taps L-1
    observed = Fingerprint(1.86, None, [0.46, 0.27, 0.13], 500, 4, "server, 3 tokens a step")
    faults = {"taps one layer late": late, "taps one layer early": early}
    from blockdraft.doctor.diagnose import compare

    whole = sorted((compare(observed, fp, name, 1.15) for name, fp in faults.items()), key=lambda h: h.distance)
    assert whole[0].name == "taps one layer early"  # what comparing against the whole block said
    assert rank_hypotheses(observed, reference, faults)[0].name == "taps one layer late"
    assert reference.at_depth(3).tau == pytest.approx(1.95) and reference.at_depth(20) is reference
    assert "vs reference 1.95 at the 3 tokens drafted a step" in verdict(observed, reference, faults)


def test_a_faults_cost_is_stated_in_tokens_per_second() -> None:
    """tokens/s = tau / step time: at the served depth and the same step time, the fault costs 1 - tau / tau_ref."""
    from blockdraft.doctor.diagnose import throughput_lost

    observed = Fingerprint(1.4, 0.03, [0.27, 0.1, 0.03] + [0.0] * 12, 500, 16, "vLLM")
    assert throughput_lost(observed, REFERENCE) == pytest.approx(1 - 1.4 / 6.5)
    assert f"{1 - 1.4 / 6.5:.0%} of the tokens/s this drafter gives" in verdict(observed, REFERENCE, FAULTS)


def prompt_counts(rates: list[float], prompts: int, seed: int, drafts: int = 20) -> list[list[int]]:
    """Per-prompt [drafts, accepted at 1, 2, ...] drawn from unconditional rates (each position a binomial of the
    one before, so the counts can only fall)."""
    import random

    rng = random.Random(seed)
    counts = []
    for _ in range(prompts):
        row, reached = [drafts], drafts
        for i, rate in enumerate(rates):
            keep = rate / rates[i - 1] if i and rates[i - 1] else (rate if not i else 0.0)
            reached = sum(rng.random() < keep for _ in range(reached))
            row.append(reached)
        counts.append(row)
    return counts


def measured(rates: list[float], prompts: int, seed: int, name: str) -> Fingerprint:
    return Fingerprint.from_prompt_counts(prompt_counts(rates, prompts, seed), len(rates) + 1, name)


def test_tau_carries_its_interval_over_prompts() -> None:
    """The bootstrap interval holds tau, narrows with more prompts, needs two prompts, and survives JSON."""
    few, many = measured([0.6, 0.3, 0.1], 6, 1, "6 prompts"), measured([0.6, 0.3, 0.1], 60, 1, "60 prompts")
    low, high = few.tau_interval()
    assert low < few.tau < high
    assert many.tau_interval()[1] - many.tau_interval()[0] < high - low
    assert measured([0.6, 0.3, 0.1], 1, 1, "one").tau_interval() is None
    assert Fingerprint.from_dict(few.to_dict(), "json").tau_interval() == few.tau_interval()
    lengths = Fingerprint.from_prompt_lengths([[1, 2, 3], [4, 1]], 4, "probe")
    assert lengths.prompts == [[3, 2, 1, 0], [2, 1, 1, 1]] and lengths.tau == pytest.approx(11 / 5)


def test_a_fault_is_named_alone_only_when_the_noise_separates_it() -> None:
    """Paired resampling of the prompts (the probe ran on the prompts the server was replayed with): a fault far
    from the others is named with its certainty; two faults within the noise are named together, with the prompts
    that would separate them."""
    from blockdraft.doctor.diagnose import separation

    reference = measured([0.8, 0.6, 0.45, 0.3], 12, 0, "reference")
    far = {"wrong mask": measured([0.1, 0.0, 0.0, 0.0], 12, 1, "mask"),
           "taps L+1": measured([0.6, 0.35, 0.2, 0.1], 12, 2, "late")}
    observed = measured([0.6, 0.35, 0.2, 0.1], 12, 3, "server")
    sure = separation(observed, reference, far)
    assert sure is not None and sure.best == "taps L+1" and sure.separated
    assert "most likely taps L+1" in verdict(observed, reference, far) and "of resamples of the 12" in verdict(
        observed, reference, far)
    close = {**far, "taps L-1": measured([0.61, 0.34, 0.2, 0.1], 12, 4, "early")}
    unsure = separation(observed, reference, close)
    assert unsure is not None and not unsure.separated and {unsure.best, unsure.runner_up} == {"taps L+1", "taps L-1"}
    said = verdict(observed, reference, close)
    assert "not told apart on 12 prompts" in said and "doctor static" in said
    assert "95% interval" in said and separation(Fingerprint(1.5, None, [], None, None, "typed"), reference,
                                                 close) is None


def test_within_tolerance_close_faults_are_named_together_not_one_of_them() -> None:
    """A server within the tolerance of the reference whose closest fingerprints sit within the noise of the next
    (taps L+1, taps L-1, healthy): the verdict says the drafter is the limit and that the closest is not told apart,
    not that it is the one."""
    reference = measured([0.6, 0.3, 0.15], 12, 0, "reference")
    close = {"taps L+1": measured([0.55, 0.27, 0.13], 12, 2, "late"),
             "taps L-1": measured([0.55, 0.275, 0.125], 12, 4, "early"),
             "wrong mask": measured([0.05, 0.0, 0.0], 12, 1, "mask")}
    observed = measured([0.55, 0.27, 0.13], 12, 3, "server")
    said = verdict(observed, reference, close)
    assert said.startswith("the drafter is the limit")
    assert "taps L+1" in said and "is not told apart from" in said and "on 12 prompts" in said


def test_within_tolerance_says_how_large_a_loss_the_noise_still_allows() -> None:
    """Few prompts: "the drafter is the limit" comes with the largest loss the interval does not rule out; many
    prompts narrow it under the tolerance and the sentence goes."""
    reference = measured([0.6, 0.3, 0.15], 200, 0, "reference")
    few = verdict(measured([0.6, 0.3, 0.15], 3, 5, "server"), reference)
    assert few.startswith("the drafter is the limit") and "the noise of 3 prompts does not rule out a fault" in few
    many = verdict(measured([0.6, 0.3, 0.15], 400, 5, "server"), reference)
    assert many.startswith("the drafter is the limit") and "does not rule out" not in many


def test_a_fault_read_from_the_served_config_is_named_and_the_acceptance_says_its_cost() -> None:
    reference = Fingerprint.from_acceptance_lengths([4, 3, 5, 2, 4, 3], 8, "reference")
    observed = Fingerprint.from_acceptance_lengths([4, 3, 4, 2, 4, 3], 8, "observed")
    said = verdict(observed, reference, config_fault="dflash_config.mask_token_id = 2 where the drafter ships 16")
    assert said.startswith("deployment fault in the served config: dflash_config.mask_token_id = 2")
    assert "what it costs on these prompts: observed tau" in said and "the drafter is the limit" not in said
    flat = Fingerprint.from_acceptance_lengths([1, 1, 1, 1], 8, "reference")
    assert "cannot be measured" in verdict(observed, flat, config_fault="rope_theta = 1.0 where the drafter ships 1e4")
