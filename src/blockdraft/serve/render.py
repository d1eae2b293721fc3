"""A finished or progressing job -> OpenAI's response bodies and SSE chunks, as vLLM's serving code shapes them
(entrypoints/openai/{chat_completion,completion}/serving.py): a chat stream opens with the assistant role, every
commit with new text is one chunk (with its tokens' logprobs where asked for), the last chunk carries finish_reason
and stop_reason, and with stream_options.include_usage a final chunk with no choices carries usage and the
per-request metrics.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from blockdraft.decoding.logprobs import TokenLogprobs
from blockdraft.serve.jobs import JobOutput
from blockdraft.serve.logprob_render import TokenTexts, chat_logprobs, completion_logprobs
from blockdraft.serve.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DeltaToolCall,
    PerRequestMetrics,
    SpeculativeDecodingMetrics,
    ToolCallOut,
    UsageInfo,
)
from blockdraft.serve.tools import ToolPlan, ToolStream

DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel | dict) -> str:
    """One server-sent event; chunks drop the fields never set, as vLLM's do."""
    data = chunk.model_dump_json(exclude_unset=True) if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


def speculative_metrics(output: JobOutput, method: str, num_spec_tokens: int) -> SpeculativeDecodingMetrics:
    """vLLM's RequestSpecDecodeMetrics.to_dict over the steps that drafted, plus tau over every verify step."""
    result = output.result
    steps = result.drafted_steps()
    histogram = [0] * (num_spec_tokens + 1)
    for _, accepted in steps:
        histogram[min(accepted, num_spec_tokens)] += 1
    accepted_total = sum(a for _, a in steps)
    drafted_total = sum(d for d, _ in steps)
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=1.0 + accepted_total / len(steps) if steps else 1.0,
        draft_acceptance_rate=accepted_total / drafted_total if drafted_total else 0.0,
        acceptance_histogram=histogram,
        num_spec_steps=len(steps),
        num_accepted_draft_tokens=accepted_total,
        num_draft_tokens=drafted_total,
        num_spec_tokens=num_spec_tokens,
        per_step_accepted=[a for _, a in steps],
        per_step_drafted=[d for d, _ in steps],
        method=method,
        tau=result.stats.tau,
        acceptance_lengths=list(result.acceptance_lengths),
    )


def request_metrics(output: JobOutput, method: str, num_spec_tokens: int | None) -> PerRequestMetrics:
    """vLLM's PerRequestMetrics (generate/base/serving.py build_per_request_timing_metrics), in milliseconds."""
    t = output.timing
    n = len(output.token_ids)
    metrics = PerRequestMetrics(
        speculative_decoding=speculative_metrics(output, method, num_spec_tokens) if num_spec_tokens else None
    )
    if t.scheduled is not None:
        metrics.queue_time_ms = (t.scheduled - t.arrival) * 1000
    if t.commits and t.scheduled is not None:
        first, last = t.commits[0], t.commits[-1]
        metrics.time_to_first_token_ms = (first - t.scheduled) * 1000
        metrics.generation_time_ms = (last - first) * 1000
        if n > 1:
            metrics.mean_itl_ms = (last - first) / (n - 1) * 1000
        if last > t.scheduled:
            metrics.tokens_per_second = n / (last - t.scheduled)
    return metrics


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


