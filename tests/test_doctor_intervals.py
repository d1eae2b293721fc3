"""Every acceptance figure with its 95% interval: a normal approximation from one window of a server's counters, a
bootstrap over scrape windows, a bootstrap over prompts for `doctor lossless`; in tables, JSON and HTML."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console
from test_doctor_live import SGLANG_METRICS, Recorded, server, vllm_text  # noqa: F401 (server is a fixture)

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.doctor.live import measure_server
from blockdraft.doctor.lossless import check_lossless, print_lossless, write_lossless_html
from blockdraft.doctor.replay import Endpoint
from blockdraft.doctor.report import DoctorReport, print_report, render_html, to_dict
from blockdraft.doctor.server_metrics import vllm_recent
from blockdraft.errors import BlockdraftError

RATES = [0.9, 0.6, 0.3, 0.0]


def counted(drafts: int, rates: list[float] = RATES) -> Fingerprint:
    """One window of a server's counters: `drafts` drafts accepting `rates` at each position."""
    accepted = [round(r * drafts) for r in rates]
    fp = Fingerprint.from_counts(drafts, drafts * len(rates), sum(accepted), accepted, "counters")
    fp.windows = [[drafts, *accepted]]
    return fp


def contains(span: tuple[float, float], value: float) -> bool:
    return span[0] <= value <= span[1]


def test_one_window_of_counters_gets_a_normal_interval_that_narrows_with_more_drafts() -> None:
    few, many = counted(100).intervals(), counted(10000).intervals()
    assert few is not None and many is not None
    assert few.kind == "normal approximation over 100 drafts (Wilson per position)"
    assert contains(few.tau, 2.8) and contains(few.acceptance_rate, 0.45)
    assert all(contains(span, rate) for span, rate in zip(few.per_position, RATES))
    for wide, narrow in [(few.tau, many.tau), (few.acceptance_rate, many.acceptance_rate),
                         *zip(few.per_position, many.per_position)]:
        assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert few.per_position[3][0] == 0.0 < few.per_position[3][1]  # a position at 0 is not claimed exactly 0
    # tau's variance follows from the per-position rates (a draft accepts a prefix): L is 0..4 with these odds
    odds = [0.1, 0.3, 0.3, 0.3, 0.0]
    variance = sum(n * n * p for n, p in enumerate(odds)) - 1.8**2
    assert few.tau[1] - 2.8 == pytest.approx(1.959964 * (variance / 100) ** 0.5, rel=1e-5)


def test_no_counts_means_no_interval() -> None:
    assert Fingerprint.from_numbers(2.5, [0.9, 0.6]).intervals() is None  # typed numbers
    assert Fingerprint(5.5, None, [], None, None, "sglang gauge").intervals() is None
    assert Fingerprint.from_counts(100, 300, 180, [], "no per-position counters").intervals() is None


def scrapes(windows: list[list[int]]) -> list[str]:
    """/metrics texts whose successive differences are `windows` ([drafts, accepted at 1, ...] each)."""
    totals = [0] * len(windows[0])
    texts = [vllm_text(0, 0, totals[1:])]
    for window in windows:
        totals = [t + n for t, n in zip(totals, window)]
        texts.append(vllm_text(totals[0], 3 * totals[0], totals[1:]))
    return texts


def noisy_windows(count: int) -> list[list[int]]:
    """Windows of 40 drafts whose acceptance swings from window to window (traffic of varied difficulty)."""
    return [[40, *(round(40 * r * (0.7 + 0.6 * (i % 5) / 4)) for r in (0.8, 0.5, 0.25))] for i in range(count)]


def test_scrape_windows_are_bootstrapped_weighted_by_their_drafts() -> None:
    few = vllm_recent(scrapes(noisy_windows(5)), None, "window", "since start")
    many = vllm_recent(scrapes(noisy_windows(50)), None, "window", "since start")
    found = few.intervals()
    assert found is not None and found.kind == "bootstrap over 5 scrape windows, each weighted by its drafts"
    assert few.windows == noisy_windows(5) and few.num_drafts == 200
    assert contains(found.tau, few.tau) and contains(found.acceptance_rate, few.acceptance_rate)
    assert all(contains(span, rate) for span, rate in zip(found.per_position, few.per_position))
    assert many.tau_interval()[1] - many.tau_interval()[0] < found.tau[1] - found.tau[0]
    # idle windows carry no drafts and are left out; a window twice as long weighs twice as much
    idle = vllm_recent(scrapes([[0, 0, 0, 0], [40, 30, 20, 10], [0, 0, 0, 0], [80, 40, 20, 0]]), None, "w", "s")
    assert idle.windows == [[40, 30, 20, 10], [80, 40, 20, 0]] and idle.tau == pytest.approx(1 + 120 / 120)
    assert Fingerprint.from_dict(idle.to_dict(), "json").intervals() == idle.intervals()
    assert idle.at_depth(2).windows == [[40, 30, 20], [80, 40, 20]]


def test_doctor_server_splits_its_interval_into_scrape_windows(server: tuple[str, Recorded]) -> None:  # noqa: F811
    url, recorded = server
    recorded.routes["/metrics"] = [(200, text) for text in scrapes(noisy_windows(4))]
    fp = measure_server(url, interval=0.0, windows=4)
    assert recorded.hits["/metrics"] == 5 and fp.num_drafts == 160
    assert fp.intervals().kind.startswith("bootstrap over 4 scrape windows")
    with pytest.raises(BlockdraftError, match="--windows 0 must be at least 1"):
        measure_server(url, interval=0.0, windows=0)


