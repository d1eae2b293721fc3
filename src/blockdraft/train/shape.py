"""The drafter's shape for a target: layers, block size, taps, sliding layers, mask token, initial weights.

Geometry (hidden size, heads, MLP width, RoPE) comes from the target so the drafter lives in the target's
representation space and its layers can start as copies of the target's last layers. Every choice is returned as
a note so the user sees what was picked and why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from blockdraft.config import DEFAULT_BLOCK_SIZE, DraftConfig, default_target_layer_ids, parse_draft_config
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target

DEFAULT_DRAFT_LAYERS = 5


@dataclass(frozen=True)
class ShapeRequest:
    """What the user asked for; None means "choose for me"."""

    num_layers: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    taps: list[int] | None = None
    sliding_layers: list[int] | None = None
    sliding_window: int | None = None
    causal: bool | None = None
    mask_token_id: int | None = None


def _unused_special_tokens(tokenizer: object) -> dict[int, str]:
    """Added/special tokens that neither the chat template nor the bos/eos/pad/unk roles use."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk")}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {
        i: str(tok) for i, tok in decoder.items() if i not in roles and str(tok) not in template
    }


def _preference(content: str) -> int:
    """Reserved/mask tokens first, then `<|...|>` specials, then any other unused special token."""
    if re.search(r"reserved|mask", content, re.IGNORECASE):
        return 0
    return 1 if re.fullmatch(r"<\|.*\|>", content) else 2


def choose_mask_token(vocab_size: int, tokenizer: object | None, requested: int | None) -> tuple[int, str]:
    """An id the target never sees in text: the first embedding row past the tokenizer, else an unused special token."""
    size = len(tokenizer) if tokenizer is not None else None  # type: ignore[arg-type]
    unused = _unused_special_tokens(tokenizer) if tokenizer is not None else {}
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise BlockdraftError(
                f"--mask-token-id {requested} is outside the target's vocabulary (0..{vocab_size - 1}); "
                "pass an unused or reserved id inside it"
            )
        if size is not None and requested < size and requested not in unused:
            token = tokenizer.convert_ids_to_tokens(requested)  # type: ignore[union-attr]
            raise BlockdraftError(
                f"--mask-token-id {requested} is the ordinary or in-use token {token!r} of the target's vocabulary; "
                f"pass an unused or reserved id (e.g. {choose_mask_token(vocab_size, tokenizer, None)[0]})"
            )
        return requested, "given by --mask-token-id"
    if tokenizer is None:
        raise BlockdraftError(
            "the target has no tokenizer in which to find an unused token id; pass --mask-token-id with an id "
            "that never occurs in the training data"
        )
    if size is not None and size < vocab_size:
        return size, f"first embedding row past the tokenizer's {size} tokens (no text ever maps to it)"
    if not unused:
        raise BlockdraftError(
            "found no unused reserved/special token in the target's tokenizer; pass --mask-token-id with an id "
            "that never occurs in the training data"
        )
    best = min(unused, key=lambda i: (_preference(unused[i]), -i))
    return best, f"unused special token {unused[best]!r} (not in the chat template, not bos/eos/pad/unk)"


def _sliding_layout(request: ShapeRequest, layers: int) -> tuple[list[str], list[str]]:
    """layer_types and a note; a window without explicit layers makes all but the last layer sliding (Qwen3.6 style)."""
    sliding = request.sliding_layers
    if sliding is None and request.sliding_window is None:
        return ["full_attention"] * layers, []
    if request.sliding_window is None:
        raise BlockdraftError("--sliding-layers needs --sliding-window (the window in tokens, e.g. 2048)")
    if sliding is None:
        sliding = list(range(layers - 1))
    bad = [i for i in sliding if not 0 <= i < layers]
    if bad:
        raise BlockdraftError(f"--sliding-layers {bad} out of range: the drafter has layers 0..{layers - 1}")
    types = ["sliding_attention" if i in sliding else "full_attention" for i in range(layers)]
    return types, [f"sliding layers {sorted(set(sliding))} with window {request.sliding_window}"]


def build_draft_config(target: Target, tokenizer: object | None, request: ShapeRequest) -> tuple[DraftConfig, list[str]]:
    """The drafter config for this target and request, plus notes saying what was chosen."""
    text = target.model.config.get_text_config(decoder=True)
    n = target.num_layers
    layers = request.num_layers or min(DEFAULT_DRAFT_LAYERS, n)
    if layers < 1:
        raise BlockdraftError(f"--layers {layers} must be >= 1")
    if request.block_size < 2:
        raise BlockdraftError(f"--block-size {request.block_size} must be >= 2 (published drafters use 16)")
    notes = [f"{layers} draft layers, block size {request.block_size}"]
    if request.taps is not None:
        taps = list(request.taps)
        bad = [t for t in taps if not 0 <= t < n]
        if not taps or bad:
            raise BlockdraftError(
                f"--taps {taps} out of range: the target has {n} layers, taps must be in 0..{n - 1}"
            )
        notes.append(f"taps {taps} (given)")
    else:
        rule = default_target_layer_ids(n, layers)
        taps = sorted(set(rule))
        dropped = "" if taps == rule else f", duplicates of {rule} dropped"
        notes.append(f"taps {taps} (published rule for {n} target layers{dropped})")
    types, sliding_notes = _sliding_layout(request, layers)
    notes += sliding_notes
    mask_id, why = choose_mask_token(target.vocab_size, tokenizer, request.mask_token_id)
    notes.append(f"mask token {mask_id}: {why}")
    heads = text.num_attention_heads
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or target.hidden_size // heads,
        "intermediate_size": text.intermediate_size,
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
        "hidden_act": getattr(text, "hidden_act", "silu"),
        "attention_bias": bool(getattr(text, "attention_bias", False)),
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_positions or 32768,
        "rope_parameters": dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        "layer_types": types,
        "use_sliding_window": request.sliding_window is not None,
        "sliding_window": request.sliding_window,
        "num_target_layers": n,
        "block_size": request.block_size,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": taps, "block_size": request.block_size},
    }
    if request.causal is not None:
        raw["is_causal"] = request.causal
        notes.append(f"every layer {'causal' if request.causal else 'bidirectional'} inside the block (is_causal)")
    return parse_draft_config(raw, source="blockdraft train"), notes


def init_from_target(drafter: DFlashDrafter, target: Target) -> str:
    """Start draft layer i as a copy of target layer N-k+i wherever names and shapes match; say what was copied.

    The last target layers already map features into the LM head's space, a better start than noise; weights the
    target lacks (e.g. q_norm/k_norm on Llama-style targets) stay at their neutral init.
    """
    source_layers = getattr(target.model.get_decoder(), "layers", None)
    k = len(drafter.layers)
    if source_layers is None or len(source_layers) < k:
        return "draft layers randomly initialised (target layers not reachable)"
    first = len(source_layers) - k
    copied: set[str] = set()
    kept: set[str] = set()
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            source = source_layers[first + i].state_dict()
            for name, param in layer.named_parameters():
                match = source.get(name)
                if match is not None and match.shape == param.shape:
                    param.copy_(match.to(param.dtype))
                    copied.add(name.rsplit(".", 2)[-2])
                else:
                    kept.add(name.rsplit(".", 2)[-2])
    if not copied:
        return "draft layers randomly initialised (no target layer weight matches the drafter's shapes)"
    note = f"draft layers initialised from target layers {first}..{first + k - 1}: copied {', '.join(sorted(copied))}"
    if kept:
        note += f"; kept fresh {', '.join(sorted(kept))} (absent or shaped differently in the target)"
    return note
