"""Launch commands: shell quoting round-trips, units inside the JSON, and a runnable Python launcher."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from blockdraft.config import DraftConfig, parse_draft_config
from blockdraft.doctor.cli import launch_command
from blockdraft.doctor.launch import (
    launcher_source,
    mtp_layers,
    sglang_command,
    sglang_mtp_command,
    vllm_command,
    vllm_mtp_command,
    write_python_launcher,
)
from blockdraft.errors import BlockdraftError

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
MTP_TARGET = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}}
DENSE_TARGET = {"model_type": "qwen3", "hidden_size": 2560}
CONFORMANCE = Path(__file__).parent / "fixtures" / "engines" / "launch_conformance.json"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_round_trips_through_shlex() -> None:
    plan = vllm_command(DRAFTER_PATH, "Qwen/Qwen3-4B", draft_config(sliding=False), port=8123)
    argv = shlex.split(plan.shell())
    assert argv == plan.argv
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-4B"]
    spec = json.loads(flag(argv, "--speculative-config"))
    assert spec == {"method": "dflash", "model": DRAFTER_PATH, "num_speculative_tokens": 15}
    assert flag(argv, "--port") == "8123"
    # vLLM 0.33: --attention-backend is global (it forces the target too) and the drafter's backend is chosen
    # by itself with non-causal support (v1/spec_decode/llm_base_proposer.py, dflash.py), so neither is set.
    assert "--attention-backend" not in argv and "attention_backend" not in spec
    assert any("attention_backend" in note for note in plan.notes)


def test_vllm_mixed_sliding_drafter_relies_on_the_default_v2_runner() -> None:
    plan = vllm_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True))
    argv = shlex.split(plan.shell())
    # vLLM 0.33 picks the V2 model runner by default (config/vllm.py use_v2_model_runner), so no variable
    assert argv[0] == "vllm" and not any("VLLM_USE_V2_MODEL_RUNNER=" in word for word in argv)
    assert json.loads(flag(argv, "--speculative-config"))["num_speculative_tokens"] == 15
    assert any("V2 model runner" in note for note in plan.notes)
    assert any("50169" in note for note in plan.notes)
    assert not any("V2 model runner" in note for note in vllm_command("d", "t", draft_config(False)).notes)


def test_sglang_command_counts_the_whole_block() -> None:
    plan = sglang_command(DRAFTER_PATH, "Qwen/Qwen3-4B", draft_config(sliding=False), DENSE_TARGET)
    argv = shlex.split(plan.shell())
    assert argv == plan.argv
    assert argv[:4] == ["sglang", "serve", "--model-path", "Qwen/Qwen3-4B"]
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == DRAFTER_PATH
    assert flag(argv, "--speculative-num-draft-tokens") == "16"
    assert "--enable-metrics" in argv
    assert not any(word.startswith("--mamba") for word in argv)
    assert plan.notes == []


def test_sglang_hybrid_target_needs_no_mamba_flag() -> None:
    """SGLang 0.5.23 rejects --mamba-scheduler-strategy, and its default strategy `auto` resolves to extra_buffer."""
    plan = sglang_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), HYBRID_TARGET, port=31000)
    assert not any(word.startswith("--mamba") for word in plan.argv)
    assert flag(plan.argv, "--port") == "31000"
    assert len(plan.notes) == 1 and "--mamba-radix-cache-strategy auto" in plan.notes[0]
    assert "extra_buffer" in plan.notes[0]
    unknown = sglang_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True), None)
    assert unknown.argv == [*plan.argv[:5], "30000", *plan.argv[6:]]
    assert unknown.notes == []


def test_stale_mamba_flag_is_what_sglang_rejects() -> None:
    """The captured parser error of SGLang 0.5.23 for the flag blockdraft used to write."""
    error = (CONFORMANCE.parent / "sglang_0.5.23_stale_mamba_flag.txt").read_text()
    assert "unrecognized arguments: --mamba-scheduler-strategy extra_buffer" in error


def test_mtp_commands_use_the_targets_own_layers() -> None:
    vllm = vllm_mtp_command("Qwen/Qwen3.6-27B", MTP_TARGET)
    assert json.loads(flag(vllm.argv, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 3}
    assert "1 MTP layer(s) for 3 proposals" in vllm.notes[0]
    assert vllm_mtp_command("Qwen/Qwen3.6-27B", MTP_TARGET, steps=1).notes == []
    sglang = sglang_mtp_command("Qwen/Qwen3.6-27B", MTP_TARGET, steps=2)
    assert [flag(sglang.argv, f) for f in ("--speculative-algorithm", "--speculative-num-steps",
                                           "--speculative-eagle-topk", "--speculative-num-draft-tokens")] == [
        "NEXTN", "2", "1", "3"]
    assert "--speculative-draft-model-path" not in sglang.argv and "--enable-metrics" in sglang.argv
    assert mtp_layers({"model_type": "qwen3_next"}, "t") == 1  # both engines assume Qwen3-Next's one layer


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (DENSE_TARGET, "model_type is 'qwen3'"),
        (HYBRID_TARGET, "`mtp_num_hidden_layers` is None"),
        ({"model_type": "qwen3_5_moe", "text_config": {"mtp_num_hidden_layers": 0}}, "`mtp_num_hidden_layers` is 0"),
        ({"model_type": "qwen3_next", "num_nextn_predict_layers": 0}, "`num_nextn_predict_layers` is 0"),
        (None, "local target folder"),
    ],
)
def test_mtp_needs_mtp_layers(config: dict[str, Any] | None, match: str) -> None:
    with pytest.raises(BlockdraftError, match=match):
        vllm_mtp_command("Qwen/Qwen3-8B", config)
    with pytest.raises(BlockdraftError, match="--mtp-steps 0"):
        sglang_mtp_command("Qwen/Qwen3.6-27B", MTP_TARGET, steps=0)


def test_launch_matches_what_the_engines_accepted() -> None:
    """Every command blockdraft writes equals one that vLLM 0.33.0's / SGLang 0.5.23's own parser accepted and
    resolved as meant (benchmarks/engine_conformance.py --write-fixtures); re-run it when a command changes."""
    recorded = json.loads(CONFORMANCE.read_text())
    assert recorded["versions"] == {"vllm": "0.33.0", "sglang": "0.5.23"}
    drafters = {k: parse_draft_config(v) for k, v in recorded["drafter_configs"].items()}
    targets = recorded["target_configs"]
    target, drafter = "{TARGET}", "{DRAFTER}"
    plans = {
        "dflash_plain": {"vllm": vllm_command(drafter, target, drafters["plain"]),
                         "sglang": sglang_command(drafter, target, drafters["plain"], targets["dense"])},
        "dflash_sliding": {"vllm": vllm_command(drafter, target, drafters["sliding"]),
                           "sglang": sglang_command(drafter, target, drafters["sliding"], targets["dense"])},
        "dflash_hybrid": {"vllm": vllm_command(drafter, target, drafters["plain"]),
                          "sglang": sglang_command(drafter, target, drafters["plain"], targets["hybrid"])},
        "mtp_hybrid": {"vllm": vllm_mtp_command(target, targets["hybrid"]),
                       "sglang": sglang_mtp_command(target, targets["hybrid"])},
        "dflash2_plain": {"vllm": vllm_command(drafter, target, drafters["dflash2"]),
                          "sglang": sglang_command(drafter, target, drafters["dflash2"], targets["dense"])},
        "dspark_plain": {"vllm": vllm_command(drafter, target, drafters["dspark"])},
    }
    assert set(recorded["commands"]) == set(plans)
    for name, engines in recorded["commands"].items():
        assert set(engines) == set(plans[name]), name  # DSpark: vLLM only (launch sglang refuses it)
        for engine, seen in engines.items():
            assert plans[name][engine].argv == seen["argv"], (name, engine)
    dflash2 = recorded["commands"]["dflash2_plain"]["vllm"]["resolved_by_engine"]
    assert dflash2["method"] == "dflash" and dflash2["candidate_draft"] is True  # vLLM's DFlash2 speculator
    assert recorded["commands"]["dspark_plain"]["vllm"]["resolved_by_engine"]["method"] == "dspark"
    resolved = recorded["commands"]["dflash_hybrid"]["sglang"]["resolved_by_engine"]
    assert resolved["mamba_radix_cache_strategy"] == "extra_buffer"
    assert recorded["commands"]["mtp_hybrid"]["sglang"]["resolved_by_engine"]["speculative_algorithm"] == "EAGLE"
    assert recorded["commands"]["dflash_sliding"]["vllm"]["resolved_by_engine"]["v2_runner"] is True


def fake_engine(bin_dir: Path, name: str, record: Path) -> None:
    """An executable `name` that records its argv."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    script.chmod(0o755)


