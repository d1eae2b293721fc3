"""Acceptance probes: the drafter's healthy fingerprint and the fingerprints of known deployment faults.

A user's observed acceptance only says "low"; to say *why*, `diagnose` compares it with what this drafter
delivers when run correctly and with what it delivers under each fault engines are known to make
(REFERENCE.md sections 1 and 6). Every fault is injected the way the misconfigured engine runs the drafter,
by composition and never by editing the engine: another tap list, a drafter rebuilt from an edited config with
the same weights, a context cache that evicts, a fresh LM head. All runs are greedy (T = 0), so the acceptance
lengths depend on the deployment alone.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from blockdraft.config import parse_draft_config
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.doctor.diagnose import HEALTHY
from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult, prompt_digest
from blockdraft.doctor.thinking import THINKING_ON
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter, DrafterContextCache
from blockdraft.models.target import Target, TargetOutput
from blockdraft.models.target_cache import TargetCache

TAPS_LAYER_INPUT = "taps off by one (layer input, L-1)"
TAPS_NEXT_LAYER = "taps off by one (next layer, L+1)"
SWA_AS_FULL = "SWA layers run as full attention"
CONTEXT_EVICTED = "context evicted by a sliding-window KV allocator"
WRONG_MASK = "wrong mask token"
HEAD_NOT_SHARED = "LM head not shared"
WRONG_ROPE_THETA = "wrong RoPE theta"
GUESSED_TAPS = "taps guessed from a wrong formula"
SHORT_BLOCK = "num_speculative_tokens below B-1 (block cut)"

# The config field (or engine setting) each fault misreads: what `doctor compare` names when a live server's
# acceptance matches that fault's fingerprint.
FAULT_FIELDS = {
    TAPS_LAYER_INPUT: "dflash_config.target_layer_ids read as layer inputs (taps - 1): use an engine release that "
    "taps layer outputs (vLLM PR #40727)",
    TAPS_NEXT_LAYER: "dflash_config.target_layer_ids read one layer too deep (taps + 1)",
    SWA_AS_FULL: "layer_types / use_sliding_window: the drafter's sliding layers run as full attention",
    CONTEXT_EVICTED: "sliding_window applied to the drafter's context cache: the engine's KV allocator evicts "
    "context the full layers need (vLLM PR #50169)",
    WRONG_MASK: "dflash_config.mask_token_id: the engine fills the block with another token",
    HEAD_NOT_SHARED: "the LM head: the drafter's logits do not come from the target's head",
    WRONG_ROPE_THETA: "rope_theta / rope_parameters of the drafter",
    GUESSED_TAPS: "dflash_config.target_layer_ids guessed from a wrong formula instead of the drafter's config",
    SHORT_BLOCK: "num_speculative_tokens below block_size - 1 (the engine cuts the drafter's block)",
    THINKING_ON: "chat_template_kwargs.enable_thinking: requests rendered with thinking on",
}

# Mask ids of published drafters: Qwen3 and Qwen3.5/3.6. Swapping one for the other is the classic mistake.
QWEN_MASK_IDS = (151669, 248070)
ROPE_THETA_FACTOR = 10.0
_HEAD_SEED = 0


@dataclass
class Deployment:
    """One way of running the drafter: `target` verifies and supplies taps, `proposer` drafts."""

    name: str
    detail: str
    target: Target
    proposer: DFlashProposer


@dataclass
class ProbeRun:
    """The probe's fingerprints, plus why each fault that does not apply to this pair was left out."""

    result: ProbeResult
    skipped: dict[str, str] = field(default_factory=dict)