def test_reports_show_each_figures_interval_and_its_kind(server: tuple[str, Recorded]) -> None:  # noqa: F811
    url, recorded = server
    recorded.routes["/metrics"] = [(200, text) for text in scrapes(noisy_windows(4))]
    observed = measure_server(url, interval=0.0, windows=4)
    gauge = Fingerprint(5.5, None, [], None, None, "sglang")
    report = DoctorReport("doctor server", observed=observed, faults={"gauge": gauge})
    found = observed.intervals()
    console = Console(record=True, width=250)
    print_report(report, console)
    text = console.export_text()
    tau = f"{observed.tau:.2f} [{found.tau[0]:.2f}, {found.tau[1]:.2f}]"
    rate = f"{observed.acceptance_rate:.1%} [{found.acceptance_rate[0]:.1%}, {found.acceptance_rate[1]:.1%}]"
    first = f"[{found.per_position[0][0]:.3f}, {found.per_position[0][1]:.3f}]"
    for expected in (tau, rate, found.kind, "none: no counts behind these figures",
                     "per-position acceptance, 95% intervals", first):
        assert expected in text
    data = to_dict(report)["fingerprints"]
    assert data["observed"]["intervals"]["kind"] == found.kind and data["gauge"]["intervals"] is None
    assert data["observed"]["intervals"]["per_position"][0] == found.per_position[0]
    page = render_html(report)
    position = f"{observed.per_position[0]:.3f} ({found.per_position[0][0]:.3f}-{found.per_position[0][1]:.3f})"
    for expected in (tau, rate, found.kind, position, "none: no counts behind these figures"):
        assert expected in page


class Replayed:
    """A vLLM-like server for `doctor lossless`: each prompt's answer, and counters that grow by that prompt's
    drafts and accepted tokens (acceptance varies from prompt to prompt)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], metrics: bool = True) -> None:
        self.answers, self.metrics = answers, metrics
        self.totals = [0, 0, 0, 0]
        self.served = 0

    def complete(self, prompt: list[int]) -> list[int]:
        self.served += 1
        window = [10, 8, 8 - self.served % 3 * 2, self.served % 2 * 3]
        self.totals = [t + n for t, n in zip(self.totals, window)]
        return self.answers[tuple(prompt)]

    def exposition(self) -> str:
        return vllm_text(self.totals[0], 3 * self.totals[0], self.totals[1:])


@pytest.fixture
def replayed() -> Iterator[tuple[str, Replayed]]:
    state = Replayed({})

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            self.reply(200, state.exposition()) if state.metrics else self.reply(404, "not found")

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = state.complete(body["prompt"])[: body["max_tokens"]]
            self.reply(200, json.dumps({"choices": [{"token_ids": ids}]}))

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def test_lossless_reports_the_servers_acceptance_with_intervals_over_prompts(
    replayed: tuple[str, Replayed], qwen3_target, tmp_path: Path
) -> None:
    from blockdraft.decoding.generate import generate

    url, state = replayed
    prompts = [[1 + i, 5, 9 + i] for i in range(6)]
    state.answers = {tuple(p): generate(qwen3_target, p, None, 4).token_ids for p in prompts}
    report = check_lossless(qwen3_target, Endpoint(url, "m"), prompts, 4)
    assert report.summary.startswith("lossless: 6/6") and report.acceptance is not None
    assert report.acceptance.prompts is not None and len(report.acceptance.prompts) == 6
    found = report.acceptance_intervals
    assert found is not None and found.kind == "bootstrap over 6 prompts"
    assert contains(found.tau, report.acceptance.tau) and found.tau[0] < found.tau[1]
    data = report.to_dict()
    assert data["acceptance"]["intervals"]["tau"] == found.tau and data["acceptance_note"] == ""
    console = Console(record=True, width=250)
    print_lossless(report, console)
    text = console.export_text()
    tau = f"{report.acceptance.tau:.2f} [{found.tau[0]:.2f}, {found.tau[1]:.2f}]"
    assert tau in text and "bootstrap over 6 prompts" in text
    page = write_lossless_html(report, tmp_path / "lossless.html").read_text()
    assert tau in page and "bootstrap over 6 prompts" in page and "lossless: 6/6" in page


def test_lossless_without_metrics_still_checks_and_says_why_acceptance_is_missing(
    replayed: tuple[str, Replayed], qwen3_target, tmp_path: Path
) -> None:
    from blockdraft.decoding.generate import generate

    url, state = replayed
    state.metrics = False
    prompts = [[3, 4, 5], [6, 7, 8]]
    state.answers = {tuple(p): generate(qwen3_target, p, None, 3).token_ids for p in prompts}
    report = check_lossless(qwen3_target, Endpoint(url, "m"), prompts, 3)
    assert report.summary.startswith("lossless: 2/2") and report.acceptance is None
    assert report.acceptance_note.startswith(f"acceptance not measured: {url}/metrics does not exist")
    assert report.to_dict()["acceptance"] is None
    assert report.acceptance_note in write_lossless_html(report, tmp_path / "l.html").read_text()
