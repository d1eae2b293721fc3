"""Compare a live server with our reference engine on the same prompts: per-position acceptance side by side,
and which config field explains the difference.

`doctor server --reference` judges a server's acceptance against a probe run on other traffic. Here the doctor
drives the traffic itself: it probes the drafter (healthy and under every known fault) on a prompt set, replays
the same prompts through the server while scraping its /metrics before and after, and matches the server's
acceptance over exactly that window against the fingerprints. The closest fault names the field to fix.
"""

from __future__ import annotations

from blockdraft.doctor.diagnose import HEALTHY, rank_hypotheses
from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.doctor.replay import Endpoint, ReplayMeter, complete_ids


def replay_acceptance(
    endpoint: Endpoint, prompts: list[list[int]], max_tokens: int, model_name: str | None = None
) -> Fingerprint:
    """Replay every prompt (greedy, EOS ignored) and measure the server's acceptance over those requests only: prompt
    by prompt where the server counts (vLLM's counters, blockdraft's), so the measurement carries its noise; over the
    whole replay where it averages (SGLang's gauges)."""
    meter = ReplayMeter(endpoint, model_name)
    for prompt in prompts:
        complete_ids(endpoint, prompt, max_tokens)
        meter.prompt_done()
    return meter.fingerprint(prompts)


def served_width(observed: Fingerprint, whole: int, given: int | None) -> int | None:
    """Draft tokens per step the server runs: the user's number, else the width of its per-position counters (vLLM
    creates one per drafted position) when that is below the drafter's whole block."""
    if given is not None:
        return given
    width = len(observed.per_position)
    return width if 0 < width < whole else None


def closest_fault(observed: Fingerprint, reference: Fingerprint, faults: dict[str, Fingerprint]) -> str | None:
    """The name of the fault closest to the observation; None when the healthy reference is closest."""
    best = rank_hypotheses(observed, reference, faults)[0]
    return None if best.name == HEALTHY else best.name
