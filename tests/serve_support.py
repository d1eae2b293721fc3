"""Helpers for the serve tests: a tiny target with a character-level tokenizer and chat template, and a real
uvicorn server run on a thread of the test process (127.0.0.1, a free port)."""

from __future__ import annotations

import shutil
import string
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import VOCAB

from blockdraft.serve.server import BlockdraftServer
from blockdraft.serve.settings import ServeSettings

# One token per character: a stop string of two characters always spans two tokens.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c`^"]
EOS = "<|eos|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def add_char_tokenizer(folder: Path) -> None:
    """Save a tokenizer of exactly VOCAB ids (every id the tiny target can produce decodes) into `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def text_pair_dirs(tiny_dirs: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    """The tiny fixture target with a tokenizer added, and the tiny drafter."""
    target, drafter = tiny_dirs
    text_target = root / "text_target"
    shutil.copytree(target, text_target)
    add_char_tokenizer(text_target)
    return text_target, drafter


@contextmanager
def running(settings: ServeSettings, say: Callable[[str], None] = lambda line: None) -> Iterator[BlockdraftServer]:
    """A BlockdraftServer serving on a thread until the block ends (then drained and joined)."""
    server = BlockdraftServer(settings, say)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=60)


def settings(target: Path, drafter: Path | None, **overrides: object) -> ServeSettings:
    """Test defaults: a free port, CPU, no self-check (the tiny random drafter accepts almost nothing)."""
    values = dict(target=str(target), drafter=str(drafter) if drafter else None, port=0, device="cpu",
                  self_check=False, drain_timeout=10.0)
    values.update(overrides)
    return ServeSettings(**values)  # type: ignore[arg-type]
