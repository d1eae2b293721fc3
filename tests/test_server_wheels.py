"""`benchmarks/gpu/server_wheels.py`: the wheels a GPU machine without a registry needs are the whole installed
closure of blockdraft's runtime dependencies (a dependency's dependency included: fastapi's opentelemetry-api, whose
absence killed a server at its first import there), minus the image's torch/transformers stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import server_wheels  # noqa: E402


def test_the_closure_holds_dependencies_of_dependencies_and_not_the_images_stack() -> None:
    needed = server_wheels.closure(["fastapi>=0.1", "torch>=2.11,<2.14", "typer==0.29.2 ; python_version >= '3.9'"])
    assert {"fastapi", "starlette", "pydantic", "pydantic-core", "opentelemetry-api", "typer", "rich"} <= set(needed)
    assert not {"torch", "numpy", "jinja2"} & set(needed)
    assert needed["fastapi"] == server_wheels.metadata.version("fastapi")


def test_every_needed_pin_is_downloaded_for_the_gpu_machines_python(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda command, check: calls.append(command))
    assert server_wheels.main(["--out", str(tmp_path)]) == 0
    (command,) = calls
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command
    pins = {arg.split("==")[0] for arg in command if "==" in arg}
    assert {"fastapi", "uvicorn", "opentelemetry-api", "httpx", "gguf", "prometheus-client"} <= pins
    assert "torch" not in pins and "matplotlib" not in pins
