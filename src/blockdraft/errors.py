"""One exception type for every mistake a user can fix: the CLI prints its message as one line and exits 2."""

from __future__ import annotations


class BlockdraftError(Exception):
    """A user-facing error: the message names the field at fault and the fix."""
