"""Compare an observed fingerprint with the drafter's reference and with fingerprints of known faults.

Distances are expressed as fractions of the reference's speculative gain (tau - 1 = the sum of its per-position
rates), so tau and per-position curves land on one scale: 0.1 means "10% of what the drafter can deliver".
If the deployment delivers (nearly) what the drafter delivers offline, the drafter is the limit; otherwise the
closest fault fingerprint names the most likely deployment fault.

Like is compared with like: a server that drafts k tokens a step (vLLM's num_speculative_tokens, a blockdraft
server's --draft-tokens) is compared with the probes' first k positions (`Fingerprint.at_depth`), not with their whole block. A
probe drafting the whole block accepts at positions past k that the server never drafted: padded with zeros, the
observation then sat closest to whichever fault had the least acceptance there, not to the fault it came from (a
3-token server with taps one layer late was called "taps one layer early").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import zip_longest

import torch

from blockdraft.doctor.fingerprint import Fingerprint, bootstrap_indices, resampled

HEALTHY = "healthy"
DEFAULT_TOLERANCE = 0.1
_MIN_GAIN = 0.05


@dataclass(frozen=True)
class Hypothesis:
    """How well one explanation (`healthy` = the reference, or a named fault) matches the observation."""

    name: str
    distance: float
    tau_distance: float
    curve_distance: float | None


def depth(fingerprint: Fingerprint) -> int | None:
    """Draft positions a fingerprint covers (None: unknown, a tau alone)."""
    if fingerprint.per_position:
        return len(fingerprint.per_position)
    return fingerprint.block_size - 1 if fingerprint.block_size else None


def _scale(reference: Fingerprint) -> float:
    return max(reference.tau - 1.0, _MIN_GAIN)


def curve_distance(a: list[float], b: list[float], scale: float) -> float | None:
    """L1 gap between two per-position curves (the shorter padded with zeros), relative to `scale`."""
    if not a or not b:
        return None
    return sum(abs(x - y) for x, y in zip_longest(a, b, fillvalue=0.0)) / scale


def compare(observed: Fingerprint, candidate: Fingerprint, name: str, scale: float) -> Hypothesis:
    """Distance of the observation from one candidate: mean of the tau gap and the curve gap (when both exist)."""
    tau_gap = abs(observed.tau - candidate.tau) / scale
    curve_gap = curve_distance(observed.per_position, candidate.per_position, scale)
    distance = tau_gap if curve_gap is None else (tau_gap + curve_gap) / 2
    return Hypothesis(name, distance, tau_gap, curve_gap)


def rank_hypotheses(
    observed: Fingerprint, reference: Fingerprint, faults: dict[str, Fingerprint]
) -> list[Hypothesis]:
    """`healthy` and every fault, closest to the observation first, each at the observation's depth."""
    k = depth(observed)
    reference = reference.at_depth(k)
    scale = _scale(reference)
    candidates = {HEALTHY: reference, **{name: fp.at_depth(k) for name, fp in faults.items()}}
    return sorted((compare(observed, fp, name, scale) for name, fp in candidates.items()), key=lambda h: h.distance)


SEPARATED = 0.95  # a fault is named alone when it is the closest in this share of resamples
RESAMPLES = 1000


@dataclass(frozen=True)
class Separation:
    """How sure the ranking is: the closest fault, the hypothesis after it, the share of bootstrap resamples of the
    prompts in which the closest stays closest, and the prompts that would separate them (None: more prompts would
    not: their fingerprints coincide)."""

    best: str
    runner_up: str
    share: float
    prompts: int
    prompts_needed: int | None

    @property
    def separated(self) -> bool:
        return self.share >= SEPARATED


