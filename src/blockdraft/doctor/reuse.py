"""Reuse or retrain: does a base model's drafter still work on a fine-tune of that model?

Users report both outcomes: a base drafter reused on a fine-tune drops to single-digit acceptance (z-lab/dflash
#80), while some same-lineage pairs keep ~98% of it (z-lab/dflash #149). So measure: the drafter's healthy
acceptance on the fine-tuned target against the same drafter on its base target, same prompts, T = 0, and decide
from the share of the base pair's speculative gain (tau - 1) the fine-tune keeps.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from blockdraft.doctor.fingerprint import Fingerprint

# Keep at least this share of the base pair's gain and retraining has little left to win; below it, a short
# `train --init` run from this drafter on the fine-tune's own answers recovers what the fine-tune moved.
REUSE_RETENTION = 0.9


@dataclass(frozen=True)
class ReuseVerdict:
    """The drafter's acceptance on the fine-tune and on its base, and what to do."""

    pair: Fingerprint
    base: Fingerprint
    target: str
    drafter: str

    @property
    def retention(self) -> float:
        """Share of the base pair's gain (tau - 1) the fine-tuned pair keeps (1.0 = all of it)."""
        gain = self.base.tau - 1.0
        return (self.pair.tau - 1.0) / gain if gain > 0 else 0.0

    @property
    def decision(self) -> str:
        return "reuse" if self.retention >= REUSE_RETENTION else "retrain"

    @property
    def train_command(self) -> str:
        """Continue from this drafter on the fine-tune's own responses (its weights as the start)."""
        out = f"runs/{self.target.rstrip('/').split('/')[-1]}-dflash"
        return shlex.join(["blockdraft", "train", "--target", self.target, "--init", self.drafter,
                           "--prompts", "sharegpt-turns", "--out", out])

    @property
    def summary(self) -> str:
        numbers = (f"tau {self.pair.tau:.2f} on the fine-tune vs {self.base.tau:.2f} on its base: "
                   f"{self.retention:.0%} of the base pair's gain kept")
        if self.decision == "reuse":
            return f"reuse the drafter: {numbers} (>= {REUSE_RETENTION:.0%})"
        return f"retrain: {numbers} (< {REUSE_RETENTION:.0%}); continue from this drafter: {self.train_command}"
