"""Compare a live server with our reference engine on the same prompts: per-position acceptance side by side,
and which config field explains the difference.

`doctor server --reference` judges a server's acceptance against a probe run on other traffic. Here the doctor
drives the traffic itself: it probes the drafter (healthy and under every known fault) on a prompt set, replays
the same prompts through the server while scraping its /metrics before and after, and matches the server's
acceptance over exactly that window against the fingerprints. The closest fault names the field to fix.
"""

from __future__ import annotations

from collections.abc import Callable

from blockdraft.doctor.diagnose import HEALTHY, rank_hypotheses
from blockdraft.doctor.fingerprint import Fingerprint, prompt_digest
from blockdraft.doctor.live import fetch
from blockdraft.doctor.replay import Endpoint, complete_ids
from blockdraft.doctor.server_metrics import (detect_engine, parse_samples, parse_sglang_metrics, parse_vllm_metrics,
                                             vllm_window)
from blockdraft.errors import BlockdraftError


def acceptance_while(endpoint: Endpoint, traffic: Callable[[], None], model_name: str | None = None) -> Fingerprint:
    """The server's acceptance over the window in which `traffic` runs (vLLM counters: the difference of two
    scrapes; SGLang: its recent-average gauges read right after)."""
    metrics_url = f"{endpoint.url}/metrics"
    before = fetch(metrics_url, endpoint.timeout, missing_ok=True)
    if before is None:
        raise BlockdraftError(f"{metrics_url} does not exist; start the server with metrics on (SGLang: --enable-metrics)")
    engine = detect_engine(parse_samples(before, metrics_url))
    traffic()
    after = fetch(metrics_url, endpoint.timeout) or ""
    source = f"{metrics_url} while the doctor replayed its prompts"
    if engine == "vllm":
        return vllm_window(before, after, model_name, source)
    if engine == "sglang":
        return parse_sglang_metrics(after, model_name, source)
    raise BlockdraftError(f"{metrics_url} has neither vllm: nor sglang: metrics; point --url at a vLLM, SGLang or "
                          "blockdraft server running speculative decoding")


def replay_acceptance(
    endpoint: Endpoint, prompts: list[list[int]], max_tokens: int, model_name: str | None = None
) -> Fingerprint:
    """Replay every prompt (greedy, EOS ignored) and measure the server's acceptance over those requests only: prompt
    by prompt where the server counts (vLLM's counters, blockdraft's), so the measurement carries its noise; over the
    whole replay where it averages (SGLang's gauges)."""
    metrics_url = f"{endpoint.url}/metrics"
    first = fetch(metrics_url, endpoint.timeout, missing_ok=True)
    if first is None or detect_engine(parse_samples(first, metrics_url)) != "vllm":
        return acceptance_while(endpoint, lambda: [complete_ids(endpoint, p, max_tokens) for p in prompts], model_name)
    source = f"{metrics_url} while the doctor replayed its prompts"
    counts: list[list[int]] = []
    start = before = parse_vllm_metrics(first, model_name, source)
    for prompt in prompts:
        complete_ids(endpoint, prompt, max_tokens)
        after = parse_vllm_metrics(fetch(metrics_url, endpoint.timeout) or "", model_name, source)
        window = after.since(before, source)
        counts.append([round(window.drafts), *(round(n) for n in window.accepted_per_position)])
        before = after
    pooled = before.since(start, source).fingerprint(source)
    if pooled.per_position and all(len(c) == 1 + len(pooled.per_position) for c in counts):
        pooled.prompts = counts  # per-position counters on every window: the noise over prompts can be read
        pooled.prompt_set = prompt_digest(prompts)
    return pooled


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
