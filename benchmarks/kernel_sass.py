"""Our few-row product kernels as an H200 runs them, read without a GPU: each config compiled for sm_90, its
registers and spills, and its hottest loop's instructions per weight element it streams.

Why: a product of a few rows is a read of its weights only while each SM issues the loop's instructions faster
than the weights arrive. An H200 SM receives ~8 bf16 weight elements a cycle (4.29 TB/s of copy bandwidth over 132
SMs at 1.98 GHz, 2 bytes each) and issues at most 4 warp instructions a cycle (4 schedulers), so a loop that needs
more than ~0.49 warp instructions per weight element cannot keep up with memory, whatever its tiles. The one-row
GEMV, which runs the 8B decode step at 1.10x its weights' read (benchmarks/RESULTS.md session 29), needs 0.13-0.15.
Triton compiles for a target without a driver and ships ptxas and cuobjdump, so this needs no device: it tells
which configs and row counts are worth a GPU's time before any is spent.

    python benchmarks/kernel_sass.py --kernel gemv_rows --rows 2,4,8 --epilogues plain,norm,glu+residual
    python benchmarks/kernel_sass.py --kernel gemv --epilogues norm
    python benchmarks/kernel_sass.py --kernel weights_first --rows 16 --epilogues plain,norm --json sass.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from rich.console import Console
from rich.table import Table
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from blockdraft.models import skinny_gemm
from blockdraft.numbers import int_list

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ISSUE_A_CYCLE = 4  # warp instructions an SM issues a cycle (four schedulers, one each)
ALIGNED = 16  # what Triton assumes of a pointer or size divisible by 16 when it specializes a launch (all of ours)
POINTERS = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "g_ptr", "r_ptr")
# each kernel: its function, its runtime arguments beyond the pointers, its tuned configs and their row constexpr
KERNELS = {
    "gemv": (skinny_gemm._gemv_kernel, ("part_ptr", "count_ptr", "N", "K", "eps", "stride_wn"),
             skinny_gemm.GEMV_CONFIGS, None),
    "gemv_rows": (skinny_gemm._gemv_rows_kernel, ("M", "N", "K", "eps", "stride_xm", "stride_wn", "stride_ym",
                                                  "stride_rm"), skinny_gemm.GEMV_ROWS_CONFIGS, "ROWS"),
    "weights_first": (skinny_gemm._weights_first_kernel, ("part_ptr", "count_ptr", "M", "N", "K", "eps", "stride_xm",
                                                          "stride_wn", "stride_ym", "stride_rm"),
                      skinny_gemm.WEIGHTS_FIRST_CONFIGS, "ROWS"),
}
TYPES = {"part_ptr": "*fp32", "count_ptr": "*i32", "eps": "fp32"}
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)([^;]*);")


@dataclass
class Reading:
    """One compiled config: what it holds and what its hottest loop issues."""

    kernel: str
    rows: int
    epilogue: str
    config: str
    registers: int
    spilled_bytes: int
    loop_instructions: int
    per_weight_element: float  # warp instructions the loop issues per weight element it reads
    issue_bound: bool
    top: str


def compile_for_sm90(kernel: str, rows: int | None, epilogue: str, config: triton.Config) -> bytes:
    """The cubin of one config of `kernel` for sm_90 (bf16 operands, every pointer and size 16-aligned, as the
    engine's launches are specialized)."""
    fn, scalars, _, rows_name = KERNELS[kernel]
    signature = {name: "*bf16" for name in POINTERS} | {name: TYPES.get(name, "i32") for name in scalars}
    constants = dict(HAS_BIAS="bias" in epilogue, GLU="glu" in epilogue, NORM="norm" in epilogue,
                     RESIDUAL="residual" in epilogue) | config.kwargs
    if kernel == "weights_first":
        constants["F32_DOT"] = False
    if kernel == "gemv":
        constants.setdefault("SPLITS", 1)
    if rows_name is not None:
        constants[rows_name] = rows
    names = list(fn.arg_names)
    signature = {name: "constexpr" if name in constants else signature[name] for name in names}
    aligned = [i for i, name in enumerate(names) if signature[name].startswith("*")
               or name in ("N", "K") or name.startswith("stride")]
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(i,): [["tt.divisibility", ALIGNED]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.asm["cubin"]


def hottest_loop(sass: str) -> collections.Counter[str]:
    """The opcodes of the longest backward branch's body in `sass` (the K loop: the kernels have no longer one)."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    index = {address: i for i, (address, _, _) in enumerate(code)}
    body = (0, -1)
    for i, (address, opcode, operands) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            start = index[int(target.group(1), 16)]
            if i - start > body[1] - body[0]:
                body = (start, i)
    return collections.Counter(opcode.split(".")[0] for _, opcode, _ in code[body[0] : body[1] + 1])


def read(kernel: str, rows: int, epilogue: str, config: triton.Config, elements_a_cycle: float) -> Reading:
    """Compile one config and read its resources and loop (`elements_a_cycle`: weight elements an SM receives a
    cycle at full bandwidth)."""
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernel.cubin"
        cubin.write_bytes(compile_for_sm90(kernel, rows, epilogue, config))
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    resources = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", usage))
    loop = hottest_loop(sass)
    instructions = sum(loop.values())
    tile = config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"]
    per_element = instructions * config.num_warps / tile
    label = "/".join(str(v) for v in config.kwargs.values()) + f" w{config.num_warps} s{config.num_stages}"
    return Reading(kernel, rows, epilogue, label, int(resources["REG"]),
                   int(resources.get("LOCAL", 0)) + int(resources.get("STACK", 0)), instructions, per_element,
                   per_element * elements_a_cycle > ISSUE_A_CYCLE, ", ".join(f"{k} {v}" for k, v in loop.most_common(5)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=tuple(KERNELS), default="gemv_rows")
    parser.add_argument("--rows", type=int_list, default="2,4", help="rows (a power of two) for the kernels with a "
                        "row tile; the one-row GEMV ignores it")
    parser.add_argument("--epilogues", default="plain,norm,glu+residual",
                        help="comma-separated; each names any of glu, norm, residual, bias joined by +")
    parser.add_argument("--bandwidth", type=float, default=4.29e12, help="bytes/s (the H200's measured copy rate)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--clock", type=float, default=1.98e9, help="Hz")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    elements = args.bandwidth / args.sms / args.clock / 2
    _, _, configs, rows_name = KERNELS[args.kernel]
    readings = [read(args.kernel, rows, epilogue, config, elements)
                for rows in (args.rows if rows_name else [1]) for epilogue in args.epilogues.split(",")
                for config in configs]
    table = Table(title=f"{args.kernel} for sm_90: the K loop per weight element (an SM receives {elements:.1f} a "
                        f"cycle and issues {ISSUE_A_CYCLE}: at most {ISSUE_A_CYCLE / elements:.2f} keeps up)")
    for column in ("rows", "epilogue", "config", "registers", "spilled B", "loop instr", "per weight element",
                   "issue-bound", "most issued"):
        table.add_column(column)
    for r in readings:
        table.add_row(str(r.rows), r.epilogue, r.config, str(r.registers), str(r.spilled_bytes),
                      str(r.loop_instructions), f"{r.per_weight_element:.3f}", "yes" if r.issue_bound else "no", r.top)
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in readings], indent=1))


if __name__ == "__main__":
    main()
