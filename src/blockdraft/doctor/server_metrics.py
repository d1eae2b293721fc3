"""Read speculative-decoding acceptance out of what vLLM and SGLang servers expose.

vLLM exports cumulative counters on /metrics (one series per engine, label `engine`), so acceptance over a
window is the difference of two scrapes, summed over engines. SGLang exports gauges on /metrics, one series per
scheduler rank, each already averaged over that rank's last decode-log interval, and `avg_spec_accept_length` per
DP rank in /server_info, averaged since start. Speculative methods share these metrics: MTP is read exactly as
DFlash is. Metric names are matched exactly (each vLLM counter has a `_created` twin that a substring match would
sum in).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from blockdraft.synthetic_acceptance import METRIC as SYNTHETIC_METRIC
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
    engines: int = 1

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
            engines=self.engines,
        )

    def row(self) -> list[int]:
        """The counts as a fingerprint keeps them per window: [drafts, accepted at position 1, 2, ...]."""
        return [round(self.drafts), *(round(n) for n in self.accepted_per_position)]

    def fingerprint(self, source: str) -> Fingerprint:
        """Convert counts to tau, rate and unconditional per-position rates, the counts kept as one window."""
        if self.drafts <= 0:
            raise BlockdraftError(
                f"{source}: no speculative drafts were counted; send requests while measuring or lengthen --interval"
            )
        summed = f" ({self.engines} engines summed)" if self.engines > 1 else ""
        measured = Fingerprint.from_counts(
            self.drafts, self.draft_tokens, self.accepted, list(self.accepted_per_position), source + summed
        )
        measured.windows = [self.row()]
        return measured


def parse_vllm_metrics(text: str, model_name: str | None = None, source: str = "/metrics") -> VllmCounters:
    """Sum vLLM's spec-decode counters out of one /metrics scrape (refused where the acceptance is dialled)."""
    samples = parse_samples(text, source)
    if any(s.name == SYNTHETIC_METRIC for s in samples):
        raise BlockdraftError(f"{source}: this server dials its acceptance (blockdraft serve --synthetic-acceptance, "
                              "benchmarks only), so its counters measure the dial, not the drafter; diagnose a server "
                              "started without it")

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
    engines = {s.labels.get("engine") for s in _select(samples, VLLM_DRAFTS, model_name, source)}
    return VllmCounters(
        drafts=total(VLLM_DRAFTS),
        draft_tokens=total(VLLM_DRAFT_TOKENS),
        accepted=total(VLLM_ACCEPTED),
        accepted_per_position=tuple(per_position.get(i, 0.0) for i in range(width)),
        engines=max(len(engines), 1),
    )


def vllm_window(before: str, after: str, model_name: str | None, source: str) -> Fingerprint:
    """Acceptance over the window between two /metrics scrapes."""
    earlier = parse_vllm_metrics(before, model_name, source)
    later = parse_vllm_metrics(after, model_name, source)
    return later.since(earlier, source).fingerprint(source)


def vllm_recent(scrapes: Sequence[str], model_name: str | None, source: str, since_start: str) -> Fingerprint:
    """Acceptance over the span of successive scrapes, the counts of each window between two of them that drafted
    kept for the figures' intervals; where no draft fell in the span (a server that had traffic, idle now), the
    totals since the server started, the fingerprint's `since_start` source saying so."""
    if len(scrapes) < 2:
        raise BlockdraftError(f"{source}: a window needs two scrapes of /metrics, got {len(scrapes)}")
    counters = [parse_vllm_metrics(text, model_name, source) for text in scrapes]
    windows = [later.since(earlier, source) for earlier, later in zip(counters, counters[1:])]
    span = counters[-1].since(counters[0], source)
    if span.drafts <= 0 < counters[-1].drafts:
        return counters[-1].fingerprint(since_start)
    observed = span.fingerprint(source)
    drafted = [window.row() for window in windows if window.drafts > 0]
    if len(drafted) > 1:
        observed.windows = drafted
    return observed


