"""The FastAPI app: OpenAI's endpoints, /health and /metrics. The event loop only validates, queues and streams;
decoding happens in the engine process, whose events come back through the EngineClient's reader thread.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockdraft.serve.engine_client import EngineClient
from blockdraft.serve.errors import ApiError, error_body
from blockdraft.serve.jobs import Failed, Finished, Progress
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.prepare import (Prepared, ServedModel, chat_prompt, chat_tools, completion_prompt, echoed_prompt,
                                     prepare)
from blockdraft.serve.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingRequest,
                                      parse_request)
from blockdraft.serve.relay import EventRelay
from blockdraft.serve.logprob_render import TokenTexts
from blockdraft.serve.render import DONE, Rendering, sse
from blockdraft.serve.tools import ToolPlan

GUARDED_PREFIX = "/v1"  # as vLLM: /health and /metrics stay open with --api-key
SYNTHETIC_HEADER = b"x-blockdraft-synthetic-acceptance"


@dataclass(frozen=True)
class ServerState:
    """Everything a request handler needs."""

    served: ServedModel
    engine: EngineClient
    metrics: ServeMetrics
    method: str
    num_spec_tokens: int | None
    api_key: str | None
    synthetic: str | None = None  # --synthetic-acceptance's profile: every /v1 response is marked with it


class BearerAuth:
    """Pure ASGI middleware (streams and disconnects pass through untouched): /v1 needs `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIX) and scope.get("method") != "OPTIONS":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token, self.key):
                message = "missing or wrong API key; send `Authorization: Bearer KEY` with the server's --api-key"
                await JSONResponse(error_body(401, message), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SyntheticMark:
    """Pure ASGI middleware: under --synthetic-acceptance every /v1 response (streams too) carries the header
    `x-blockdraft-synthetic-acceptance`: its tokens are the drafter's under a dialled verdict, not the model's."""

    def __init__(self, app: ASGIApp, profile: str) -> None:
        self.app = app
        self.header = (SYNTHETIC_HEADER, profile.encode("ascii", "replace"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, marked)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ApiError(400, f"the request body is not valid JSON ({getattr(exc, 'msg', exc)}{where})") from None


async def _watch_disconnect(request: Request, cancel: Callable[[], None]) -> None:
    """A non-streamed request whose client leaves frees the engine at the next commit."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel()


async def _events(cancel: Callable[[], None], relay: EventRelay, rendering: Rendering,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE lines for one job (the commits a batch collected become one chunk), ending with [DONE] whatever happens;
    leaving early (the client went away) cancels the job."""
    done = False
    try:
        for line in rendering.opening():
            yield line
        async for batch in relay.batches():
            progress = [event for event in batch if isinstance(event, Progress)]
            if progress:
                chunk = rendering.chunk("".join(p.text for p in progress), [t for p in progress for t in p.token_ids],
                                        [lp for p in progress for lp in p.logprobs or []],
                                        next((p.prompt_logprobs for p in progress if p.prompt_logprobs), None))
                if chunk:
                    yield chunk
            final = batch[-1]
            if isinstance(final, Finished):
                done = True
                yield rendering.closing(final.output)
                if include_usage:
                    yield rendering.usage_chunk(final.output)
            elif isinstance(final, Failed):
                done = True
                yield sse(final.error.body())
    except Exception as exc:  # a bug while rendering still ends the stream with an error and [DONE]
        yield sse(error_body(500, f"internal error ({type(exc).__name__}: {exc})"))
    finally:
        if not done:
            cancel()
    yield DONE


async def _run(request: Request, state: ServerState, prepared: Prepared, rendering: Rendering, stream: bool,
               include_usage: bool) -> Response:
    relay = EventRelay(asyncio.get_running_loop())
    job_id = state.engine.submit(prepared, relay)

    def cancel() -> None:
        state.engine.cancel(job_id)

    if stream:
        return StreamingResponse(_events(cancel, relay, rendering, include_usage), media_type="text/event-stream")
    watcher = asyncio.create_task(_watch_disconnect(request, cancel))
    try:
        async for batch in relay.batches():
            final = batch[-1]
    finally:
        watcher.cancel()
    if isinstance(final, Failed):
        return final.error.response()
    assert isinstance(final, Finished)
    return JSONResponse(rendering.response(final.output).model_dump())


def build_app(state: ServerState) -> ASGIApp:
    """The ASGI app for one served model."""
    app = FastAPI(title="blockdraft serve", docs_url=None, redoc_url=None, openapi_url=None)
    served = state.served

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(500, f"internal error ({type(exc).__name__}: {exc})"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine process runs; 503 once it has died (vLLM's /health does the same)."""
        return Response(status_code=200 if state.engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=served.name, root=served.root, max_model_len=served.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    def rendering(kind: str, ids: list[int], req: SamplingRequest, request: Request,
                  tools: ToolPlan | None = None, echo: str | None = None) -> Rendering:
        """The response's shared parts; its id from the X-Request-Id header, else the body's `request_id`, as vLLM."""
        options = req.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        top = req.logprobs_asked
        texts = None if top is None else TokenTexts(served.tokenizer, bool(req.return_tokens_as_token_ids))
        return Rendering(kind, served.name, ids, state.method, state.num_spec_tokens, bool(req.return_token_ids),
                         continuous, request.headers.get("X-Request-Id") or req.request_id, top, texts, tools, echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = parse_request(await _json_body(request), ChatCompletionRequest, "chat")
        served.check_model(req.model)
        tools = chat_tools(req, served)
        ids = chat_prompt(req, served, tools)
        requested, param = req.max_output
        prepared = prepare(req, ids, served, requested, param, "messages", tools)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _run(request, state, prepared, rendering("chat", ids, req, request, tools), bool(req.stream),
                          include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(await _json_body(request), CompletionRequest, "completion")
        served.check_model(req.model)
        ids = completion_prompt(req, served)
        prepared = prepare(req, ids, served, req.max_tokens, "max_tokens", "prompt")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        echo = echoed_prompt(req, ids, served) if req.echo else None
        return await _run(request, state, prepared, rendering("completion", ids, req, request, echo=echo),
                          bool(req.stream), include_usage)

    marked: ASGIApp = SyntheticMark(app, state.synthetic) if state.synthetic else app
    return BearerAuth(marked, state.api_key) if state.api_key else marked
