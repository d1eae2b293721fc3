"""`blockdraft doctor` commands end to end on local files, a local HTTP server and typed numbers."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from blockdraft.doctor.cli import doctor_app
from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult
from blockdraft.errors import BlockdraftError

BROKEN_LINE = (
    "SpecDecoding metrics: Mean acceptance length: 1.14, Accepted throughput: 10.60 tokens/s, Drafted "
    "throughput: 609.61 tokens/s, Accepted: 106 tokens, Drafted: 6096 tokens, Per-position acceptance rate: "
    "0.139, 0.000, ..., Avg Draft acceptance rate: 1.7%"
)
DRAFTER: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 16,
    "rope_theta": 1000000,
    "block_size": 4,
    "num_target_layers": 6,
    "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3]},
}
ENGINES = Path(__file__).parent / "fixtures" / "engines"
TARGET = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 6, "vocab_size": 16, "rope_theta": 1000000}
runner = CliRunner()


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """A drafter folder and a target folder with config.json, a tiny tokenizer and a thinking chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2, "the": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<|endoftext|>", "<|mask|>"])  # ids 4, 5
    target = tmp_path / "target"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(str(target))
    write_json(target / "config.json", TARGET)
    (target / "chat_template.jinja").write_text("{% if enable_thinking %}<think>{% endif %}")
    return write_json(tmp_path / "drafter" / "config.json", DRAFTER).parent, target


def test_static_healthy_pair(folders: tuple[Path, Path], tmp_path: Path) -> None:
    drafter, target = folders
    html = tmp_path / "static.html"
    result = runner.invoke(doctor_app, ["static", "--drafter", str(drafter), "--target", str(target),
                                        "--num-speculative-tokens", "3", "--json", "--html", str(html)])
    assert result.exit_code == 0, result.output
    findings = json.loads(result.stdout)["findings"]
    assert [(f["severity"], f["field"]) for f in findings] == [("info", "chat_template")]
    assert html.exists()


def test_static_finds_errors_and_exits_1(folders: tuple[Path, Path]) -> None:
    drafter, target = folders
    write_json(drafter / "config.json", {**DRAFTER, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3]}})
    result = runner.invoke(doctor_app, ["static", "--drafter", str(drafter), "--target", str(target / "config.json"),
                                        "--sglang-draft-tokens", "5", "--json"])
    assert result.exit_code == 1
    findings = json.loads(result.stdout)["findings"]
    assert [(f["severity"], f["field"]) for f in findings] == [("error", "speculative_num_draft_tokens")]
    result = runner.invoke(doctor_app, ["static", "--drafter", str(drafter), "--target", str(target), "--json"])
    assert "'the'" in result.stdout  # with the tokenizer, mask id 3 is the ordinary word "the"


