"""OpenAI's request and response bodies, field for field as vLLM 0.33 writes them, for what blockdraft serves.

A request body is read in two passes. `check_parameters` sorts every top-level key: implemented (validated by the
models below), harmless (metadata a stock OpenAI client may send that cannot change the output; dropped), known
but not implemented (accepted only at its neutral value, else a 400 naming it), or unknown (a 400 naming it).
Then pydantic validates types and ranges strictly (no "0.5" for a number); any failure is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from blockdraft.decoding.sampling import MAX_LOGPROBS
from blockdraft.serve.errors import ApiError

# Sent by OpenAI clients, never able to change the tokens generated: accepted and ignored. (vLLM's
# include_reasoning only splits a reasoning parser's output, and blockdraft runs none; session_id routes and caches.)
HARMLESS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "parallel_tool_calls", "include_reasoning", "session_id",
})

# Parameters of OpenAI's or vLLM's API that blockdraft does not implement, with the values that mean "off"
# (null is always accepted). Any other value is a 400 naming the parameter: never silently ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "min_p": (0,), "length_penalty": (1,), "suffix": (),
    "functions": ([],), "function_call": ("none", "auto"),
    "reasoning_effort": (), "verbosity": (), "modalities": (["text"],),
    "audio": (), "prediction": (), "web_search_options": (), "moderation": (), "use_beam_search": (False,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "allowed_token_ids": (),
    "truncate_prompt_tokens": (), "prompt_logprobs": (), "priority": (0,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "documents": (), "chat_template": (),
    "logprob_token_ids": (), "thinking_token_budget": (), "cache_salt": (), "prompt_embeds": (),
    "watermarking": (), "truncation_side": ("left", "right"), "media_io_kwargs": ({},), "mm_processor_kwargs": ({},),
    "return_weight_versions": (False,), "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,), "return_prompt_text": (False,), "mm_payload": ("tensors",),
    "return_mm_kwargs": (False,), "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": ({},),
    "repetition_detection": (), "stream_interval": (1,),
}
# add_special_tokens defaults differ per endpoint (vLLM: chat False, completions True); chat's `echo` (vLLM: repeat
# the last message in the response) is not served, completions' is.
_ENDPOINT_NEUTRAL = {"chat": {"add_special_tokens": (False,), "echo": (False,)},
                     "completion": {"add_special_tokens": (True,)}}

_INTERNAL_LOC = re.compile(r"[\[\](){}]|^(str|int|float|bool|list|dict|none|function-\w+|union|json-or-python)$")


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind: False is not the neutral 0, nor 1 the neutral True."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def check_parameters(body: Any, endpoint: Literal["chat", "completion"], implemented: set[str]) -> dict[str, Any]:
    """The body with harmless and neutral keys removed; anything unknown or not implemented is a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    neutral = {**NEUTRAL, **_ENDPOINT_NEUTRAL[endpoint]}
    kept: dict[str, Any] = {}
    for key, value in body.items():
        if key in implemented:
            kept[key] = value
        elif key in neutral:
            if value is not None and not any(_same(value, n) for n in neutral[key]):
                shown = " or ".join(repr(n) for n in neutral[key]) or "null"
                raise ApiError(
                    400, f"`{key}`={value!r} is not supported by blockdraft serve; leave it out (or send {shown})", key
                )
        elif key not in HARMLESS:
            raise ApiError(400, f"unknown parameter `{key}`; blockdraft serve does not accept it", key)
    return kept


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted field path, without union-branch markers: messages.0.content."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and _INTERNAL_LOC.search(p))]
    return ".".join(parts) or ".".join(str(p) for p in loc)


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """Strict validation; the first error becomes a 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(tuple(first["loc"]))
        raise ApiError(400, f"`{param}`: {first['msg']}", param) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: with include_usage, usage so far on every chunk


class SamplingRequest(_Strict):
    """What both endpoints take: sampling, stops, streaming (vLLM extensions: top_k, stop_token_ids, ignore_eos,
    return_token_ids)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    request_id: str | None = Field(None, min_length=1)  # vLLM: the response's id is "chatcmpl-" / "cmpl-" + it
    return_tokens_as_token_ids: bool | None = False  # vLLM: logprobs name tokens "token_id:<id>"
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, clamped to [-100, 100] as vLLM
    min_tokens: int | None = Field(None, ge=0)
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (serve/structured.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar or json_object

    @property
    def logprobs_asked(self) -> int | None:
        """How many most likely tokens each position's logprobs list (None: no logprobs)."""
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessageIn:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs `content` (only an assistant turn with `tool_calls` may "
                             "leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries `tool_calls`")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """Text parts joined by newlines, as vLLM's "string" content format does; a call's arguments read as JSON
        where they parse (chat templates write them out as objects, as vLLM gives them)."""
        content = self.content
        text = content if content is None or isinstance(content, str) else "\n".join(p.text for p in content)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool = False


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: ChatTemplateKwargs | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (vLLM: maxItems 1 under required)

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool plan take them."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @property
    def logprobs_asked(self) -> int | None:
        """`top_logprobs` (default 0) with `logprobs: true`; `top_logprobs` alone is a 400, as in vLLM."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "`top_logprobs` needs `logprobs`: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    @property
    def max_output(self) -> tuple[int | None, str]:
        """(requested output tokens, the parameter that set them): max_completion_tokens wins, as in vLLM."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False  # the prompt before the output (with `logprobs`: the prompt's logprobs too)

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """One prompt per request: a batch of prompts (n > 1 in disguise) is a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"`prompt` holds {len(prompt)} prompts; send one prompt per request", "prompt")
            return prompt[0]  # type: ignore[return-value]
        if isinstance(prompt, list) and not prompt:
            raise ApiError(400, "`prompt` is empty; give text or at least one token id", "prompt")
        return prompt  # type: ignore[return-value]


def parse_request(body: Any, model: type[SamplingRequest], endpoint: Literal["chat", "completion"]) -> Any:
    """JSON body -> a validated request, or a 400 naming the parameter at fault."""
    return validate(model, check_parameters(body, endpoint, set(model.model_fields)))


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageInfo(_Out):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: None = None


class SpeculativeDecodingMetrics(_Out):
    """vLLM's per-request acceptance (generate/base/protocol.py, `detailed` level) plus blockdraft's tau and
    acceptance lengths (tokens committed per verify step, bonus included)."""

    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None
    method: str
    tau: float
    acceptance_lengths: list[int]


class PerRequestMetrics(_Out):
    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None
    speculative_decoding: SpeculativeDecodingMetrics | None = None


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(_Out):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Out):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatLogProb(_Out):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(_Out):
    content: list[ChatLogProbsContent] | None = None


class CompletionLogProbs(_Out):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatChoice(_Out):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None


class ChatStreamChoice(_Out):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    metrics: PerRequestMetrics | None = None


class CompletionStreamResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metrics: PerRequestMetrics | None = None


class ModelPermission(_Out):
    id: str = Field(default_factory=lambda: _id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = False
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_Out):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blockdraft"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(_Out):
    object: str = "list"
    data: list[ModelCard]