def test_vllm_launcher_runs_with_an_argv_list(tmp_path: Path) -> None:
    plan = vllm_command(DRAFTER_PATH, "Qwen/Qwen3.6-27B", draft_config(sliding=True))
    launcher = write_python_launcher(plan, tmp_path / "serve.py")
    source = launcher.read_text()
    compile(source, str(launcher), "exec")
    assert 'if __name__ == "__main__":' in source
    assert "SPECULATIVE_CONFIG = {'method': 'dflash'" in source
    assert "json.dumps(SPECULATIVE_CONFIG)" in source
    assert all(f"# note: {note}" in source for note in plan.notes)

    record = tmp_path / "argv.json"
    fake_engine(tmp_path / "bin", "vllm", record)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([sys.executable, str(launcher)], env=env, check=True, timeout=30)
    assert json.loads(record.read_text()) == plan.argv[1:]


def test_launcher_prefers_the_engine_beside_its_interpreter(tmp_path: Path) -> None:
    """`python serve.py` from a venv runs that venv's `sglang serve`, even when another one comes first on PATH."""
    plan = sglang_mtp_command("Qwen/Qwen3.6-27B", MTP_TARGET)
    source = launcher_source(plan)
    compile(source, "serve.py", "exec")
    assert "SPECULATIVE_CONFIG" not in source and "import json" not in source
    (tmp_path / "serve.py").write_text(source)

    venv_bin = tmp_path / "venv" / "bin"
    fake_engine(venv_bin, "sglang", tmp_path / "venv.json")
    fake_engine(tmp_path / "elsewhere", "sglang", tmp_path / "path.json")
    (venv_bin / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{tmp_path / 'elsewhere'}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(venv_bin / "python"), str(tmp_path / "serve.py")], env=env, check=True, timeout=30)
    assert json.loads((tmp_path / "venv.json").read_text()) == plan.argv[1:]
    assert not (tmp_path / "path.json").exists()


