"""Tool calling as vLLM 0.33 serves it: a request's `tools` and `tool_choice` -> what the chat template is given,
the grammar that enforces a call, and how the model's text becomes `tool_calls`.

- `none`: the tools go to the template (vLLM's default), the output is plain text.
- `auto`: the output is parsed with the tool-call format of the target's chat template: `hermes` (Qwen2.5 / Qwen3:
  a JSON object {"name", "arguments"} inside <tool_call>...</tool_call>) or `qwen3_coder` (Qwen3-Coder / Qwen3.5:
  <tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>). Text before the first call
  is the content; a call that does not parse leaves the whole text as content, as vLLM does.
- `required`: the grammar forces a JSON array of at least one {"name", "parameters"} object, one of the tools each
  (vLLM's schema); every item is a call.
- a named function: the grammar forces that function's `parameters` schema; the output is its arguments.
A grammar runs on the verified tokens, so speculation stays lossless under it (decoding/grammar.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from blockdraft.decoding.grammar import GrammarSpec
from blockdraft.serve.errors import ApiError

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's `tool_calls` item, arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_format(template: str | None) -> str | None:
    """The tool-call format a chat template writes calls in (None: it writes none blockdraft parses)."""
    if not template:
        return None
    if "<function=" in template and START in template:
        return "qwen3_coder"
    if START in template:
        return "hermes"
    return None


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools: what the template is given, which mode, and for `auto` the format calls come in."""

    tools: tuple[dict[str, Any], ...]
    mode: str  # none, auto, required or named
    name: str | None = None  # the named function
    parser: str | None = None  # auto's format: hermes or qwen3_coder
    parallel: bool = True  # `parallel_tool_calls`: false keeps one call (required: the grammar allows one)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [dict(tool) for tool in self.tools] or None

    def grammar(self) -> GrammarSpec | None:
        """The grammar that enforces the call (required, named), else None."""
        if self.mode == "named":
            return GrammarSpec("json_schema", json.dumps(self._parameters(self.name)))
        if self.mode != "required":
            return None
        definitions: dict[str, Any] = {}
        options = []
        for tool in self.tools:
            parameters = dict(self._parameters(tool["function"]["name"]))
            for key, schema in parameters.pop("$defs", {}).items():  # one $defs for the array, as vLLM hoists them
                if definitions.setdefault(key, schema) != schema:
                    raise ApiError(400, f"`tools` define `$defs.{key}` twice with different schemas; name them apart",
                                   "tools")
            options.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                           "parameters": parameters}, "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
        if not self.parallel:
            schema["maxItems"] = 1
        if definitions:
            schema["$defs"] = definitions
        return GrammarSpec("json_schema", json.dumps(schema))

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or NO_PARAMETERS

    @property
    def reports_tool_calls(self) -> bool:
        """Whether a choice with calls finishes as "tool_calls" (a forced named function reports "stop", as in
        OpenAI's API and vLLM)."""
        return self.mode in ("auto", "required")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content, calls); the first call only where parallel calls are off."""
        content, calls = self._parse(text)
        return content, calls if self.parallel else calls[:1]

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            return None, [ToolCall(str(self.name), text)]
        if self.mode == "required":
            return None, _required_calls(text)
        if self.mode == "auto" and START in text:
            try:
                calls = [self.call_in(region) for region in _regions(text)]
            except (ValueError, KeyError, TypeError):
                return text, []
            content = text[: text.find(START)]
            return content or None, calls
        return text, []

    def call_in(self, region: str) -> ToolCall:
        """One <tool_call> region's text -> the call it makes (ValueError, KeyError or TypeError: none)."""
        if self.parser == "qwen3_coder":
            return _coder_call(region, self.tools)
        body = json.loads(region)
        return ToolCall(body["name"], json.dumps(body.get("arguments", {}), ensure_ascii=False))

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _regions(text: str) -> list[str]:
    """The text of every <tool_call> region (the last may be unterminated)."""
    regions = []
    at = text.find(START)
    while at != -1:
        begin = at + len(START)
        end = text.find(END, begin)
        regions.append((text[begin:] if end == -1 else text[begin:end]).strip())
        at = -1 if end == -1 else text.find(START, end)
    return regions


