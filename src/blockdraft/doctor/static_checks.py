"""Static checks: does this drafter fit this target and this deployment, before anything runs?

Each check reads configs only (plus, when given, the tokenizer and chat template) and returns `Finding`s that
say what is wrong, what it costs in acceptance, and the exact fix. The drafter's own config is the authority on
what it was trained with; a check flags what contradicts the target, the engine flags, or known mistakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from blockdraft.config import DraftConfig, default_target_layer_ids
from blockdraft.errors import BlockdraftError

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "info": 2}

COLLAPSE = "acceptance collapses to ~1-2% (tau ~1.1)"
QWEN3_MASK_ID = 151669
QWEN35_MASK_IDS = (248070, 248077)  # both published: z-lab's Qwen3.6 drafters use the first, Qwen3.5-4B-DFlash the second
QWEN35_VOCAB = 248320
HYBRID_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next"})
THINKING_MARKERS = ("enable_thinking", "<think>")


@dataclass(frozen=True)
class Finding:
    """One problem (or thing to know) about a drafter/target/engine combination."""

    severity: Severity
    field: str
    message: str
    cost: str
    fix: str


def text_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a target config (multimodal Qwen3.5/3.6 nest it under `text_config`)."""
    inner = target_config.get("text_config")
    if not isinstance(inner, dict):
        return target_config
    return {**target_config, **inner}


def is_hybrid_target(target_config: dict[str, Any] | None) -> bool:
    """Targets with linear-attention (Gated DeltaNet) layers need engine-specific capture and state handling."""
    if not target_config:
        return False
    inner = target_config.get("text_config")
    model_types = {target_config.get("model_type"), inner.get("model_type") if isinstance(inner, dict) else None}
    layer_types = text_config(target_config).get("layer_types") or []
    return bool(model_types & HYBRID_MODEL_TYPES) or "linear_attention" in layer_types


def _require(target: dict[str, Any], name: str) -> int:
    value = target.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BlockdraftError(
            f"target config has no integer `{name}`; pass the base model's config.json (or its folder) as --target"
        )
    return value


def _check_geometry(draft: DraftConfig, target: dict[str, Any]) -> list[Finding]:
    findings = []
    hidden = _require(target, "hidden_size")
    if draft.hidden_size != hidden:
        findings.append(Finding(
            "error", "hidden_size",
            f"drafter hidden_size {draft.hidden_size} != target hidden_size {hidden}",
            "the drafter cannot run on this target (its fc layer and KV injection expect other shapes)",
            "use a drafter trained for this target",
        ))
    layers = _require(target, "num_hidden_layers")
    if draft.num_target_layers is not None and draft.num_target_layers != layers:
        findings.append(Finding(
            "error", "num_target_layers",
            f"drafter was trained on a {draft.num_target_layers}-layer target; this target has {layers} layers",
            f"its taps read other layers than it was trained on: {COLLAPSE}",
            "use a drafter trained for this target (same model, same depth)",
        ))
    return findings


def _ordinary_token(tokenizer: Any, token_id: int) -> str | None:
    """The token text if `token_id` is an ordinary vocabulary entry; None for special, added or unused ids."""
    if token_id in set(getattr(tokenizer, "all_special_ids", None) or []):
        return None
    if token_id in (getattr(tokenizer, "added_tokens_decoder", None) or {}) or token_id >= len(tokenizer):
        return None
    return tokenizer.convert_ids_to_tokens(token_id)


def _family_mask_ids(vocab: int) -> tuple[int, ...]:
    """The mask ids published drafters use for a target vocabulary size (none known: empty)."""
    if 151_900 <= vocab < 152_000:
        return (QWEN3_MASK_ID,)
    if vocab == QWEN35_VOCAB:
        return QWEN35_MASK_IDS
    return ()


