"""What a step of the batched engine may run: AR, a DFlash chain of N drafted tokens, or a DDTree of N nodes, with
the labels the schedule files and the server's metrics use ('ar', 'dflash/N', 'ddtree@N')."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from blockdraft.engine.field_checks import FieldCheck
from blockdraft.errors import BlockdraftError

# Rank among equal row counts for tie-breaking: no drafter beats a drafter, and a chain needs no tree built on the
# host. Kept here rather than imported from decoding.methods, which pulls in torch; the schedule is arithmetic.
METHOD_RANK = {"ar": 0, "dflash": 1, "ddtree": 2}
_LABEL = re.compile(r"ar|dflash/(?P<chain>[1-9][0-9]*)|ddtree@(?P<budget>[1-9][0-9]*)")
_LABELS = "'ar', 'dflash/N' (a chain of N draft tokens) or 'ddtree@N' (a tree of N nodes), N >= 1"


@dataclass(frozen=True)
class Candidate:
    """One way to decode a step: AR, a DFlash chain of `draft_tokens`, or a DDTree of `budget` nodes.

    A DDTree is keyed by its budget alone (its tau and build time are measured per budget), so its draft_tokens is 0.
    """

    method: str
    draft_tokens: int = 0
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHOD_RANK:
            raise BlockdraftError(f"candidate method {self.method!r} must be one of {', '.join(METHOD_RANK)}")
        if self.method == "dflash" and not self.draft_tokens >= 1:
            raise BlockdraftError(f"a dflash candidate needs draft_tokens >= 1, not {self.draft_tokens}")
        if self.method != "dflash" and self.draft_tokens != 0:
            raise BlockdraftError(f"a {self.method} candidate drafts no chain; leave draft_tokens at 0, "
                                  f"not {self.draft_tokens}")
        if self.method == "ddtree" and not (self.budget or 0) >= 1:
            raise BlockdraftError(f"a ddtree candidate needs a budget >= 1, not {self.budget}")
        if self.method != "ddtree" and self.budget is not None:
            raise BlockdraftError(f"a {self.method} candidate has no tree; leave budget unset, not {self.budget}")

    @property
    def rows(self) -> int:
        """Rows per sequence in the verify forward: the last committed token plus every drafted one."""
        if self.method == "ddtree":
            return 1 + int(self.budget or 0)
        return 1 + self.draft_tokens

    @property
    def label(self) -> str:
        if self.method == "dflash":
            return f"dflash/{self.draft_tokens}"
        if self.method == "ddtree":
            return f"ddtree@{self.budget}"
        return "ar"

    @classmethod
    def from_label(cls, label: str) -> Candidate:
        """The candidate `label` names (the inverse of `.label`): a cost table keys each candidate's host work by it."""
        match = _LABEL.fullmatch(label) if isinstance(label, str) else None
        if match is None:
            raise BlockdraftError(f"candidate label {label!r} must be {_LABELS}")
        if match["chain"]:
            return cls("dflash", int(match["chain"]))
        if match["budget"]:
            return cls("ddtree", budget=int(match["budget"]))
        return cls("ar")

    def cheapness(self) -> tuple[int, int]:
        """Sort key for ties: fewer verify rows first, then no drafter, then no host-built tree."""
        return self.rows, METHOD_RANK[self.method]


AR = Candidate("ar")


def speculative_label(check: FieldCheck, raw: Any) -> str:
    """A key of commit_by_candidate_s: a speculative candidate's label (AR's host work is commit_s)."""
    try:
        candidate = Candidate.from_label(raw)
    except BlockdraftError:
        candidate = AR
    if candidate == AR:
        raise check.fail(f"a key of commit_by_candidate_s = {raw!r} must be a speculative candidate's label, "
                         "'dflash/N' or 'ddtree@N' (AR's host work is commit_s)")
    return candidate.label
