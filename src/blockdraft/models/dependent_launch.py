"""Programmatic dependent launch (Hopper's PDL) for the decode step's Triton kernels: off until a GPU shows it pays.

A batched AR step of the 8B shape runs ~300 kernels, and its CUDA graph leaves 0.24-0.32 ms a step between them on an
H100 (the graph's step minus the kernels' own time, benchmarks/RESULTS.md session 44): ~0.06x of an H200's roofline at
batch 4-16, the largest piece of issue 22's goal left there. Launched dependent, a kernel's programs are scheduled
while the kernel before it finishes and wait at their first instruction (`griddepcontrol.wait`) until that kernel has
completed and its writes are visible: the same results, less of each launch's latency exposed. Each kernel lets the
next one be scheduled once all its own programs have started (`griddepcontrol.launch_dependents`). Triton 3.6 (the
GPU machine's) has the launch option but not those instructions (Triton 3.9's `gdc_wait`), so they are inline PTX
here; Triton's interpreter has neither, so a kernel takes them only where `launch_options` turns them on.
"""

from __future__ import annotations

import torch

from blockdraft.models.capability import cuda_capability

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU install): no kernel launches at all
    triton = None

ENABLED = False  # off until `benchmarks/batch_roofline.py --dependent-launch` times the step faster with it
MIN_CAPABILITY = (9, 0)  # griddepcontrol: sm_90 and newer


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keyword arguments a step kernel's launch on `device` takes: its PDL constant, and Triton's `launch_pdl`
    with it, on only with ENABLED on a GPU of compute capability 9.0 or newer."""
    dependent = ENABLED and device.type == "cuda" and cuda_capability(device) >= MIN_CAPABILITY
    return {"PDL": True, "launch_pdl": True} if dependent else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """A step kernel's first statement: with PDL, wait until the kernel launched before it has completed and
        its writes are visible, then let the next one be scheduled. Nothing without (the interpreter, older GPUs,
        ENABLED off)."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nmov.u32 $0, 0;", "=r",
                                      [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_then_wait(PDL: tl.constexpr, w_ptr, features, stride_wn, first, end, BLOCK_K: tl.constexpr):
        """A product kernel's first statement: with PDL, ask L2 for the program's first weight tile (the `features`
        rows of w, columns [first, first + BLOCK_K) up to `end`), then `wait_for_inputs`. Weights are no kernel's
        output and an L2 prefetch is a hint with no result, so it may run before the wait: a program scheduled
        during the previous kernel's last wave streams its first tile in while that wave finishes, not after."""
        if PDL:
            LINE: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)  # elements a 128-byte line
            LINES: tl.constexpr = BLOCK_K // LINE if BLOCK_K >= LINE else 1
            columns = tl.minimum(first + tl.arange(0, LINES) * LINE, end - 1)
            lines = w_ptr + features[:, None].to(tl.int64) * stride_wn + columns[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [lines.to(tl.int64)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        wait_for_inputs(PDL)