def _check_vocab(draft: DraftConfig, target: dict[str, Any], tokenizer: Any | None) -> list[Finding]:
    findings = []
    vocab = _require(target, "vocab_size")
    mask = draft.mask_token_id
    if draft.vocab_size is not None and draft.vocab_size != vocab:
        findings.append(Finding(
            "error", "vocab_size",
            f"drafter vocab_size {draft.vocab_size} != target vocab_size {vocab}: it was trained for another tokenizer",
            "its proposals are ids of a different vocabulary: acceptance ~0",
            "use a drafter trained for this target's tokenizer",
        ))
    if mask >= vocab:
        findings.append(Finding(
            "error", "dflash_config.mask_token_id",
            f"mask_token_id {mask} is outside the target vocabulary (vocab_size {vocab})",
            "embedding the mask slots fails (index out of range) or the engine refuses to load",
            "set dflash_config.mask_token_id to the id the drafter was trained with for this target",
        ))
        return findings
    published = _family_mask_ids(vocab)
    if published and mask not in published:
        cross_family = mask == QWEN3_MASK_ID and published == QWEN35_MASK_IDS
        named = " or ".join(map(str, published))
        findings.append(Finding(
            "error" if cross_family else "warning", "dflash_config.mask_token_id",
            f"mask_token_id {mask} on a {vocab}-token vocabulary; published drafters for this family use {named}"
            + (" (151669 is the Qwen3 mask id, an ordinary token here)" if cross_family else ""),
            f"a mask id other than the trained one: {COLLAPSE}",
            f"set dflash_config.mask_token_id to the one of {named} this drafter was trained with, unless it was "
            f"trained with {mask}",
        ))
    token = None if tokenizer is None else _ordinary_token(tokenizer, mask)
    if token is not None:
        findings.append(Finding(
            "warning", "dflash_config.mask_token_id",
            f"mask_token_id {mask} is the ordinary token {token!r}, not a special, added or unused id",
            f"if it is not the id the drafter was trained with: {COLLAPSE}",
            "use the drafter's trained mask id (a reserved/special token or an unused embedding row)",
        ))
    return findings


