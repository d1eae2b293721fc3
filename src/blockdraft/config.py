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
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


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
class DFlash2Shape:
    """What makes a drafter DFlash-2 (vLLM 0.33 `qwen3_dflash2.py`): each layer's two grouped causal convolutions
    along the block (`conv_kernel_size` taps, channels in groups of `conv_group_size`) and the candidate selector
    (the drafter's `selector_top_k` tokens per position, edges scored through rank-`selector_rank` codebooks)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class DSparkShape:
    """What makes a drafter DSpark (vLLM 0.33 `qwen3_dspark.py` + `DSparkSpeculator`): a rank-`markov_rank` Markov
    head whose bias on each position's logits depends on the token drafted before it, logits scaled by
    `logit_scale`. With `sample_from_anchor` (vLLM's default) the drafter pass has N rows [anchor, MASK x (N-1)] and
    row i predicts the token after it, so the verify block (`DraftConfig.block_size`) is N + 1; without, the
    pass is DFlash's [anchor, MASK x N] fill-in block."""

    markov_rank: int
    sample_from_anchor: bool
    logit_scale: float

    def pass_rows(self, block_size: int) -> int:
        """Rows of a whole drafter pass for a verify block of `block_size`."""
        return block_size - 1 if self.sample_from_anchor else block_size


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash drafter's shape and semantics, whatever config.json variant it came from.

    `layer_types` is what each layer runs (after `dflash_config.use_swa`), `layer_causal` whether it is causal
    inside the block, `sliding_window` the window of its sliding layers (None: unbounded). The rules follow vLLM
    0.33's qwen3_dflash.py and the authors' dflash 0.1.0 model.py, which agree (DESIGN.md, "Drafter attention").
    """

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
    declared_layer_types: tuple[str, ...]
    layer_causal: tuple[bool, ...]
    sliding_window: int | None
    use_sliding_window: bool
    is_causal: bool | None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    partial_rotary_factor: float = 1.0
    value_scale: float | None = None
    attention_sinks: bool = False
    dflash2: DFlash2Shape | None = None
    dspark: DSparkShape | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def layer_is_causal(self, layer: int) -> bool:
        """Causal inside the block: the explicit override when set, else exactly the declared sliding layers."""
        return self.layer_causal[layer]

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for unbounded attention."""
        if self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def field_name(self, name: str) -> str:
        """Where this config holds `name` (`dflash_config.<name>` or top level), so messages name the right field."""
        return _located(self.raw, name)[1]

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json for this drafter (the raw fields, with our resolved values written back)."""
        out = copy.deepcopy(self.raw)
        dflash = dict(out.get("dflash_config") or {})
        dflash["mask_token_id"] = self.mask_token_id
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        block = self.block_size if self.dspark is None else self.dspark.pass_rows(self.block_size)
        dflash["block_size"] = block
        out["dflash_config"] = dflash
        out["block_size"] = block
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        out["layer_types"] = list(self.declared_layer_types)
        out.setdefault("architectures", ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"])
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
    return _located(raw, name, default)[0]


def _located(raw: dict[str, Any], name: str, default: Any = None) -> tuple[Any, str]:
    """A field's value and where it was read (`dflash_config.<name>` or `<name>`), so errors name the right one."""
    dflash = raw.get("dflash_config") or {}
    if name in dflash and dflash[name] is not None:
        return dflash[name], f"dflash_config.{name}"
    if name in raw and raw[name] is not None:
        return raw[name], name
    return default, f"dflash_config.{name}" if "dflash_config" in raw else name


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
    return "dflash_config" in raw or any("DFlash" in str(a) or "DSpark" in str(a) for a in archs)


def is_speculators_config(raw: dict[str, Any]) -> bool:
    """vllm-project/speculators writes its own layout: the decoder geometry nested in `transformer_layer_config`."""
    return "speculators_model_type" in raw or "transformer_layer_config" in raw


def from_speculators(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A speculators-format DFlash config -> the z-lab layout, with vLLM 0.33's mapping (speculators/algos.py):
    taps are `aux_hidden_state_layer_ids` - 1 (layer inputs -> layer outputs), and every layer is causal exactly
    when `sliding_window_non_causal` is false (its default, true, makes every layer bidirectional)."""
    kind = raw.get("speculators_model_type")
    layers = raw.get("transformer_layer_config")
    if kind != "dflash":
        variant = "a DFlash-2 drafter (candidate selector / convolutions)" if kind == "dflash2" else f"a {kind!r} speculator"
        raise BlockdraftError(
            f"{source} is a speculators-format config (`speculators_model_type`={kind!r}): {variant}, not a DFlash "
            "(v1) drafter; blockdraft runs speculators_model_type \"dflash\" only"
        )
    if not isinstance(layers, dict):
        raise BlockdraftError(
            f"{source} is a speculators-format DFlash config without a `transformer_layer_config` object; "
            "re-export it with vllm-project/speculators or convert it to the z-lab layout (dflash_config)"
        )
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise BlockdraftError(
            f"{source}: speculators field `aux_hidden_state_layer_ids`={aux!r} must list target layer indices >= 1 "
            "(layer inputs; blockdraft reads layer outputs id - 1)"
        )
    if raw.get("sample_from_anchor"):
        raise BlockdraftError(
            f"{source}: `sample_from_anchor` true drafts from the anchor slot too, which DFlash (v1) does not; "
            "use a drafter trained with sample_from_anchor false"
        )
    converted = copy.deepcopy(layers)
    converted["architectures"] = ["DFlashDraftModel"]
    for name in ("draft_vocab_size", "target_hidden_size", "block_size"):
        if raw.get(name) is not None:
            converted[name] = raw[name]
    converted["dflash_config"] = {
        "mask_token_id": raw.get("mask_token_id"),
        "target_layer_ids": [i - 1 for i in aux],
        "causal": not raw.get("sliding_window_non_causal", True),
    }
    return converted


# Fields published configs carry that no public reference gives DFlash semantics for (or that this engine does not
# run): refused by name instead of silently dropped. Each entry: field -> (value that is harmless, why, fix).
_REFUSED_FIELDS: dict[str, tuple[Any, str, str]] = {
    "is_neox_style": (True, "interleaved (GPT-J style) RoPE on the drafter's own heads",
                      "use a drafter distilled with neox-style RoPE"),
    "use_aux_hidden_state": (True, "a drafter that reads only the last target layer, without the fc over taps",
                             "use a DFlash drafter that reads target_layer_ids"),
    "has_own_lm_head": (False, "a drafter with its own LM head (DFlash shares the target's)",
                        "use a drafter that shares the target's head"),
    "mrope_section": (None, "multimodal (M-RoPE) positions", "use a drafter with 1-D RoPE"),
}


def _check_refused(raw: dict[str, Any], hidden: int, head_dim: int, vocab: int | None, source: str) -> None:
    """Refuse, by name, fields that would change what the drafter computes in ways blockdraft does not implement."""
    for name, (harmless, what, fix) in _REFUSED_FIELDS.items():
        value = _get(raw, name)
        if value is not None and value != harmless:
            raise BlockdraftError(f"{source}: field `{name}`={value!r} asks for {what}, which blockdraft does not run; {fix}")
    v_head_dim = _get(raw, "v_head_dim")
    if v_head_dim is not None and v_head_dim != head_dim:
        raise BlockdraftError(
            f"{source}: field `v_head_dim`={v_head_dim} differs from head_dim={head_dim} (a MiMo DFlash variant); no "
            "public DFlash reference (vLLM 0.33, dflash 0.1.0) defines such drafters and blockdraft does not run them"
        )
    target_hidden = _get(raw, "target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        raise BlockdraftError(
            f"{source}: field `target_hidden_size`={target_hidden} differs from hidden_size={hidden}; blockdraft runs "
            "drafters as wide as their target (the block is embedded with the target's own embedding)"
        )
    draft_vocab = _get(raw, "draft_vocab_size")
    if draft_vocab is not None and vocab is not None and draft_vocab != vocab:
        raise BlockdraftError(
            f"{source}: field `draft_vocab_size`={draft_vocab} is a reduced draft vocabulary (d2t mapping) of the "
            f"{vocab}-token target vocabulary, which blockdraft does not run; use a full-vocabulary drafter"
        )


def _declared_layer_types(raw: dict[str, Any], layers: int, window: int | None, source: str) -> list[str]:
    """`layer_types` as given, or as transformers' Qwen3Config derives it when absent (sliding from
    `max_window_layers` on, when use_sliding_window and a window are set), which is what both references read."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first_sliding = raw.get("max_window_layers", 28)
        return [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention" for i in range(layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        count = len(layer_types) if isinstance(layer_types, list) else layer_types
        raise BlockdraftError(
            f"{source}: `layer_types` has {count} entries but `num_hidden_layers`={layers}; give one per layer"
        )
    bad = [t for t in layer_types if t not in LAYER_TYPES]
    if bad:
        raise BlockdraftError(f"{source}: `layer_types` entry {bad[0]!r} is not one of {LAYER_TYPES}")
    return list(layer_types)


def _causal_override(raw: dict[str, Any], source: str) -> bool | None:
    """The explicit causality override: top-level `is_causal`, `dflash_config.is_causal` or `dflash_config.causal`;
    two that disagree are an error, since engines read different ones."""
    dflash = raw.get("dflash_config") or {}
    given = {
        name: value
        for name, value in (
            ("is_causal", raw.get("is_causal")),
            ("dflash_config.is_causal", dflash.get("is_causal")),
            ("dflash_config.causal", dflash.get("causal")),
        )
        if value is not None
    }
    for name, value in given.items():
        if not isinstance(value, bool):
            raise BlockdraftError(f"{source}: `{name}`={value!r} must be true or false")
    if len(set(given.values())) > 1:
        listed = ", ".join(f"`{k}`={str(v).lower()}" for k, v in given.items())
        raise BlockdraftError(f"{source}: {listed} disagree; keep one (engines read different ones)")
    return next(iter(given.values()), None)


def _attention(
    raw: dict[str, Any], layers: int, override: bool | None, source: str
) -> tuple[list[str], list[str], list[bool], int | None]:
    """(layer kinds run, layer kinds declared, causal per layer, window) by vLLM 0.33's `_resolve_layer_attention`
    rule, which the authors' dflash 0.1.0 shares where it has the field: `use_swa` slides every layer of a drafter
    that declares no sliding layer; the window is `dflash_config.swa_window_size`, else `sliding_window` when
    `use_sliding_window` is true; causal = the override, else the declared layer type is sliding."""
    use_sw = bool(raw.get("use_sliding_window", False))
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise BlockdraftError(f"{source}: `sliding_window`={window!r} must be a positive integer")
    dflash = raw.get("dflash_config") or {}
    swa_window = dflash.get("swa_window_size")
    if swa_window is not None and (isinstance(swa_window, bool) or not isinstance(swa_window, int) or swa_window < 1):
        raise BlockdraftError(f"{source}: `dflash_config.swa_window_size`={swa_window!r} must be a positive integer")
    effective_window = swa_window if swa_window is not None else (window if use_sw else None)
    declared = _declared_layer_types(raw, layers, window if use_sw else None, source)
    use_swa = dflash.get("use_swa", False)
    if not isinstance(use_swa, bool):
        raise BlockdraftError(f"{source}: `dflash_config.use_swa`={use_swa!r} must be true or false")
    kinds = ["sliding_attention"] * layers if use_swa and "sliding_attention" not in declared else declared
    sliding = [i for i, t in enumerate(kinds) if t == "sliding_attention"]
    if sliding and effective_window is None:
        why = "`dflash_config.use_swa` is true" if use_swa else f"layers {sliding} are sliding_attention"
        unset = "use_sliding_window is false" if window is not None else "no sliding_window is set"
        raise BlockdraftError(
            f"{source}: {why} but {unset}, so they have no window (vLLM refuses such a drafter and the authors' "
            "reference crashes on it); set use_sliding_window: true and sliding_window (or "
            "dflash_config.swa_window_size) to the trained window, or declare the layers full_attention"
        )
    causal = [override if override is not None else t == "sliding_attention" for t in declared]
    return kinds, declared, causal, effective_window


def _partial_rotary_factor(raw: dict[str, Any], source: str) -> float:
    """The share of each head RoPE rotates (vLLM reads it from rope_parameters, older configs at top level)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    factor = _optional_float(value, "partial_rotary_factor", source)
    if factor is None:
        return 1.0
    if not 0.0 < factor <= 1.0:
        raise BlockdraftError(f"{source}: `partial_rotary_factor`={factor} must be in (0, 1]")
    return factor


def _dflash2_shape(raw: dict[str, Any], hidden: int, vocab: int | None, source: str) -> DFlash2Shape | None:
    """The DFlash-2 fields when the config has any of them (or a DFlash2 architecture): all four are required, as
    vLLM reads them, with the constraints its modules assume."""
    present = [name for name in DFLASH2_FIELDS if _get(raw, name) is not None]
    if not present and not any("DFlash2" in str(a) for a in raw.get("architectures") or []):
        return None
    values = {}
    for name in DFLASH2_FIELDS:
        value, where = _located(raw, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            why = " is missing" if value is None else f"={value!r} is not a positive integer"
            raise BlockdraftError(
                f"{source}: `{where}`{why}; a DFlash-2 drafter (convolutions + candidate selector) needs all of "
                f"{', '.join(DFLASH2_FIELDS)} in dflash_config, as vLLM's qwen3_dflash2.py reads them"
            )
        values[name] = value
    if hidden % values["conv_group_size"]:
        raise BlockdraftError(
            f"{source}: `{_located(raw, 'conv_group_size')[1]}`={values['conv_group_size']} must divide "
            f"hidden_size={hidden} (the convolution's channel groups)"
        )
    if values["conv_kernel_size"] > 64:
        raise BlockdraftError(f"{source}: `{_located(raw, 'conv_kernel_size')[1]}`={values['conv_kernel_size']} taps "
                              "is longer than any block; it counts taps along the block (published: a few)")
    if vocab is not None and values["selector_top_k"] > vocab:
        raise BlockdraftError(f"{source}: `{_located(raw, 'selector_top_k')[1]}`={values['selector_top_k']} exceeds "
                              f"vocab_size={vocab}")
    return DFlash2Shape(**values)


# DFlash relatives vLLM 0.33 serves that blockdraft does not run, told apart by architecture or a field of their own:
# (name, architecture marker, marker fields, how vLLM serves them). DSpark runs (`_dspark_shape`).
_RELATIVES = (
    ("an XPress drafter (a DFlash backbone with a Jacobi-refined latent head)", "XPress", ("xpress_rank", "xpress_num_passes"),
     '--speculative-config \'{"method": "dflash", ...}\' (its XPressSpeculator is picked by the architecture)'),
)


def _refuse_relatives(raw: dict[str, Any], source: str) -> None:
    """XPress checkpoints look like DFlash ones (dflash_config, DFlash layers) but draft differently: refused by
    name, with the vLLM method that serves them, rather than run as DFlash and drafting garbage."""
    archs = [str(a) for a in raw.get("architectures") or []]
    for name, marker, fields, served in _RELATIVES:
        found = [a for a in archs if marker in a] or [f for f in fields if _get(raw, f) is not None]
        if found:
            raise BlockdraftError(
                f"{source}: {found[0]!r} marks {name}, which blockdraft does not run; serve it with vLLM "
                f"0.33 {served}"
            )


DSPARK_MARKER_FIELDS = ("markov_rank", "dspark_block_size", "dspark_noise_token_id")


def _dspark_shape(raw: dict[str, Any], source: str) -> DSparkShape | None:
    """The DSpark fields when the config is one (a DSpark architecture or field), checked against what vLLM 0.33's
    Qwen3 DSpark path runs; variants it or blockdraft does not run are refused by name."""
    archs = [str(a) for a in raw.get("architectures") or []]
    if not any("DSpark" in a for a in archs) and all(_get(raw, f) is None for f in DSPARK_MARKER_FIELDS):
        return None
    if any("Omni" in a for a in archs):
        raise BlockdraftError(f"{source}: architecture {archs} is a multimodal (Omni) DSpark drafter, which "
                              "blockdraft does not run; use a text DSpark drafter (Qwen3DSparkModel)")
    rank, where = _located(raw, "markov_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise BlockdraftError(f"{source}: `{where}`={rank!r} must be a positive integer (the DSpark Markov head's "
                              "rank); a DSpark config.json needs it")
    head = _get(raw, "markov_head_type")
    if head not in (None, "vanilla"):
        raise BlockdraftError(f"{source}: `markov_head_type`={head!r} is not run by blockdraft (nor by vLLM 0.33's "
                              "Qwen3 DSpark path): only the vanilla Markov head is")
    if _get(raw, "dspark_draft_topk") is not None:
        raise BlockdraftError(f"{source}: `dspark_draft_topk` truncates DSpark's drafts to the base top-k, which "
                              "blockdraft does not run yet; remove it to draft from the whole vocabulary")
    for name in ("output_multiplier", "final_logit_softcapping"):
        if _get(raw, name) is not None:
            raise BlockdraftError(f"{source}: `{name}` on a DSpark drafter: vLLM's DSpark head reads only "
                                  "`logit_scale`, so this field would be silently ignored; remove it")
    anchor = _get(raw, "sample_from_anchor", True)
    if not isinstance(anchor, bool):
        raise BlockdraftError(f"{source}: `sample_from_anchor`={anchor!r} must be true or false")
    scale = _optional_float(_get(raw, "logit_scale", 1.0), "logit_scale", source)
    return DSparkShape(markov_rank=rank, sample_from_anchor=anchor, logit_scale=1.0 if scale is None else scale)


def parse_draft_config(raw: dict[str, Any], source: str = "config.json") -> DraftConfig:
    """Validate a drafter config dict; every problem is reported with the field name and the fix."""
    if not isinstance(raw, dict):
        raise BlockdraftError(f"{source}: expected a JSON object")
    _refuse_relatives(raw, source)
    if is_speculators_config(raw):
        raw = from_speculators(raw, source)
    if not is_drafter_config(raw):
        raise BlockdraftError(
            f"{source} is not a DFlash drafter config (no `dflash_config` and no DFlash architecture); "
            "pass the drafter folder as --drafter and the base model as --target"
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
    vocab = raw.get("vocab_size")
    _check_refused(raw, hidden, head_dim, vocab, source)
    dflash2 = _dflash2_shape(raw, hidden, vocab, source)
    dspark = _dspark_shape(raw, source)
    if dflash2 is not None and dspark is not None:
        raise BlockdraftError(f"{source}: the config has both DFlash-2 and DSpark fields; keep the ones of the "
                              "drafter's architecture")

    block_size, block_field = _located(raw, "block_size", DEFAULT_BLOCK_SIZE)
    if dspark is not None:
        block_size, block_field = _located(raw, "dspark_block_size", block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise BlockdraftError(f"{source}: `{block_field}`={block_size!r} must be an integer >= 2 (published: 16)")
    if dspark is not None and dspark.sample_from_anchor:
        block_size += 1  # N rows [anchor, MASK x (N-1)] draft N tokens: a verify block of N + 1

    mask, mask_field = _located(raw, "mask_token_id")
    if mask is None and dspark is not None:
        mask, mask_field = _located(raw, "dspark_noise_token_id")
    if mask is None and "mask_token_id" in {**raw, **(raw.get("dflash_config") or {})}:
        raise BlockdraftError(
            f"{source}: `{mask_field}` is null, as in a training template (the trainer fills it in); use the trained "
            "drafter's exported config.json, or set it to the id the drafter was trained with"
        )
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise BlockdraftError(
            f"{source}: `{mask_field}` is missing or invalid ({mask!r}); set it to the id the drafter "
            "was trained with (Qwen3 drafters: 151669, Qwen3.5/3.6 drafters: 248070)"
        )
    if vocab is not None and mask >= vocab:
        raise BlockdraftError(
            f"{source}: `{mask_field}`={mask} is outside the drafter's vocab_size={vocab}; "
            "use the mask id the drafter was trained with"
        )

    num_target_layers = _get(raw, "num_target_layers")
    taps, taps_field = _located(raw, "target_layer_ids")
    from_rule = taps is None
    if from_rule:
        if not isinstance(num_target_layers, int):
            raise BlockdraftError(
                f"{source}: neither `dflash_config.target_layer_ids` nor `num_target_layers` is set; "
                "add the target layers the drafter was trained on"
            )
        taps = default_target_layer_ids(num_target_layers, layers)
    if not isinstance(taps, list) or not taps or not all(isinstance(t, int) and t >= 0 for t in taps):
        raise BlockdraftError(f"{source}: `{taps_field}`={taps!r} must be a non-empty list of layer indices >= 0")
    if isinstance(num_target_layers, int) and max(taps) >= num_target_layers:
        raise BlockdraftError(
            f"{source}: `{taps_field}` {taps} reach past `num_target_layers`={num_target_layers}; "
            "taps are 0-based decoder layers of the target"
        )

    override = _causal_override(raw, source)
    kinds, declared, causal, window = _attention(raw, layers, override, source)
    scale = _optional_float(_get(raw, "input_embedding_scale", 1.0), "input_embedding_scale", source)
    mult = _optional_float(_get(raw, "output_multiplier", 1.0), "output_multiplier", source)
    logit_scale = _optional_float(_get(raw, "logit_scale", 1.0), "logit_scale", source)
    softcap = _optional_float(_get(raw, "final_logit_softcapping"), "final_logit_softcapping", source)
    value_scale = _optional_float(_get(raw, "attention_value_scale"), "attention_value_scale", source)
    sinks = _get(raw, "attention_sink_bias", raw.get("add_swa_attention_sink_bias", False))
    if not isinstance(sinks, bool):
        raise BlockdraftError(f"{source}: `attention_sink_bias`={sinks!r} must be true or false")

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
        layer_types=tuple(kinds),
        declared_layer_types=tuple(declared),
        layer_causal=tuple(causal),
        sliding_window=window,
        use_sliding_window=bool(raw.get("use_sliding_window", False)),
        is_causal=override,
        input_embedding_scale=1.0 if scale is None else scale,
        output_multiplier=(1.0 if mult is None else mult) * (1.0 if logit_scale is None else logit_scale),
        final_logit_softcapping=softcap if softcap and softcap > 0 else None,
        partial_rotary_factor=_partial_rotary_factor(raw, source),
        value_scale=value_scale,
        attention_sinks=sinks,
        dflash2=dflash2,
        dspark=dspark,
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
