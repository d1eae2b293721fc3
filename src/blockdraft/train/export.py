"""Export: the trained drafter as a z-lab folder (config.json + model.safetensors) and how to serve it.

The folder is written by `save_drafter` (the published weight names and config fields), then loaded back with
`load_drafter` against the target, so a broken export fails here rather than in a user's server.
"""

from __future__ import annotations

from pathlib import Path

from blockdraft.config import DraftConfig
from blockdraft.doctor.launch import sglang_command, vllm_command
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.loading import load_drafter, save_drafter
from blockdraft.models.target import Target


def export_drafter(drafter: DFlashDrafter, folder: Path, target: Target) -> Path:
    """Save in the target's dtype (what serving engines run) and check the folder loads for this target."""
    save_drafter(drafter, folder, dtype=target.dtype)
    load_drafter(folder, target)
    return folder


def launch_commands(target_name: str, drafter_dir: Path, draft: DraftConfig) -> dict[str, str]:
    """The `blockdraft launch` commands for the exported drafter (vLLM counts B-1 proposals, SGLang the block B):
    one source of engine flags, checked against the engines' own parsers by benchmarks/engine_conformance.py."""
    return {
        "vllm": vllm_command(str(drafter_dir), target_name, draft).shell(),
        "sglang": sglang_command(str(drafter_dir), target_name, draft, None).shell(),
    }
