"""Training checkpoints that survive a kill at any moment and resume to the bit.

A checkpoint holds everything the next step depends on: drafter, optimizer, scheduler, RNG states, the step and
the micro-batch counter (batches are a pure function of it). It is written to a temporary file and renamed over
the old one, so a kill mid-write leaves the previous checkpoint intact. Its format does not depend on the parallel
mode: under FSDP the shards are gathered into full (unsharded) state dicts in torch's own layout, so a run may be
resumed with fsdp, ddp or one process whatever wrote the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from blockdraft.errors import BlockdraftError

CHECKPOINT_NAME = "checkpoint.pt"


def rng_states() -> dict[str, Any]:
    """Global torch RNG states (CPU and every visible GPU)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` saved, on as many GPUs as both runs see: a run written by a process that saw two
    GPUs (DDP) resumes in one that sees one."""
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def full_state(drafter: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Drafter and optimizer state dicts as one process would have them (`Module.state_dict`, `Optimizer.state_dict`).

    Sharded (FSDP), this is a collective every rank must enter; rank 0 gets the gathered dicts on CPU and the other
    ranks empty ones (rank 0 is the one writer).
    """
    if not sharded:
        return drafter.state_dict(), optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(drafter, optimizer, options=options)
    if not model_state:
        return {}, {}
    # parameter names -> torch's indices (its order: the groups' parameters, in turn); hyperparameters as they are
    names = [name for group in optim_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    state = dict(sorted(((index[name], value) for name, value in optim_state["state"].items()), key=lambda kv: kv[0]))
    return model_state, {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def load_full_state(drafter: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                    optim_state: dict[str, Any], sharded: bool) -> None:
    """Load `full_state`'s dicts; sharded, every rank passes the full dicts and keeps its own shards."""
    if not sharded:
        drafter.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    names = [name for name, _ in drafter.named_parameters()]  # the optimizer was built on drafter.parameters()
    by_name = {
        "state": {names[i]: dict(value) for i, value in optim_state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in optim_state["param_groups"]],
    }
    # copies: set_state_dict swaps the tensors of the dicts it is given for this rank's shards, in place
    set_state_dict(drafter, optimizer, model_state_dict=dict(model_state), optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True))
    for group, saved in zip(optimizer.param_groups, optim_state["param_groups"]):  # as saved (it turns tuples to lists)
        group.update({key: value for key, value in saved.items() if key != "params"})


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
