"""flash-linear-attention's chunked gated delta rule (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`) in the
engine's layout, for a hybrid target's prefill where that library is installed (`pip install blockdraft[gpu]` pins
it) and a CUDA device runs it.

The engine's own rule (`fast.delta_net.chunked_delta_rule`) is PyTorch: some ten launches a chunk of 64 rows, each
small, so a 1K-token prefill pays for launches and tiny products in every one of a 27B model's 48 linear layers. fla
computes each chunk's triangular solve and the state hand-over in fused Triton kernels, as transformers' Qwen3.5
forward does when fla is present. The engine takes it only in half precision and only where `kernel_choice` timed it
faster at that shape (`HybridUnits.prefill_rule`): in float32 the engine's rule is kept, the one whose exactness the
lossless tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@cache
def library_rule() -> Rule | None:
    """fla's `chunk_gated_delta_rule`, or None where fla is not installed or fails to import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # fla absent, or built for another torch/triton: the engine's own rule runs
        return None
    return chunk_gated_delta_rule


def fla_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, dtype: torch.dtype, rule: Rule | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_delta_rule`'s contract from fla: q, k [B, H, t, dk] (q already scaled), v [B, H, t, dv], g and beta
    [B, H, t], the committed state [B, H, dk, dv] (float32, left unchanged); q, k and v go in as `dtype` (the model's,
    as transformers feeds fla); the outputs [B, H, t, dv] in v's dtype and the final state in float32."""
    run = rule or library_rule()
    if run is None:
        raise RuntimeError("flash-linear-attention is not installed: pip install 'blockdraft[gpu]'")
    out, final = run(*(x.transpose(1, 2).to(dtype) for x in (q, k, v)), g.transpose(1, 2).float(),
                     beta.transpose(1, 2).float(), scale=1.0, initial_state=state.float(), output_final_state=True)
    return out.transpose(1, 2).to(v.dtype), final.to(state.dtype)