def separation(observed: Fingerprint, reference: Fingerprint, faults: dict[str, Fingerprint],
               resamples: int = RESAMPLES) -> Separation | None:
    """The ranking's certainty, by a bootstrap over the prompts of every measurement that kept them (None: the
    observation kept no prompts, or no fault is ranked). Measurements of the observation's own prompts (the probe
    beside `doctor compare`'s replay) are resampled with the same prompts, the others each on their own; a
    fingerprint without prompts is taken as it is."""
    ranked = rank_hypotheses(observed, reference, faults)
    best = next((h.name for h in ranked if h.name != HEALTHY), None)
    if best is None or not observed.prompts or len(observed.prompts) < 2:
        return None
    runner_up = next(h.name for h in ranked if h.name != best)
    n, k = len(observed.prompts), depth(observed)
    candidates = {HEALTHY: reference, **faults}
    width = max(len(fp.at_depth(k).per_position) for fp in [observed, *candidates.values()])
    seeds = iter(range(1, 2 + len(candidates)))
    shared = bootstrap_indices(n, resamples)

    def draws(fp: Fingerprint) -> tuple[torch.Tensor, torch.Tensor]:
        if not fp.prompts:
            return resampled(fp, None, k, width, resamples)
        paired = fp.prompt_set is not None and fp.prompt_set == observed.prompt_set and len(fp.prompts) == n
        index = shared if paired else bootstrap_indices(len(fp.prompts), resamples, next(seeds))
        return resampled(fp, index, k, width, resamples)

    tau_o, rates_o = draws(observed)
    drawn = {name: draws(fp) for name, fp in candidates.items()}
    scale = (drawn[HEALTHY][0] - 1.0).clamp_min(_MIN_GAIN)
    distances = {}
    for name, fp in candidates.items():  # as `compare` measures them, in each resample
        tau_c, rates_c = drawn[name]
        tau_gap = (tau_o - tau_c).abs() / scale
        curves = bool(observed.per_position) and bool(fp.per_position)
        distances[name] = (tau_gap + (rates_o - rates_c).abs().sum(1) / scale) / 2 if curves else tau_gap
    others = torch.stack([d for name, d in distances.items() if name != best])
    share = float((distances[best] < others.min(0).values).double().mean())
    gap = distances[runner_up] - distances[best]
    mean, spread = float(gap.mean()), float(gap.std())
    needed = math.ceil(n * (1.645 * spread / mean) ** 2) if mean > 0 and spread > 0 else None
    return Separation(best, runner_up, share, n, needed)


def gain_deficit(observed: Fingerprint, reference: Fingerprint) -> float:
    """Share of the reference's gain (tau - 1), at the observation's depth, that the deployment loses; negative when
    it does better."""
    return 1.0 - (observed.tau - 1.0) / _scale(reference.at_depth(depth(observed)))


def throughput_lost(observed: Fingerprint, reference: Fingerprint) -> float:
    """The share of tokens/s the deployment loses against the drafter run right, at the same draft length (the
    observation's depth) and the same step time: tokens/s is tau / step time, so 1 - tau / reference tau."""
    return 1.0 - observed.tau / reference.at_depth(depth(observed)).tau


COLLAPSE_TAU = 1.35
SMALL_DEFICIT = 0.25
_CAUSES = {
    "collapse": "wrong or zero features (tap indexing, hybrid-model capture), a wrong mask_token_id, a RoPE mismatch "
    "(theta, partial rotary factor), an LM head not shared with the target, or sliding layers run as full attention "
    "/ context evicted",
    "small": "taps off by one (layer input read instead of layer output)",
    "partial": "thinking-mode mismatch, temperature > 0 with greedy drafts, prompts unlike the training data, "
    "context longer than trained, block-size unit confusion (vLLM B-1 vs SGLang B), or num_speculative_tokens "
    "below B-1 (vLLM then cuts the drafter's block)",
}


def typical_causes(observed: Fingerprint, reference: Fingerprint) -> str:
    """The usual causes of this symptom (REFERENCE.md section 6), for when no fault fingerprint is at hand."""
    if observed.tau < COLLAPSE_TAU:
        return _CAUSES["collapse"]
    if gain_deficit(observed, reference) <= SMALL_DEFICIT:
        return _CAUSES["small"]
    return _CAUSES["partial"]


def _loss_not_excluded(low: float, reference_tau: float, observed: Fingerprint, tolerance: float) -> str:
    """What the noise still allows: the share of the drafter's gain lost at the low end of the observed tau's
    interval, said where it exceeds the tolerance (a fault that costs that much is not ruled out by these prompts)."""
    gain = reference_tau - 1.0
    worst = 1.0 - (low - 1.0) / gain if gain > 0 else 0.0
    if worst <= tolerance:
        return ""
    prompts = len(observed.prompts) if observed.prompts else 0
    return (f"; the noise of {prompts} prompts does not rule out a fault costing up to {worst:.0%} of the gain "
            "(more prompts, --limit, narrow it)")