def _known_wrong_taps(num_layers: int, k: int) -> dict[str, list[int]]:
    """Tap lists produced by mistakes seen in the wild, by the name of the mistake."""
    if k < 2:
        return {}
    default = default_target_layer_ids(num_layers, k)
    step = (num_layers - 2) / (k - 1)
    ceil_step = -(-(num_layers - 2) // (k - 1))
    guesses = {
        "spacing (N-2)/(k-1), rounded": [int(1 + i * step + 0.5) for i in range(k)],
        "spacing (N-2)/(k-1), truncated": [int(1 + i * step) for i in range(k)],
        "spacing ceil((N-2)/(k-1)), clamped to N-1": [min(1 + i * ceil_step, num_layers - 1) for i in range(k)],
        "HF hidden_states index (layer input, +1)": [t + 1 for t in default],
        "layer inputs instead of outputs (-1)": [t - 1 for t in default] if default[0] >= 1 else default,
    }
    return {name: taps for name, taps in guesses.items() if taps != default}


def _check_taps(draft: DraftConfig, target: dict[str, Any]) -> list[Finding]:
    layers = _require(target, "num_hidden_layers")
    taps = list(draft.target_layer_ids)
    k = draft.num_hidden_layers
    outside = [t for t in taps if t > layers - 1]
    if outside:
        return [Finding(
            "error", "dflash_config.target_layer_ids",
            f"taps {outside} are past the target's last layer {layers - 1} (taps are 0-based layer outputs)",
            "the engine cannot load the drafter, or reads layers that do not exist",
            "use a drafter trained for this target",
        )]
    findings = []
    default = default_target_layer_ids(layers, k)
    if draft.taps_from_default_rule:
        findings.append(Finding(
            "info", "dflash_config.target_layer_ids",
            f"config gives no taps; the default rule picks {taps}",
            f"if the drafter was trained with other taps: {COLLAPSE}",
            "add dflash_config.target_layer_ids from the drafter's training run if it differs",
        ))
    elif taps != default:
        wrong = [name for name, guess in _known_wrong_taps(layers, k).items() if guess == taps]
        if wrong:
            findings.append(Finding(
                "warning", "dflash_config.target_layer_ids",
                f"taps {taps} match a known wrong formula ({wrong[0]}); the published rule gives {default}",
                "features from layers the drafter was not trained on: tau a few % below reference, or a collapse",
                f"restore the drafter's published target_layer_ids (the rule gives {default}) unless it was "
                "trained with these",
            ))
        else:
            findings.append(Finding(
                "info", "dflash_config.target_layer_ids",
                f"taps {taps} differ from the default rule {default}; they are given explicitly, so they stand",
                "none if they are the trained taps (the drafter's own config is the authority)",
                "nothing to do; engines must read exactly these layers' outputs",
            ))
    if layers - 1 in taps:
        findings.append(Finding(
            "warning", "dflash_config.target_layer_ids",
            f"tap {layers - 1} is the target's last layer: HF's last hidden state is post-norm, "
            "engines hook the raw residual",
            "training and serving see different features at that tap: tau a few % to much lower in the engine",
            f"train and serve with the same definition of layer {layers - 1}, or retrain with taps <= {layers - 2}",
        ))
    return findings


# Measured by `doctor probe` on a trained pair with a causal sliding layer and a full layer (benchmarks/RESULTS.md,
# 2026-11-29): the healthy drafter's tau and the tau with its sliding layers run as full attention.
SWA_AS_FULL_COST = "tau 4.43 -> 1.13 in blockdraft's probe of a trained sliding+full pair; vLLM PR #50169: 33% -> 2.3%"


def _check_sliding(draft: DraftConfig) -> list[Finding]:
    findings = []
    sliding = [i for i, t in enumerate(draft.layer_types) if t == "sliding_attention"]
    full = [i for i, t in enumerate(draft.layer_types) if t == "full_attention"]
    if draft.use_sliding_window and draft.raw.get("sliding_window") is not None and not sliding:
        how = "`layer_types` is absent" if draft.raw.get("layer_types") is None else "`layer_types` lists no sliding layer"
        findings.append(Finding(
            "warning", "layer_types",
            f"use_sliding_window is true with sliding_window {draft.raw['sliding_window']}, but {how}: every layer "
            "runs full attention (the windowed layers of the trained drafter, if any, were lost from the config)",
            f"if the drafter was trained with sliding layers, running them as full attention collapses acceptance "
            f"({SWA_AS_FULL_COST})",
            "restore layer_types from the published config (Qwen3.6-27B-DFlash: 4 sliding_attention + 1 "
            "full_attention); if the drafter really has no sliding layer, set use_sliding_window: false",
        ))
    if sliding:
        mixed = ("its V2 model runner (the default; older releases need VLLM_USE_V2_MODEL_RUNNER=1) runs sliding and "
                 "full layers mixed, and " if full else "")
        findings.append(Finding(
            "info", "layer_types",
            f"drafter has {len(sliding)} sliding and {len(full)} full layers; engines must run both kinds as trained",
            "sliding layers run as full attention, or pre-written context evicted by a sliding-window KV "
            "allocator: 33% -> 2.3% acceptance (vLLM PR #50169)",
            f"vLLM 0.33: {mixed}it picks a non-causal-capable backend for the drafter itself (no global "
            "--attention-backend: it would force the target's too); use a release whose allocator never evicts the "
            "drafter's context; `blockdraft launch vllm` writes the command",
        ))
    return findings


def _rope(config: dict[str, Any]) -> tuple[float | None, tuple[str, float | None] | None, float]:
    """(theta, (scaling type, factor) or None, partial rotary factor) from transformers 5 or older fields."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    scaling = params if params.get("rope_type") not in (None, "default") else config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    scaled = None if kind in (None, "default") else (str(kind), scaling.get("factor"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    return (None if theta is None else float(theta)), scaled, float(partial)


def _check_rope(draft: DraftConfig, target: dict[str, Any]) -> list[Finding]:
    findings = []
    d_theta, d_scaling, d_partial = _rope(draft.raw)
    t_theta, t_scaling, t_partial = _rope(target)
    if d_theta is None and t_theta is not None:
        findings.append(Finding(
            "warning", "rope_theta",
            f"drafter config has no rope_theta; loaders fall back to a library default (target: {t_theta:g})",
            f"if the default differs from the trained theta: {COLLAPSE}",
            f"set rope_theta (or rope_parameters.rope_theta) to {t_theta:g}, the value published drafters copy",
        ))
    elif d_theta is not None and t_theta is not None and d_theta != t_theta:
        findings.append(Finding(
            "warning", "rope_theta",
            f"drafter rope_theta {d_theta:g} != target rope_theta {t_theta:g}; published drafters copy the target's",
            f"if the drafter was trained with the target's theta: {COLLAPSE}",
            f"set the drafter's rope_theta to {t_theta:g} unless it was trained with {d_theta:g}",
        ))
    if d_scaling != t_scaling:
        findings.append(Finding(
            "warning", "rope_scaling",
            f"drafter RoPE scaling {d_scaling} != target RoPE scaling {t_scaling}",
            "positions are rotated differently past the original context: acceptance falls on long prompts",
            "copy the target's rope_scaling (rope_parameters) into the drafter config unless it was trained without",
        ))
    if d_partial != t_partial:
        findings.append(Finding(
            "info", "partial_rotary_factor",
            f"drafter rotates {d_partial:.0%} of each head, the target {t_partial:.0%}",
            f"an engine that applies the target's factor to the drafter: {COLLAPSE}",
            f"engines must rotate the drafter with its own factor ({d_partial:g}), the target with {t_partial:g}",
        ))
    return findings


def _check_units(draft: DraftConfig, vllm_tokens: int | None, sglang_tokens: int | None) -> list[Finding]:
    findings = []
    block = draft.block_size
    if vllm_tokens is not None and vllm_tokens != block - 1:
        too_many = vllm_tokens > block - 1
        trap = " (that is the block size, SGLang's unit)" if vllm_tokens == block else ""
        findings.append(Finding(
            "error" if too_many else "warning", "num_speculative_tokens",
            f"vLLM num_speculative_tokens={vllm_tokens}{trap}; this drafter proposes block_size - 1 = {block - 1}"
            + ("" if too_many else f", and vLLM then builds a block of {vllm_tokens + 1} rows, not the {block} the "
               "drafter was trained on"),
            "slots the drafter was never trained on: tau 2-3 instead of 5-6"
            if too_many else f"tau is capped at {vllm_tokens + 1} instead of {block}, and every slot accepts less in "
            "the shorter block (embedded pair, 3 tokens: tau 1.69, where the same 3 slots drafted from the whole "
            "block reach 1.94)",
            f"pass num_speculative_tokens {block - 1} in --speculative-config; to see what {vllm_tokens} costs this "
            f"pair: blockdraft doctor probe --num-speculative-tokens {vllm_tokens}",
        ))
    if sglang_tokens is not None and sglang_tokens != block:
        severity: Severity = "error" if sglang_tokens > block else "warning" if sglang_tokens == block - 1 else "info"
        trap = " (that is vLLM's unit, block_size - 1)" if sglang_tokens == block - 1 else ""
        findings.append(Finding(
            severity, "speculative_num_draft_tokens",
            f"SGLang --speculative-num-draft-tokens={sglang_tokens}{trap}; SGLang counts the whole block, "
            f"block_size = {block}",
            "slots the drafter was never trained on: tau 2-3 instead of 5-6"
            if sglang_tokens > block else f"tau is capped at {sglang_tokens} instead of {block}",
            f"pass --speculative-num-draft-tokens {block}",
        ))
    return findings


DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel")


def _check_dflash2(draft: DraftConfig) -> list[Finding]:
    """DFlash-2 traps: engines pick the model class (and vLLM its speculator) by architecture, not by fields."""
    if draft.dflash2 is None:
        return []
    findings = []
    architectures = draft.raw.get("architectures") or []
    if not set(architectures) & set(DFLASH2_ARCHITECTURES):
        findings.append(Finding(
            "error", "architectures",
            f"the config has DFlash-2 fields (block convolutions, candidate selector) but architectures "
            f"{architectures}; vLLM 0.33 and SGLang choose the drafter class by architecture (vLLM its DFlash2 "
            "speculator too, under method dflash)",
            "the drafter is built as DFlash (v1): its convolution and selector tensors are rejected at load, or the "
            "drafts come from a model that is not the trained one",
            'set "architectures": ["DFlash2DraftModel"] in the drafter\'s config.json',
        ))
    if draft.dflash2.selector_top_k == 1:
        findings.append(Finding(
            "warning", draft.field_name("selector_top_k"),
            "selector_top_k = 1: the walk has one candidate per position, so it is the chain's per-position argmax",
            "DFlash-2's selector does nothing: the chain's acceptance, with a selector's cost",
            "use the top-k the drafter was trained with (published DFlash-2 drafters: 16)",
        ))
    if draft.dflash2.conv_kernel_size > draft.block_size:
        findings.append(Finding(
            "info", draft.field_name("conv_kernel_size"),
            f"conv_kernel_size {draft.dflash2.conv_kernel_size} is longer than the block ({draft.block_size} rows): "
            "the taps past the block read only zeros",
            "none at run time", "nothing to do unless the config was edited by hand (published: 2)",
        ))
    return findings


def _check_thinking(chat_template: str | None) -> list[Finding]:
    if not chat_template or not any(marker in chat_template for marker in THINKING_MARKERS):
        return []
    return [Finding(
        "info", "chat_template",
        "the target's chat template has a thinking mode (enable_thinking / <think>)",
        "serving in the other mode than the drafter was trained in: tau 2-3 instead of 5-6",
        "serve in the mode the drafter was trained in (model card): send chat_template_kwargs "
        '{"enable_thinking": ...} with each request, or set the server default',
    )]


def target_layer_types(target: dict[str, Any]) -> list[str]:
    """A hybrid target's layer types: as listed, or as transformers derives them from `full_attention_interval`
    when the config has none (Qwen3.5 / Qwen3-Next: every interval-th layer is full attention, default 4)."""
    listed = target.get("layer_types")
    if isinstance(listed, list):
        return listed
    interval = target.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(target["num_hidden_layers"])]


def _check_hybrid(draft: DraftConfig, target_config: dict[str, Any], target: dict[str, Any]) -> list[Finding]:
    if not is_hybrid_target(target_config):
        return []
    layer_types = target_layer_types(target)
    linear_taps = [t for t in draft.target_layer_ids if t < len(layer_types) and layer_types[t] == "linear_attention"]
    where = f"taps {linear_taps} are linear-attention layers" if linear_taps else "every tap is a full-attention layer"
    return [Finding(
        "info", "model_type",
        f"hybrid target (linear attention interleaved with full attention); {where}",
        f"an engine that captures hidden states only from full-attention layers feeds zero features: {COLLAPSE}; "
        "linear-attention state of rejected drafts must be rolled back",
        "SGLang 0.5.23: no mamba flag is needed: --mamba-radix-cache-strategy defaults to auto, which resolves to "
        "extra_buffer for Qwen3.5/3.6 and Qwen3-Next while overlap scheduling is on (the old "
        "--mamba-scheduler-strategy is rejected); use an engine release that captures hidden states from "
        "linear-attention layers too",
    )]


def check_pair(
    draft: DraftConfig,
    target_config: dict[str, Any],
    tokenizer: Any | None = None,
    vllm_num_speculative_tokens: int | None = None,
    sglang_num_draft_tokens: int | None = None,
    chat_template: str | None = None,
) -> list[Finding]:
    """Every static finding for a drafter on a target (and engine flags, when given), errors first."""
    target = text_config(target_config)
    if chat_template is None and tokenizer is not None:
        chat_template = getattr(tokenizer, "chat_template", None)
    findings = [
        *_check_geometry(draft, target),
        *_check_vocab(draft, target, tokenizer),
        *_check_taps(draft, target),
        *_check_sliding(draft),
        *_check_rope(draft, target),
        *_check_units(draft, vllm_num_speculative_tokens, sglang_num_draft_tokens),
        *_check_dflash2(draft),
        *_check_thinking(chat_template),
        *_check_hybrid(draft, target_config, target),
    ]
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])