def _required_calls(text: str) -> list[ToolCall]:
    """`required`'s output: the grammar's JSON array of {"name", "parameters"} (a cut-off array: no calls)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def _coder_call(region: str, tools: tuple[dict[str, Any], ...]) -> ToolCall:
    """A qwen3_coder call: each parameter's text converted by its type in the function's schema (strings as they
    are, everything else read as JSON where it parses)."""
    found = _FUNCTION.search(region)
    if found is None:
        raise ValueError("no <function=...> in the tool call")
    name, body = found.group(1).strip(), found.group(2)
    schema = next((t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name), {})
    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    arguments: dict[str, Any] = {}
    for parameter in _PARAMETER.finditer(body):
        key, raw = parameter.group(1).strip(), parameter.group(2)
        kind = properties.get(key, {}).get("type") if isinstance(properties.get(key), dict) else None
        arguments[key] = raw if kind == "string" else _json_or_text(raw)
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that starts `tag` (held back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """A streamed choice's text -> content deltas and tool-call deltas (OpenAI's `delta.tool_calls`, each with its
    index). Auto: content up to a <tool_call> streams as it comes (a possible partial tag held back), each call is
    sent whole once its region closes (or at the end). Named: the arguments stream as they come. Required: the
    calls are sent at the end, when the array is complete."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text accounted for (sent as content, or inside a sent call)
        self.calls = 0
        self.started = False  # auto: a <tool_call> was met

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """New text -> (content to send, tool-call deltas to send)."""
        self.text += delta
        if self.plan.mode == "named":
            return "", [self._named(delta)] if delta or not self.calls else []
        if self.plan.mode == "required":
            return "", []
        if self.plan.mode != "auto":
            self.sent = len(self.text)
            return delta, []
        return self._auto(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the text: whatever was held back."""
        if self.plan.mode == "required":
            return "", [d for d in map(self._whole, _required_calls(self.text)) if d is not None]
        if self.plan.mode == "named":
            return "", [] if self.calls else [self._named("")]
        if self.plan.mode != "auto":
            return "", []
        return self._auto(final=True)

    @property
    def called(self) -> bool:
        return self.calls > 0

    def _named(self, delta: str) -> dict[str, Any]:
        if self.calls:
            return {"index": 0, "function": {"arguments": delta}}
        self.calls = 1
        call = ToolCall(str(self.plan.name), delta)
        return {"index": 0, **call.body()}

    def _whole(self, call: ToolCall) -> dict[str, Any] | None:
        if self.calls and not self.plan.parallel:
            return None
        self.calls += 1
        return {"index": self.calls - 1, **call.body()}

    def _auto(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = "", []
        while True:
            rest = self.text[self.sent :]
            at = rest.find(START)
            if at == -1:
                hold = 0 if final else _tag_prefix(rest, START)
                if not self.started:  # after the first call nothing is content (as in the whole response)
                    content += rest[: len(rest) - hold]
                self.sent += len(rest) - hold
                return content, deltas
            if not self.started:
                content += rest[:at]
            self.started = True
            self.sent += at
            end = rest.find(END, at)
            if end == -1 and not final:
                return content, deltas
            region = rest[at + len(START) : len(rest) if end == -1 else end]
            try:
                delta = self._whole(self.plan.call_in(region.strip()))
                deltas.extend([] if delta is None else [delta])
            except (ValueError, KeyError, TypeError):  # not a call after all: its text is content
                content += rest[at : len(rest) if end == -1 else end + len(END)]
            self.sent += (len(rest) if end == -1 else end + len(END)) - at


def tool_plan(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, template: str | None,
              parallel: bool | None = None) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools), or a 400 naming what cannot be served."""
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "`tool_choice` needs `tools`: send the functions the model may call", "tool_choice")
        return None
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "`tools` names a function twice; give each function one entry", "tools")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise ApiError(400, f"`tool_choice` names the function {name!r}, which is not in `tools` "
                           f"({', '.join(names)})", "tool_choice")
        return ToolPlan(tuple(tools), "named", name)
    mode = choice or "auto"
    if mode != "auto":
        return ToolPlan(tuple(tools), mode, parallel=parallel is not False)
    parser = template_format(template)
    if parser is None:
        raise ApiError(400, "`tool_choice` auto needs the tool-call format of the target's chat template, and this "
                       "template writes none blockdraft parses (hermes or qwen3_coder <tool_call> blocks); send "
                       "`tool_choice` \"required\" or a named function (enforced by a grammar), or \"none\"",
                       "tool_choice")
    return ToolPlan(tuple(tools), "auto", parser=parser, parallel=parallel is not False)
