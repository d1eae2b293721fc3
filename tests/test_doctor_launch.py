"""Launch commands: shell quoting round-trips, units inside the JSON, and a runnable Python launcher."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer
from typer.testing import CliRunner

from blockdraft.config import DraftConfig, parse_draft_config
from blockdraft.doctor.cli import launch_command
from blockdraft.doctor.launch import launcher_source, sglang_command, vllm_command, write_python_launcher

DRAFTER_PATH = "/models/Bob's drafter \"b16\" $HOME"  # quotes, spaces and a $ must survive the shell


def draft_config(sliding: bool) -> DraftConfig:
    """Qwen3-4B-DFlash-b16's shape, optionally with Qwen3.6-27B-DFlash's 4 sliding + 1 full layers."""
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 2560,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 9728,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }
    if sliding:
        raw.update(layer_types=["sliding_attention"] * 4 + ["full_attention"], use_sliding_window=True,
                   sliding_window=2048)
    return parse_draft_config(raw)


HYBRID_TARGET = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "hidden_size": 2560}}
DENSE_TARGET = {"model_type": "qwen3", "hidden_size": 2560}


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_round_trips_through_shlex() -> None:
    plan = vllm_command(DRAFTER_PATH, "Qwen/Qwen3-4B", draft_config(sliding=False), DENSE_TARGET, port=8123)
    env, argv = split_env(shlex.split(plan.shell()))
    assert env == {}
    assert argv == plan.argv
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-4B"]
    spec = json.loads(flag(argv, "--speculative-config"))
    assert spec == {"method": "dflash", "model": DRAFTER_PATH, "num_speculative_tokens": 15}
    assert flag(argv, "--attention-backend") == "flash_attn"
    assert flag(argv, "--port") == "8123"


def test_vllm_mixed_sliding_drafter_sets_v2_runner() -> None:
    plan = vllm_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), HYBRID_TARGET)
    env, argv = split_env(shlex.split(plan.shell()))
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert json.loads(flag(argv, "--speculative-config"))["num_speculative_tokens"] == 15
    assert any("50169" in note for note in plan.notes)


def test_sglang_command_counts_the_whole_block() -> None:
    plan = sglang_command(DRAFTER_PATH, "Qwen/Qwen3-4B", draft_config(sliding=False), DENSE_TARGET)
    argv = shlex.split(plan.shell())
    assert argv == plan.argv
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == DRAFTER_PATH
    assert flag(argv, "--speculative-num-draft-tokens") == "16"
    assert "--enable-metrics" in argv
    assert "--mamba-scheduler-strategy" not in argv
    assert plan.notes == []


def test_sglang_hybrid_target_and_unknown_target() -> None:
    plan = sglang_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), HYBRID_TARGET, port=31000)
    assert flag(plan.argv, "--mamba-scheduler-strategy") == "extra_buffer"
    unknown = sglang_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), None)
    assert "--mamba-scheduler-strategy" not in unknown.argv
    assert "extra_buffer" in unknown.notes[0]


def fake_vllm(bin_dir: Path, record: Path) -> None:
    """An executable `vllm` that records its argv and the V2 runner variable."""
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(record)!r}, 'w').write(json.dumps([sys.argv[1:], os.environ.get('VLLM_USE_V2_MODEL_RUNNER')]))\n"
    )
    script.chmod(0o755)


def test_vllm_launcher_runs_with_an_argv_list(tmp_path: Path) -> None:
    plan = vllm_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), HYBRID_TARGET)
    launcher = write_python_launcher(plan, tmp_path / "serve.py")
    source = launcher.read_text()
    compile(source, str(launcher), "exec")
    assert 'if __name__ == "__main__":' in source
    assert "SPECULATIVE_CONFIG = {'method': 'dflash'" in source
    assert "json.dumps(SPECULATIVE_CONFIG)" in source

    record = tmp_path / "argv.json"
    fake_vllm(tmp_path / "bin", record)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([sys.executable, str(launcher)], env=env, check=True, timeout=30)
    argv, v2 = json.loads(record.read_text())
    assert argv == plan.argv[1:]
    assert v2 == "1"


def test_sglang_launcher_uses_this_interpreter(tmp_path: Path) -> None:
    plan = sglang_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), HYBRID_TARGET)
    source = launcher_source(plan)
    compile(source, "serve.py", "exec")
    assert "sys.executable" in source and "SPECULATIVE_CONFIG" not in source

    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    record = tmp_path / "argv.json"
    (package / "launch_server.py").write_text(
        f"import json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    (tmp_path / "serve.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    subprocess.run([sys.executable, str(tmp_path / "serve.py")], env=env, check=True, timeout=30)
    assert json.loads(record.read_text()) == plan.argv[3:]


def test_launch_cli(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(draft_config(sliding=True).to_dict()))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(HYBRID_TARGET))
    app = typer.Typer()
    app.command("launch")(launch_command)
    app.command("other")(lambda: None)  # keep `launch` a sub-command, as under `blockdraft`

    result = CliRunner().invoke(
        app, ["launch", "sglang", "--drafter", str(drafter), "--target", str(target),
              "--write-launcher", str(tmp_path / "serve.py")],
    )
    assert result.exit_code == 0, result.output
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert flag(command, "--speculative-num-draft-tokens") == "16"
    assert flag(command, "--mamba-scheduler-strategy") == "extra_buffer"
    assert flag(command, "--port") == "30000"
    compile((tmp_path / "serve.py").read_text(), "serve.py", "exec")

    result = CliRunner().invoke(app, ["launch", "vllm", "--drafter", str(drafter), "--target", "Qwen/Qwen3.6-27B"])
    assert result.exit_code == 0, result.output
    env, argv = split_env(shlex.split(result.stdout.strip().splitlines()[-1]))
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert json.loads(flag(argv, "--speculative-config"))["num_speculative_tokens"] == 15