class EngineTapTarget(Target):
    """The target as engines tap it: layer N-1 is hooked as the raw residual, not HF's post-norm last state.

    HF's `hidden_states[N]` has the final norm applied; an engine that captures layer outputs (or "the input of
    layer N") sees the residual stream. Other taps are the same either way.
    """

    def __init__(self, model: Any, last_layer: nn.Module) -> None:
        super().__init__(model)
        self._last_layer = last_layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetCache,
        tap_layers: tuple[int, ...] | None = None,
        last_logits_only: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        last = self.num_layers - 1
        if tap_layers is None or last not in tap_layers:
            return super().forward(input_ids, positions, cache, tap_layers, last_logits_only, attention_mask)
        captured: list[torch.Tensor] = []

        def keep(_module: nn.Module, _inputs: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        handle = self._last_layer.register_forward_hook(keep)
        try:
            out = super().forward(input_ids, positions, cache, tap_layers, last_logits_only, attention_mask)
        finally:
            handle.remove()
        parts = out.taps.split(self.hidden_size, dim=-1)  # type: ignore[union-attr]
        taps = torch.cat([captured[-1] if layer == last else part for layer, part in zip(tap_layers, parts)], dim=-1)
        return TargetOutput(logits=out.logits, taps=taps)


class EvictingProposer(DFlashProposer):
    """DFlash whose context cache keeps only the last `keep` positions in every layer, full layers included.

    That is what a sliding-window KV allocator does to the drafter's pre-written context: full layers lose
    everything older than the window.
    """

    def __init__(self, drafter: DFlashDrafter, target: Target, keep: int) -> None:
        self.keep = keep
        super().__init__(drafter, target, static=False)  # the eviction lives in the eager cache
        self.reset()

    def reset(self) -> None:
        self.cache = _EvictingCache(self.drafter, self.keep)


class _EvictingCache(DrafterContextCache):
    def __init__(self, drafter: DFlashDrafter, keep: int) -> None:
        super().__init__(drafter)
        self.keep = keep

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().append(layer, k, v)
        if k.shape[2] > self.keep:
            k, v = k[:, :, -self.keep :], v[:, :, -self.keep :]
            self.keys[layer], self.values[layer] = k, v
        return k, v


def _proposer(
    drafter: DFlashDrafter, target: Target, taps: Sequence[int] | None = None, mask_token_id: int | None = None
) -> DFlashProposer:
    """A DFlash proposer that reads other taps or writes another mask token than the drafter's config says."""
    proposer = DFlashProposer(drafter, target)
    if taps is not None:
        proposer.tap_layers = tuple(taps)
    if mask_token_id is not None:
        proposer.cfg = replace(proposer.cfg, mask_token_id=mask_token_id)
    return proposer


def _rebuilt_drafter(drafter: DFlashDrafter, edit: Callable[[dict[str, Any]], None]) -> DFlashDrafter:
    """The same weights under an edited config: how an engine that misreads one config field runs the drafter."""
    raw = drafter.cfg.to_dict()
    edit(raw)
    weight = next(drafter.parameters())
    with torch.device(weight.device):
        rebuilt = DFlashDrafter(parse_draft_config(raw, "probe config"))
    rebuilt.load_state_dict({k: v for k, v in drafter.state_dict().items() if "rotary_emb" not in k}, strict=False)
    return rebuilt.to(dtype=weight.dtype).eval()


def _rope_theta(config: Any) -> float | None:
    """A config's single RoPE theta (transformers 5 `rope_parameters`, or the legacy field); None if per-layer."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta) if isinstance(theta, (int, float)) else None


def wrong_formula_taps(num_target_layers: int, num_taps: int) -> list[int]:
    """Taps from the (N-2)/(k-1) spacing rule (rounded up, clamped to N-1): 64 layers, 5 taps -> [1,17,33,49,63]."""
    step = math.ceil((num_target_layers - 2) / (num_taps - 1))
    return [min(1 + i * step, num_target_layers - 1) for i in range(num_taps)]


def _frequent_token(prompts: Sequence[Sequence[int]], exclude: int) -> int | None:
    counts = Counter(t for ids in prompts for t in ids if t != exclude)
    return counts.most_common(1)[0][0] if counts else None


def _last_decoder_layer(model: Any) -> nn.Module | None:
    layers = getattr(model.get_decoder(), "layers", None)
    return layers[-1] if isinstance(layers, nn.ModuleList) and len(layers) else None


def _tap_fault(name: str, target: Target, drafter: DFlashDrafter, taps: list[int]) -> Deployment | str:
    """The drafter fed other taps, read the way engines hook them."""
    real = list(drafter.cfg.target_layer_ids)
    verifier = target
    if target.num_layers - 1 in taps:
        last = _last_decoder_layer(target.model)
        if last is None:
            return f"{type(target.model).__name__} exposes no decoder `.layers` to hook the last layer's output"
        verifier = EngineTapTarget(target.model, last)
    return Deployment(name, f"taps {taps} instead of {real}", verifier, _proposer(drafter, target, taps))


def _shifted_taps(target: Target, drafter: DFlashDrafter, shift: int, name: str) -> Deployment | str:
    """Off by one: -1 reads layer L's input (L = 0 gives the embeddings), +1 the next layer's output."""
    taps = [min(t + shift, target.num_layers - 1) for t in drafter.cfg.target_layer_ids]
    return _tap_fault(name, target, drafter, taps)


def _guessed_taps(target: Target, drafter: DFlashDrafter) -> Deployment | str:
    real = list(drafter.cfg.target_layer_ids)
    if len(real) < 2:
        return "the spacing formula needs at least two taps"
    guessed = wrong_formula_taps(target.num_layers, len(real))
    if guessed == real:
        return f"the wrong formula gives the real taps {real} for {target.num_layers} layers"
    return _tap_fault(GUESSED_TAPS, target, drafter, guessed)


def _swa_as_full(target: Target, drafter: DFlashDrafter) -> Deployment | str:
    types = drafter.cfg.layer_types
    if "sliding_attention" not in types:
        return "the drafter has no sliding-window layers"

    def all_full(raw: dict[str, Any]) -> None:
        raw["layer_types"] = ["full_attention"] * len(types)

    full = DFlashProposer(_rebuilt_drafter(drafter, all_full), target)
    return Deployment(SWA_AS_FULL, f"layer_types {list(types)} run as full attention", target, full)


def _context_evicted(target: Target, drafter: DFlashDrafter) -> Deployment | str:
    window = drafter.cfg.sliding_window
    if window is None:
        return "the drafter has no sliding window"
    if all(t == "sliding_attention" for t in drafter.cfg.layer_types):
        return "every layer already slides, so evicting older context changes nothing"
    return Deployment(
        CONTEXT_EVICTED, f"every layer keeps only the last {window} context positions", target,
        EvictingProposer(drafter, target, window),
    )


def _wrong_mask(target: Target, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]]) -> Deployment | str:
    mask = drafter.cfg.mask_token_id
    other = [i for i in QWEN_MASK_IDS if i != mask and i < target.vocab_size]
    if other:
        wrong, why = other[0], "the other Qwen family's mask id"
    else:
        frequent = _frequent_token(prompts, mask)
        if frequent is None:
            return "the prompts hold no token other than the mask to use as a wrong mask"
        wrong, why = frequent, "the prompts' most frequent token"
    proposer = _proposer(drafter, target, mask_token_id=wrong)
    return Deployment(WRONG_MASK, f"mask id {wrong} ({why}) instead of {mask}", target, proposer)


def _head_not_shared(target: Target, drafter: DFlashDrafter) -> Deployment:
    config = target.model.config.get_text_config(decoder=True)
    head = nn.Linear(target.hidden_size, target.vocab_size, bias=False, device=target.device, dtype=target.dtype)
    generator = torch.Generator(device=target.device).manual_seed(_HEAD_SEED)
    with torch.no_grad():
        head.weight.normal_(0.0, getattr(config, "initializer_range", 0.02), generator=generator)
    drafting_view = copy.copy(target)
    drafting_view.lm_head = head
    return Deployment(
        HEAD_NOT_SHARED, "logits through a freshly initialised head instead of the target's", target,
        DFlashProposer(drafter, drafting_view),
    )


def _wrong_rope(target: Target, drafter: DFlashDrafter) -> Deployment | str:
    hf = drafter.cfg.hf_config()
    own = _rope_theta(hf)
    if own is None:
        return "the drafter's config has no single rope_theta"
    targets = _rope_theta(target.model.config.get_text_config(decoder=True))
    if targets is not None and not math.isclose(targets, own):
        wrong, why = targets, "the target's"
    else:
        wrong, why = own * ROPE_THETA_FACTOR, f"x{ROPE_THETA_FACTOR:g}"
    params = {"rope_type": "default", **(getattr(hf, "rope_parameters", None) or {}), "rope_theta": wrong}

    def set_theta(raw: dict[str, Any]) -> None:
        raw.pop("rope_theta", None)
        raw["rope_parameters"] = params

    return Deployment(
        WRONG_ROPE_THETA, f"rope_theta {wrong:g} ({why}) instead of {own:g}", target,
        DFlashProposer(_rebuilt_drafter(drafter, set_theta), target),
    )


def healthy_deployment(target: Target, drafter: DFlashDrafter) -> Deployment:
    """The drafter run exactly as its config says: the reference every deployment is judged against."""
    return Deployment(HEALTHY, "the drafter's own config", target, DFlashProposer(drafter, target))


def thinking_deployment(target: Target, drafter: DFlashDrafter) -> Deployment:
    """The drafter run as its config says on prompts rendered with thinking on: the other mode's fingerprint."""
    return Deployment(THINKING_ON, "the drafter's own config, prompts rendered with thinking on", target,
                      DFlashProposer(drafter, target))


def _short_block(target: Target, drafter: DFlashDrafter, served: int) -> Deployment | str:
    """vLLM with num_speculative_tokens k < B-1 builds a block of k+1 rows: the drafter, trained on B rows, sees
    fewer masks and accepts less at every slot, not only past k."""
    most = drafter.cfg.block_size - 1
    if served == most:
        return f"num_speculative_tokens {served} = B-1 serves the whole block"
    if not 1 <= served < most:
        raise BlockdraftError(f"--num-speculative-tokens {served} must be between 1 and {most} (B-1 for this "
                              "drafter; `blockdraft doctor static` explains a larger value)")
    detail = f"vLLM num_speculative_tokens {served}: a block of {served + 1} rows instead of {most + 1}"
    return Deployment(SHORT_BLOCK, detail, target, DFlashProposer(drafter, target, draft_tokens=served, whole_block=False))


def fault_deployments(
    target: Target, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], served_tokens: int | None = None
) -> tuple[list[Deployment], dict[str, str]]:
    """Every known fault that applies to this pair, and the reason each other one was skipped.

    `served_tokens`, the num_speculative_tokens a user serves with below B-1, adds that cut block as a fault.
    """
    built: dict[str, Deployment | str] = {
        TAPS_LAYER_INPUT: _shifted_taps(target, drafter, -1, TAPS_LAYER_INPUT),
        TAPS_NEXT_LAYER: _shifted_taps(target, drafter, +1, TAPS_NEXT_LAYER),
        SWA_AS_FULL: _swa_as_full(target, drafter),
        CONTEXT_EVICTED: _context_evicted(target, drafter),
        WRONG_MASK: _wrong_mask(target, drafter, prompts),
        HEAD_NOT_SHARED: _head_not_shared(target, drafter),
        WRONG_ROPE_THETA: _wrong_rope(target, drafter),
        GUESSED_TAPS: _guessed_taps(target, drafter),
    }
    if served_tokens is not None:
        built[SHORT_BLOCK] = _short_block(target, drafter, served_tokens)
    deployments = [d for d in built.values() if isinstance(d, Deployment)]
    skipped = {name: why for name, why in built.items() if isinstance(why, str)}
    return deployments, skipped


