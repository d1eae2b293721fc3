"""The wheels a GPU machine without a registry needs to run blockdraft (`serve` and the benchmarks around it): the
runtime dependencies pinned in pyproject.toml and theirs, at the versions installed here, minus what the GPU
machine's image already holds (torch, transformers and their stack). Downloaded for its Python 3.12 on x86-64 into
`.gpu/w` (ignored; carry it, `benchmarks/gpu/env.sh` installs it). A missing one surfaced only when a server died at
its first import on the GPU machine (fastapi's opentelemetry-api), a call's device time lost.

    python benchmarks/gpu/server_wheels.py [--out .gpu/w]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

# torch, transformers and the hub's stack, with their own dependencies: in the image (KINDS.md's package list)
IMAGE_HAS = {"torch", "transformers", "safetensors", "tokenizers", "huggingface-hub", "accelerate", "numpy",
             "triton", "jinja2", "markupsafe", "pyyaml", "tqdm", "filelock", "fsspec", "packaging", "requests",
             "regex", "sympy", "networkx", "setuptools", "psutil"}
NOT_THERE = {"matplotlib"}  # plots are drawn from the results on this side
BENCHMARKS_NEED = ["httpx"]  # the load and start-up benchmarks' HTTP client
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def named(requirement: str) -> str:
    """The canonical name a requirement ("fastapi==0.163.2", "torch>=2.11,<2.14") asks for."""
    return canonical(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])


def closure(requirements: list[str]) -> dict[str, str]:
    """Each installed distribution `requirements` need (extras' aside), by canonical name: its version."""
    found: dict[str, str] = {}
    todo = [named(requirement) for requirement in requirements if "extra ==" not in requirement]
    while todo:
        name = todo.pop()
        if name in found or name in IMAGE_HAS | NOT_THERE:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement of another platform or Python (its marker excluded it here)
        found[name] = dist.version
        todo += [named(requirement) for requirement in dist.requires or [] if "extra ==" not in requirement]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu/w"))
    args = parser.parse_args(argv)
    needed = closure([*(metadata.requires("blockdraft") or []), *BENCHMARKS_NEED])
    pins = [f"{name}=={version}" for name, version in sorted(needed.items())]
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(args.out), *pins],
                   check=True)
    print(f"{len(pins)} wheels in {args.out}: {' '.join(pins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
