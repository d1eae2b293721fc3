"""Scraping a live server: a local http.server plays vLLM or SGLang with recorded responses."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from blockdraft.doctor.live import base_url, measure_server
from blockdraft.errors import BlockdraftError

QWEN = "Qwen/Qwen3-8B"
ENGINES = Path(__file__).parent / "fixtures" / "engines"


def vllm_text(drafts: int, draft_tokens: int, per_position: list[int], engine: str = "0") -> str:
    labels = f'engine="{engine}",model_name="{QWEN}"'
    lines = [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}.0",
        "# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_created gauge",
        f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7559123e+09",
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}.0",
        "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {sum(per_position)}.0",
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
        *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {n}.0'
          for i, n in enumerate(per_position)),
    ]
    return "\n".join(lines) + "\n"


SGLANG_METRICS = """\
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="Qwen/Qwen3-8B"} 6.25
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{model_name="Qwen/Qwen3-8B"} 0.35
"""


class Recorded:
    """Responses per path; each GET takes the next one, the last one repeats. A missing path is a 404."""

    def __init__(self) -> None:
        self.routes: dict[str, list[tuple[int, str]]] = {}
        self.delay = 0.0
        self.hits: dict[str, int] = {}

    def next(self, path: str) -> tuple[int, str]:
        responses = self.routes.get(path)
        if not responses:
            return 404, "not found"
        self.hits[path] = self.hits.get(path, 0) + 1
        return responses.pop(0) if len(responses) > 1 else responses[0]


@pytest.fixture
def server() -> Iterator[tuple[str, Recorded]]:
    recorded = Recorded()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            time.sleep(recorded.delay)
            status, body = recorded.next(self.path)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                pass

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", recorded
    httpd.shutdown()
    httpd.server_close()


def test_vllm_window_between_two_scrapes(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [
        (200, vllm_text(1000, 15000, [900, 700, 500] + [0] * 12)),
        (200, vllm_text(1200, 18000, [1080, 820, 560] + [0] * 12)),
    ]
    fp = measure_server(url, interval=0.01, windows=1)
    # window: 200 drafts, 3000 draft tokens, per position [180, 120, 60, 0...] -> 360 accepted
    assert fp.tau == pytest.approx(2.8)
    assert fp.acceptance_rate == pytest.approx(360 / 3000)
    assert fp.per_position[:4] == pytest.approx([0.9, 0.6, 0.3, 0.0])
    assert fp.block_size == 16
    assert fp.num_drafts == 200
    assert recorded.hits["/metrics"] == 2


def test_an_idle_server_is_judged_on_its_totals_since_start(server: tuple[str, Recorded]) -> None:
    """A server that had traffic before but none while measured: its totals since start, named as such."""
    url, recorded = server
    recorded.routes["/metrics"] = [(200, vllm_text(1000, 15000, [900, 700, 500] + [0] * 12))]
    fp = measure_server(url, interval=0.0)
    assert fp.num_drafts == 1000 and fp.tau == pytest.approx(3.1)
    assert "totals since the server started" in fp.source


def test_url_forms(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [(200, vllm_text(10, 30, [5, 2, 1])), (200, vllm_text(20, 60, [10, 4, 2]))]
    fp = measure_server(url.removeprefix("http://") + "/metrics/", interval=0.0)
    assert fp.tau == pytest.approx(1.8)
    assert base_url("localhost:8000") == "http://localhost:8000"
    assert base_url("https://h:1/server_info") == "https://h:1"


def test_counter_reset_between_scrapes(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [(200, vllm_text(1000, 3000, [9, 9, 9])), (200, vllm_text(5, 15, [1, 0, 0]))]
    with pytest.raises(BlockdraftError, match="went down"):
        measure_server(url, interval=0.0)


def test_sglang_metrics(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [(200, SGLANG_METRICS)]
    fp = measure_server(url, interval=5.0)  # gauges: no waiting
    assert (fp.tau, fp.acceptance_rate) == (6.25, 0.35)


def test_sglang_server_info_when_metrics_are_off(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    info = {"version": "0.5.23", "internal_states": [{"avg_spec_accept_length": 5.5, "last_gen_throughput": 180.2}]}
    recorded.routes["/server_info"] = [(200, json.dumps(info))]
    fp = measure_server(url, interval=5.0)
    assert fp.tau == 5.5
    assert "average since start" in fp.source


def test_real_sglang_metrics_with_an_idle_rank(server: tuple[str, Recorded]) -> None:
    """SGLang 0.5.23's collector text (3 DP ranks, rank 1 idle at 0.0): the idle rank is not averaged in."""
    url, recorded = server
    recorded.routes["/metrics"] = [(200, (ENGINES / "sglang_0.5.23_dflash_dp3_metrics.txt").read_text())]
    fp = measure_server(url, interval=5.0)
    assert fp.tau == pytest.approx(5.75)
    assert "1 idle rank(s) at 0.0 ignored" in fp.source
    assert recorded.hits["/metrics"] == 1


def test_real_vllm_metrics_of_two_dp_engines(server: tuple[str, Recorded]) -> None:
    """vLLM 0.33.0's PrometheusStatLogger text, engines 0 and 1, scraped before and after one interval."""
    url, recorded = server
    recorded.routes["/metrics"] = [
        (200, (ENGINES / f"vllm_0.33.0_dflash_dp2_metrics_{when}.txt").read_text()) for when in ("before", "after")
    ]
    fp = measure_server(url, interval=0.01)
    assert (fp.tau, fp.num_drafts, fp.block_size) == (pytest.approx(6.9), 100, 16)
    assert "2 engines summed" in fp.source


def test_not_an_inference_server(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [(200, "# HELP up Up.\n# TYPE up gauge\nup 1.0\n")]
    with pytest.raises(BlockdraftError, match="neither vllm: nor sglang:"):
        measure_server(url, interval=0.0)


def test_http_error_names_the_url(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [(500, "boom")]
    with pytest.raises(BlockdraftError, match=f"{url}/metrics answered HTTP 500"):
        measure_server(url, interval=0.0)


def test_timeout_names_the_url(server: tuple[str, Recorded]) -> None:
    url, recorded = server
    recorded.routes["/metrics"] = [(200, SGLANG_METRICS)]
    recorded.delay = 1.0
    start = time.monotonic()
    with pytest.raises(BlockdraftError, match=f"cannot reach {url}/metrics"):
        measure_server(url, interval=0.0, timeout=0.2)
    assert time.monotonic() - start < 0.9


def test_unreachable_port_fails_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(BlockdraftError, match=f"cannot reach http://127.0.0.1:{port}/metrics"):
        measure_server(f"127.0.0.1:{port}", interval=0.0, timeout=2.0)
    assert time.monotonic() - start < 1.5