def measure(
    deployment: Deployment,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
) -> Fingerprint:
    """Greedy generation over all prompts; the fingerprint of every verify step's acceptance length."""
    if not prompts:
        raise BlockdraftError("the probe needs at least one prompt")
    lengths: list[list[int]] = []
    for ids in prompts:
        result = generate(
            deployment.target, list(ids), deployment.proposer, max_new_tokens, stop_token_ids=stop_token_ids
        )
        lengths.append(list(result.acceptance_lengths))
    source = f"probe: {deployment.detail}, {len(prompts)} prompts"
    return Fingerprint.from_prompt_lengths(lengths, deployment.proposer.block_size, source, prompt_digest(prompts))


def run_probes(
    target: Target,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    on_measure: Callable[[str], None] | None = None,
    served_tokens: int | None = None,
    thinking_prompts: Sequence[Sequence[int]] | None = None,
) -> ProbeRun:
    """The healthy reference and every applicable fault's fingerprint on the same prompts; with
    `thinking_prompts` (the same prompts rendered with thinking on), the healthy drafter's fingerprint on those
    too, kept among the faults as `thinking on`."""
    faults, skipped = fault_deployments(target, drafter, prompts, served_tokens)
    plan = [(deployment, prompts) for deployment in [healthy_deployment(target, drafter), *faults]]
    if thinking_prompts is not None:
        plan.append((thinking_deployment(target, drafter), thinking_prompts))
    fingerprints: dict[str, Fingerprint] = {}
    for deployment, ids in plan:
        if on_measure is not None:
            on_measure(deployment.name)
        fingerprints[deployment.name] = measure(deployment, ids, max_new_tokens, stop_token_ids)
    reference = fingerprints.pop(HEALTHY)
    return ProbeRun(ProbeResult(reference, fingerprints), skipped)
