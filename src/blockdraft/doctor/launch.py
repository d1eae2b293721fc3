"""Engine launch commands for a DFlash drafter, with the units and flags the static checks ask for.

The commands are built as argv lists (never by pasting strings), so quoting is shlex's job for the shell form
and disappears entirely in the Python launcher, where the speculative config stays a dict.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from blockdraft.config import DraftConfig, sglang_num_draft_tokens, vllm_num_speculative_tokens
from blockdraft.doctor.static_checks import is_hybrid_target

EngineName = Literal["vllm", "sglang"]
VLLM_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True)
class LaunchPlan:
    """A server command as argv + environment, with notes a user should read before running it."""

    engine: EngineName
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    speculative_config: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """One copy-pasteable shell line: `ENV=1 cmd --flag 'quoted json'`."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*prefix, shlex.join(self.argv)])


def mixes_sliding_and_full(draft: DraftConfig) -> bool:
    """vLLM needs its V2 model runner for drafters with both sliding and full attention layers."""
    return {"sliding_attention", "full_attention"} <= set(draft.layer_types)


def _unknown_target_note(target_config: dict[str, Any] | None, flag: str) -> list[str]:
    if target_config is not None:
        return []
    return [f"target config not read (pass a local target folder): if the target is hybrid (Qwen3.5/3.6, "
            f"Qwen3-Next), add {flag}"]


def vllm_command(
    drafter_path: str,
    target: str,
    draft: DraftConfig,
    target_config: dict[str, Any] | None,
    port: int = 8000,
    extra: tuple[str, ...] = (),
) -> LaunchPlan:
    """`vllm serve` with method dflash, num_speculative_tokens = B - 1 and a non-causal attention backend."""
    spec = {
        "method": "dflash",
        "model": drafter_path,
        "num_speculative_tokens": vllm_num_speculative_tokens(draft.block_size),
    }
    argv = [
        "vllm", "serve", target,
        "--port", str(port),
        "--speculative-config", json.dumps(spec),
        "--attention-backend", "flash_attn",
        *extra,
    ]
    env = {VLLM_V2_RUNNER_ENV: "1"} if mixes_sliding_and_full(draft) else {}
    notes = [
        "use a vLLM release with PR #40727 (taps read as layer outputs, not inputs)",
        *(["sliding-window drafter: use a release whose KV allocator never evicts the drafter context "
           "(vLLM PR #50169)"] if "sliding_attention" in draft.layer_types else []),
    ]
    return LaunchPlan("vllm", argv, env, spec, notes)


def sglang_command(
    drafter_path: str,
    target: str,
    draft: DraftConfig,
    target_config: dict[str, Any] | None,
    port: int = 30000,
    extra: tuple[str, ...] = (),
) -> LaunchPlan:
    """`sglang.launch_server` with DFLASH, draft tokens = B, metrics on, extra_buffer for hybrid targets."""
    hybrid_flag = ["--mamba-scheduler-strategy", "extra_buffer"]
    argv = [
        "python", "-m", "sglang.launch_server",
        "--model-path", target,
        "--port", str(port),
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", drafter_path,
        "--speculative-num-draft-tokens", str(sglang_num_draft_tokens(draft.block_size)),
        "--enable-metrics",
        *(hybrid_flag if is_hybrid_target(target_config) else []),
        *extra,
    ]
    return LaunchPlan("sglang", argv, {}, None, _unknown_target_note(target_config, " ".join(hybrid_flag)))


def _argv_source(plan: LaunchPlan) -> str:
    """ARGV as Python source: the speculative config stays a dict, `python` becomes this interpreter."""
    spec_json = json.dumps(plan.speculative_config) if plan.speculative_config is not None else None
    items = []
    for i, arg in enumerate(plan.argv):
        if arg == spec_json:
            items.append("json.dumps(SPECULATIVE_CONFIG)")
        elif i == 0 and arg == "python":
            items.append("sys.executable")
        else:
            items.append(repr(arg))
    return "[\n" + "".join(f"    {item},\n" for item in items) + "]"


def launcher_source(plan: LaunchPlan) -> str:
    """A standalone Python script that starts the server with an argv list (no shell quoting)."""
    has_spec = plan.speculative_config is not None
    lines = [
        f'"""Start {plan.engine} with a DFlash drafter (written by `blockdraft launch`)."""',
        "",
        *(["import json"] if has_spec else []),
        "import os",
        "import subprocess",
        "import sys",
        "",
        *(f"# note: {note}" for note in plan.notes),
        *([f"SPECULATIVE_CONFIG = {plan.speculative_config!r}"] if has_spec else []),
        f"ENV = {plan.env!r}",
        f"ARGV = {_argv_source(plan)}",
        "",
        "",
        "def main() -> int:",
        '    """Run the server in the foreground with ENV added to this environment."""',
        "    return subprocess.call(ARGV, env={**os.environ, **ENV})",
        "",
        "",
        'if __name__ == "__main__":',
        "    sys.exit(main())",
    ]
    return "\n".join(lines) + "\n"


def write_python_launcher(plan: LaunchPlan, path: str | Path) -> Path:
    """Write `launcher_source(plan)` to `path` (for shells where JSON quoting is painful, e.g. Windows)."""
    path = Path(path)
    path.write_text(launcher_source(plan))
    return path
