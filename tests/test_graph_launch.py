"""benchmarks/gpu/graph_launch.py: each fused call's host time a step, on the CPU's tiny pair (the GPU runs it on
the embedded shape with graphs kept alive)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "graph_launch.py"
SPEC = importlib.util.spec_from_file_location("graph_launch", SCRIPT)
graph_launch = importlib.util.module_from_spec(SPEC)
sys.modules["graph_launch"] = graph_launch
SPEC.loader.exec_module(graph_launch)


@pytest.mark.parametrize("lookup", [0, 3])
def test_a_cpu_run_times_each_fused_call_of_a_ddtree_decode(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            lookup: int) -> None:
    """With a lookup chain too (searched and merged in the fused draft)."""
    out = tmp_path / "launch.json"
    graph_launch.main(["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--extra", "0", "--tokens", "48",
                       "--repeats", "1", "--budget", "6", "--lookup", str(lookup), "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["lookup"] == lookup
    (row,) = report["rows"]
    assert row["extra graphs"] == 0 and row["wall ms a step"] > 0 and row["tau"] >= 1
    assert row["host ms in verify"] > 0 and row["host ms in draft"] > 0  # the fused steps ran (eagerly, on a CPU)
    printed = capsys.readouterr().out
    assert "| 0 x 400 kernels |" in printed and printed.startswith("ddtree@6+lookup3," if lookup else "ddtree@6,")


def test_extra_graphs_need_a_gpu_counts_are_not_negative_and_a_lookup_chain_is_ddtrees(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        graph_launch.main(["--device", "cpu", "--extra", "0,5"])
    assert "--extra needs CUDA graphs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        graph_launch.main(["--extra", "0,-1"])
    assert "counts of 0 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        graph_launch.main(["--device", "cpu", "--extra", "0", "--method", "dflash", "--lookup", "4"])
    assert "--lookup 4 is DDTree's" in capsys.readouterr().err


def test_preferring_fused_units_picks_their_fastest_kernel_where_the_library_was_timed_faster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused unit whose library was timed fastest takes its fastest kernel; a plain product and a unit whose kernel
    won keep the chooser's pick (timings seeded, so no GPU is needed)."""
    import torch

    from blockdraft.kernels import kernel_choice, skinny_gemm

    monkeypatch.setattr(skinny_gemm, "fastest", skinny_gemm.fastest)
    monkeypatch.setattr(kernel_choice, "_TIMES", {
        ("few-row norm linear", 1): {"gemv": 3.0, "weights-first": 2.0, "library": 1.0},
        ("few-row glu linear", 1): {"weights-first": 0.5, "library": 1.0},
        ("few-row linear", 1): {"weights-first": 2.0, "library": 1.0}})
    graph_launch.prefer_fused_units()
    options = {"gemv": None, "weights-first": None, "library": None}
    gpu = torch.device("cuda")
    assert skinny_gemm.fastest("few-row norm linear", 1, gpu, options) == "weights-first"
    assert skinny_gemm.fastest("few-row glu linear", 1, gpu, {"weights-first": None, "library": None}) == "weights-first"
    assert skinny_gemm.fastest("few-row linear", 1, gpu, {"weights-first": None, "library": None}) == "library"
