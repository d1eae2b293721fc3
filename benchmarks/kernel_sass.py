"""Our few-row product kernels (and the compact-mask attention) as an H200 runs them, read without a GPU: each
config compiled for sm_90, its registers and spills, and its hottest loop's instructions per weight (or K/V) element
it streams.

Why: a product of a few rows is a read of its weights only while each SM issues the loop's instructions faster
than the weights arrive. An H200 SM receives ~8 bf16 weight elements a cycle (4.29 TB/s of copy bandwidth over 132
SMs at 1.98 GHz, 2 bytes each) and issues at most 4 warp instructions a cycle (4 schedulers), so a loop that needs
more than ~0.49 warp instructions per weight element cannot keep up with memory, whatever its tiles. The one-row
GEMV, which runs the 8B decode step at 1.10x its weights' read (H200, benchmarks/RESULTS.md, 2026-12-03), needs
0.13-0.15.
Triton compiles for a target without a driver and ships ptxas and cuobjdump, so this needs no device: it tells
which configs and row counts are worth a GPU's time before any is spent.

    python benchmarks/kernel_sass.py --kernel gemv_rows --rows 2,4,8 --epilogues plain,norm,glu+residual
    python benchmarks/kernel_sass.py --kernel gemv --epilogues norm
    python benchmarks/kernel_sass.py --kernel weights_first --rows 16 --epilogues plain,norm --json sass.json
    python benchmarks/kernel_sass.py --kernel block_attention --epilogues plain,window,merge,one-split
    python benchmarks/kernel_sass.py --kernel block_attention --rows 16,64 --epilogues plain,merge
    python benchmarks/kernel_sass.py --kernel combine --epilogues plain   # also qkv_rope
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from rich.console import Console
from rich.table import Table
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from blockdraft.kernels import block_attention, flash_decode, qkv_rope, skinny_gemm
from blockdraft.kernels.flash_decode import BLOCK_KEYS, BLOCK_ROWS
from blockdraft.numbers import int_list

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ISSUE_A_CYCLE = 4  # warp instructions an SM issues a cycle (four schedulers, one each)
SM_REGISTERS, SM_SHARED, SM_WARPS = 65536, 228 * 1024, 64  # an H100/H200 SM's (registers go 8 a thread at a time)
SHARED_RESERVED = 1024  # the shared memory the driver keeps for each resident program
ALIGNED = 16  # what Triton assumes of a pointer or size divisible by 16 when it specializes a launch (all of ours)
HEAD_DIM = 128  # the attention's head dimension (Qwen3-8B's and most targets')


@dataclass
class Spec:
    """How to compile one kernel: its function, its arguments' types (pointers bf16 unless named), which of them are
    16-aligned at the engine's launches, its configs, the constant that holds its rows, its constants for an
    epilogue, and the streamed elements one iteration of its K loop reads for a config."""

    fn: object
    types: dict[str, str]
    aligned: Callable[[str], bool]
    configs: list[triton.Config]
    rows_name: str | None
    constants: Callable[[str], dict[str, object]]
    elements: Callable[[triton.Config], int]
    default_rows: tuple[int, ...] = (2, 4)  # what --rows reads when left out


def _product_constants(epilogue: str) -> dict[str, object]:
    return dict(HAS_BIAS="bias" in epilogue, GLU="glu" in epilogue, NORM="norm" in epilogue,
                RESIDUAL="residual" in epilogue)


def _tile(config: triton.Config) -> int:
    return config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"]


def _product_aligned(name: str) -> bool:
    return name in ("N", "K") or name.startswith("stride")


TRITON_DEFAULTS = [triton.Config({}, num_warps=4, num_stages=3)]  # as the kernels launched without tuning run
_PRODUCT_TYPES = {"part_ptr": "*fp32", "count_ptr": "*i32", "eps": "fp32"}
KERNELS = {
    "gemv": Spec(skinny_gemm._gemv_kernel, {"eps": "fp32"}, _product_aligned, skinny_gemm.GEMV_CONFIGS, None,
                 _product_constants, _tile),
    "gemv_rows": Spec(skinny_gemm._gemv_rows_kernel, _PRODUCT_TYPES, _product_aligned, skinny_gemm.GEMV_ROWS_CONFIGS,
                      "ROWS", _product_constants, _tile),
    "weights_first": Spec(skinny_gemm._weights_first_kernel, _PRODUCT_TYPES, _product_aligned,
                          skinny_gemm.WEIGHTS_FIRST_CONFIGS, "ROWS",
                          lambda epilogue: _product_constants(epilogue) | {"F32_DOT": False}, _tile),
    "block_attention": Spec(  # as `block_attention` launches it (Triton's default 4 warps, 3 stages; a decode's rows),
        block_attention._block_split_kernel,  # then the other launches the engine's chooser may pick
        {"seq_ptr": "*i64", "length_ptr": "*i64", "pos_ptr": "*i64", "own_ptr": "*u8", "acc_ptr": "*fp32",
         "m_ptr": "*fp32", "l_ptr": "*fp32", "count_ptr": "*i32", "scale": "fp32"},
        lambda name: name == "D" or name[:3] in ("sq_", "sk_", "sv_", "so_"),
        [triton.Config({}, num_warps=w, num_stages=st) for w, st in ((4, 3), (8, 3), (4, 4), (8, 2))], "BLOCK_R",
        lambda epilogue: dict(WINDOW="window" in epilogue, F32_DOT=False, MIN_KEYS=BLOCK_KEYS,
                              MERGE="merge" in epilogue, ONE_SPLIT="one" in epilogue,
                              BLOCK_S=BLOCK_KEYS, BLOCK_D=HEAD_DIM),
        lambda config: 2 * BLOCK_KEYS * HEAD_DIM,  # a block of keys and its values
        (BLOCK_ROWS,)),  # its query rows a program (`--rows 16,64`: the taller row blocks the chooser may pick)
    "combine": Spec(flash_decode._combine_kernel, {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                                                   "length_ptr": "*i64"},
                    lambda name: name == "D" or name.startswith("so_"), TRITON_DEFAULTS, None,
                    lambda epilogue: dict(LENGTHS=True, MIN_KEYS=BLOCK_KEYS, BLOCK_R=BLOCK_ROWS, BLOCK_S=BLOCK_KEYS,
                                          BLOCK_D=HEAD_DIM),
                    lambda config: BLOCK_ROWS * HEAD_DIM),  # a split's partial rows
    "qkv_rope": Spec(qkv_rope._qkv_rope_kernel, {"slot_ptr": "*i64", "col_ptr": "*i64", "eps": "fp32"},
                     lambda name: name == "D" or name.startswith("s_"), TRITON_DEFAULTS, None,
                     lambda epilogue: dict(NORM="norm" in epilogue, BLOCK_D=HEAD_DIM),
                     lambda config: HEAD_DIM),  # one head of one row
}
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
    shared_bytes: int
    warps_an_sm: int  # resident warps an SM holds, by registers, shared memory and the 64-warp limit
    per_element: float  # warp instructions the loop issues per element it streams (weights; K/V for the attention)
    issue_bound: bool
    top: str
    opcodes: dict[str, int]  # the loop's, each opcode's count


def compile_for_sm90(kernel: str, rows: int | None, epilogue: str, config: triton.Config) -> tuple[bytes, int]:
    """The cubin of one config of `kernel` for sm_90 (bf16 operands, the pointers and the sizes the engine's launches
    give as multiples of 16 specialized so, as Triton specializes them) and the shared memory a program takes."""
    spec = KERNELS[kernel]
    constants = spec.constants(epilogue) | config.kwargs
    if spec.rows_name is not None:
        constants[spec.rows_name] = rows
    names = list(spec.fn.arg_names)
    signature = {name: "constexpr" if name in constants else spec.types.get(
        name, "*bf16" if name.endswith("_ptr") else "i32") for name in names}
    aligned = [i for i, name in enumerate(names) if signature[name].startswith("*") or spec.aligned(name)]
    source = ASTSource(fn=spec.fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(i,): [["tt.divisibility", ALIGNED]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.asm["cubin"], compiled.metadata.shared


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
        code, shared = compile_for_sm90(kernel, rows, epilogue, config)
        cubin.write_bytes(code)
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    resources = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", usage))
    loop = hottest_loop(sass)
    instructions = sum(loop.values())
    per_element = instructions * config.num_warps / KERNELS[kernel].elements(config)
    registers = int(resources["REG"])
    programs = min(SM_REGISTERS // (-(-registers // 8) * 8 * 32 * config.num_warps),
                   SM_SHARED // max(shared + SHARED_RESERVED, 1), SM_WARPS // config.num_warps)
    tiles = "/".join(str(v) for v in config.kwargs.values())
    label = f"{tiles} w{config.num_warps} s{config.num_stages}".strip()
    return Reading(kernel, rows, epilogue, label, registers,
                   int(resources.get("LOCAL", 0)) + int(resources.get("STACK", 0)), instructions, shared,
                   programs * config.num_warps, per_element, per_element * elements_a_cycle > ISSUE_A_CYCLE,
                   ", ".join(f"{k} {v}" for k, v in loop.most_common(5)), dict(loop))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=tuple(KERNELS), default="gemv_rows")
    parser.add_argument("--rows", type=int_list, default=None, help="rows (a power of two) for the kernels with a "
                        "row tile (default 2,4; the attention's query rows a program, default 16); the one-row GEMV "
                        "ignores it")
    parser.add_argument("--epilogues", default="plain,norm,glu+residual",
                        help="comma-separated; each names any of glu, norm, residual, bias (products) or window, "
                        "merge (attention) joined by +")
    parser.add_argument("--bandwidth", type=float, default=4.29e12, help="bytes/s (the H200's measured copy rate)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--clock", type=float, default=1.98e9, help="Hz")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    elements = args.bandwidth / args.sms / args.clock / 2
    spec = KERNELS[args.kernel]
    readings = [read(args.kernel, rows, epilogue, config, elements)
                for rows in ((args.rows or spec.default_rows) if spec.rows_name else [1])
                for epilogue in args.epilogues.split(",")
                for config in spec.configs]
    table = Table(title=f"{args.kernel} for sm_90: the K loop's warp instructions per element it streams (an SM "
                        f"receives {elements:.1f} a cycle and issues {ISSUE_A_CYCLE}: at most "
                        f"{ISSUE_A_CYCLE / elements:.2f} keeps up)")
    for column in ("rows", "epilogue", "config", "registers", "spilled B", "shared KB", "warps an SM", "loop instr",
                   "per element", "issue-bound", "most issued"):
        table.add_column(column)
    for r in readings:
        table.add_row(str(r.rows), r.epilogue, r.config, str(r.registers), str(r.spilled_bytes),
                      f"{r.shared_bytes / 1024:.0f}", str(r.warps_an_sm), str(r.loop_instructions),
                      f"{r.per_element:.3f}", "yes" if r.issue_bound else "no", r.top)
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in readings], indent=1))


if __name__ == "__main__":
    main()
