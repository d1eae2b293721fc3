"""Capturing a CUDA graph with the diagnostics a failed capture needs (`kernels.capture`), on a CPU: torch's capture
context and sync-debug switch are stood in for, and what the wrapper asks of them and reports is checked."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from blockdraft.errors import BlockdraftError
from blockdraft.kernels import capture as capture_mod
from blockdraft.kernels.capture import capture_mode, capturing


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    seen: dict[str, list] = {"modes": [], "sync": []}

    @contextmanager
    def graph(graph, pool=None, capture_error_mode="global"):  # noqa: ANN001, ANN202
        seen["modes"].append(capture_error_mode)
        yield

    monkeypatch.setattr(capture_mod.torch.cuda, "graph", graph)
    monkeypatch.setattr(capture_mod.torch.cuda, "set_sync_debug_mode", seen["sync"].append)
    return seen


def test_a_capture_runs_in_the_chosen_mode_and_debugs_syncs_only_when_asked(fake_cuda, monkeypatch, capsys) -> None:
    with capturing(object()):
        pass
    assert fake_cuda["modes"] == ["global"] and fake_cuda["sync"] == []
    monkeypatch.setenv("BLOCKDRAFT_CAPTURE_MODE", "thread_local")
    monkeypatch.setenv("BLOCKDRAFT_CAPTURE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="broke"):
        with capturing(object()):
            raise RuntimeError("the capture broke")
    assert fake_cuda["modes"][-1] == "thread_local"
    assert fake_cuda["sync"] == ["error", "default"]  # on inside the capture, off again whatever happened
    assert "capture failed; threads alive: MainThread" in capsys.readouterr().err


def test_an_unknown_capture_mode_is_named(monkeypatch) -> None:
    monkeypatch.setenv("BLOCKDRAFT_CAPTURE_MODE", "loose")
    with pytest.raises(BlockdraftError, match="BLOCKDRAFT_CAPTURE_MODE='loose' is not one of global, thread_local"):
        capture_mode()


class _DroppedGraph:
    """Stands for a CUDA graph kept alive only by a reference cycle: freeing it inside a capture breaks the capture."""

    freed_inside: list[bool] = []

    def __init__(self, capturing_now: list[bool]) -> None:
        self.cycle = self
        self.capturing_now = capturing_now

    def __del__(self) -> None:
        _DroppedGraph.freed_inside.append(self.capturing_now[0])


def test_no_garbage_collection_frees_a_graph_inside_a_capture(monkeypatch) -> None:
    """A collection starts at whatever allocation crosses its threshold; inside a capture it must not run, or a
    dropped graph in a cycle is destroyed there (the cold-start failure). Outside it collects as before."""
    import gc

    now = [False]

    @contextmanager
    def graph(graph, pool=None, capture_error_mode="global"):  # noqa: ANN001, ANN202
        now[0] = True
        try:
            yield
        finally:
            now[0] = False

    monkeypatch.setattr(capture_mod.torch.cuda, "graph", graph)
    _DroppedGraph.freed_inside.clear()
    gc.collect()
    _DroppedGraph(now)  # unreachable at once; only the cyclic collector frees it
    with capturing(object()):
        kept = [[] for _ in range(20_000)]  # a capture's allocations: far past the collector's threshold
    del kept
    gc.collect()
    assert _DroppedGraph.freed_inside == [False] and gc.isenabled()
