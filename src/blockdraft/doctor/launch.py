"""Engine launch commands (vLLM 0.33, SGLang 0.5.23) for a DFlash drafter, or the target's own MTP layers.

The commands are built as argv lists (never by pasting strings), so quoting is shlex's job for the shell form
and disappears entirely in the Python launcher, where the speculative config stays a dict. Every flag here is
one the engine's own argument parser accepts (benchmarks/engine_conformance.py runs them through it); the notes
say why a flag a user may expect is absent.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from blockdraft.config import DraftConfig, sglang_num_draft_tokens, vllm_num_speculative_tokens
from blockdraft.doctor.static_checks import is_hybrid_target, text_config
from blockdraft.errors import BlockdraftError

EngineName = Literal["vllm", "sglang"]

MTP_LAYERS_FIELD = "mtp_num_hidden_layers"
QWEN3_NEXT_MTP_FIELD = "num_nextn_predict_layers"
QWEN35_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"})
QWEN3_NEXT_MODEL_TYPE = "qwen3_next"
DEFAULT_MTP_STEPS = 3  # SGLang 0.5.23's own choice (steps 3, topk 1, 4 draft tokens) for these architectures

VLLM_BACKEND_NOTE = (
    "no --attention-backend: it is global and would force the target's backend too; vLLM picks a "
    "non-causal-capable backend for the DFlash drafter by itself (pin one with \"attention_backend\" inside "
    "--speculative-config only if you must)"
)
VLLM_MIXED_NOTE = (
    "the drafter mixes sliding-window and full layers: vLLM runs it only on its V2 model runner, the default in "
    "0.33 (keep VLLM_USE_V2_MODEL_RUNNER unset or 1; older releases need VLLM_USE_V2_MODEL_RUNNER=1)"
)
SGLANG_HYBRID_NOTE = (
    "hybrid target: no mamba flag needed; SGLang's default --mamba-radix-cache-strategy auto resolves to "
    "extra_buffer while overlap scheduling is on (the old --mamba-scheduler-strategy no longer exists)"
)


@dataclass(frozen=True)
class LaunchPlan:
    """A server command as argv, with notes a user should read before running it."""

    engine: EngineName
    argv: list[str]
    speculative_config: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """One copy-pasteable shell line: `cmd --flag 'quoted json'`."""
        return shlex.join(self.argv)


def mixes_sliding_and_full(draft: DraftConfig) -> bool:
    """vLLM needs its V2 model runner for drafters with both sliding and full attention layers."""
    return {"sliding_attention", "full_attention"} <= set(draft.layer_types)


def _vllm_argv(target: str, port: int, spec: dict[str, Any]) -> list[str]:
    return ["vllm", "serve", target, "--port", str(port), "--speculative-config", json.dumps(spec)]


def _sglang_argv(target: str, port: int, speculative: list[str]) -> list[str]:
    """`sglang serve` (the module form `python -m sglang.launch_server` warns that it is the old entry point)."""
    return ["sglang", "serve", "--model-path", target, "--port", str(port), *speculative, "--enable-metrics"]


def _sglang_hybrid_notes(target_config: dict[str, Any] | None) -> list[str]:
    return [SGLANG_HYBRID_NOTE] if is_hybrid_target(target_config) else []


def vllm_command(drafter_path: str, target: str, draft: DraftConfig, port: int = 8000) -> LaunchPlan:
    """`vllm serve` with method dflash (dspark for a DSpark drafter) and num_speculative_tokens = B - 1."""
    spec = {
        "method": "dspark" if draft.dspark else "dflash",
        "model": drafter_path,
        "num_speculative_tokens": vllm_num_speculative_tokens(draft.block_size),
    }
    notes = [
        "use a vLLM release with PR #40727 (taps read as layer outputs, not inputs)",
        VLLM_BACKEND_NOTE,
        *(["DFlash-2 drafter: vLLM 0.33 serves it under method dflash, choosing its DFlash2 speculator (candidates + "
           "selector walk) from the drafter's architecture DFlash2DraftModel; there is no method dflash2"]
          if draft.dflash2 else []),
        *([VLLM_MIXED_NOTE] if mixes_sliding_and_full(draft) else []),
        *(["sliding-window drafter: use a release whose KV allocator never evicts the drafter context "
           "(vLLM PR #50169)"] if "sliding_attention" in draft.layer_types else []),
    ]
    return LaunchPlan("vllm", _vllm_argv(target, port, spec), spec, notes)


def sglang_command(
    drafter_path: str,
    target: str,
    draft: DraftConfig,
    target_config: dict[str, Any] | None,
    port: int = 30000,
) -> LaunchPlan:
    """`sglang serve` with DFLASH, draft tokens = B and metrics on (SGLang runs DFlash-2 drafters under DFLASH too,
    by their architecture)."""
    if draft.dspark is not None:
        raise BlockdraftError(f"--drafter {drafter_path} is a DSpark drafter: blockdraft does not write SGLang's DSpark "
                              "launch yet (its flags are not checked against SGLang); use `blockdraft launch vllm`")
    speculative = [
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", drafter_path,
        "--speculative-num-draft-tokens", str(sglang_num_draft_tokens(draft.block_size)),
    ]
    argv = _sglang_argv(target, port, speculative)
    return LaunchPlan("sglang", argv, None, _sglang_hybrid_notes(target_config))


def mtp_layers(target_config: dict[str, Any] | None, target: str) -> int:
    """How many MTP layers a Qwen3.5/3.6 (`mtp_num_hidden_layers`) or Qwen3-Next target ships."""
    if target_config is None:
        raise BlockdraftError(
            f"--method mtp reads `{MTP_LAYERS_FIELD}` from the target's config.json; pass a local target folder "
            f"instead of {target}"
        )
    text = text_config(target_config)
    model_types = {target_config.get("model_type"), text.get("model_type")}
    if QWEN3_NEXT_MODEL_TYPE in model_types:
        name, value = QWEN3_NEXT_MTP_FIELD, text.get(QWEN3_NEXT_MTP_FIELD, 1)  # both engines assume one layer
    elif model_types & QWEN35_MODEL_TYPES:
        name, value = MTP_LAYERS_FIELD, text.get(MTP_LAYERS_FIELD)
    else:
        raise BlockdraftError(
            f"--method mtp needs a target with MTP layers (Qwen3.5/3.6 with `{MTP_LAYERS_FIELD}`, or Qwen3-Next); "
            f"this target's model_type is {target_config.get('model_type')!r}: use --method dflash with --drafter"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BlockdraftError(
            f"--method mtp: the target config's `{name}` is {value!r}, so it ships no MTP layers; use --method "
            "dflash with --drafter"
        )
    return value


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise BlockdraftError(f"--mtp-steps {steps} must be >= 1 (draft tokens proposed per step)")


def vllm_mtp_command(
    target: str, target_config: dict[str, Any] | None, steps: int = DEFAULT_MTP_STEPS, port: int = 8000
) -> LaunchPlan:
    """`vllm serve` with method mtp: the drafter is the target's own MTP layers, `steps` proposals per draft."""
    _check_steps(steps)
    layers = mtp_layers(target_config, target)
    spec = {"method": "mtp", "num_speculative_tokens": steps}
    notes = [f"vLLM reruns the target's {layers} MTP layer(s) for {steps} proposals per draft (it warns that "
             f"acceptance may drop; --mtp-steps {layers} keeps the trained depth)"] if steps > layers else []
    return LaunchPlan("vllm", _vllm_argv(target, port, spec), spec, notes)