def launch_app() -> typer.Typer:
    app = typer.Typer()
    app.command("launch")(launch_command)
    app.command("other")(lambda: None)  # keep `launch` a sub-command, as under `blockdraft`
    return app


def test_launch_cli(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(draft_config(sliding=True).to_dict()))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(HYBRID_TARGET))
    app = launch_app()

    result = CliRunner().invoke(
        app, ["launch", "sglang", "--drafter", str(drafter), "--target", str(target),
              "--write-launcher", str(tmp_path / "serve.py")],
    )
    assert result.exit_code == 0, result.output
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert command[:2] == ["sglang", "serve"]
    assert flag(command, "--speculative-num-draft-tokens") == "16"
    assert not any(word.startswith("--mamba") for word in command)
    assert "# note: hybrid target" in result.stdout
    assert flag(command, "--port") == "30000"
    compile((tmp_path / "serve.py").read_text(), "serve.py", "exec")

    result = CliRunner().invoke(app, ["launch", "vllm", "--drafter", str(drafter), "--target", "Qwen/Qwen3.6-27B"])
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[0] == "vllm"
    assert json.loads(flag(argv, "--speculative-config"))["num_speculative_tokens"] == 15


def test_launch_cli_mtp(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(MTP_TARGET))
    app = launch_app()
    result = CliRunner().invoke(app, ["launch", "vllm", "--method", "mtp", "--target", str(target),
                                      "--mtp-steps", "2", "--port", "8100"])
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert json.loads(flag(argv, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 2}
    assert flag(argv, "--port") == "8100"
    result = CliRunner().invoke(app, ["launch", "sglang", "--method", "mtp", "--target", str(target)])
    assert result.exit_code == 0, result.output
    assert flag(shlex.split(result.stdout.strip().splitlines()[-1]), "--speculative-algorithm") == "NEXTN"

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(draft_config(sliding=False).to_dict()))
    for args, match in [
        (["--method", "mtp", "--drafter", str(drafter)], "drop --drafter"),
        ([], "needs --drafter"),
        (["--drafter", str(drafter), "--mtp-steps", "2"], "--mtp-steps applies to --method mtp"),
    ]:
        result = CliRunner().invoke(app, ["launch", "vllm", "--target", str(target), *args])
        assert isinstance(result.exception, BlockdraftError), args
        assert match in str(result.exception)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(DENSE_TARGET))
    result = CliRunner().invoke(app, ["launch", "sglang", "--method", "mtp", "--target", str(dense)])
    assert "needs a target with MTP layers" in str(result.exception)
