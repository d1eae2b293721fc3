"""Merge tuning tables a GPU machine sent back (`BLOCKDRAFT_SAVE_TUNING=$OUT/added.json`) into the shipped table of
their card (`src/blockdraft/kernels/tuned/<card>.json`), keeping every entry the shipped table holds.

    python benchmarks/gpu/merge_tuning.py /work/.device/.../added.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blockdraft.kernels.tuned_configs import merge, table_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", type=Path, nargs="+", help="tables saved under BLOCKDRAFT_SAVE_TUNING")
    args = parser.parse_args(argv)
    for path in args.tables:
        table = json.loads(path.read_text())
        shipped = table_path(table["card"])
        print(f"{path}: {merge(table, shipped)} entries added to {shipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
