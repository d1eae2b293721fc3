"""Which of a Triton kernel and the library call it replaces runs a shape: timed once per shape on the GPU.

A kernel is only worth its place where it is faster on the device at hand, and that depends on the shape (cuBLAS
runs the largest decode GEMMs of an 8B model at 96% of copy bandwidth, the narrow ones at 73%; benchmarks/RESULTS.md,
2026-11-30). So each kernel call site asks `kernel_wins` with a key naming the shape; the first time, both
run a few times under CUDA events and the faster is kept, so turning kernels on never makes a step slower. Each side
is timed replaying a CUDA graph of ten calls of it, as the engine's steps run: timed eagerly, the library side also
paid the CPU cost of launching it (its compiled wrapper's guards, our dispatch), which a captured step does not, and
the chooser picked the folded kernel for gate|up at 16 rows though in the step it ran 68.7 us against cuBLAS's 48.7
(H200, benchmarks/RESULTS.md, 2026-12-02); a graph of one call timed the launch of each replay on small shapes. The
first call comes from a CUDA graph's warm-up, before its capture; a shape first met while capturing keeps the
library call. A pick the card's shipped table holds (`tuned_configs`) is taken untimed. Off a GPU (Triton's
interpreter, the tests) the kernel always runs. `fastest` does the same among several variants of a kernel and the
library call. A kernel that fails to compile or run on the device counts as the slowest (one warning): with the
q|k|v kernel on by default on CUDA, a GPU it cannot serve must still decode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import torch

from blockdraft.kernels.capture import capturing
from blockdraft.kernels.tuned_configs import record_pick, shipped_pick
from blockdraft.kernels.warm_costs import TIMING, spent

_TIMES: dict[tuple[str, Hashable], dict[str, float]] = {}  # each option's milliseconds a call
CALLS_PER_GRAPH = 10  # calls of an option in one timed graph, as a step's graph runs its kernels: one call a graph
# timed the host's launch of each replay on the smaller shapes (the embedded 135M pair's options all took 4-8 us a
# call whatever their kernels, benchmarks/RESULTS.md, 2026-12-03), not the kernels a step's graph runs back to back
REPLAYS = 3  # replays of that graph timed


def _milliseconds(run: Callable[[], object], calls: int = CALLS_PER_GRAPH, replays: int = REPLAYS) -> float:
    """Milliseconds a call: `calls` of `run` captured back to back in one CUDA graph (after eager calls that
    autotune, compile and allocate), the graph replayed `replays` times."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        for _ in range(calls):
            run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls)


def fastest(kind: str, key: Hashable, device: torch.device, options: dict[str, Callable[[], object]]) -> str:
    """The name of the option that runs this `kind` of call at shape `key`: the fastest, timed the first time. The
    last option is the library call: the choice while a graph is captured before the shape was timed. Off a GPU the
    first runs (the kernels' tests)."""
    names = list(options)
    if device.type != "cuda":
        return names[0]
    if (kind, key) not in _TIMES:
        shipped = shipped_pick(kind, key)
        if shipped in options:
            _TIMES[(kind, key)] = {shipped: 0.0}
            record_pick(kind, key, shipped)
            return shipped
        if torch.cuda.is_current_stream_capturing():
            return names[-1]
        with spent(TIMING):
            times = {name: _kernel_milliseconds(kind, name, run) for name, run in options.items() if name != names[-1]}
            times[names[-1]] = _milliseconds(options[names[-1]])
        _TIMES[(kind, key)] = times
        record_pick(kind, key, min(times, key=lambda name: times[name]))
    times = _TIMES[(kind, key)]
    return min(times, key=lambda name: times[name])


def _kernel_milliseconds(kind: str, name: str, run: Callable[[], object]) -> float:
    """`_milliseconds` of a kernel option; infinite, with one warning, where it fails to compile or run on this
    device (a GPU Triton cannot target): the library call then runs, as it would without the kernels."""
    try:
        return _milliseconds(run)
    except Exception as exc:  # a kernel must cost speed where it cannot run, never the forward
        sys.stderr.write(f"warning: the {kind} kernel ({name}) failed on this device, the library call runs instead "
                         f"({exc!r:.200})\n")
        return float("inf")


def kernel_wins(kind: str, key: Hashable, device: torch.device, kernel: Callable[[], object],
                library: Callable[[], object]) -> bool:
    """Whether `kernel` runs this `kind` of call at shape `key` (timed against `library` the first time)."""
    return fastest(kind, key, device, {"kernel": kernel, "library": library}) == "kernel"


def choices() -> dict[str, str]:
    """Every shape chosen so far: "kind key" -> which runs it, and every option's time (or that the table said)."""
    return {f"{kind} {key}": f"{min(times, key=lambda n: times[n])} (" + (
        "shipped table" if len(times) == 1 else ", ".join(f"{name} {1e3 * ms:.1f} us" for name, ms in times.items()))
            + ")" for (kind, key), times in _TIMES.items()}
