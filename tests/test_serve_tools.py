"""Tool calling through `blockdraft serve` (serve/tools.py): the tools reach the chat template, `tool_choice` required
and named are enforced by a grammar under speculation (DDTree on the tiny pair), `auto` parses the template's format
(hermes, qwen3_coder), and a streamed choice carries the same calls as the whole response."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st
from serve_support import CHARS, running, settings, text_pair_dirs

from blockdraft.serve.errors import ApiError
from blockdraft.serve.tools import template_format, tool_plan

MODEL = "tiny"
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}: {{ t['function']['description'] }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
NO_SPACE = {str(CHARS.index(ch) + 2): -100 for ch in " \n"}  # the character tokenizer's ids (serve_support)


@pytest.fixture(scope="module")
def tool_pair(tiny_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    target, drafter = text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("tools"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(target)
    return target, drafter


@pytest.fixture(scope="module")
def server(tool_pair):
    with running(settings(*tool_pair, served_model_name=MODEL, method="ddtree")) as server:
        yield server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, stream: bool, **body):
    """One chat request; streamed, its chunks folded into (content, calls, finish_reason) as a client does. JSON
    allows any whitespace between tokens and the random tiny target loves it: a logit bias keeps it out."""
    request = {**dict(model=MODEL, messages=CHAT, max_tokens=60, temperature=0, tools=TOOLS, logit_bias=NO_SPACE),
               **body}
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_follow_the_tools_schemas(client, stream: bool) -> None:
    content, calls, finish = ask(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert content is None and finish == "tool_calls" and calls
    for name, arguments in calls:
        args = json.loads(arguments)
        if name == "get_weather":
            assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9 and set(args) == {"city", "days"}
        else:
            assert name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})
    assert (content, calls, finish) == ask(client, not stream, tool_choice="required", parallel_tool_calls=False)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_its_arguments(client, stream: bool) -> None:
    content, calls, finish = ask(client, stream, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert content is None and finish == "stop" and len(calls) == 1  # forced: OpenAI and vLLM report "stop"
    name, arguments = calls[0]
    assert name == "get_time" and json.loads(arguments) in ({"zone": "UTC"}, {"zone": "CET"})


def test_named_calls_are_the_masked_target_loops_ids(client, tool_pair) -> None:
    """Lossless: the DDTree server's ids under the named function's grammar equal a token-by-token masked loop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockdraft.decoding.grammar import GrammarState, compile_grammar

    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           logit_bias=NO_SPACE, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    tokenizer = AutoTokenizer.from_pretrained(tool_pair[0])
    model = AutoModelForCausalLM.from_pretrained(tool_pair[0], dtype=torch.float32).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    spec = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None).grammar()
    grammar, output = GrammarState(compile_grammar(spec, tokenizer, vocab), vocab), []
    while len(output) < 40 and (not output or output[-1] != tokenizer.eos_token_id):
        with torch.no_grad():
            row = model(torch.tensor([reply.prompt_token_ids + output])).logits[0, -1:]
        for token, bias in NO_SPACE.items():
            row[0, int(token)] += bias
        output.append(int(grammar.apply(row, [], []).argmax()))
        grammar.accept(output[-1:])
    assert choice.token_ids == output


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_templates_calls(client, stream: bool) -> None:
    """The model's text (here forced by a regex) in hermes form becomes content before the call and the calls."""
    text = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    regex = "".join("\\" + ch if ch in '.{}[]()"' else ch for ch in text)
    content, calls, finish = ask(client, stream, tool_choice="auto", max_tokens=len(text) + 5,
                                 extra_body={"structured_outputs": {"regex": regex}})
    assert content == "Sure." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Rome", "days": 2}),
                                                     ("get_time", {"zone": "UTC"})]


def test_the_template_sees_the_tools_and_earlier_calls(client, tool_pair) -> None:
    from transformers import AutoTokenizer

    history = CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, temperature=0, tools=TOOLS,
                                           tool_choice="none", extra_body={"return_token_ids": True})
    prompt = AutoTokenizer.from_pretrained(tool_pair[0]).decode(reply.prompt_token_ids)
    assert "<tools>get_weather: the weather in a city;get_time: ;</tools>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in prompt
    assert "<tool>sunny" in prompt and reply.choices[0].message.tool_calls == []


def test_bad_tool_requests_are_400s_by_name(server) -> None:
    import httpx

    cases = [({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": TOOLS + [WEATHER]}, "tools"),
             ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
             ({"messages": [{"role": "user", "tool_calls": []}]}, "messages.0")]
    for extra, param in cases:
        body = {"messages": CHAT, **extra}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (extra, reply.text)


def test_auto_needs_a_template_that_writes_calls() -> None:
    with pytest.raises(ApiError, match="tool_choice` auto needs") as refused:
        tool_plan(TOOLS, "auto", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert refused.value.param == "tool_choice"
    assert template_format("...<tool_call>\n<function=...") == "qwen3_coder"
    assert template_format("...<tool_call>{{ tool | tojson }}") == "hermes"


def test_qwen3_coder_calls_take_their_parameters_types_from_the_schema() -> None:
    plan = tool_plan(TOOLS, "auto", "<tool_call><function=")
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    content, calls = plan.parse(text)
    assert content == "Checking.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert plan.parse("<tool_call>\nnot a call</tool_call>") == ("<tool_call>\nnot a call</tool_call>", [])


@hsettings(max_examples=40, deadline=None)
@given(st.data())
def test_streamed_auto_calls_equal_the_whole_texts(data) -> None:
    """Whatever the chunking, the streamed content and calls are the whole response's."""
    for template, text in [
        ("<tool_call>", 'Hi <there>.<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
                        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 4}}'),
        ("<tool_call><function=", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
                                  "</function>\n</tool_call>"),
        ("<tool_call>", "no calls here <tool_ but a partial tag")]:
        plan = tool_plan(TOOLS, "auto", template)
        cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
        stream, content, calls = plan.stream(), "", []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            more, deltas = stream.feed(text[start:end])
            content, calls = content + more, calls + deltas
        more, deltas = stream.finish()
        content, calls = content + more, calls + deltas
        whole_content, whole_calls = plan.parse(text)
        assert (content or None) == whole_content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls]
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_required_schema_allows_only_the_tools() -> None:
    spec = json.loads(tool_plan(TOOLS, "required", None).grammar().source)
    assert spec["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in spec["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