@dataclass
class Rendering:
    """What every body of one response shares: its id and time, the served name, the prompt, the method."""

    kind: str  # "chat" or "completion"
    model: str
    prompt_ids: list[int]
    method: str
    num_spec_tokens: int | None
    return_token_ids: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    request_id: str | None = None  # the request's own id (vLLM's `request_id`), else a new one
    logprobs: int | None = None  # the candidates each token's logprobs list (None: no logprobs)
    texts: TokenTexts | None = None  # token ids as logprob entries name them
    tools: ToolPlan | None = None  # the request's tools: the text becomes tool calls (serve/tools.py)
    echo: str | None = None  # completions' `echo`: the prompt text before the output (None: no echo)
    id: str = field(init=False)
    tool_stream: ToolStream | None = field(default=None, init=False)
    echoed: bool = field(default=False, init=False)  # the echo went out in a chunk
    emitted: int = field(default=0, init=False)  # completion tokens streamed so far
    sent: int = field(default=0, init=False)  # characters of text streamed so far (completions' text offsets)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id or uuid.uuid4().hex}"
        if self.tools is not None:
            self.tool_stream = self.tools.stream()

    def _finish_reason(self, output: JobOutput, called: bool) -> str:
        """vLLM's: "tool_calls" where the choice carries calls, the model stopped by itself and no named function
        was forced; a `length` cut stays visible."""
        if called and output.finish_reason == "stop" and self.tools is not None and self.tools.reports_tool_calls:
            return "tool_calls"
        return output.finish_reason

    def response(self, output: JobOutput) -> BaseModel:
        """The whole (non-streamed) response."""
        ids = output.token_ids if self.return_token_ids else None
        common = dict(id=self.id, created=self.created, model=self.model,
                      usage=usage(len(self.prompt_ids), len(output.token_ids)),
                      metrics=request_metrics(output, self.method, self.num_spec_tokens))
        logprobs = self._logprobs(output.logprobs or [], 0)
        if self.kind == "chat":
            content, calls = (output.text, []) if self.tools is None else self.tools.parse(output.text)
            message = ChatMessageOut(content=content, tool_calls=[ToolCallOut(**call.body()) for call in calls])
            choice = ChatChoice(message=message, finish_reason=self._finish_reason(output, bool(calls)),
                                stop_reason=output.stop_reason, token_ids=ids, logprobs=logprobs)
            prompt_ids = self.prompt_ids if self.return_token_ids else None
            return ChatCompletionResponse(choices=[choice], prompt_token_ids=prompt_ids, **common)
        if self.echo is not None:
            logprobs = self._logprobs([*(output.prompt_logprobs or []), *(output.logprobs or [])], 0)
        choice = CompletionChoice(text=(self.echo or "") + output.text, finish_reason=output.finish_reason,
                                  stop_reason=output.stop_reason, token_ids=ids, logprobs=logprobs,
                                  prompt_token_ids=self.prompt_ids if self.return_token_ids else None)
        return CompletionResponse(choices=[choice], **common)

    def _logprobs(self, entries: list[TokenLogprobs], offset: int) -> Any:
        """A choice's `logprobs` for these tokens (None where the request asked for none)."""
        if self.logprobs is None or self.texts is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.logprobs, self.texts)
        return completion_logprobs(entries, self.logprobs, self.texts, offset)

    def opening(self) -> list[str]:
        """A chat stream opens with the assistant role and empty content; a completion stream with nothing."""
        if self.kind != "chat":
            return []
        choice = ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                                  finish_reason=None)
        prompt_ids = {"prompt_token_ids": self.prompt_ids} if self.return_token_ids else {}
        return [sse(ChatCompletionStreamResponse(id=self.id, object="chat.completion.chunk", created=self.created,
                                                 model=self.model, choices=[choice], **self._usage_so_far(),
                                                 **prompt_ids))]

    def chunk(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs] | None = None,
              prompt_logprobs: list[TokenLogprobs] | None = None) -> str | None:
        """One commit's chunk, with its tokens' logprobs where asked for; None when it adds no text (and neither
        ids nor logprobs are asked for). A completion's first chunk opens with its echoed prompt (and its logprobs)."""
        if self.echo is not None and not self.echoed:
            self.echoed = True
            text, logprobs = self.echo + text, [*(prompt_logprobs or []), *(logprobs or [])]
        self.emitted += len(token_ids)
        offset, self.sent = self.sent, self.sent + len(text)
        if not text and not self.return_token_ids and self.logprobs is None:
            return None
        fields: dict[str, Any] = {"token_ids": token_ids} if self.return_token_ids else {}
        delta = self._delta(text, final=False) if self.kind == "chat" else DeltaMessage()
        if self.tool_stream is not None and not delta.content and not delta.tool_calls and not fields \
                and self.logprobs is None:
            return None  # text the tool calls hold back
        if self.logprobs is not None:
            fields["logprobs"] = self._logprobs(logprobs or [], offset)
        return self._chunk(delta, text, fields)

    def _delta(self, text: str, final: bool) -> DeltaMessage:
        """A chat chunk's delta: the text, or with tools, the content and tool calls it makes."""
        if self.tool_stream is None:
            return DeltaMessage(content=text) if text or not final else DeltaMessage()
        content, calls = self.tool_stream.feed(text)
        if final:
            more_content, more_calls = self.tool_stream.finish()
            content, calls = content + more_content, calls + more_calls
        delta = DeltaMessage(content=content) if content else DeltaMessage()
        if calls:
            delta.tool_calls = [DeltaToolCall(**call) for call in calls]
        return delta

    def closing(self, output: JobOutput) -> str:
        """The last chunk with choices: the text held back until the end (after the echoed prompt, where no chunk
        carried it), finish_reason and stop_reason."""
        self.emitted = len(output.token_ids)
        rest, fields = output.rest, {}
        if self.echo is not None and not self.echoed:  # no commit was streamed: the echo goes now
            self.echoed = True
            rest = self.echo + rest
            if self.logprobs is not None:
                fields["logprobs"] = self._logprobs(output.prompt_logprobs or [], 0)
        delta = self._delta(rest, final=True) if self.kind == "chat" else DeltaMessage()
        called = self.tool_stream is not None and self.tool_stream.called
        fields.update(finish_reason=self._finish_reason(output, called), stop_reason=output.stop_reason)
        if self.return_token_ids:
            fields["token_ids"] = []
        return self._chunk(delta, rest, fields)

    def _chunk(self, delta: DeltaMessage, text: str, fields: dict) -> str:
        fields = {"index": 0, "logprobs": None, "finish_reason": None, **fields}
        if self.kind == "chat":
            return sse(ChatCompletionStreamResponse(id=self.id, object="chat.completion.chunk", created=self.created,
                                                    model=self.model, choices=[ChatStreamChoice(delta=delta, **fields)],
                                                    **self._usage_so_far()))
        return sse(CompletionStreamResponse(id=self.id, object="text_completion", created=self.created,
                                            model=self.model, choices=[CompletionChoice(text=text, **fields)],
                                            **self._usage_so_far()))

    def _usage_so_far(self) -> dict[str, UsageInfo]:
        """A streamed chunk's usage field: the tokens so far where continuous usage is asked for (as vLLM does),
        else none (left unset, so the chunk omits it)."""
        return {"usage": usage(len(self.prompt_ids), self.emitted)} if self.continuous_usage else {}

    def usage_chunk(self, output: JobOutput) -> str:
        """stream_options.include_usage: a last chunk with no choices, usage and the per-request metrics."""
        body = dict(id=self.id, created=self.created, model=self.model, choices=[],
                    usage=usage(len(self.prompt_ids), len(output.token_ids)),
                    metrics=request_metrics(output, self.method, self.num_spec_tokens))
        model = ChatCompletionStreamResponse if self.kind == "chat" else CompletionStreamResponse
        chunk = model(object="chat.completion.chunk" if self.kind == "chat" else "text_completion", **body)
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
