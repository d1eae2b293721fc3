"""Measure a running vLLM or SGLang server: scrape its endpoints and return a Fingerprint.

vLLM's counters are cumulative since start-up, which would mix warm-up and old traffic into the answer, so
only the window between a first and a last scrape counts; scrapes between them split it into sub-windows whose
spread gives the figures' intervals. A server idle in that window is judged on its totals since it started, and
the report's source says so. SGLang's gauges are already recent
averages (one per rank), so one reading of /metrics is the answer; without --enable-metrics SGLang serves no
/metrics and /server_info's average since start is the fallback (its Fingerprint source says so).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.doctor.server_metrics import (
    detect_engine,
    parse_samples,
    parse_server_info,
    parse_sglang_metrics,
    vllm_recent,
)
from blockdraft.errors import BlockdraftError


def base_url(url: str) -> str:
    """`host:port`, `http://host:port/` or `.../metrics` -> `http://host:port`."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    for suffix in ("/metrics", "/server_info"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


def fetch(url: str, timeout: float, missing_ok: bool = False) -> str | None:
    """GET a URL as text (None for a 404 when `missing_ok`); network failures name the URL in one sentence."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        if missing_ok and exc.code == 404:
            return None
        raise BlockdraftError(
            f"{url} answered HTTP {exc.code} ({exc.reason}); check --url and the server's flags"
        ) from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BlockdraftError(
            f"cannot reach {url} ({reason}); check that the server is up and --url has the right host and port"
        ) from None


def fetch_json(url: str, timeout: float) -> Any:
    """GET a URL and decode JSON."""
    try:
        return json.loads(fetch(url, timeout) or "")
    except json.JSONDecodeError:
        raise BlockdraftError(f"{url} did not return JSON; is this SGLang's /server_info?") from None


DEFAULT_WINDOWS = 10


def measure_server(
    url: str, interval: float = 10.0, model_name: str | None = None, timeout: float = 5.0,
    windows: int = DEFAULT_WINDOWS,
) -> Fingerprint:
    """Acceptance of a live server: vLLM over `interval` seconds, scraped `windows` times so that the spread of the
    windows' counts gives the figures' intervals; SGLang as it reports now."""
    if windows < 1:
        raise BlockdraftError(f"--windows {windows} must be at least 1 (the scrape windows --interval is split into)")
    base = base_url(url)
    metrics_url = f"{base}/metrics"
    info_url = f"{base}/server_info"
    first = fetch(metrics_url, timeout, missing_ok=True)
    if first is None:  # SGLang without --enable-metrics serves no /metrics
        return parse_server_info(fetch_json(info_url, timeout), info_url)
    engine = detect_engine(parse_samples(first, metrics_url))
    if engine == "vllm":
        scrapes = [first]
        for _ in range(windows):
            time.sleep(interval / windows)
            scrapes.append(fetch(metrics_url, timeout) or "")
        return vllm_recent(scrapes, model_name, f"{metrics_url} over {interval:g} s",
                           f"{metrics_url}: no drafts in {interval:g} s, so the totals since the server started")
    if engine == "sglang":
        return parse_sglang_metrics(first, model_name, metrics_url)
    try:
        return parse_server_info(fetch_json(info_url, timeout), info_url)
    except BlockdraftError:
        raise BlockdraftError(
            f"{metrics_url} has neither vllm: nor sglang: metrics and {info_url} has no acceptance length; "
            "point --url at a vLLM or SGLang server running speculative decoding"
        ) from None
