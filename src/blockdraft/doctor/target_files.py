"""Read what static checks need from a local target: config.json, and the tokenizer and chat template if present.

No weights and no network: the doctor must run on a laptop next to a config downloaded with `hf download`. The
embedded target's name resolves to its local folder (converted once from the installed package), as elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.assets import resolve_target_path
from blockdraft.errors import BlockdraftError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass
class TargetFiles:
    """A target's config dict, plus its tokenizer and chat template when the folder has them."""

    config: dict[str, Any]
    tokenizer: Any | None
    chat_template: str | None


def read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object from disk; a missing or broken file is one sentence naming it."""
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise BlockdraftError(f"{what}: {file} does not exist; pass a folder holding config.json") from None
    except json.JSONDecodeError as exc:
        raise BlockdraftError(f"{what}: {file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise BlockdraftError(f"{what}: {file} must hold a JSON object")
    return raw


def load_target_config(target: str) -> dict[str, Any] | None:
    """config.json of a local target folder or file (or the embedded target's); None for anything else (a hub id)."""
    path = resolve_target_path(target)
    if path.is_dir():
        return read_json(path / "config.json", "--target")
    if path.is_file():
        return read_json(path, "--target")
    return None


def load_target_files(target: str) -> TargetFiles:
    """Config, tokenizer and chat template of a local target (a folder, or a config.json alone)."""
    config = load_target_config(target)
    if config is None:
        raise BlockdraftError(
            f"--target {target} is not a local folder or config.json (the doctor works offline); fetch it with "
            f"`hf download {target} config.json tokenizer.json tokenizer_config.json --local-dir DIR`"
        )
    folder = resolve_target_path(target)
    if not folder.is_dir():
        return TargetFiles(config, None, None)
    tokenizer = None
    if any((folder / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise BlockdraftError(
                f"--target {folder}: the tokenizer does not load ({exc}); fix its files, or pass "
                f"{folder / 'config.json'} to skip tokenizer checks"
            ) from None
    template_file = folder / CHAT_TEMPLATE_FILE
    chat_template = template_file.read_text() if template_file.exists() else getattr(tokenizer, "chat_template", None)
    return TargetFiles(config, tokenizer, chat_template)
