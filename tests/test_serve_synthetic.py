"""`blockdraft serve --synthetic-acceptance`: never on by accident and never mistaken for a drafter's acceptance. The
start-up says it, every /v1 response carries its header, the speculative counters their own label beside a gauge of
the dialled length, a sampled request is refused naming the field, the counters count the dialled steps and the
doctor refuses to read them as a drafter's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from serve_support import running, settings, text_pair_dirs
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.doctor.server_metrics import parse_vllm_metrics
from blockdraft.errors import BlockdraftError

CHAT = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def text_pair(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("synthetic"))


def test_a_dialled_server_is_marked_everywhere_and_counts_the_dial(text_pair: tuple[Path, Path]) -> None:
    said: list[str] = []
    with running(settings(*text_pair, served_model_name="tiny", method="dflash", draft_tokens=3,
                          synthetic_acceptance="1.0:1.0:1.0"), said.append) as server:
        assert any(line.startswith("SYNTHETIC ACCEPTANCE") for line in said)
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 25, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200
        assert "per-position rates 1.0:1.0:1.0" in reply.headers["x-blockdraft-synthetic-acceptance"]
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as streamed:
            assert "x-blockdraft-synthetic-acceptance" in streamed.headers
            streamed.read()
        sampled = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "temperature": 0.7}, timeout=60)
        assert sampled.status_code == 400 and sampled.json()["error"]["param"] == "temperature"
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'blockdraft:synthetic_acceptance_length{engine="0",model_name="tiny"} 4.0' in metrics
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert drafts and all('acceptance="synthetic"' in line for line in drafts + accepted)
    n_drafts, n_accepted = float(drafts[0].split()[-1]), float(accepted[0].split()[-1])
    assert n_drafts > 0 and n_accepted == 3 * n_drafts  # every drafted token accepted, as dialled
    with pytest.raises(BlockdraftError, match="dials its acceptance"):
        parse_vllm_metrics(metrics)


def test_a_plain_server_has_no_mark(text_pair: tuple[Path, Path]) -> None:
    with running(settings(*text_pair, served_model_name="tiny", method="dflash", draft_tokens=3)) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions",
                           json={"model": "tiny", "messages": CHAT, "max_tokens": 4}, timeout=60)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "x-blockdraft-synthetic-acceptance" not in reply.headers
    assert "synthetic" not in metrics


def test_bench_refuses_a_dial_it_cannot_honour(text_pair: tuple[Path, Path]) -> None:
    target, drafter = text_pair
    base = ["bench", "--target", str(target), "--drafter", str(drafter), "--device", "cpu", "--limit", "1"]
    sampled = CliRunner().invoke(app, [*base, "--synthetic-acceptance", "3", "--temperature", "0.5"])
    assert sampled.exit_code != 0 and "temperature 0" in str(sampled.exception)
    bad = CliRunner().invoke(app, [*base, "--synthetic-acceptance", "3,decay=2"])
    assert bad.exit_code != 0 and "--synthetic-acceptance" in str(bad.exception)
