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
    from blockdraft.models.skinny_gemm import GEMV_ROWS_CONFIGS

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


def test_a_dependent_launch_waits_before_its_first_global_access() -> None:
    """ACQBULK (griddepcontrol.wait) ahead of the first global load or store, and PREEXIT present: waiting; a load
    hoisted above the wait, or no PREEXIT, or no wait at all: not."""
    ordered = "/*0000*/ MOV R1, c[0x0][0x28] ;\n/*0010*/ ACQBULK ;\n/*0020*/ PREEXIT ;\n/*0030*/ LDG.E R0, desc[UR4][R2.64] ;"
    hoisted = "/*0000*/ LDGSTS [R1], desc[UR4][R2.64] ;\n/*0010*/ ACQBULK ;\n/*0020*/ PREEXIT ;"
    no_exit = "/*0000*/ ACQBULK ;\n/*0010*/ STG.E desc[UR4][R2.64], R5 ;"
    plain = "/*0000*/ LDG.E R0, desc[UR4][R2.64] ;\n/*0010*/ STG.E desc[UR4][R2.64], R5 ;"
    lines = {name: "\n".join("        " + line for line in sass.splitlines())
             for name, sass in dict(ordered=ordered, hoisted=hoisted, no_exit=no_exit, plain=plain).items()}
    assert kernel_sass.waits_before_memory(lines["ordered"])
    assert not any(kernel_sass.waits_before_memory(lines[name]) for name in ("hoisted", "no_exit", "plain"))


def test_a_prefetch_counts_only_ahead_of_the_wait() -> None:
    """An L2 prefetch (CCTL.E.PF2) before ACQBULK is one, and is no global access the wait must precede; one after
    the wait, another cache operation before it, or no wait at all: not."""
    ahead = "/*0000*/ CCTL.E.PF2 [R2] ;\n/*0010*/ ACQBULK ;\n/*0020*/ PREEXIT ;\n/*0030*/ LDG.E R0, desc[UR4][R2.64] ;"
    after = "/*0000*/ ACQBULK ;\n/*0010*/ CCTL.E.PF2 [R2] ;\n/*0020*/ PREEXIT ;"
    other = "/*0000*/ CCTL.IVALL ;\n/*0010*/ ACQBULK ;\n/*0020*/ PREEXIT ;"
    unwaited = "/*0000*/ CCTL.E.PF2 [R2] ;\n/*0010*/ LDG.E R0, desc[UR4][R2.64] ;"
    lines = {name: "\n".join("        " + line for line in sass.splitlines())
             for name, sass in dict(ahead=ahead, after=after, other=other, unwaited=unwaited).items()}
    assert kernel_sass.prefetches_before_wait(lines["ahead"]) and kernel_sass.waits_before_memory(lines["ahead"])
    assert not any(kernel_sass.prefetches_before_wait(lines[name]) for name in ("after", "other", "unwaited"))


def test_every_step_kernel_compiled_for_dependent_launch_waits_before_it_touches_memory() -> None:
    """Each kernel of a decode step (the products, the attentions' splits and combine, the q|k|v epilogue), its
    first config compiled for sm_90 with PDL on, waits for the kernel before it ahead of any global access (a
    dependent launch reads and writes only what that kernel finished) and lets the next one launch, and the
    products prefetch their first weight tile ahead of that wait; with PDL off (the default, and every CPU) none
    of it."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}  # compiled, not run
    code = (f"import sys, json; sys.path.insert(0, {str(SCRIPT.parent)!r}); import kernel_sass as k\n"
            "readings = {name: [k.read(name, 16, 'norm', spec.configs[0], 8.0, dependent)\n"
            "                   for dependent in (False, True)] for name, spec in k.KERNELS.items()}\n"
            "print(json.dumps({name: [[r.waits_first, r.prefetches_first] for r in pair]\n"
            "                  for name, pair in readings.items()}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    readings = json.loads(done.stdout.splitlines()[-1])
    products = {"gemv", "gemv_rows", "weights_first", "skinny"}
    assert set(readings) >= products | {"block_attention", "split", "combine", "qkv_rope"}, readings
    assert all([plain[0], dependent[0]] == [False, True] for plain, dependent in readings.values()), readings
    # the products ask L2 for their first weight tile before they wait; nothing does so with PDL off
    prefetching = {name: [plain[1], dependent[1]] for name, (plain, dependent) in readings.items()}
    assert all(pair == [False, name in products] for name, pair in prefetching.items()), prefetching
