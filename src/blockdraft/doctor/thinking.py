"""Thinking mode: the chat-template switch most often reported behind a collapsed acceptance.

A reasoning model's chat template (Qwen3's `enable_thinking`) renders one chat two ways, and a drafter trained on
one mode's answers accepts far less in the other (tau 5-6 falls to 2-3). The doctor sends prompts rendered with
thinking off, as `generate` and the trainer render them. Where the switch changes a render, the probe also
measures the drafter with thinking on, kept as the fingerprint `thinking on` beside the faults, so that a
server's acceptance can be matched to either mode; `compare` says which mode its requests run and which mode the
server's tau matches. The second mode is measured only where the switch exists, healthy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from blockdraft.doctor.diagnose import DEFAULT_TOLERANCE, rank_hypotheses
from blockdraft.doctor.fingerprint import LEVEL, RESAMPLES, Fingerprint, Span, bootstrap_indices, resampled
from blockdraft.doctor.report import tau_text
from blockdraft.doctor.static_checks import Finding

THINKING_ON = "thinking on"
FIELD = "chat_template_kwargs.enable_thinking"


@dataclass(frozen=True)
class Renders:
    """A prompt set as token ids with thinking off (what the doctor sends) and with thinking on (None where no
    render changes, `why_not` saying why)."""

    off: list[list[int]]
    on: list[list[int]] | None
    why_not: str = ""


def render_modes(items: Sequence[Any], tokenizer: Any) -> Renders:
    """Every prompt rendered with the chat template's thinking off and on: the template has the switch where a
    render differs (a template without one ignores `enable_thinking`; prompts given as ids or text use none)."""
    from blockdraft.pair import encode_item

    off = [encode_item(item, tokenizer, False) for item in items]
    if not any(item.messages is not None for item in items):
        return Renders(off, None, "the prompts are not chat messages, so no chat template renders them")
    on = [encode_item(item, tokenizer, True) for item in items]
    if on == off:
        return Renders(off, None, "the chat template has no thinking switch (enable_thinking renders the same either "
                                  "way)")
    return Renders(off, on)


def tau_gap(better: Fingerprint, worse: Fingerprint, level: float = LEVEL, resamples: int = RESAMPLES) -> Span | None:
    """The `level` interval of `better`'s tau minus `worse`'s over resamples of their prompts, drawn together where
    both measured the same prompts (here rendered two ways), so each prompt's own difficulty cancels; None where
    either kept fewer than two prompts."""
    if not better.prompts or not worse.prompts or min(len(better.prompts), len(worse.prompts)) < 2:
        return None
    index = bootstrap_indices(len(better.prompts), resamples)
    paired = len(worse.prompts) == len(better.prompts)
    other = index if paired else bootstrap_indices(len(worse.prompts), resamples, seed=1)
    gap = resampled(better, index, None)[0] - resampled(worse, other, None)[0]
    low, high = torch.quantile(gap, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=gap.dtype))
    return float(low), float(high)


def mode_finding(off: Fingerprint, on: Fingerprint) -> Finding:
    """Which mode the drafter serves well. The worse mode is served badly only when even the low end of the tau
    gap exceeds what the verdict forgives (10% of the better mode's gain); else both modes are served alike."""
    better, worse, good, bad = (off, on, "off", "on") if off.tau >= on.tau else (on, off, "on", "off")
    said = {"off": tau_text(off, off.intervals()), "on": tau_text(on, on.intervals())}
    gain = better.tau - 1.0
    gap = tau_gap(better, worse)
    least = better.tau - worse.tau if gap is None else gap[0]
    if gain <= 0.0 or least <= DEFAULT_TOLERANCE * gain:
        return Finding("info", FIELD, f"the drafter serves thinking on and off alike: tau {said['on']} with thinking "
                                      f"on, {said['off']} off", "", "")
    lost = 1.0 - (worse.tau - 1.0) / gain
    spread = "" if gap is None else f" (tau gap {gap[0]:.2f}-{gap[1]:.2f})"
    return Finding(
        "warning", FIELD,
        f"the drafter serves thinking {good} well; with thinking {bad} tau is {said[bad]} against {said[good]}",
        f"requests run with thinking {bad} lose {lost:.0%} of the drafter's gain{spread}",
        f'run requests with thinking {good}: chat_template_kwargs {{"enable_thinking": {str(good == "on").lower()}}} '
        "with each request, or as the server's default",
    )


def served_mode_finding(observed: Fingerprint, off: Fingerprint, on: Fingerprint) -> Finding:
    """The mode the server's requests ran (the doctor renders them with thinking off and sends the ids), and which
    mode's fingerprint the server's acceptance matches: the other one makes a mode mismatch the likely cause."""
    sent = ("the doctor's requests run thinking off (it renders each prompt with the chat template's enable_thinking "
            "false and sends the ids)")
    if rank_hypotheses(observed, off, {THINKING_ON: on})[0].name == THINKING_ON:
        return Finding(
            "warning", FIELD,
            f"{sent}, yet the server's tau {observed.tau:.2f} matches this drafter with thinking on ({on.tau:.2f}) "
            f"better than off ({off.tau:.2f})",
            "a thinking-mode mismatch is the likely cause of the gap",
            "run the server's requests in the mode the drafter serves well (see the line above)",
        )
    return Finding("info", FIELD, f"{sent}; the server's tau {observed.tau:.2f} matches this drafter with thinking off "
                                  f"({off.tau:.2f}) better than on ({on.tau:.2f})", "", "")


def thinking_findings(renders: Renders, reference: Fingerprint, faults: dict[str, Fingerprint],
                      observed: Fingerprint | None = None) -> list[Finding]:
    """A report's thinking-mode lines: without a switch, one line saying so; with one, the mode the drafter serves
    well and, beside a server's measurement (`compare`), the mode its requests ran and the mode its tau matches."""
    on = faults.get(THINKING_ON)
    if renders.on is None or on is None:
        return [Finding("info", FIELD, f"{renders.why_not}; probed once", "", "")]
    said = [mode_finding(reference, on)]
    if observed is not None:
        said.append(served_mode_finding(observed, reference, on))
    return said
