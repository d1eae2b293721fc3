"""The start-up acceptance check: refuse to serve a deployment whose acceptance has collapsed.

Acceptance that collapses silently after a bad deployment (wrong mask id, taps, RoPE, a quantized drafter, ...) is
the failure users report most: output stays correct, only slow. So before serving, a few built-in prompts are
decoded greedily with the DFlash chain at the served depth and the acceptance is judged against, in order:
1. a `blockdraft doctor probe` file given with --expect;
2. the figures recorded next to the drafter (`probe.json`, which the shipped drafter carries);
3. a floor only a broken deployment falls under (first-position acceptance or tau - 1 under 0.1).
Far below (more than half of the expected gain lost, or under the floor) is a BlockdraftError carrying the doctor's
verdict. The chain is measured even when DDTree is served: probe figures are chain figures, and the tree is built
from the same drafter pass, so a broken chain means a broken tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.decoding.draft import DFlashProposer
from blockdraft.doctor.diagnose import gain_deficit, typical_causes, verdict
from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult
from blockdraft.doctor.probes import Deployment
from blockdraft.doctor.probes import measure as probe_measure
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target
from blockdraft.pair import demo_prompt_ids

RECORDED = "probe.json"  # a drafter folder's recorded probe (ProbeResult JSON)
CHECK_TOKENS = 24
FAR_BELOW = 0.5  # refuse when the deployment loses more than this share of the expected gain (tau - 1)
# With nothing to compare against: first-position acceptance or tau - 1 under this is a collapse (a broken pair
# measures ~0.06 here: a wrong mask id, a random drafter; a working one, even poor, 0.3 and up).
FLOOR = 0.1


@dataclass(frozen=True)
class CheckResult:
    """What the check measured, what it was judged against, and the one-line summary printed at start-up."""

    observed: Fingerprint
    expected: Fingerprint | None
    summary: str


def measure(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], depth: int,
            stop_token_ids: tuple[int, ...]) -> Fingerprint:
    """Greedy DFlash-chain acceptance at `depth` drafted tokens per step over the prompts (the probe's measure)."""
    chain = Deployment("self-check", f"self-check at depth {depth}", target,
                       DFlashProposer(drafter, target, draft_tokens=depth))
    return probe_measure(chain, prompts, CHECK_TOKENS, stop_token_ids)


def expected_figures(expect: Path | None, drafter_dir: Path | None) -> ProbeResult | None:
    """--expect, else the drafter's recorded probe, else None (the floor)."""
    if expect is not None:
        return ProbeResult.load(expect)
    recorded = drafter_dir / RECORDED if drafter_dir is not None else None
    if recorded is not None and recorded.is_file():
        return ProbeResult.load(recorded)
    return None


def judge(observed: Fingerprint, probe: ProbeResult | None, depth: int, source: str) -> CheckResult:
    """Pass (a summary line) or raise with the doctor's verdict."""
    first = observed.per_position[0] if observed.per_position else 0.0
    if probe is None:
        if first < FLOOR or observed.tau - 1.0 < FLOOR:
            raise BlockdraftError(
                f"start-up self-check failed: first-position acceptance {first:.3f} and tau {observed.tau:.2f} are "
                f"what a broken deployment shows; typical causes: {typical_causes(observed, observed)}; fix the "
                "pairing (`blockdraft doctor static`) or pass --no-self-check to serve anyway"
            )
        return CheckResult(observed, None, f"tau {observed.tau:.2f}, first position {first:.2f} (above the floor "
                                           f"{FLOOR} that only a broken deployment falls under)")
    reference = probe.reference.at_depth(depth)
    faults = {name: fp.at_depth(depth) for name, fp in probe.faults.items()}
    if gain_deficit(observed, reference) > FAR_BELOW:
        raise BlockdraftError(
            f"start-up self-check failed against {source}: {verdict(observed, reference, faults)}; pass "
            "--no-self-check to serve anyway"
        )
    return CheckResult(observed, reference, f"tau {observed.tau:.2f} vs {reference.tau:.2f} expected from {source}")


def self_check(target: Target, drafter: DFlashDrafter, tokenizer: Any, depth: int, stop_token_ids: tuple[int, ...],
               expect: Path | None, drafter_dir: Path | None) -> CheckResult:
    """Measure and judge; a collapsed deployment raises BlockdraftError (exit 2) with the doctor's verdict."""
    probe = expected_figures(expect, drafter_dir)
    if expect is not None:
        source = f"--expect {expect}"
    elif probe is not None and drafter_dir is not None:
        source = f"the drafter's recorded {drafter_dir / RECORDED}"
    else:
        source = "the floor"
    observed = measure(target, drafter, demo_prompt_ids(tokenizer, target.vocab_size), depth, stop_token_ids)
    return judge(observed, probe, depth, source)