def test_static_resolves_the_embedded_target_by_name(folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`--target smollm2-135m-instruct` means the embedded target's local folder, as for generate and bench."""
    import blockdraft.assets

    drafter, target = folders
    monkeypatch.setattr(blockdraft.assets, "ensure_embedded_target", lambda progress=True: target)
    result = runner.invoke(doctor_app, ["static", "--drafter", str(drafter), "--target", "smollm2-135m-instruct", "--json"])
    assert result.exit_code == 0, result.output
    assert [f["field"] for f in json.loads(result.stdout)["findings"]] == ["chat_template"]


def test_static_needs_a_local_target(folders: tuple[Path, Path]) -> None:
    drafter, _ = folders
    result = runner.invoke(doctor_app, ["static", "--drafter", str(drafter), "--target", "Qwen/Qwen3-8B"])
    assert isinstance(result.exception, BlockdraftError)
    assert "hf download Qwen/Qwen3-8B" in str(result.exception)


def test_log_line_against_a_probe_file(tmp_path: Path) -> None:
    probe = tmp_path / "probe.json"
    reference = Fingerprint.from_numbers(6.5, None, block_size=16, source="probe")
    ProbeResult(reference, {"wrong mask id": Fingerprint.from_numbers(1.12, [0.12] + [0.0] * 14)}).save(probe)
    result = runner.invoke(doctor_app, ["log", "--line", BROKEN_LINE, "--reference", str(probe), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fingerprints"]["observed"]["tau"] == pytest.approx(1.14)
    assert data["verdict"].startswith("deployment fault, most likely wrong mask id")


def test_log_file_and_argument_errors(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO start\n" + BROKEN_LINE + "\nINFO more\n")
    result = runner.invoke(doctor_app, ["log", "--file", str(log), "--reference-tau", "1.15"])
    assert result.exit_code == 0, result.output
    assert "the drafter is the limit" in " ".join(result.stdout.split())
    for args in (["log"], ["log", "--line", BROKEN_LINE, "--file", str(log)]):
        assert isinstance(runner.invoke(doctor_app, args).exception, BlockdraftError)
    both = runner.invoke(doctor_app, ["log", "--line", BROKEN_LINE, "--reference", str(log), "--reference-tau", "2"])
    assert "not both" in str(both.exception)


def test_log_file_of_two_dp_engines() -> None:
    """vLLM 0.33.0's own log of two DP engines: every SpecDecoding line counts, and the report says so."""
    result = runner.invoke(doctor_app, ["log", "--file", str(ENGINES / "vllm_0.33.0_dflash_dp2.log"), "--json"])
    assert result.exit_code == 0, result.output
    observed = json.loads(result.stdout)["fingerprints"]["observed"]
    assert observed["tau"] == pytest.approx(6.45, abs=0.005)  # 1 + 1090 accepted / 200 drafts
    assert observed["num_drafts"] is None
    assert "4 vLLM SpecDecoding lines combined" in observed["source"]
    result = runner.invoke(doctor_app, ["log", "--file", str(ENGINES / "vllm_0.33.0_mtp.log"), "--json",
                                        "--reference-tau", "2.9"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fingerprints"]["observed"]["block_size"] == 4  # MTP with 3 proposals reads like any drafter
    assert data["verdict"] is not None


def test_numbers_command() -> None:
    result = runner.invoke(doctor_app, ["numbers", "--tau", "1.2", "--per-position", "0.14,0,0",
                                        "--reference-tau", "3.4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fingerprints"]["observed"]["block_size"] == 4
    assert data["verdict"].startswith("deployment fault:")


@pytest.fixture
def vllm_server() -> Iterator[str]:
    scrapes = [(100, 300, [60, 30, 10]), (200, 600, [150, 90, 40])]  # the last one repeats

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            drafts, tokens, per_pos = scrapes.pop(0) if len(scrapes) > 1 else scrapes[0]
            lines = [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}.0',
                "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {tokens}.0',
                "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {sum(per_pos)}.0',
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
                *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} '
                  f"{n}.0" for i, n in enumerate(per_pos)),
            ]
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_server_command(vllm_server: str, tmp_path: Path) -> None:
    result = runner.invoke(doctor_app, ["server", "--url", vllm_server, "--interval", "0.01", "--model", "m",
                                        "--reference-tau", "2.9", "--json", "--html", str(tmp_path / "s.html")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # window: 100 drafts, 300 draft tokens, per position [90, 60, 30] -> tau 2.8
    observed = data["fingerprints"]["observed"]
    assert observed["tau"] == pytest.approx(2.8)
    assert data["verdict"].startswith("the drafter is the limit")
    # drafts fell in one of the scrape windows alone, so the figures carry a normal interval over its 100 drafts
    assert observed["intervals"]["kind"].startswith("normal approximation over 100 drafts")
    low, high = observed["intervals"]["tau"]
    assert low < 2.8 < high and observed["tau_interval"] == [low, high]
    html = (tmp_path / "s.html").read_text()
    assert f"2.80 [{low:.2f}, {high:.2f}]" in html and "normal approximation over 100 drafts" in html
