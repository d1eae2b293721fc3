"""Which forward runs a target: Hugging Face's own (any model) or the fast engine's (static cache, CUDA graphs) where
it supports the model."""

from __future__ import annotations

from transformers import PreTrainedModel

from blockdraft.errors import BlockdraftError
from blockdraft.fast.target import FastTarget, fast_engine_problem
from blockdraft.models.target import Target

ENGINES = ("auto", "hf", "fast")


def check_engine(engine: str) -> str:
    """Refuse an unknown engine before any loading."""
    if engine not in ENGINES:
        raise BlockdraftError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    return engine


def make_target(model: PreTrainedModel, engine: str = "hf") -> Target:
    """Wrap a loaded model: "hf" runs HF's own forward (any model); "fast" our static-cache / CUDA-graph forward
    (common dense models only); "auto" is fast on CUDA when the model is supported, else hf."""
    if check_engine(engine) == "hf":
        return Target(model)
    problem = fast_engine_problem(model)
    if problem is None and (engine == "fast" or model.device.type == "cuda"):
        return FastTarget(model)
    if engine == "fast":
        raise BlockdraftError(f"--engine fast does not support this target's {problem}; use --engine hf (or auto)")
    return Target(model)
