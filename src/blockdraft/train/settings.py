"""`blockdraft train` options as one object, and the run's summary.

The CLI and Python callers (tests, fixtures) build the same `TrainSettings`; it is written next to the checkpoint
so a resumed run can be checked against the options that shaped the one it continues.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blockdraft.prompt_sets import BUILTIN_SETS
from blockdraft.errors import BlockdraftError

SELF_SOURCE = "self"  # --prompts self: the target writes its own prompts (train.self_prompts)

SETTINGS_NAME = "train_settings.json"
SUMMARY_NAME = "train_summary.json"
# Options that do not change the training trajectory, so a resumed run may differ in them.
# `parallel` is among them: fsdp, ddp and one process train the same model, and write the same checkpoint format.
RESUME_FREE = {"resume", "save_every", "eval_every", "eval_tokens", "device", "gen_batch_size", "parallel", "compile"}
PARALLEL_MODES = ("ddp", "fsdp")


@dataclass(frozen=True)
class TrainSettings:
    """Every `blockdraft train` option; defaults follow the DFlash paper's recipe."""

    target: str
    out: Path
    prompts: str | None = None
    layers: int | None = None
    block_size: int = 16
    taps: list[int] | None = None
    sliding_layers: list[int] | None = None
    sliding_window: int | None = None
    causal: bool | None = None
    mask_token_id: int | None = None
    max_length: int = 3072
    response_tokens: int = 1024
    anchors_per_seq: int = 512
    epochs: int = 6
    steps: int | None = None
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    gamma: float | None = None
    save_every: int = 500
    eval_every: int = 500
    eval_prompts: int = 8
    eval_tokens: int = 128
    resume: bool = False
    regenerate: bool = True
    num_prompts: int | None = None
    gen_batch_size: int = 32
    gen_temperatures: tuple[float, ...] = (0.0,)
    precompute_features: bool = False
    distill_topk: int = 0
    init: str = "target"
    attention: str = "auto"
    compile: bool = False
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    parallel: str = "ddp"

    def check(self) -> None:
        """Refuse impossible values before any loading."""
        for name in ("block_size", "max_length", "response_tokens", "anchors_per_seq", "epochs", "batch_size",
                     "grad_accum", "gen_batch_size"):
            if getattr(self, name) < 1:
                raise BlockdraftError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.steps is not None and self.steps < 1:
            raise BlockdraftError(f"--steps {self.steps} must be >= 1 (or leave it out to train --epochs)")
        if self.lr <= 0:
            raise BlockdraftError(f"--lr {self.lr} must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise BlockdraftError(f"--warmup-ratio {self.warmup_ratio} must be in [0, 1): the share of steps spent warming up")
        if not self.gen_temperatures or any(t < 0 for t in self.gen_temperatures):
            raise BlockdraftError(f"--gen-temperatures {self._temperatures()} must list temperatures >= 0 (0: greedy)")
        if self.gen_temperatures.count(0) > 1:
            raise BlockdraftError(f"--gen-temperatures {self._temperatures()} lists 0 twice; greedy answers are all alike, list it once")
        if self.init not in ("target", "random") and not (Path(self.init).expanduser() / "config.json").is_file():
            raise BlockdraftError(
                f"--init {self.init!r} must be target, random or a drafter folder (config.json + model.safetensors)"
            )
        if self.attention not in ("auto", "sdpa", "flex"):
            raise BlockdraftError(f"--attention {self.attention!r} must be auto, sdpa or flex")
        if self.parallel not in PARALLEL_MODES:
            raise BlockdraftError(f"--parallel {self.parallel!r} must be ddp or fsdp")
        if self.distill_topk < 0:
            raise BlockdraftError(f"--distill-topk {self.distill_topk} must be >= 0 (0: train on the text's tokens)")
        if self.distill_topk and self.precompute_features:
            raise BlockdraftError("--distill-topk needs the target's logits at every step; drop --precompute-features")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise BlockdraftError(f"--num-prompts {self.num_prompts} must be >= 1 (or leave it out to use every prompt)")
        if self.prompts == SELF_SOURCE:
            if self.num_prompts is None:
                raise BlockdraftError("--prompts self needs --num-prompts N: how many requests the target writes")
            if not self.regenerate:
                raise BlockdraftError("--prompts self has no answers to train on; drop --no-regenerate")
        elif self.prompts is not None and self.prompts not in BUILTIN_SETS and not Path(self.prompts).expanduser().is_file():
            raise BlockdraftError(
                f"--prompts {self.prompts}: no such file; pass a .jsonl/.json/.txt file, a built-in set "
                f"({', '.join(BUILTIN_SETS)}) or self (requests the target writes)"
            )

    def _temperatures(self) -> str:
        return ",".join(f"{t:g}" for t in self.gen_temperatures)

    def to_json(self) -> dict[str, Any]:
        """JSON values (paths as strings, tuples as lists), so a resumed run compares equal to what was written."""
        return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
                for k, v in asdict(self).items()}


@dataclass
class TrainSummary:
    """The run in numbers (also written to train_summary.json)."""

    samples: int
    steps: int
    tokens: int
    tokens_per_s: float
    first_loss: float | None
    last_loss: float | None
    tau_before: float | None
    tau_after: float | None
    drafter_dir: str
    launch: dict[str, str] = field(default_factory=dict)
    stopped_early: bool = False
