"""DraftConfig: every published DFlash config.json variant parsed into one validated object.

Published drafters disagree on where fields live (`block_size` at top level or in `dflash_config`, `is_causal`
or `dflash_config.causal`, taps given or left to a default rule). Everything downstream reads this object only,
so those differences are settled once, here, with errors that name the field and the fix.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockdraft.errors import BlockdraftError

LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16
_UNSUPPORTED_VARIANT_FIELDS = ("selector_rank", "conv_kernel_size", "conv_group_size")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published tap rule: k taps spread over layers 1..N-3 (k = 1 takes the middle layer)."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise BlockdraftError(
            f"num_target_layers={num_target_layers} and num_hidden_layers={num_draft_layers} must both be >= 1"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def vllm_num_speculative_tokens(block_size: int) -> int:
    """vLLM counts proposals only: a block of B slots proposes B - 1 tokens."""
    return block_size - 1


def sglang_num_draft_tokens(block_size: int) -> int:
    """SGLang counts the whole block, anchor included."""
    return block_size


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash drafter's shape and semantics, whatever config.json variant it came from."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    vocab_size: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    taps_from_default_rule: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    use_sliding_window: bool
    is_causal: bool | None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    raw: dict[str, Any] = field(compare=False, repr=False)

    def layer_is_causal(self, layer: int) -> bool:
        """Reference rule: `is_causal` when set, else causal exactly for sliding layers."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for unbounded attention."""
        if self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json for this drafter (the raw fields, with our resolved values written back)."""
        out = copy.deepcopy(self.raw)
        dflash = dict(out.get("dflash_config") or {})
        dflash["mask_token_id"] = self.mask_token_id
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        dflash["block_size"] = self.block_size
        out["dflash_config"] = dflash
        out["block_size"] = self.block_size
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        out["layer_types"] = list(self.layer_types)
        out.setdefault("architectures", ["DFlashDraftModel"])
        out.setdefault("model_type", "qwen3")
        return out

    def hf_config(self) -> Any:
        """A transformers Qwen3Config with this drafter's geometry (for rotary embeddings and MLP blocks)."""
        from transformers import Qwen3Config

        raw = {k: v for k, v in self.raw.items() if k not in ("dflash_config", "architectures", "auto_map")}
        raw.update(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            layer_types=list(self.layer_types),
        )
        if self.vocab_size is not None:
            raw["vocab_size"] = self.vocab_size
        return Qwen3Config(**raw)


