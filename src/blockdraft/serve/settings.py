"""`blockdraft serve`'s flags as one value: the HTTP process reads the serving ones, the engine process the rest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blockdraft.assets import EMBEDDED_TARGET_NAME


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """Every `blockdraft serve` flag; None means "the default for this pair and device"."""

    target: str = EMBEDDED_TARGET_NAME
    drafter: str | None = None
    method: str | None = None  # ddtree, unless the schedule picks per batch size (`schedule_choice`)
    budget: int | None = None
    draft_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_queue: int = 256
    max_num_seqs: int | None = None
    schedule: str | None = None  # auto or off by `schedule_choice`
    device: str | None = None
    dtype: str | None = None
    engine: str = "auto"
    self_check: bool = True
    expect: Path | None = None
    drain_timeout: float = 30.0
    stream_interval_ms: float = 20.0
    schedule_adapt: bool = True
    lookup: int = 0  # DDTree's prompt-lookup chain (`decoding/lookup.py`), a schedule's DDTree steps' too
    synthetic_acceptance: str | None = None  # benchmarks only: dialled verdicts (`synthetic_acceptance`)

    @property
    def served_method(self) -> str:
        """--method, else DDTree: the fastest for one request at a time on the embedded pair (benchmarks/RESULTS.md)."""
        return self.method or "ddtree"
