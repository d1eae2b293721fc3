"""benchmarks/gpu/profile_step.py's breakdown of a step's GPU time by part, from kernel names (CPU: no profiling)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "profile_step.py"
SPEC = importlib.util.spec_from_file_location("profile_step", SCRIPT)
profile_step = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(profile_step)


def test_the_kernels_of_an_h200_step_fall_in_their_parts() -> None:
    """Names from the H200's profiles (benchmarks/RESULTS.md, 2026-12-03): Triton's, cuBLAS's, cuDNN's, inductor's."""
    kernels = [("_gemv_kernel", 2000.0), ("nvjet_sm90_tst_64x72_64x12_2x1_v_bz_splitK_TNT", 1000.0),
               ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 100.0),
               ("_weights_first_kernel", 500.0), ("_block_split_kernel", 300.0), ("_combine_kernel", 100.0),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 700.0),
               ("_qkv_rope_kernel", 50.0), ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 80.0),
               ("triton_poi_fused_mul_silu_split_0", 40.0), ("triton_poi_fused_clone_transpose_view_0", 30.0),
               ("_path_delta_rule_kernel", 60.0), ("_advance_kernel", 20.0)]  # a hybrid target's linear layers
    parts = profile_step.by_category(kernels, steps=2)
    assert parts == pytest.approx({"weight products": 1.8, "attention": 0.55, "q|k|v epilogue": 0.025,
                                   "delta rule": 0.04, "norms": 0.04, "glu": 0.02, "other": 0.015})


def test_a_prefill_step_repeats_on_an_empty_cache() -> None:
    """`--prefill N`'s step: an N-token prompt into the cache, which is then emptied, so the profiled steps are
    alike (CPU, the tests' tiny target); `--rows ""` leaves the decode steps out."""
    from conftest import make_target_model

    from blockdraft.fast.target import FastTarget

    target = FastTarget(make_target_model("qwen3"))
    step = profile_step.prefill_step(target, 12)
    for _ in range(2):
        step()
    assert int(target.storage.length) == 0  # the device length the cache keeps: emptied
    assert profile_step.ints_or_none("") == [] and profile_step.ints_or_none("1,16") == [1, 16]


@pytest.mark.parametrize("flags", [["--rows", "16", "--batch", "16,64"], ["--rows", "", "--prefill", "1024"]])
def test_flags_left_out_parse(flags: list[str]) -> None:
    """Every flag has a default the parser takes: an empty --trees default once stopped a GPU call before its
    profile (H100, 2026-12-07). On the CPU the script then says it needs a CUDA device."""
    res = subprocess.run([sys.executable, str(SCRIPT), "--shape", "8b", *flags],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "profile_step.py needs a CUDA device" in res.stderr, res.stderr[-2000:]