def sglang_mtp_command(
    target: str, target_config: dict[str, Any] | None, steps: int = DEFAULT_MTP_STEPS, port: int = 30000
) -> LaunchPlan:
    """`sglang serve` with NEXTN (SGLang's MTP, run as EAGLE on the target's own MTP layers), a chain of `steps`."""
    _check_steps(steps)
    mtp_layers(target_config, target)
    speculative = [
        "--speculative-algorithm", "NEXTN",
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(steps + 1),
    ]
    return LaunchPlan("sglang", _sglang_argv(target, port, speculative), None, _sglang_hybrid_notes(target_config))


def _argv_source(plan: LaunchPlan) -> str:
    """ARGV as Python source, with the speculative config kept as a dict."""
    spec_json = json.dumps(plan.speculative_config) if plan.speculative_config is not None else None
    items = ["json.dumps(SPECULATIVE_CONFIG)" if arg == spec_json else repr(arg) for arg in plan.argv]
    return "[\n" + "".join(f"    {item},\n" for item in items) + "]"


def launcher_source(plan: LaunchPlan) -> str:
    """A standalone Python script that starts the server with an argv list (no shell quoting)."""
    has_spec = plan.speculative_config is not None
    lines = [
        f'"""Start {plan.engine} with speculative decoding (written by `blockdraft launch`)."""',
        "",
        *(["import json"] if has_spec else []),
        "import os",
        "import shutil",
        "import subprocess",
        "import sys",
        "",
        *(f"# note: {note}" for note in plan.notes),
        *([f"SPECULATIVE_CONFIG = {plan.speculative_config!r}"] if has_spec else []),
        f"ARGV = {_argv_source(plan)}",
        "",
        "",
        "def main() -> int:",
        '    """Run the server in the foreground; the engine installed beside this interpreter wins over PATH."""',
        "    program = shutil.which(ARGV[0], path=os.path.dirname(sys.executable)) or ARGV[0]",
        "    return subprocess.call([program, *ARGV[1:]])",
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
