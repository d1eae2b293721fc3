"""The CLI contract: `generate --json` / `--prompts` lines, `bench`, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app

runner = CliRunner()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed entry point in a subprocess: the real exit code and streams."""
    return subprocess.run([sys.executable, "-m", "blockdraft", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_prompt_ids(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    res = runner.invoke(
        app, ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json"]
    )
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(record) == {"token_ids", "text", "acceptance_lengths", "metrics"}
    assert len(record["token_ids"]) == 12 and record["text"] is None
    assert sum(record["acceptance_lengths"]) == 11
    assert record["metrics"]["tau"] == pytest.approx(11 / len(record["acceptance_lengths"]))
    ar = runner.invoke(app, ["generate", "--target", str(target), "--method", "ar", "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json"])
    assert json.loads(ar.stdout.strip().splitlines()[-1])["token_ids"] == record["token_ids"]


def test_generate_prompts_file_one_line_each(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt_ids": [4, 5]}\n{"prompt_ids": [7, 8, 9]}\n')
    res = runner.invoke(app, ["generate", "--target", str(target), "--drafter", str(drafter), "--prompts", str(file), "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.strip().splitlines()]
    assert len(lines) == 2 and all(len(x["token_ids"]) == 8 for x in lines)


def bench_results(tiny_dirs: tuple[Path, Path], tmp_path: Path, prompts: str, *args: str) -> dict:
    """`blockdraft bench` on the tiny pair over `prompts` (JSONL lines), 10 new tokens each: its JSON results."""
    target, drafter = tiny_dirs
    file = tmp_path / "p.jsonl"
    file.write_text(prompts)
    res = runner.invoke(app, ["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(file),
                              "--max-new-tokens", "10", "--json-out", str(tmp_path / "r.json"), *args])
    assert res.exit_code == 0, res.output
    return json.loads((tmp_path / "r.json").read_text())


def test_bench_writes_json_and_plot(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    data = bench_results(tiny_dirs, tmp_path, '{"prompt_ids": [4, 5], "category": "a"}\n'
                         '{"prompt_ids": [7, 8, 9], "category": "b"}\n', "--plot", str(tmp_path / "p.png"))
    assert set(data["methods"]) == {"ar", "dflash"}
    assert data["methods"]["dflash"]["identical_to_ar"] == 2
    assert set(data["methods"]["dflash"]["by_category"]) == {"a", "b"}
    low, high = data["methods"]["dflash"]["tau_interval"]  # over the two prompts; AR has none
    assert low <= data["methods"]["dflash"]["stats"]["tau"] <= high and data["methods"]["ar"]["tau_interval"] is None
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_sweeps_lookup_chains(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """`--lookup 0,3` runs each DDTree budget with and without the chain, each labelled, each AR's ids."""
    methods = bench_results(tiny_dirs, tmp_path, '{"prompt_ids": [4, 5, 4, 5, 4]}\n{"prompt_ids": [7, 8, 9]}\n',
                            "--methods", "ar,ddtree", "--budget", "4", "--lookup", "0,3")["methods"]
    assert set(methods) == {"ar", "ddtree@4", "ddtree@4+lookup3"}
    assert methods["ddtree@4+lookup3"]["identical_to_ar"] == 2
    assert (methods["ddtree@4"]["lookup"], methods["ddtree@4+lookup3"]["lookup"]) == (0, 3)
    target, drafter = tiny_dirs
    refused = run_cli("bench", "--target", str(target), "--drafter", str(drafter), "--prompts",
                      str(tmp_path / "p.jsonl"), "--methods", "ar,dflash", "--lookup", "3")
    assert refused.returncode == 2 and "add ddtree to --methods" in refused.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "/nonexistent/model", "--prompt-ids", "1"], "config.json"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--drafter", "/nonexistent/drafter", "--prompt-ids", "1"], "does not exist"),
        (["--prompt", "hi"], "tokenizer"),
        (["--prompt-ids", "1", "--max-new-tokens", "600"], "context window"),
        (["--prompt-ids", "1", "--temperature", "-1"], "--temperature"),
        (["--prompt-ids", "1", "--method", "beam"], "--method"),
        (["--prompt-ids", "1", "--prompt", "x"], "exactly one"),
        (["--prompt-ids", "1", "--method", "dflash", "--lookup", "4"], "--method ddtree"),
    ],
)
def test_errors_are_one_line_exit_2(tiny_dirs: tuple[Path, Path], args: list[str], message: str) -> None:
    target, drafter = tiny_dirs
    full = ["generate", "--target", str(target), "--drafter", str(drafter), *args]
    if "--target" in args:
        full = ["generate", "--drafter", str(drafter), *args]
    if "--drafter" in args:
        full = ["generate", "--target", str(target), *args]
    res = run_cli(*full)
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (["serve", "--port", "99999"], "Invalid value for '--port'"),
    (["serve", "--drain-timeout", "-1"], "Invalid value for '--drain-timeout'"),
    (["generate", "--max-new-tokens", "abc"], "Invalid value for '--max-new-tokens'"),
    (["generate", "hi"], "unexpected extra argument"),
    (["generate", "--no-such-flag"], "No such option: --no-such-flag"),
])
def test_usage_errors_exit_2_without_a_traceback(args: list[str], message: str) -> None:
    """A flag the parser refuses is its usage line and one error line, exit 2: typer 0.29 raises its own click's
    exceptions, which are not the click package's."""
    res = run_cli(*args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr[-400:]


def test_drafter_for_another_target(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    cfg = json.loads((drafter / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((drafter / "model.safetensors").read_bytes())
    for field, value, message in [("hidden_size", 64, "hidden_size"), ("num_target_layers", 8, "num_target_layers")]:
        edited = dict(cfg, **{field: value})
        (bad / "config.json").write_text(json.dumps(edited))
        res = run_cli("generate", "--target", str(target), "--drafter", str(bad), "--prompt-ids", "1")
        assert res.returncode == 2 and message in res.stderr
    edited = json.loads(json.dumps(cfg))
    edited["dflash_config"]["target_layer_ids"] = [0, 2, 7]
    edited.pop("num_target_layers")
    (bad / "config.json").write_text(json.dumps(edited))
    res = run_cli("generate", "--target", str(target), "--drafter", str(bad), "--prompt-ids", "1")
    assert res.returncode == 2 and "target_layer_ids" in res.stderr


def test_embedded_target_defaults_to_the_shipped_drafter(tiny_dirs: tuple[Path, Path]) -> None:
    from blockdraft.pair import EMBEDDED_DRAFTER, default_drafter

    target, drafter = tiny_dirs
    assert default_drafter("smollm2-135m-instruct", None) == str(EMBEDDED_DRAFTER)
    assert default_drafter("SmolLM2-135M-Instruct", str(drafter)) == str(drafter)
    assert default_drafter(str(target), None) is None
    res = run_cli("generate", "--target", str(target), "--prompt-ids", "1,2", "--max-new-tokens", "4")
    assert res.returncode == 2 and "--method dflash needs --drafter PATH" in res.stderr


def test_benchmark_lists_are_checked_in_one_line() -> None:
    """The benchmarks' comma lists (`blockdraft.numbers.int_list` / `count_list`, argparse types): a list of positive
    integers (or counts), or argparse's one-line error naming the flag and an example."""
    import argparse

    from blockdraft.numbers import count_list, int_list

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--budgets", type=int_list, default="32,64")
    assert parser.parse_args([]).budgets == [32, 64]
    assert parser.parse_args(["--budgets", "1, 4,16"]).budgets == [1, 4, 16]
    for bad, says in (("1,x", "comma-separated integers like 1,4,16"), ("0,4", "positive integers"),
                      (",", "is empty")):
        with pytest.raises(argparse.ArgumentError, match=says):
            parser.parse_args(["--budgets", bad])
    parser.add_argument("--lookup", type=count_list, default="0")  # counts: 0 is one of them
    assert parser.parse_args(["--lookup", "0,15"]).lookup == [0, 15]
    for bad, says in (("-1,4", "counts of 0 or more like 0,15"), ("a", "comma-separated integers like 0,15")):
        with pytest.raises(argparse.ArgumentError, match=says):
            parser.parse_args([f"--lookup={bad}"])
