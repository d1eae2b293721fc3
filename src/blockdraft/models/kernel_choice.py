"""Which of a Triton kernel and the library call it replaces runs a shape: timed once per shape on the GPU.

A kernel is only worth its place where it is faster on the device at hand, and that depends on the shape (cuBLAS
runs the largest decode GEMMs of an 8B model at 96% of copy bandwidth, the narrow ones at 73%; benchmarks/RESULTS.md,
2026-11-30 session 4). So each kernel call site asks `kernel_wins` with a key naming the shape; the first time, both
run a few times under CUDA events and the faster is kept, so turning kernels on never makes a step slower. Each side
is timed replaying a CUDA graph of it, as the engine's steps run: timed eagerly, the library side also paid the CPU
cost of launching it (its compiled wrapper's guards, our dispatch), which a captured step does not, and the chooser
picked the folded kernel for gate|up at 16 rows though in the step it ran 68.7 us against cuBLAS's 48.7 (H200,
benchmarks/RESULTS.md session 17; graph timing not yet run there). The first call comes from a CUDA graph's warm-up,
before its capture; a shape first met while capturing keeps the library call. Off a GPU (Triton's interpreter, the
tests) the kernel always runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

_TIMES: dict[tuple[str, Hashable], tuple[float, float]] = {}  # (kernel, library) milliseconds a call


def _milliseconds(run: Callable[[], object], repeats: int = 20) -> float:
    """Milliseconds a call over `repeats` replays of a CUDA graph of `run` (after eager calls that autotune,
    compile and allocate)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def kernel_wins(kind: str, key: Hashable, device: torch.device, kernel: Callable[[], object],
                library: Callable[[], object]) -> bool:
    """Whether `kernel` runs this `kind` of call at shape `key` (timed against `library` the first time)."""
    if device.type != "cuda":
        return True
    if (kind, key) not in _TIMES:
        if torch.cuda.is_current_stream_capturing():
            return False
        _TIMES[(kind, key)] = (_milliseconds(kernel), _milliseconds(library))
    kernel_ms, library_ms = _TIMES[(kind, key)]
    return kernel_ms < library_ms


def choices() -> dict[str, str]:
    """Every shape timed so far: "kind key" -> which runs it, and both sides' times."""
    return {f"{kind} {key}": f"{'kernel' if k < lib else 'library'} (kernel {1e3 * k:.1f} us, library "
            f"{1e3 * lib:.1f} us)" for (kind, key), (k, lib) in _TIMES.items()}
