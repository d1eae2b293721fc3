"""benchmarks/kernel_sass.py: our product kernels compiled for sm_90 without a GPU (Triton's own ptxas and
cuobjdump), their registers, spills and the K loop's instructions per weight element. The compile runs in a process
of its own: under the interpreter (conftest's, without CUDA) the kernels are not compiled."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"
SPEC = importlib.util.spec_from_file_location("kernel_sass", SCRIPT)
kernel_sass = importlib.util.module_from_spec(SPEC)
sys.modules["kernel_sass"] = kernel_sass
SPEC.loader.exec_module(kernel_sass)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   FFMA R2, R3, R4, R2 ;
        /*0030*/               @P0 BRA 0x20 ;
        /*0040*/                   LDG.E R5, desc[UR4][R6.64] ;
        /*0050*/                   FFMA R2, R3, R5, R2 ;
        /*0060*/                   IMAD R7, R7, 0x2, RZ ;
        /*0070*/              @!P1 BRA 0x40 ;
        /*0080*/                   EXIT ;
"""


def test_the_hottest_loop_is_the_longest_backward_branchs_body() -> None:
    """Two loops: the longer (LDG, FFMA, IMAD and its branch) is the one counted, by opcode without modifiers."""
    assert kernel_sass.hottest_loop(SASS) == {"LDG": 1, "FFMA": 1, "IMAD": 1, "BRA": 1}


def test_more_rows_of_the_gemv_issue_more_for_each_weight_element(tmp_path: Path) -> None:
    """Each tuned config of the GEMV of several rows compiles for sm_90 with the norm epilogue; at 8 rows every one
    issues more instructions per weight element it reads than at 2 (more multiply-adds a loaded weight), which is why
    the GEMV stops at GEMV_MAX_ROWS."""
    from blockdraft.kernels.skinny_gemm import GEMV_ROWS_CONFIGS

    out = tmp_path / "sass.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}  # compiled, not run
    subprocess.run([sys.executable, str(SCRIPT), "--kernel", "gemv_rows", "--rows", "2,8", "--epilogues", "norm",
                    "--json", str(out)], env=env, check=True, capture_output=True)
    readings = json.loads(out.read_text())
    assert len(readings) == 2 * len(GEMV_ROWS_CONFIGS)
    for reading in readings:
        assert reading["registers"] > 0 and reading["loop_instructions"] > 0 and "FFMA" in reading["top"], reading
        assert 0 < reading["warps_an_sm"] <= 64, reading
    per_element = {(r["rows"], r["config"]): r["per_element"] for r in readings}
    configs = {config for _, config in per_element}
    assert all(per_element[8, config] > per_element[2, config] for config in configs), per_element
    assert any(r["issue_bound"] for r in readings if r["rows"] == 8)
    assert not any(r["issue_bound"] or r["spilled_bytes"] for r in readings if r["rows"] == 2)


def test_the_attention_compiles_as_launched_its_keys_streamed_by_async_copies(tmp_path: Path) -> None:
    """The compact-mask attention, its strides and head dimension specialized as multiples of 16 as the engine's
    launches are: its key loop copies K and V asynchronously (LDGSTS, the pipelined loads; without the alignment
    the same loop loads element by element) and multiplies on tensor cores (HMMA)."""
    out = tmp_path / "attention.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(SCRIPT), "--kernel", "block_attention", "--epilogues", "plain", "--json",
                    str(out)], env=env, check=True, capture_output=True)
    readings = json.loads(out.read_text())
    assert readings[0]["config"] == "w4 s3"  # as launched: Triton's defaults
    for reading in readings:
        assert reading["opcodes"].get("LDGSTS", 0) > 0 and reading["opcodes"].get("HMMA", 0) > 0, reading
        assert reading["warps_an_sm"] >= 4 and reading["shared_bytes"] > 0, reading


def test_every_step_kernel_compiles_for_sm90_without_spilling() -> None:
    """Each kernel of a decode step the script reads (the products, the attentions' splits and combine, the q|k|v
    epilogue), its first config compiled for sm_90 as launched (the GEMV of several rows at 4, its most): registers
    held, nothing spilled, a loop found where it streams."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}  # compiled, not run
    code = (f"import sys, json; sys.path.insert(0, {str(SCRIPT.parent)!r}); import kernel_sass as k\n"
            "rows = {name: 4 if name == 'gemv_rows' else 16 for name in k.KERNELS}\n"
            "print(json.dumps({name: k.read(name, rows[name], 'norm', spec.configs[0], 8.0).__dict__\n"
            "                  for name, spec in k.KERNELS.items()}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    readings = json.loads(done.stdout.splitlines()[-1])
    assert set(readings) >= {"gemv", "gemv_rows", "weights_first", "block_attention", "combine", "qkv_rope"}, readings
    for name, reading in readings.items():
        assert reading["registers"] > 0 and reading["spilled_bytes"] == 0, reading
        assert (reading["loop_instructions"] > 0) == (name != "qkv_rope"), reading  # one head of one row: no loop


def test_a_64_row_attention_block_holds_its_rows_on_8_warps_and_spills_on_4() -> None:
    """The taller row block the engine's chooser may pick (a KV head's 64 folded rows in one program, reading its keys
    once): on 8 warps (`fast_ops.WIDE_LAUNCH`, the launch the chooser offers it with) nothing spills and an SM holds 8
    warps, its loop under what keeps up with an H200's memory; on Triton's default 4 warps it spills, which is why
    its 4-warp option is only the plain one."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = (f"import sys, json, triton; sys.path.insert(0, {str(SCRIPT.parent)!r}); import kernel_sass as k\n"
            "print(json.dumps({w: k.read('block_attention', 64, 'plain', triton.Config({}, num_warps=w, "
            "num_stages=3), 8.2).__dict__ for w in (4, 8)}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    readings = json.loads(done.stdout.splitlines()[-1])
    wide, narrow = readings["8"], readings["4"]
    assert wide["spilled_bytes"] == 0 and wide["warps_an_sm"] >= 8 and not wide["issue_bound"], wide
    assert narrow["spilled_bytes"] > 0, narrow