def verdict(
    observed: Fingerprint,
    reference: Fingerprint,
    faults: dict[str, Fingerprint] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    config_fault: str | None = None,
) -> str:
    """One sentence: the drafter is the limit, or which deployment fault most likely explains the gap. A fault read
    from the served config (`config_fault`) is named as found, and the acceptance then says only what it costs."""
    faults = faults or {}
    if reference.tau - 1.0 < _MIN_GAIN:
        if config_fault is not None:
            return (f"deployment fault in the served config: {config_fault}; what it costs cannot be measured: the "
                    f"drafter itself accepts almost nothing on these prompts (reference tau {reference.tau:.2f})")
        return (
            f"the drafter itself accepts almost nothing (reference tau {reference.tau:.2f}): fix the drafter/target "
            "pairing first (`blockdraft doctor static`)"
        )
    deficit = gain_deficit(observed, reference)
    shallower = reference.at_depth(depth(observed))
    interval = observed.tau_interval()
    spread = "" if interval is None else f" (95% interval {interval[0]:.2f}-{interval[1]:.2f})"
    summary = f"observed tau {observed.tau:.2f}{spread} vs reference {shallower.tau:.2f}" + (
        f" at the {depth(observed)} tokens drafted a step" if shallower is not reference else "")
    hidden = "" if interval is None else _loss_not_excluded(interval[0], shallower.tau, observed, tolerance)
    if config_fault is not None:
        return (f"deployment fault in the served config: {config_fault}; what it costs on these prompts: {summary}, "
                f"{max(deficit, 0.0):.0%} of the drafter's gain ({max(throughput_lost(observed, reference), 0.0):.0%} "
                f"of its tokens/s){hidden}")
    if deficit <= tolerance:
        closest = rank_hypotheses(observed, reference, faults)[0].name if faults else HEALTHY
        sure = separation(observed, reference, faults) if closest != HEALTHY else None
        cost = f"would cost this drafter at most {max(deficit, 0.0):.0%} of its gain"
        if sure is None:
            minor = ""
        elif sure.separated:
            minor = (f"; the closest fingerprint is {closest}'s (the closest in {sure.share:.0%} of resamples of the "
                     f"{sure.prompts} prompts, {sure.runner_up} next), a fault that {cost}")
        else:
            pair = ("not told apart from a healthy deployment" if sure.runner_up == HEALTHY else
                    f"not told apart from {sure.runner_up}")
            minor = (f"; the closest fingerprint, {closest}'s, is {pair} on {sure.prompts} prompts (the closest in "
                     f"only {sure.share:.0%} of resamples): such a fault {cost}")
        return (
            f"the drafter is the limit: {summary} (within {tolerance:.0%} of its gain){minor}{hidden}; better "
            "acceptance needs a better drafter or prompts closer to its training data"
        )
    lost = (f"{summary}, {deficit:.0%} of the drafter's gain lost: {throughput_lost(observed, reference):.0%} of "
            "the tokens/s this drafter gives at the same draft length and step time")
    ranked = [h for h in rank_hypotheses(observed, reference, faults) if h.name != HEALTHY]
    if not ranked:
        return (
            f"deployment fault: {lost}; typical causes: {typical_causes(observed, reference)}; "
            "run `blockdraft doctor static` to check the configs"
        )
    best = ranked[0]
    sure = separation(observed, reference, faults)
    if sure is None or sure.separated:
        certainty = "" if sure is None else f"; the closest in {sure.share:.0%} of resamples of the {sure.prompts} prompts"
        return (f"deployment fault, most likely {best.name}: {lost} (distance {best.distance:.2f} to that fault"
                f"{certainty})")
    more = ("more prompts would not separate them" if sure.prompts_needed is None else
            f"about {max(sure.prompts_needed, sure.prompts + 1)} prompts would separate them (`doctor compare "
            "--separate` measures them)")
    return (f"deployment fault: {lost}; {sure.best} or {sure.runner_up}, not told apart on {sure.prompts} prompts "
            f"({sure.best} the closest in {sure.share:.0%} of resamples); {more}, or check the config fields both "
            "name (`blockdraft doctor static`; `doctor compare --served-drafter` reads what the server loaded)")
