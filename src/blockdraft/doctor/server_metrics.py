"""Read speculative-decoding acceptance out of what vLLM and SGLang servers expose.

vLLM exports cumulative counters on /metrics, so acceptance over a window is the difference of two scrapes.
SGLang exports gauges (already averaged) on /metrics and `avg_spec_accept_length` in /server_info. Metric names
are matched exactly (each vLLM counter has a `_created` twin that a substring match would sum in).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.errors import BlockdraftError

Engine = Literal["vllm", "sglang"]

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"
SERVER_INFO_FIELD = "avg_spec_accept_length"


def parse_samples(text: str, source: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; anything else is a user-facing error."""
    try:
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except ValueError as exc:
        raise BlockdraftError(
            f"{source} is not Prometheus text exposition ({exc}); point --url at the server's /metrics endpoint"
        ) from None


def detect_engine(samples: list[Sample]) -> Engine | None:
    """vLLM and SGLang prefix every metric with their name; None when neither does."""
    names = {sample.name.split(":", 1)[0] for sample in samples if ":" in sample.name}
    if "vllm" in names:
        return "vllm"
    if "sglang" in names:
        return "sglang"
    return None


def _select(samples: list[Sample], name: str, model_name: str | None, source: str) -> list[Sample]:
    """Samples of one metric, optionally for one `model_name` label (an unknown model name is an error)."""
    found = [s for s in samples if s.name == name]
    if model_name is None:
        return found
    chosen = [s for s in found if s.labels.get("model_name") == model_name]
    if found and not chosen:
        known = sorted({s.labels.get("model_name", "") for s in found})
        raise BlockdraftError(f"{source}: no {name} for --model {model_name!r}; this server reports {known}")
    return chosen


@dataclass(frozen=True)
class VllmCounters:
    """vLLM's speculative-decoding counters, summed over engines (and models unless one was selected)."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: tuple[float, ...]

    def since(self, earlier: VllmCounters, source: str) -> VllmCounters:
        """Counts accumulated between an earlier scrape and this one."""
        per_position = list(zip_longest(self.accepted_per_position, earlier.accepted_per_position, fillvalue=0.0))
        totals = [(self.drafts, earlier.drafts), (self.draft_tokens, earlier.draft_tokens)]
        if any(now < before for now, before in [*totals, (self.accepted, earlier.accepted), *per_position]):
            raise BlockdraftError(
                f"{source}: speculative-decoding counters went down between the two scrapes (the server restarted "
                "or an engine left); scrape again once it is up"
            )
        return VllmCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted=self.accepted - earlier.accepted,
            accepted_per_position=tuple(now - before for now, before in per_position),
        )

    def fingerprint(self, source: str) -> Fingerprint:
        """Convert counts to tau, rate and unconditional per-position rates."""
        if self.drafts <= 0:
            raise BlockdraftError(
                f"{source}: no speculative drafts were counted; send requests while measuring or lengthen --interval"
            )
        return Fingerprint.from_counts(
            self.drafts, self.draft_tokens, self.accepted, list(self.accepted_per_position), source
        )


def parse_vllm_metrics(text: str, model_name: str | None = None, source: str = "/metrics") -> VllmCounters:
    """Sum vLLM's spec-decode counters out of one /metrics scrape."""
    samples = parse_samples(text, source)

    def total(name: str) -> float:
        chosen = _select(samples, name, model_name, source)
        if not chosen:
            raise BlockdraftError(
                f"{source} has no {name}; start vLLM with --speculative-config (see `blockdraft launch vllm`)"
            )
        return sum(s.value for s in chosen)

    per_position: dict[int, float] = defaultdict(float)
    for s in _select(samples, VLLM_ACCEPTED_PER_POS, model_name, source):
        try:
            per_position[int(s.labels["position"])] += s.value
        except (KeyError, ValueError):
            raise BlockdraftError(
                f"{source}: {VLLM_ACCEPTED_PER_POS} sample has no integer `position` label ({s.labels})"
            ) from None
    width = max(per_position) + 1 if per_position else 0
    return VllmCounters(
        drafts=total(VLLM_DRAFTS),
        draft_tokens=total(VLLM_DRAFT_TOKENS),
        accepted=total(VLLM_ACCEPTED),
        accepted_per_position=tuple(per_position.get(i, 0.0) for i in range(width)),
    )


def vllm_window(before: str, after: str, model_name: str | None, source: str) -> Fingerprint:
    """Acceptance over the window between two /metrics scrapes."""
    earlier = parse_vllm_metrics(before, model_name, source)
    later = parse_vllm_metrics(after, model_name, source)
    return later.since(earlier, source).fingerprint(source)


def _mean(samples: list[Sample]) -> float | None:
    """Gauges repeat per rank; their mean is the server's value."""
    return sum(s.value for s in samples) / len(samples) if samples else None


def _sglang_tau(tau: float, source: str) -> float:
    if tau < 1.0:
        raise BlockdraftError(
            f"{source}: SGLang reports an acceptance length of {tau} (< 1): no speculative traffic yet, or the "
            "server runs without --speculative-algorithm; send requests and measure again"
        )
    return tau


def parse_sglang_metrics(text: str, model_name: str | None = None, source: str = "/metrics") -> Fingerprint:
    """SGLang's acceptance gauges out of one /metrics scrape."""
    samples = parse_samples(text, source)
    tau = _mean(_select(samples, SGLANG_ACCEPT_LENGTH, model_name, source))
    if tau is None:
        raise BlockdraftError(
            f"{source} has no {SGLANG_ACCEPT_LENGTH}; start SGLang with --enable-metrics and --speculative-algorithm"
        )
    rate = _mean(_select(samples, SGLANG_ACCEPT_RATE, model_name, source))
    return Fingerprint(_sglang_tau(tau, source), rate, [], None, None, source)


def parse_server_info(info: Any, source: str = "/server_info") -> Fingerprint:
    """SGLang's `avg_spec_accept_length`, top level or under `internal_states` (a dict, or one per DP rank)."""
    if not isinstance(info, dict):
        raise BlockdraftError(f"{source}: expected a JSON object from SGLang's /server_info")
    values: list[float] = []
    if isinstance(info.get(SERVER_INFO_FIELD), (int, float)):
        values = [info[SERVER_INFO_FIELD]]
    else:
        states = info.get("internal_states")
        states = [states] if isinstance(states, dict) else states if isinstance(states, list) else []
        values = [
            s[SERVER_INFO_FIELD]
            for s in states
            if isinstance(s, dict) and isinstance(s.get(SERVER_INFO_FIELD), (int, float))
        ]
    if not values:
        raise BlockdraftError(
            f"{source} has no {SERVER_INFO_FIELD} (top level or under internal_states); the server is not running "
            "speculative decoding, or this is not SGLang"
        )
    return Fingerprint(_sglang_tau(sum(values) / len(values), source), None, [], None, None, source)
