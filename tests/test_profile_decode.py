"""benchmarks/gpu/profile_decode.py: the per-step numbers from a profiler trace, and a CPU run on the tiny pair."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from blockdraft.decoding.fused_steps import FusedSteps

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "profile_decode.py"
SPEC = importlib.util.spec_from_file_location("profile_decode", SCRIPT)
profile_decode = importlib.util.module_from_spec(SPEC)
sys.modules["profile_decode"] = profile_decode  # its dataclass looks its module up
SPEC.loader.exec_module(profile_decode)


def event(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}


def test_busy_time_counts_overlapping_kernels_once_and_only_inside_the_decode_ranges() -> None:
    trace = [
        event(profile_decode.DECODE, "user_annotation", 1000, 1000),  # two decode ranges of 1 ms each
        event(profile_decode.DECODE, "user_annotation", 5000, 1000),
        event(profile_decode.DECODE, "gpu_user_annotation", 1010, 1200),  # the same range on the device: no window
        event("prefill gemm", "kernel", 500, 400),  # before the first range: the prefill, not counted
        event("a", "kernel", 1100, 200), event("b", "kernel", 1200, 200),  # overlap: 300 us busy
        event("copy", "gpu_memcpy", 1900, 300),  # runs past the range's end: 100 us of it inside
        event("c", "kernel", 5000, 500),
        event("cudaGraphLaunch", "cuda_runtime", 1050, 5), event("cudaLaunchKernel", "cuda_runtime", 1060, 5),
        event("cuLaunchKernel", "cuda_driver", 5010, 5), event("cudaStreamSynchronize", "cuda_runtime", 1500, 400),
        event("cudaLaunchKernel", "cuda_runtime", 3000, 5),  # between the ranges: not counted
        event("cudaGraphLaunch", "cuda_runtime", 5100, 405),
        event("fused draft", "user_annotation", 1040, 400), event("fused read", "user_annotation", 5600, 200),
        event("fused draft", "user_annotation", 3000, 900),  # between the ranges: not counted
    ]
    row = profile_decode.summarize(trace, "ddtree@32", steps=4, tau=2.5)
    assert row.wall_ms == pytest.approx(0.5)  # 2 ms over 4 steps
    assert row.device_busy_ms == pytest.approx((0.3 + 0.1 + 0.5) / 4)
    assert row.device_idle_ms == pytest.approx(row.wall_ms - row.device_busy_ms)
    assert (row.kernels, row.graph_launches, row.eager_launches) == (1.0, 0.5, 0.5)
    assert row.fused_host_ms == pytest.approx({"verify": 0.0, "draft": 0.1, "read": 0.05})
    assert row.graph_launch_us == (205.0, 405)  # the median of 5 and 405 us, the longest
    assert row.host_waits_ms == pytest.approx(0.1)
    assert row.kernel_us == pytest.approx({"a": 50.0, "b": 50.0, "c": 125.0})  # the prefill's kernel is not counted
    assert row.kernel_counts == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.25})
    table = profile_decode.kernel_table([row], top=2)
    assert "| c | 125.0 us (0.2) |\n| a |" in table and "| b |" not in table  # the top kernels by time (ties by name)
    assert "| other | 0.225 |" in table  # every kernel's time in its part
    with pytest.raises(ValueError, match="no decode steps"):
        profile_decode.summarize(trace[2:], "ar", steps=4, tau=1.0)


def test_a_cpu_run_of_the_tiny_pair_profiles_each_method(tiny_dirs: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in ([4, 5, 6], [7, 8, 9, 10], [3, 2])))
    out = tmp_path / "rows.json"
    profile_decode.main(["--target", str(target), "--drafter", str(drafter), "--device", "cpu", "--prompts",
                         str(prompts), "--limit", "2", "--max-new-tokens", "12", "--budget", "4,6", "--json", str(out)])
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ar", "dflash", "ddtree@4", "ddtree@6"}
    assert rows["ar"]["steps"] == 2 * 11 and rows["ar"]["tau"] == 1.0  # two prompts, 11 steps after the prefill each
    for row in rows.values():
        assert row["wall_ms"] > 0 and row["device_busy_ms"] == 0 and row["kernels"] == 0  # no device work on a CPU
        assert row["device_idle_ms"] == pytest.approx(row["wall_ms"])
    assert "| ddtree@6 |" in capsys.readouterr().out
    assert rows["ar"]["fused_host_ms"] == {"verify": 0, "draft": 0, "read": 0}  # a CPU's steps are not fused


def test_a_fused_steps_host_calls_are_timed_each_in_its_own_range(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    loaded = profile_decode.Loaded(str(target), str(drafter), "cpu", None, "fast")
    loaded.target.fused = True  # a GPU's default; a CPU runs the fused steps' work eagerly
    verify = FusedSteps.verify
    row, _ = profile_decode.profile_method(loaded, "ddtree", 4, [[4, 5, 6], [7, 8, 9, 10]], 12, top=3)
    assert all(row.fused_host_ms[call] > 0 for call in profile_decode.FUSED_CALLS)
    assert FusedSteps.verify is verify  # the ranges are gone after the profile
