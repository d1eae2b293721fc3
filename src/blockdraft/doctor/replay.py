"""Replay prompts through a live OpenAI-compatible server (vLLM, SGLang, `blockdraft serve`) as token ids.

Lossless and acceptance checks must compare ids, not text: the prompt goes in as a token-id list and the server is
asked for its output ids (`return_token_ids`, which vLLM, SGLang and blockdraft all implement) and to ignore EOS
(`ignore_eos`, likewise), so a run is exactly `max_tokens` greedy tokens and comparable with our engine's.
`ReplayMeter` reads the server's acceptance over the replayed requests alone.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from blockdraft.doctor.fingerprint import Fingerprint, prompt_digest
from blockdraft.doctor.live import base_url, fetch
from blockdraft.doctor.server_metrics import detect_engine, parse_samples, parse_sglang_metrics, parse_vllm_metrics
from blockdraft.errors import BlockdraftError


@dataclass(frozen=True)
class Endpoint:
    """Where to send completions: base URL, served model name, optional API key, per-request timeout."""

    url: str
    model: str
    api_key: str | None = None
    timeout: float = 300.0


def _request(url: str, body: dict[str, Any] | None, api_key: str | None, timeout: float) -> Any:
    """One JSON request; HTTP and network failures become one sentence naming the URL and the server's message."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", errors="replace")[:300]
        fix = " (pass --api-key)" if exc.code == 401 else ""
        raise BlockdraftError(f"{url} answered HTTP {exc.code}{fix}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BlockdraftError(f"cannot reach {url} ({reason}); check that the server is up and --url is right") from None
    except json.JSONDecodeError:
        raise BlockdraftError(f"{url} did not answer JSON; point --url at an OpenAI-compatible server") from None


def connect(url: str, model: str | None = None, api_key: str | None = None, timeout: float = 300.0) -> Endpoint:
    """The endpoint, with the served model named by the server's /v1/models when not given."""
    base = base_url(url)
    if model is None:
        listed = _request(f"{base}/v1/models", None, api_key, timeout)
        models = [m.get("id") for m in listed.get("data") or [] if isinstance(m, dict)] if isinstance(listed, dict) else []
        if not models:
            raise BlockdraftError(f"{base}/v1/models lists no model; pass --model NAME")
        model = models[0]
    return Endpoint(base, model, api_key, timeout)


def complete_ids(endpoint: Endpoint, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The server's greedy continuation of `prompt_ids`: exactly its output token ids (EOS ignored)."""
    body = {
        "model": endpoint.model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    url = f"{endpoint.url}/v1/completions"
    answer = _request(url, body, endpoint.api_key, endpoint.timeout)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    ids = choices[0].get("token_ids") if choices and isinstance(choices[0], dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise BlockdraftError(
            f"{url} returned no `token_ids` for `return_token_ids: true`; the check needs a server that returns "
            "output ids (vLLM, SGLang and blockdraft serve do)"
        )
    return ids


class ReplayMeter:
    """The server's acceptance over the doctor's own requests, read from its /metrics: prompt by prompt where the
    server counts (vLLM's counters, blockdraft's), so the figures carry their noise over prompts; over the whole
    replay where it averages (SGLang's gauges, read once the replay is done)."""

    def __init__(self, endpoint: Endpoint, model_name: str | None = None) -> None:
        self.url = f"{endpoint.url}/metrics"
        self.timeout = endpoint.timeout
        self.model_name = model_name
        self.source = f"{self.url} while the doctor replayed its prompts"
        first = fetch(self.url, self.timeout, missing_ok=True)
        if first is None:
            raise BlockdraftError(f"{self.url} does not exist; start the server with metrics on "
                                  "(SGLang: --enable-metrics)")
        engine = detect_engine(parse_samples(first, self.url))
        if engine is None:
            raise BlockdraftError(f"{self.url} has neither vllm: nor sglang: metrics; point --url at a vLLM, SGLang or "
                                  "blockdraft server running speculative decoding")
        self.start = self.last = parse_vllm_metrics(first, model_name, self.source) if engine == "vllm" else None
        self.counts: list[list[int]] = []

    def prompt_done(self) -> None:
        """Read the counters after one prompt's request: their growth is that prompt's counts."""
        if self.last is None:
            return
        now = parse_vllm_metrics(fetch(self.url, self.timeout) or "", self.model_name, self.source)
        self.counts.append(now.since(self.last, self.source).row())
        self.last = now

    def fingerprint(self, prompts: list[list[int]]) -> Fingerprint:
        """The acceptance over the replay of `prompts`, each prompt's counts kept where every window has them all."""
        if self.start is None or self.last is None:
            return parse_sglang_metrics(fetch(self.url, self.timeout) or "", self.model_name, self.source)
        pooled = self.last.since(self.start, self.source).fingerprint(self.source)
        if pooled.per_position and all(len(c) == 1 + len(pooled.per_position) for c in self.counts):
            pooled.prompts, pooled.prompt_set = self.counts, prompt_digest(prompts)
        return pooled
