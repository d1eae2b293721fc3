"""Comma-separated numbers given on a command line (`--budgets 32,64`), parsed with one clear line on bad input."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from blockdraft.errors import BlockdraftError


def comma_numbers(text: str, flag: str, kind: Callable[[str], Any], example: str) -> list[Any]:
    """`1,9,17` -> [1, 9, 17] (kind int), `0,0.7` -> [0.0, 0.7] (kind float); one line naming the flag otherwise."""
    try:
        return _values(text, kind, example)
    except ValueError as exc:
        raise BlockdraftError(f"{flag} {exc}") from None


def int_list(text: str) -> list[int]:
    """An argparse `type` for a comma-separated list of positive integers (argparse names the flag and exits 2)."""
    return _bounded_ints(text, 1, "positive integers", "1,4,16")


def count_list(text: str) -> list[int]:
    """An argparse `type` for a comma-separated list of counts, 0 included (e.g. 0,15: without and with)."""
    return _bounded_ints(text, 0, "counts of 0 or more", "0,15")


def _bounded_ints(text: str, least: int, what: str, example: str) -> list[int]:
    try:
        values = _values(text, int, example)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if min(values) < least:
        raise argparse.ArgumentTypeError(f"{text!r} must hold {what} like {example}")
    return values


def _values(text: str, kind: Callable[[str], Any], example: str) -> list[Any]:
    """The list, or a ValueError whose message follows the flag's name: what is wrong and an example."""
    noun = "integers" if kind is int else "numbers"
    try:
        values = [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{text!r} must be comma-separated {noun} like {example}") from None
    if not values:
        raise ValueError(f"is empty; give comma-separated {noun} like {example}")
    return values
