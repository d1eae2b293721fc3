"""Tuned tiles shipped per card: the best config each autotuned kernel found at each shape it was tuned at, read
into the autotuners before their first launch, so a cold machine does not time every config of every shape again
(vLLM ships its fused-MoE tiles per card the same way).

On a cold H100 `blockdraft serve` of the embedded pair spent 134 s of its 199 s start-up in Triton's autotuning
(60 keys, every config compiled and timed; benchmarks/RESULTS.md, 2026-12-07); with a key's best config known, the
start compiles that one config and times nothing. A key the table lacks (another card, another model's shapes) is
tuned as before, and `BLOCKDRAFT_SAVE_TUNING=FILE` makes a process write what its tuners hold (merged into FILE)
after each part of a server's warm-up or a benchmark, which is how the tables in `tuned/` were made.

The same table keeps `kernel_choice`'s picks (which of a kernel and its library call ran each shape faster on this
card: 14.4 s of that cold start timed them), so a shipped pick is taken without timing or compiling the loser.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

TABLES = Path(__file__).parent / "tuned"
SAVE_ENV = "BLOCKDRAFT_SAVE_TUNING"

_tuners: dict[str, Any] = {}  # kernel name -> its triton Autotuner
_read: set[str] = set()  # the cards whose table was read into the tuners
_picks: dict[tuple[str, str], str] = {}  # (kind, str(key)) -> the option kernel_choice ran that shape with
_shipped: dict[tuple[str, str], str] = {}  # the picks the card's table holds
_saved = {"entries": 0}  # what this process's `save_if_asked` calls added in all (a server saves after each part)


def register(name: str, tuner: Any) -> None:
    """An autotuner whose results the tables keep, under its kernel's name."""
    _tuners[name] = tuner


def table_path(card: str) -> Path:
    """Where `card`'s (torch.cuda.get_device_name) table is shipped."""
    return TABLES / (re.sub(r"[^A-Za-z0-9]+", "_", card).strip("_") + ".json")


def preload(card: str, path: Path | None = None) -> int:
    """Every registered tuner's best configs at the shapes `card`'s table holds (once per card); the keys read. A
    config the kernel no longer has is skipped: its key is tuned again."""
    if card in _read:
        return 0
    _read.add(card)
    path = path or table_path(card)
    if not path.exists():
        return 0
    table = json.loads(path.read_text())
    kernels = table.get("kernels", {})
    read = 0
    for entry in table.get("picks", []):
        _shipped.setdefault((entry["kind"], entry["key"]), entry["pick"])
        read += 1
    for name, tuner in _tuners.items():
        configs = {str(config): config for config in tuner.configs}
        for entry in kernels.get(name, []):
            config = configs.get(entry["config"])
            if config is not None:
                tuner.cache.setdefault(tuple(entry["key"]), config)
                read += 1
    return read


def preload_current() -> None:
    """`preload` for the current CUDA card."""
    if torch.cuda.is_available():
        preload(torch.cuda.get_device_name(torch.cuda.current_device()))


def shipped_pick(kind: str, key: object) -> str | None:
    """The option this card's table says runs `kind` at shape `key`, or None where it holds no pick."""
    preload_current()
    return _shipped.get((kind, str(key)))


def record_pick(kind: str, key: object, pick: str) -> None:
    """The option a process chose (timed or shipped) for `kind` at `key`, for `save`."""
    _picks[(kind, str(key))] = pick


def held() -> dict[str, list[dict[str, Any]]]:
    """What the tuners hold now, by kernel: each key and its best config."""
    return {name: [{"key": list(key), "config": str(config)} for key, config in tuner.cache.items()]
            for name, tuner in _tuners.items() if tuner.cache}


def save(path: Path, card: str) -> int:
    """Merge what the tuners hold and the picks made into the table at `path` (a key already there keeps its entry);
    the entries added."""
    picks = [{"kind": kind, "key": key, "pick": pick} for (kind, key), pick in _picks.items()]
    return merge({"card": card, "kernels": held(), "picks": picks}, path)


def merge(table: dict[str, Any], path: Path) -> int:
    """Add `table`'s entries (a saved table, e.g. one a GPU machine sent back) to the table at `path` (a key already
    there keeps its entry); the entries added. A table of another card is refused: its tiles were timed there."""
    kept = json.loads(path.read_text()) if path.exists() else {"card": table["card"], "kernels": {}}
    if kept["card"] != table["card"]:
        raise ValueError(f"{path} is {kept['card']}'s table, not {table['card']}'s: merge into table_path(card)")
    added = 0
    for name, entries in table.get("kernels", {}).items():
        have = kept["kernels"].setdefault(name, [])
        known = {tuple(entry["key"]) for entry in have}
        new = [entry for entry in entries if tuple(entry["key"]) not in known]
        have.extend(new)
        added += len(new)
    picks = kept.setdefault("picks", [])
    known_picks = {(entry["kind"], entry["key"]) for entry in picks}
    new_picks = [entry for entry in table.get("picks", []) if (entry["kind"], entry["key"]) not in known_picks]
    picks.extend(new_picks)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept, indent=1) + "\n")
    return added + len(new_picks)


def save_if_asked() -> str | None:
    """With BLOCKDRAFT_SAVE_TUNING=FILE set and a CUDA card, `save` into FILE; a line saying what was kept."""
    target = os.environ.get(SAVE_ENV)
    if not target or not torch.cuda.is_available():
        return None
    card = torch.cuda.get_device_name(torch.cuda.current_device())
    try:
        _saved["entries"] += save(Path(target), card)
    except ValueError as exc:  # another card's file: the run's work stands, its tuning is not kept
        return f"{SAVE_ENV}: nothing saved: {exc}"
    return f"{SAVE_ENV}: {_saved['entries']} tuned keys and picks added to {target} ({card}) by this process"
