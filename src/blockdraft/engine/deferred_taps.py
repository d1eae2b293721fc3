"""A schedule's AR steps leave their tokens out of the drafter contexts until a step drafts again.

An AR step that wrote its context at once paid a drafter extension every step (the scheduled AR step served 0.79x
the AR server on an H200); deferred, the taps of up to PENDING_MAX steps are written in one extension when drafting
resumes, and the context is the same as if every step had written it.
"""

from __future__ import annotations

import torch

from blockdraft.engine.sequence import Sequence
from blockdraft.models.host_to_device import long_tensor

PENDING_MAX = 256  # AR steps whose taps may wait out of the drafter contexts


class DeferredTaps:
    """The waiting taps, one stash a step ([B, 1, *], every sequence's one row), and the rows they hold: a sequence's
    `pending` indexes them as if concatenated."""

    def __init__(self) -> None:
        self.stashes: list[torch.Tensor] = []
        self.rows = 0

    @property
    def full(self) -> bool:
        """Whether as many steps wait as may: they are then written without waiting for a drafting step."""
        return len(self.stashes) >= PENDING_MAX

    def defer(self, taps: torch.Tensor) -> int:
        """Keep a step's taps [B, 1, *] (already copied out of the forward's buffers); the index of its first row.
        One copy for the batch: a copy a sequence cost the scheduled AR step 0.7-1.2 ms at batch 64 on an H200."""
        base = self.rows
        self.stashes.append(taps)
        self.rows += taps.shape[0]
        return base

    def take(self, running: list[Sequence]) -> tuple[list[int], list[torch.Tensor]] | None:
        """The running sequences that wait for context (their slots) and their taps [1, t, *] in commit order, each
        sequence's rows gathered in one index (None when no step waits); nothing waits afterwards."""
        if not self.stashes:
            return None
        every = torch.cat(self.stashes) if len(self.stashes) > 1 else self.stashes[0]
        slots = [b for b, seq in enumerate(running) if seq.pending]
        taps = [every[long_tensor(running[b].pending, every.device)].reshape(1, -1, every.shape[-1]) for b in slots]
        for b in slots:
            running[b].pending.clear()
        self.stashes.clear()
        self.rows = 0
        return slots, taps
