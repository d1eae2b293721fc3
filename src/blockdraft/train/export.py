"""Export: the trained drafter as a z-lab folder (config.json + model.safetensors) and how to serve it.

The folder is written by `save_drafter` (the published weight names and config fields), then loaded back with
`load_drafter` against the target, so a broken export fails here rather than in a user's server.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from blockdraft.config import sglang_num_draft_tokens, vllm_num_speculative_tokens
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.loading import load_drafter, save_drafter
from blockdraft.models.target import Target


def export_drafter(drafter: DFlashDrafter, folder: Path, target: Target) -> Path:
    """Save in the target's dtype (what serving engines run) and check the folder loads for this target."""
    save_drafter(drafter, folder, dtype=target.dtype)
    load_drafter(folder, target)
    return folder


def launch_commands(target_name: str, drafter_dir: Path, block_size: int, mixed_layers: bool) -> dict[str, str]:
    """vLLM counts proposals (B-1), SGLang counts the whole block (B): the commands carry the right numbers."""
    spec = json.dumps({"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": vllm_num_speculative_tokens(block_size)})
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixed_layers else ""
    vllm = f"{env}vllm serve {shlex.quote(target_name)} --speculative-config {shlex.quote(spec)} --attention-backend flash_attn"
    sglang = (
        f"python -m sglang.launch_server --model-path {shlex.quote(target_name)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(str(drafter_dir))} "
        f"--speculative-num-draft-tokens {sglang_num_draft_tokens(block_size)}"
    )
    return {"vllm": vllm, "sglang": sglang}
