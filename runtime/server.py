"""`ember serve`: an OpenAI-compatible HTTP API over the scheduler (FastAPI + uvicorn, the `serve` extra).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent
events ending in `data: [DONE]`, or whole), GET /v1/models and /v1/models/NAME, /health
and /metrics (Prometheus text), and a web chat page at / (static/chat.html, which streams
through /v1/chat/completions); CORS answers for the web origins the caller allows, none
by default. Every request runs through one `Scheduler`, which this module
only wraps: bodies are parsed and checked here, prompts tokenized off the event
loop, `response_format` JSON enforced by a token mask (`runtime/constrained.py`),
and every failure answered in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` (400 bad fields, 401 API key,
404 unknown model or path, 413 body too large, 429 queue full, 500 a bug), never
a traceback. Unknown request fields are ignored, as by vLLM and llama.cpp's server.
FastAPI is imported only here, so the rest of the runtime runs without it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from ember.core.errors import EmberError, GenerationError
from ember.runtime.constrained import JsonConstraints
from ember.runtime.generate import LogitsProcessor
from ember.runtime.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, SamplingParams, TokenLogprob
from ember.runtime.scheduler import Histogram, QueueFullError, Scheduler, StreamEvent

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused with 413 before it is parsed
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names of union branches in error locations
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"
_ENDPOINTS = ("/", "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

try:
    import fastapi
    import uvicorn
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
    from starlette.exceptions import HTTPException
except ImportError as err:
    raise EmberError(f"ember serve needs FastAPI and uvicorn ({err.name} is missing): "
                     "pip install 'ember[serve]'") from None


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Fields(BaseModel):
    """Fields common to both completion endpoints, with OpenAI's ranges."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # an extension, as in vLLM
    repetition_penalty: float = Field(1.0, gt=0, le=10)  # an extension, as in vLLM
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=-MAX_SEED, lt=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)  # several choices per request are not supported
    stream: bool = False
    stream_options: _StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart] | None = None


class _ChatBody(_Fields):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None  # refused when given: a model that silently ignored them would mislead
    functions: list[Any] | None = None  # the same, in OpenAI's older form


