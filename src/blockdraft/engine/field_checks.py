"""Reading cost tables and schedules written by hand or by an older release: every value checked as it is typed,
every error one line naming the file, the field and the fix."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.errors import BlockdraftError

ROUNDING = 1e-6  # what a rate or tau may exceed its bound by, after a JSON round trip


@dataclass(frozen=True)
class FieldCheck:
    """Turns raw (JSON or hand-built) values into typed ones; every error names `where`, the field and `fix`."""

    where: str
    fix: str = ""

    def fail(self, message: str) -> BlockdraftError:
        return BlockdraftError(f"{self.where}: {message}" + (f"; {self.fix}" if self.fix else ""))

    def count(self, raw: Any, name: str, must: str = "a positive integer", floor: int = 1) -> int:
        """An integer >= floor; JSON object keys arrive as strings, so digit strings count too."""
        value: int | None = None
        if isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().isdigit():
            value = int(raw)
        if value is None or value < floor:
            raise self.fail(f"{name} = {raw!r} must be {must}")
        return value

    def number(self, raw: Any, name: str, must: str, low: float = 0.0, high: float = math.inf,
               open_low: bool = False) -> float:
        """A finite float in low..high (above low when `open_low`)."""
        ok = isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw)
        if not ok or raw > high or raw < low or (open_low and raw <= low):
            raise self.fail(f"{name} = {raw!r} must be {must}")
        return float(raw)

    def text(self, raw: Any, name: str, optional: bool = False) -> str | None:
        if raw is None and optional:
            return None
        if not isinstance(raw, str) or not raw:
            raise self.fail(f"{name} = {raw!r} must be a non-empty string")
        return raw

    def mapping(self, raw: Any, name: str, empty_ok: bool = False) -> dict[Any, Any]:
        if not isinstance(raw, dict) or (not raw and not empty_ok):
            raise self.fail(f"{name} = {raw!r} must be a{'n' if empty_ok else ' non-empty'} object")
        return raw

    def seconds(self, raw: dict[Any, Any], name: str, key_must: str, zero_ok: bool = False) -> dict[int, float]:
        """{count: positive (or, with `zero_ok`, non-negative) seconds}, keys converted to int (JSON writes them as
        strings)."""
        must = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        return {
            self.count(key, f"a key of {name}", key_must): self.number(
                value, f"{name}[{key!r}]", must, open_low=not zero_ok
            )
            for key, value in raw.items()
        }


def read_json(path: str | Path, kind: str, fix: str) -> Any:
    file = Path(path)
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise BlockdraftError(f"{kind} {file} does not exist; {fix}") from None
    except json.JSONDecodeError as exc:
        raise BlockdraftError(f"{kind} {file} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}") from None


def check_format(data: Any, check: FieldCheck, expected: str) -> dict[str, Any]:
    """The top-level object of a file of `expected` format."""
    if not isinstance(data, dict):
        raise check.fail(f"expected a JSON object with \"format\": \"{expected}\"")
    if data.get("format") != expected:
        raise check.fail(f"format = {data.get('format')!r} must be {expected!r}")
    return data
