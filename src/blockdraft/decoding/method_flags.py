"""The decoding methods' names and the --lookup flag's rules: what a command checks before anything loads, kept
free of the decoding stack's imports so `serve` can check its flags before it starts the engine."""

from __future__ import annotations

from blockdraft.errors import BlockdraftError

METHODS = ("ar", "dflash", "ddtree")


def check_lookup(lookup: int) -> int:
    """A chain of 0 (off) or more tokens; refuse anything else before any compute."""
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
        raise BlockdraftError(f"--lookup {lookup} must be an integer >= 0 (the most tokens of a prompt-lookup chain "
                              "in each DDTree tree, e.g. 15; 0: off)")
    return lookup


def check_lookup_method(lookup: int, method: str) -> int:
    """`check_lookup`, and a chain only for DDTree: checked before any model loads."""
    if check_lookup(lookup) and method != "ddtree":
        raise BlockdraftError(f"--lookup {lookup} adds a prompt-lookup chain to DDTree's trees: use it with --method "
                              f"ddtree, not {method}")
    return lookup
