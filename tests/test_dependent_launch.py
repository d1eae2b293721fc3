"""models/dependent_launch.py: when the step's Triton kernels are launched dependent (Hopper's PDL), and that every
launch of theirs asks `launch_options` (a CPU run under the interpreter never launches dependent)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockdraft.models import dependent_launch


def test_only_an_enabled_hopper_gpu_launches_dependent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default, and on a CPU even when enabled; on a GPU of compute capability 9.0+ only with ENABLED, and
    then both the kernel's PDL constant and Triton's launch_pdl."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dependent_launch, "cuda_capability", lambda device: (9, 0) if device.index == 0 else (8, 6))
    assert dependent_launch.launch_options(cuda) == {"PDL": False}
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    assert dependent_launch.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    assert dependent_launch.launch_options(torch.device("cuda", 1)) == {"PDL": False}  # an older GPU
    assert dependent_launch.launch_options(torch.device("cpu")) == {"PDL": False}


def test_every_step_kernel_launch_takes_the_launch_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The products, the attention and the q|k|v epilogue each launch with what `launch_options` gives for their
    device (counted by replacing it in each module that launches): a kernel launched without them would run plain
    beside dependent ones, and one launched dependent without its wait would race."""
    pytest.importorskip("triton")
    from blockdraft.models import block_attention, flash_decode, qkv_rope, skinny_gemm

    if not skinny_gemm.kernel_available(torch.device("cpu")):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, conftest's on a CPU)")
    asked: list[str] = []

    def counted(module: str):
        def options(device: torch.device) -> dict[str, bool]:
            asked.append(module)
            return {"PDL": False}
        return options

    for module in (skinny_gemm, block_attention, flash_decode, qkv_rope):
        monkeypatch.setattr(module, "launch_options", counted(module.__name__.rsplit(".", 1)[1]))
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=generator), torch.randn(48, 64, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(skinny_gemm.gemv_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(skinny_gemm.weights_first_linear(x.expand(3, 64), w), F.linear(x.expand(3, 64), w),
                                   rtol=1e-5, atol=1e-4)
        q = torch.randn(2, 2, 2, 16, generator=generator)
        k, v = torch.randn(2, 2, 128, 16, generator=generator), torch.randn(2, 2, 128, 16, generator=generator)
        lengths = torch.tensor([100, 7])
        block_attention.block_attention(q, k, v, torch.arange(2), lengths, torch.ones(2, 1, 1, dtype=torch.bool),
                                        (lengths - 1)[:, None], None, 0.25)
        qkv = torch.randn(1, 1, 4 * 16, generator=generator)
        cos, sin = torch.ones(1, 1, 1, 16), torch.zeros(1, 1, 1, 16)
        k_cache, v_cache = torch.zeros(1, 1, 8, 16), torch.zeros(1, 1, 8, 16)
        q = qkv_rope.qkv_rope(qkv, None, None, cos, sin, 2, 1, 1e-6, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.long),
                              torch.full((1, 1), 3), k_cache.stride()[:3])
    torch.testing.assert_close(q.reshape(-1), qkv[0, 0, :32])  # rotated by angle 0: q as it was
    torch.testing.assert_close(v_cache[0, 0, 3], qkv[0, 0, 48:])
    assert asked.count("skinny_gemm") == 2 and asked.count("block_attention") == 1, asked
    assert asked.count("flash_decode") == 1 and asked.count("qkv_rope") == 1, asked  # the splits' combine; q|k|v
