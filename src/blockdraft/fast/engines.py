"""Which forward runs a target: Hugging Face's own (any model) or the fast engine's (static cache, CUDA graphs) where
it supports the model: FastTarget for dense attention stacks, HybridFastTarget for Qwen3.5-style hybrids."""

from __future__ import annotations

from transformers import PreTrainedModel

from blockdraft.errors import BlockdraftError
from blockdraft.fast.hybrid_target import HybridFastTarget, hybrid_engine_problem
from blockdraft.fast.target import FastTarget, fast_engine_problem
from blockdraft.models.target import RECURRENT_LAYER_TYPES, Target

ENGINES = ("auto", "hf", "fast")


def check_engine(engine: str) -> str:
    """Refuse an unknown engine before any loading."""
    if engine not in ENGINES:
        raise BlockdraftError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    return engine


def _hybrid(model: PreTrainedModel) -> bool:
    """Whether the model has recurrent (linear-attention) layers: HybridFastTarget's, not FastTarget's."""
    text = model.config.get_text_config(decoder=True)
    return bool(RECURRENT_LAYER_TYPES.intersection(getattr(text, "layer_types", None) or ()))


def fast_problem(model: PreTrainedModel) -> str | None:
    """Why neither fast target runs this model (the one its layers call for), or None when one does."""
    return hybrid_engine_problem(model) if _hybrid(model) else fast_engine_problem(model)


def make_target(model: PreTrainedModel, engine: str = "hf") -> Target:
    """Wrap a loaded model: "hf" runs HF's own forward (any model); "fast" our static-cache / CUDA-graph forward
    (dense attention stacks and Qwen3.5-style hybrids); "auto" is fast on CUDA when the model is supported, else hf."""
    if check_engine(engine) == "hf":
        return Target(model)
    problem = fast_problem(model)
    if problem is None and (engine == "fast" or model.device.type == "cuda"):
        return HybridFastTarget(model) if _hybrid(model) else FastTarget(model)
    if engine == "fast":
        raise BlockdraftError(f"--engine fast does not support this target's {problem}; use --engine hf (or auto)")
    return Target(model)


def engine_note(target: Target) -> str | None:
    """One line for a start-up on a GPU where the HF engine runs a model the fast one does not: why."""
    if target.engine != "hf" or target.device.type != "cuda":
        return None
    problem = fast_problem(target.model)
    return None if problem is None else f"the HF engine runs this target: the fast engine does not support its {problem}"
