"""Training checkpoints that survive a kill at any moment and resume to the bit.

A checkpoint holds everything the next step depends on: drafter, optimizer, scheduler, RNG states, the step and
the micro-batch counter (batches are a pure function of it). It is written to a temporary file and renamed over
the old one, so a kill mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from blockdraft.errors import BlockdraftError

CHECKPOINT_NAME = "checkpoint.pt"


def rng_states() -> dict[str, Any]:
    """Global torch RNG states (CPU and every visible GPU)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    """Write atomically: tmp file, fsync, rename."""
    path = folder / CHECKPOINT_NAME
    tmp = folder / f".{CHECKPOINT_NAME}.tmp"
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(folder: Path) -> dict[str, Any]:
    """The last complete checkpoint in `folder` (on CPU)."""
    path = folder / CHECKPOINT_NAME
    if not path.exists():
        raise BlockdraftError(f"--resume: no {CHECKPOINT_NAME} in {folder}; drop --resume to start a new run there")
    return torch.load(path, map_location="cpu", weights_only=True)