class _CompletionBody(_Fields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None


class _Metrics:
    """HTTP responses by endpoint and status, for /metrics."""

    def __init__(self) -> None:
        self.responses: Counter[tuple[str, int]] = Counter()

    def middleware(self, app: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        """Wrap an ASGI app to count each response's status (streamed ones included)."""
        async def counted(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope["path"]
            endpoint = (path if path in _ENDPOINTS else
                        "/v1/models/{model}" if path.startswith("/v1/models/") else "other")

            async def send_counting(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    self.responses[endpoint, message["status"]] += 1
                await send(message)

            await app(scope, receive, send_counting)

        return counted


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
               allowed_origins: Sequence[str] = ()) -> Any:
    """The ASGI application serving `scheduler`'s engine as the model `model_name`.

    `allowed_origins`: web origins (or `*`) whose pages' scripts may call the API from a browser: the
    answers carry CORS headers for them, and their preflight requests are answered. Others are refused
    by the browser itself, as without CORS; the page at / is same-origin and needs none."""
    app = fastapi.FastAPI(title="ember", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    metrics = _Metrics()
    engine = scheduler.engine
    tokenizer = engine.artifact.tokenizer
    constraints = JsonConstraints(engine.artifact, engine.vocab_size)
    created = int(time.time())
    page = CHAT_PAGE.read_text(encoding="utf-8")

    @app.exception_handler(ApiError)
    async def api_error(_request: Any, err: ApiError) -> Any:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Any, err: HTTPException) -> Any:
        code = "not_found" if err.status_code == 404 else None
        return JSONResponse(ApiError(err.status_code, str(err.detail), code=code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Any, err: Exception) -> Any:
        log.error("internal error answering a request", exc_info=err)
        body = ApiError(500, f"internal error: {type(err).__name__}", kind="server_error").body()
        return JSONResponse(body, status_code=500)

    def authorize(request: Any) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def parse(request: Any, schema: type) -> Any:
        authorize(request)
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", code="body_too_large")
        try:
            data = json.loads(bytes(body).decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not UTF-8 text", code="invalid_json") from None
        except json.JSONDecodeError as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            fields = schema.model_validate(data)
        except ValidationError as err:
            # Of a union's failed branches, the one that got deepest says most ("content.0.type", not "content").
            worst = max(err.errors(), key=lambda error: len(error["loc"]))
            where = ".".join(str(part) for part in worst["loc"] if part not in _TYPE_TAGS and "[" not in str(part))
            raise ApiError(400, f"{where or 'body'}: {worst['msg']}", param=str(worst["loc"][0]) if worst["loc"]
                           else None, code="invalid_value") from None
        check_model(fields.model)
        return fields

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")

    def sampling(fields: Any, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                 prompt_param: str) -> SamplingParams:
        context = engine.context_window
        if prompt_len > context:
            raise ApiError(400, f"the prompt is {prompt_len} tokens, more than this model's context window of "
                                f"{context} tokens", param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > context:
            raise ApiError(400, f"this model's context window is {context} tokens; the prompt is {prompt_len} and "
                                f"max_tokens {max_tokens}: reduce one of them", param="max_tokens",
                           code="context_length_exceeded")
        stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop or []
        if not all(stop):
            raise ApiError(400, "stop: strings must not be empty", param="stop", code="invalid_value")
        try:
            return SamplingParams(
                temperature=fields.temperature, top_k=fields.top_k, top_p=fields.top_p,
                repetition_penalty=fields.repetition_penalty, presence_penalty=fields.presence_penalty,
                frequency_penalty=fields.frequency_penalty, seed=fields.seed, stop_strings=tuple(stop),
                max_new_tokens=max_tokens or context - prompt_len or 1, logprobs=logprobs,
                logit_bias=logit_bias(fields.logit_bias))
        except GenerationError as err:
            raise ApiError(400, str(err), code="invalid_value") from None

    def logit_bias(biases: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (token ids as JSON keys) with ids checked against the vocabulary."""
        if not biases:
            return None
        parsed = {}
        for key, bias in biases.items():
            if not (key.isascii() and key.isdigit() and int(key) < engine.vocab_size):
                raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary "
                                    f"(0 to {engine.vocab_size - 1})", param="logit_bias", code="invalid_value")
            parsed[int(key)] = bias
        return parsed

    async def tokenize(work: Callable[[], list[int]]) -> list[int]:
        if tokenizer is None:
            raise ApiError(400, "this artifact has no tokenizer: send prompt token ids to /v1/completions",
                           param="prompt", code="unsupported_value")
        try:
            return await asyncio.to_thread(work)  # a long prompt would stall every stream
        except GenerationError as err:
            raise ApiError(400, str(err), code="invalid_value") from None

    async def constrain(fields: Any) -> LogitsProcessor | None:
        if fields.response_format is None:
            return None
        try:  # a large schema takes a while to compile: off the event loop
            return await asyncio.to_thread(constraints.mask, fields.response_format)
        except GenerationError as err:
            raise ApiError(400, str(err), param="response_format", code="invalid_value") from None

    async def start(prompt_ids: list[int], params: SamplingParams, fields: Any) -> Any:
        processor = await constrain(fields)
        try:
            return await scheduler.submit(prompt_ids, params, processor)
        except QueueFullError as err:
            raise ApiError(429, str(err), code="queue_full", kind="rate_limit_exceeded") from None
        except GenerationError as err:
            raise ApiError(400, str(err), code="invalid_value") from None

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer else str(token_id)

    def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(item.token_id, item.logprob),
                             "top_logprobs": [entry(*pair) for pair in item.top]} for item in items]}

    def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [token_text(item.token_id) for item in items]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [item.logprob for item in items],
                "top_logprobs": [{token_text(i): lp for i, lp in item.top} for item in items], "text_offset": offsets}

    def usage(event: StreamEvent) -> dict[str, int]:
        return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens}

    async def respond(request: Any, stream: Any, fields: Any, kind: str, wants_logprobs: bool) -> Any:
        """The whole answer, or its SSE stream; a client gone mid-way cancels the request."""
        chat = kind == "chat.completion"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "object": kind + ".chunk" if chat and fields.stream else kind,
                "created": int(time.time()), "model": model_name}
        include_usage = bool(fields.stream_options and fields.stream_options.include_usage)

        def choice(text: str, event: StreamEvent, offset: int, first: bool = False) -> dict[str, Any]:
            logprobs = None
            if wants_logprobs:
                logprobs = chat_logprobs(event.logprobs) if chat else completion_logprobs(event.logprobs, offset)
            if not chat:
                return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": event.finish_reason}
            if fields.stream:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                return {"index": 0, "delta": delta if text or first else {}, "logprobs": logprobs,
                        "finish_reason": event.finish_reason}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": event.finish_reason}

        if not fields.stream:
            events = await _unless_disconnected(request, _collect(stream), stream)
            merged = StreamEvent("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                                 [lp for e in events for lp in e.logprobs], events[-1].finish_reason,
                                 events[-1].prompt_tokens, events[-1].completion_tokens)
            return JSONResponse({**head, "choices": [choice(merged.text, merged, 0)], "usage": usage(merged)})

        async def chunks() -> AsyncIterator[str]:
            offset, first = 0, True
            try:
                async for event in stream:
                    if event.text or event.token_ids or event.finish_reason or first:
                        body = {**head, "choices": [choice(event.text, event, offset, first)]}
                        if include_usage:
                            body["usage"] = None
                        yield f"data: {json.dumps(body)}\n\n"
                        offset, first = offset + len(event.text), False
                    if event.finish_reason is not None and include_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(event)})}\n\n"
            except EmberError as err:  # the status line is sent: the error goes in the stream
                yield f"data: {json.dumps(ApiError(500, str(err), kind='server_error').body())}\n\n"
            except Exception as err:
                log.error("internal error in a stream", exc_info=err)
                body = ApiError(500, f"internal error: {type(err).__name__}", kind="server_error").body()
                yield f"data: {json.dumps(body)}\n\n"
            finally:
                stream.cancel()  # the client went away (or the stream ended): free the sequence now
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Any:
        fields = await parse(request, _ChatBody)
        for name in ("tools", "functions"):
            if getattr(fields, name):
                raise ApiError(400, f"{name} (function calling) are not supported", param=name,
                               code="unsupported_value")
        if fields.top_logprobs is not None and not fields.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else
                     "".join(part.text for part in m.content or [])} for m in fields.messages]

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(messages)
            return tokenizer.encode(text, add_special_tokens=False)

        prompt_ids = await tokenize(render)
        max_tokens = fields.max_completion_tokens or fields.max_tokens
        logprobs = (fields.top_logprobs or 0) if fields.logprobs else None
        params = sampling(fields, len(prompt_ids), max_tokens, logprobs, "messages")
        stream = await start(prompt_ids, params, fields)
        return await respond(request, stream, fields, "chat.completion", fields.logprobs)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        fields = await parse(request, _CompletionBody)
        prompt = fields.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request is supported", param="prompt", code="unsupported_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await tokenize(lambda: tokenizer.encode(prompt))
        else:
            prompt_ids = list(prompt)
        params = sampling(fields, len(prompt_ids), fields.max_tokens, fields.logprobs, "prompt")
        stream = await start(prompt_ids, params, fields)
        return await respond(request, stream, fields, "text_completion", fields.logprobs is not None)

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "ember",
                  "max_model_len": engine.context_window}

    @app.get("/v1/models")
    async def models(request: fastapi.Request) -> Any:
        authorize(request)
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(request: fastapi.Request, model: str) -> Any:
        # The openai client's models.retrieve(name); `path` because a model name may hold a slash.
        authorize(request)
        check_model(model)
        return model_card

    @app.get("/")
    async def chat_page() -> Any:
        # No API key here: the page holds no secret, and it asks for the key when the API wants one.
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(_prometheus(scheduler, metrics.responses), media_type="text/plain; version=0.0.4")

    return metrics.middleware(app)


async def _collect(stream: Any) -> list[StreamEvent]:
    return [event async for event in stream]


async def _unless_disconnected(request: Any, work: Awaitable[list[StreamEvent]], stream: Any) -> list[StreamEvent]:
    """`work`'s result, or cancel the request when the client disconnects before it is done."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.cancel()
    if not task.done() or task.cancelled():
        raise ApiError(499, "the client closed the connection", code="client_closed")
    try:
        return task.result()
    except EmberError as err:
        raise ApiError(500, str(err), kind="server_error") from None


def _prometheus(scheduler: Scheduler, responses: Counter[tuple[str, int]]) -> str:
    """The Prometheus text exposition of the server's and scheduler's figures."""
    stats = scheduler.stats()
    lines: list[str] = []

    def metric(name: str, kind: str, helptext: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {helptext}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}"
                     for labels, value in samples)

    def histogram(name: str, helptext: str, hist: Histogram) -> None:
        cumulative, samples = 0, []
        for bound, count in zip((*hist.bounds, "+Inf"), hist.counts):
            cumulative += count
            samples.append((f'_bucket{{le="{bound}"}}', cumulative))
        lines.extend([f"# HELP {name} {helptext}", f"# TYPE {name} histogram"])
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)
        lines.extend([f"{name}_sum {hist.total:g}", f"{name}_count {hist.count}"])

    metric("ember_http_requests_total", "counter", "HTTP responses by endpoint and status.",
           [(f'{{endpoint="{endpoint}",status="{status}"}}', n) for (endpoint, status), n in sorted(responses.items())])
    metric("ember_requests_finished_total", "counter", "Generation requests by how they ended.",
           [(f'{{reason="{reason}"}}', n) for reason, n in sorted(stats.finished.items())])
    metric("ember_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", stats.prompt_tokens)])
    metric("ember_generation_tokens_total", "counter", "Tokens generated by finished requests.",
           [("", stats.generated_tokens)])
    metric("ember_queue_depth", "gauge", "Requests waiting for a sequence.", [("", stats.queued)])
    metric("ember_running_sequences", "gauge", "Requests holding a sequence in the KV cache.", [("", stats.running)])
    metric("ember_kv_cache_tokens_used", "gauge", "KV cache tokens in pages held by running sequences.",
           [("", stats.kv_tokens_used)])
    metric("ember_kv_cache_tokens_free", "gauge", "KV cache tokens not held by running sequences (prefix cache "
           "entries' count as free: they are evicted on demand).", [("", stats.kv_tokens_free)])
    metric("ember_kv_cache_tokens_reserved", "gauge", "KV cache tokens promised to running requests "
           "(prompt + max_tokens).", [("", stats.kv_tokens_reserved)])
    metric("ember_prefill_tokens_total", "counter", "Prompt tokens run through the model (prefix cache hits "
           "skip theirs).", [("", stats.prefill_tokens)])
    metric("ember_prefix_cache_hits_total", "counter", "Requests that reused a cached or running sequence's "
           "KV pages.", [("", stats.prefix_cache_hits)])
    metric("ember_prefix_cache_hit_tokens_total", "counter", "Prompt tokens not prefilled thanks to the prefix "
           "cache.", [("", stats.prefix_cache_hit_tokens)])
    metric("ember_prefix_cache_sequences", "gauge", "Finished sequences kept as prefix cache entries.",
           [("", stats.prefix_cache_sequences)])
    metric("ember_prefix_cache_tokens", "gauge", "KV cache tokens in the pages of prefix cache entries.",
           [("", stats.prefix_cache_tokens)])
    metric("ember_speculative_proposed_tokens_total", "counter", "Guessed tokens checked by speculative verify "
           "steps (ember serve --speculate/--draft).", [("", stats.speculative_proposed)])
    metric("ember_speculative_accepted_tokens_total", "counter", "Guessed tokens the model agreed with.",
           [("", stats.speculative_accepted)])
    histogram("ember_time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", stats.ttft)
    histogram("ember_time_per_output_token_seconds", "Seconds per generated token after the first, per request.",
              stats.tpot)
    return "\n".join(lines) + "\n"


class Server:
    """An HTTP server for `scheduler`, listening from construction on; `run` it or `start` it in a thread."""

    def __init__(self, scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, allowed_origins: Sequence[str] = ()) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self._socket = _listen(host, port)
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(create_app(scheduler, model_name, api_key, allowed_origins), log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (ends in /v1)."""
        return self.page_url + "v1"

    @property
    def page_url(self) -> str:
        """The URL of the chat page (ends in /)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def run(self) -> None:
        """Serve until interrupted (Ctrl-C, SIGTERM)."""
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()

    def start(self, timeout: float = 30.0) -> None:
        """Serve from a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="ember-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise GenerationError(f"the server on {self.url} did not start within {timeout:g} s")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop a server `start`ed in a thread."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or an `EmberError` naming --host/--port.

    Its protocol is IPPROTO_TCP, not 0 as `socket.create_server` leaves it: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on accepted sockets whose protocol says TCP. With it on, each streamed token after a
    response's first write waited for the client's delayed ACK on a kept-alive connection: ~40 ms a chunk
    (the `openai` client's time to first token was 47 ms on the demo model, 1.4 ms with it off)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            if os.name == "posix":
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind((host, port))
            listener.listen(256)
        except BaseException:
            listener.close()
            raise
        return listener
    except socket.gaierror as err:
        raise EmberError(f"--host {host}: cannot resolve it: {err.strerror}") from None
    except OverflowError:
        raise EmberError(f"--port {port}: must be in [0, 65535]") from None
    except OSError as err:
        raise EmberError(f"cannot listen on {host}:{port} (--host/--port): {err.strerror}") from None