def _rank(sample: Sample) -> tuple[tuple[str, str], ...]:
    """One SGLang scheduler rank's series: its labels (model_name, engine_type, tp_rank, pp_rank, moe_ep_rank,
    dp_rank when DP is on, and any --extra-metric-labels)."""
    return tuple(sorted(sample.labels.items()))


def _ranks_phrase(counted: int, idle: int, what: str) -> str:
    phrase = f"mean of {counted} rank{'s' if counted != 1 else ''} that decoded"
    if idle:
        phrase += f", {idle} {what} ignored"
    return phrase


def _no_traffic(source: str, name: str, idle: int) -> BlockdraftError:
    return BlockdraftError(
        f"{source}: no rank reports a decoded acceptance length ({idle} {name} series at 0.0): no speculative traffic "
        "yet, or the server runs without --speculative-algorithm; send requests and measure again"
    )


def parse_sglang_metrics(text: str, model_name: str | None = None, source: str = "/metrics") -> Fingerprint:
    """SGLang's acceptance gauges out of one /metrics scrape, averaged over the ranks that have decoded.

    Each scheduler rank publishes its own series, each over its own last decode-log interval; a rank that has
    not decoded (idle, prefill only) publishes 0.0, which would drag a plain mean down, so it is left out.
    The mean over ranks is unweighted: SGLang does not publish how many verify steps each rank's value covers.
    """
    samples = parse_samples(text, source)
    lengths = _select(samples, SGLANG_ACCEPT_LENGTH, model_name, source)
    if not lengths:
        raise BlockdraftError(
            f"{source} has no {SGLANG_ACCEPT_LENGTH}; start SGLang with --enable-metrics and --speculative-algorithm"
        )
    decoded = {_rank(s): s.value for s in lengths if s.value >= 1.0}
    idle = len(lengths) - len(decoded)
    if not decoded:
        raise _no_traffic(source, SGLANG_ACCEPT_LENGTH, idle)
    rates = [s.value for s in _select(samples, SGLANG_ACCEPT_RATE, model_name, source) if _rank(s) in decoded]
    return Fingerprint(
        tau=sum(decoded.values()) / len(decoded),
        acceptance_rate=sum(rates) / len(rates) if rates else None,
        per_position=[],
        num_drafts=None,
        block_size=None,
        source=f"{source}: {SGLANG_ACCEPT_LENGTH}, {_ranks_phrase(len(decoded), idle, 'idle rank(s) at 0.0')}",
    )


def parse_server_info(info: Any, source: str = "/server_info") -> Fingerprint:
    """SGLang's `avg_spec_accept_length`: an average since the server started, per DP rank in `internal_states`.

    0.5.x answers `internal_states` as a list with one entry per DP rank; a rank that has not decoded has no
    `avg_spec_accept_length`. Older releases put the field at the top level or `internal_states` as one dict.
    """
    if not isinstance(info, dict):
        raise BlockdraftError(f"{source}: expected a JSON object from SGLang's /server_info")
    if isinstance(info.get(SERVER_INFO_FIELD), (int, float)):
        states: list[Any] = [info]
    else:
        raw = info.get("internal_states")
        states = [raw] if isinstance(raw, dict) else raw if isinstance(raw, list) else []
    values = [
        s[SERVER_INFO_FIELD]
        for s in states
        if isinstance(s, dict) and isinstance(s.get(SERVER_INFO_FIELD), (int, float))
    ]
    if not values:
        raise BlockdraftError(
            f"{source} has no {SERVER_INFO_FIELD} (top level or under internal_states); the server is not running "
            "speculative decoding, has not decoded yet, or is not SGLang"
        )
    decoded = [v for v in values if v >= 1.0]
    idle = len(states) - len(decoded)
    if not decoded:
        raise _no_traffic(source, SERVER_INFO_FIELD, idle)
    return Fingerprint(
        tau=sum(decoded) / len(decoded),
        acceptance_rate=None,
        per_position=[],
        num_drafts=None,
        block_size=None,
        source=(
            f"{source}: {SERVER_INFO_FIELD}, average since start (not a recent window), "
            f"{_ranks_phrase(len(decoded), idle, 'DP rank(s) without it')}"
        ),
    )