def _get(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """`dflash_config.<name>` wins over the top-level field, as in the reference."""
    dflash = raw.get("dflash_config") or {}
    if name in dflash and dflash[name] is not None:
        return dflash[name]
    return raw.get(name, default)


def _require_int(raw: dict[str, Any], name: str, source: str, minimum: int = 1) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlockdraftError(f"{source}: field `{name}` is missing or not an integer; a DFlash config.json needs it")
    if value < minimum:
        raise BlockdraftError(f"{source}: field `{name}`={value} must be >= {minimum}")
    return value


def _optional_float(value: Any, name: str, source: str) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BlockdraftError(f"{source}: field `{name}`={value!r} must be a number") from None


def is_drafter_config(raw: dict[str, Any]) -> bool:
    """A DFlash drafter says so by its architecture name or by a `dflash_config` section."""
    archs = raw.get("architectures") or []
    return "dflash_config" in raw or any("DFlash" in str(a) for a in archs)


def parse_draft_config(raw: dict[str, Any], source: str = "config.json") -> DraftConfig:
    """Validate a drafter config dict; every problem is reported with the field name and the fix."""
    if not isinstance(raw, dict):
        raise BlockdraftError(f"{source}: expected a JSON object")
    if not is_drafter_config(raw):
        raise BlockdraftError(
            f"{source} is not a DFlash drafter config (no `dflash_config` and no DFlash architecture); "
            "pass the drafter folder as --drafter and the base model as --target"
        )
    for name in _UNSUPPORTED_VARIANT_FIELDS:
        if _get(raw, name) is not None:
            raise BlockdraftError(
                f"{source}: field `{name}` marks a DFlash-2 drafter (candidate selector / convolutions), "
                "which blockdraft does not run yet; use a DFlash (v1) drafter"
            )
    hidden = _require_int(raw, "hidden_size", source)
    layers = _require_int(raw, "num_hidden_layers", source)
    heads = _require_int(raw, "num_attention_heads", source)
    kv_heads = raw.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise BlockdraftError(
            f"{source}: `num_key_value_heads`={kv_heads} must divide `num_attention_heads`={heads}"
        )
    head_dim = raw.get("head_dim") or hidden // heads
    intermediate = _require_int(raw, "intermediate_size", source)

    block_size = _get(raw, "block_size", DEFAULT_BLOCK_SIZE)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise BlockdraftError(f"{source}: `block_size`={block_size!r} must be an integer >= 2 (published: 16)")

    mask = _get(raw, "mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise BlockdraftError(
            f"{source}: `dflash_config.mask_token_id` is missing or invalid ({mask!r}); set it to the id the drafter "
            "was trained with (Qwen3 drafters: 151669, Qwen3.5/3.6 drafters: 248070)"
        )
    vocab = raw.get("vocab_size")
    if vocab is not None and mask >= vocab:
        raise BlockdraftError(
            f"{source}: `dflash_config.mask_token_id`={mask} is outside the drafter's vocab_size={vocab}; "
            "use the mask id the drafter was trained with"
        )

    num_target_layers = _get(raw, "num_target_layers")
    taps = _get(raw, "target_layer_ids")
    from_rule = taps is None
    if from_rule:
        if not isinstance(num_target_layers, int):
            raise BlockdraftError(
                f"{source}: neither `dflash_config.target_layer_ids` nor `num_target_layers` is set; "
                "add the target layers the drafter was trained on"
            )
        taps = default_target_layer_ids(num_target_layers, layers)
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) and t >= 0 for t in taps):
        raise BlockdraftError(
            f"{source}: `dflash_config.target_layer_ids`={taps!r} must be a non-empty list of layer indices >= 0"
        )
    if isinstance(num_target_layers, int) and max(taps) >= num_target_layers:
        raise BlockdraftError(
            f"{source}: `target_layer_ids` {taps} reach past `num_target_layers`={num_target_layers}; "
            "taps are 0-based decoder layers of the target"
        )

    layer_types = raw.get("layer_types") or ["full_attention"] * layers
    if len(layer_types) != layers:
        raise BlockdraftError(
            f"{source}: `layer_types` has {len(layer_types)} entries but `num_hidden_layers`={layers}; give one per layer"
        )
    bad = [t for t in layer_types if t not in LAYER_TYPES]
    if bad:
        raise BlockdraftError(f"{source}: `layer_types` entry {bad[0]!r} is not one of {LAYER_TYPES}")
    use_sw = bool(raw.get("use_sliding_window", False))
    window = raw.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise BlockdraftError(f"{source}: `sliding_window`={window!r} must be a positive integer")
    effective_window = window if use_sw else None

    is_causal = raw.get("is_causal")
    if is_causal is None:
        is_causal = (raw.get("dflash_config") or {}).get("causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise BlockdraftError(f"{source}: `is_causal`={is_causal!r} must be true or false")

    scale = _optional_float(_get(raw, "input_embedding_scale", 1.0), "input_embedding_scale", source)
    mult = _optional_float(_get(raw, "output_multiplier", 1.0), "output_multiplier", source)
    softcap = _optional_float(_get(raw, "final_logit_softcapping"), "final_logit_softcapping", source)

    return DraftConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        attention_bias=bool(raw.get("attention_bias", False)),
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=tuple(taps),
        num_target_layers=num_target_layers if isinstance(num_target_layers, int) else None,
        taps_from_default_rule=from_rule,
        layer_types=tuple(layer_types),
        sliding_window=effective_window,
        use_sliding_window=use_sw,
        is_causal=is_causal,
        input_embedding_scale=1.0 if scale is None else scale,
        output_multiplier=1.0 if mult is None else mult,
        final_logit_softcapping=softcap if softcap and softcap > 0 else None,
        raw=copy.deepcopy(raw),
    )


def load_draft_config(path: str | Path) -> DraftConfig:
    """Read `config.json` from a drafter folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise BlockdraftError(f"drafter config not found: {file} does not exist; pass a folder holding config.json")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise BlockdraftError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it") from None
    return parse_draft_config(raw, source=str(file))
