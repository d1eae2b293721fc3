"""The drafter config a server actually loaded, against the one the drafter ships with: the deterministic next step
when `doctor compare`'s measured fingerprints cannot tell two config faults apart (a mask id and a rope theta can
cost the same acceptance, but they differ in the file). Every field that differs is named with both values."""

from __future__ import annotations

from typing import Any

from blockdraft.config import DraftConfig
from blockdraft.doctor.static_checks import Finding

# Fields that say where or how a config was written, not how the drafter runs.
_BOOKKEEPING = {"_name_or_path", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
                "model_type_version"}


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config fields as dotted names (`dflash_config.mask_token_id`)."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if not prefix and key in _BOOKKEEPING:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def differences(intended: DraftConfig, served: DraftConfig) -> dict[str, tuple[Any, Any]]:
    """Each config field whose served value differs from the intended one: name -> (intended, served); a field one
    side lacks has None there."""
    mine, theirs = _flatten(intended.raw), _flatten(served.raw)
    return {name: (mine.get(name), theirs.get(name)) for name in sorted(mine.keys() | theirs.keys())
            if mine.get(name) != theirs.get(name)}


def served_config_findings(intended: DraftConfig, served: DraftConfig, source: str) -> list[Finding]:
    """One warning per differing field (what the server runs, what the drafter ships), or one note that they match,
    which rules out every fault that lives in the drafter's config and leaves those of the engine."""
    changed = differences(intended, served)
    if not changed:
        return [Finding("info", "config.json", f"the served drafter config ({source}) matches the drafter's own",
                        "faults in the drafter's config are ruled out; what is left is how the engine runs it "
                        "(taps read as layer inputs, sliding layers run as full, the LM head, the draft length)",
                        "check the engine's release and flags against `blockdraft doctor static`")]
    return [Finding("warning", name, f"the served drafter config ({source}) has {name} = {theirs!r}; the drafter "
                    f"ships {mine!r}", "the server drafts with a config the drafter was not trained with",
                    f"set {name} to {mine!r} in the deployment's drafter config")
            for name, (mine, theirs) in changed.items()]


def config_fault(intended: DraftConfig, served: DraftConfig) -> str | None:
    """The verdict's first clause where the served config differs: each field, as served and as shipped."""
    changed = differences(intended, served)
    if not changed:
        return None
    fields = ", ".join(f"{name} = {theirs!r} where the drafter ships {mine!r}" for name, (mine, theirs) in
                       changed.items())
    return f"{fields} (set {'it' if len(changed) == 1 else 'them'} back)"
