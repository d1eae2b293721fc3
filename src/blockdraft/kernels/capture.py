"""Capturing a CUDA graph, with what a failed capture needs to be understood.

A capture fails as "operation failed due to a previous error during capture" at its end, far from the call that broke
it, and on a fresh machine only (warm compile caches hide such faults). Two switches make such a failure say more,
for the kernel choice's timing graphs and the engine's own alike:
- BLOCKDRAFT_CAPTURE_DEBUG=1: a synchronizing call inside the capture (a host read of a device value) raises where it
  is made (torch's sync debug mode), and a failed capture names the threads alive when it failed;
- BLOCKDRAFT_CAPTURE_MODE=global|thread_local|relaxed: CUDA's capture mode (default global: an unsafe call from any
  thread breaks the capture; thread_local: only from the capturing thread).

Python's cyclic garbage collector is off while a graph is captured. A collection can start at any allocation, and
one that frees a dropped CUDA graph (an evicted entry, a timing graph held in a reference cycle) destroys it inside
the capture, an operation CUDA forbids there: the capture fails at its end ("operation not permitted when stream is
capturing (function reset)", then "operation failed due to a previous error during capture"). When a collection
runs depends on everything allocated before (compiling allocates a lot), which is why it broke starts on one machine
and not on another (a cold `serve --method dflash`, a warm one, a cold DDTree@64 speed row; H100, 2026-12-06).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from blockdraft.errors import BlockdraftError

MODES = ("global", "thread_local", "relaxed")


def capture_mode() -> str:
    """CUDA's capture mode for every graph this process captures (BLOCKDRAFT_CAPTURE_MODE, default global)."""
    mode = os.environ.get("BLOCKDRAFT_CAPTURE_MODE", "global")
    if mode not in MODES:
        raise BlockdraftError(f"BLOCKDRAFT_CAPTURE_MODE={mode!r} is not one of {', '.join(MODES)}")
    return mode


@contextmanager
def capturing(graph: Any, pool: Any = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool)` in the process's capture mode; with BLOCKDRAFT_CAPTURE_DEBUG=1 a synchronizing
    call inside raises at once, and a failed capture writes the threads alive to stderr before it is raised."""
    debug = os.environ.get("BLOCKDRAFT_CAPTURE_DEBUG") == "1"
    collecting = gc.isenabled()
    gc.disable()  # no collection may free a CUDA graph inside the capture (module docstring)
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_mode()):
            if debug:
                torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                if debug:
                    torch.cuda.set_sync_debug_mode("default")
    except Exception:
        if debug:
            alive = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate())
            sys.stderr.write(f"capture failed; threads alive: {alive}\n")
        raise
    finally:
        if collecting:
            gc.enable()
