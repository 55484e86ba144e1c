"""`ember serve`: an OpenAI-compatible HTTP API over the scheduler (FastAPI + uvicorn, the `serve` extra).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent
events ending in `data: [DONE]`, or whole; `n` choices fork one prefilled prompt), POST /v1/embeddings
(artifacts compiled with `--embeddings`; pooled as `--pooling` says), GET /v1/models and /v1/models/NAME, /health
and /metrics (Prometheus text), and a web chat page at / (static/chat.html, which streams
through /v1/chat/completions); CORS answers for the web origins the caller allows, none
by default. Every request runs through one `Scheduler`, which this module only wraps and
routes to: bodies are parsed, checked and answered by `serving/protocol.py`, prompts
tokenized off the event loop, `response_format` JSON and `tool_choice` calls enforced by a token mask
(`serving/constrained.py`, `serving/tool_calls.py`), and every failure answered in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` (400 bad fields, 401 API key,
404 unknown model or path, 413 body too large, 429 queue full, 500 a bug), never
a traceback: whatever one request raises, a Rust panic from the tokenizer included, the server goes on.
Unknown request fields are ignored, as by vLLM and llama.cpp's server.
FastAPI is imported only here, so the rest of the runtime runs without it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ember.core.errors import EmberError, GenerationError
from ember.runtime.engine import pooled_embedding
from ember.runtime.generate import LogitsProcessor
from ember.runtime.history import default_reply_tokens, fit_history
from ember.runtime.tokenizer import Tokenizer
from ember.serving.constrained import JsonConstraints
from ember.serving.protocol import (
    NEVER_CAUGHT,
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Reply,
    Request,
    chat_messages,
    chat_tools,
    check_choices,
    check_embedding_lengths,
    check_model,
    completion_prompt,
    embedding_inputs,
    embedding_response,
    generation_error,
    internal_error,
    model_card,
    parse_request,
    request_error,
    sampling_params,
    sse,
)
from ember.serving.scheduler import Histogram, Scheduler, StreamEvent, TokenStream
from ember.serving.tool_calls import ToolPlan, call_grammar

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused with 413 before it is parsed
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"
# How many of a `truncation: "auto"` chat's earliest turns were dropped to fit the context window.
DROPPED_TURNS_HEADER = "X-Dropped-Turns"
_ENDPOINTS = ("/", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics")
_Result = TypeVar("_Result")

try:
    import fastapi
    import uvicorn
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as err:
    raise EmberError(f"ember serve needs FastAPI and uvicorn ({err.name} is missing): "
                     "pip install 'ember[serve]'") from None


class _Metrics:
    """HTTP responses by endpoint and status, for /metrics."""

    def __init__(self) -> None:
        self.responses: Counter[tuple[str, int]] = Counter()

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Wrap an ASGI app to count each response's status (streamed ones included)."""
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            path = scope["path"]
            endpoint = (path if path in _ENDPOINTS else
                        "/v1/models/{model}" if path.startswith("/v1/models/") else "other")

            async def send_counting(message: Message) -> None:
                if message["type"] == "http.response.start":
                    self.responses[endpoint, message["status"]] += 1
                await send(message)

            await app(scope, receive, send_counting)

        return counted


def _guarded(app: ASGIApp) -> ASGIApp:
    """Wrap an ASGI app so that a failure no handler caught (a `BaseException` such as a Rust panic, which
    Starlette's error middleware lets through as it catches only `Exception`) is answered with OpenAI's 500."""
    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_noting(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, send_noting)
        except NEVER_CAUGHT:
            raise
        except BaseException as err:
            if started or scope["type"] != "http":  # answered already: uvicorn logs it and ends the response
                raise
            log.error("internal error answering a request", exc_info=err)
            await JSONResponse(internal_error(err).body(), status_code=500)(scope, receive, send)

    return guarded


async def _off_loop(work: Callable[[], _Result], param: str) -> _Result:
    """`work()` in a worker thread (a long prompt or a large schema would stall every stream), whatever it
    raises this request's `ApiError` naming `param`: the thread, the event loop and other requests go on."""
    try:
        return await asyncio.to_thread(work)
    except NEVER_CAUGHT:
        raise
    except BaseException as err:
        error = request_error(err, param)
        if error.status == 500:
            log.error("internal error answering a request", exc_info=err)
        raise error from None


class _Api:
    """What the routes do, over one scheduler serving one model."""

    def __init__(self, scheduler: Scheduler, model_name: str, api_key: str | None, pooling: str = "mean") -> None:
        self.scheduler = scheduler
        self.pooling = pooling
        self.engine = scheduler.engine
        self.model_name = model_name
        self.api_key = api_key
        self.tokenizer: Tokenizer | None = self.engine.artifact.tokenizer
        self.constraints = JsonConstraints(self.engine.artifact, self.engine.vocab_size)
        self.card = model_card(model_name, int(time.time()), self.engine.context_window)

    def authorize(self, request: HttpRequest) -> None:
        """Refuse a request without the server's API key, if it has one."""
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def read(self, request: HttpRequest, schema: type[Request]) -> Request:
        """The authorized request's body, checked against `schema` and the model served."""
        self.authorize(request)
        fields = parse_request(await read_body(request), schema)
        check_model(fields.model, self.model_name)
        return fields

    async def chat(self, request: HttpRequest) -> Response:
        """POST /v1/chat/completions."""
        fields = await self.read(request, ChatRequest)
        messages = chat_messages(fields)
        tokenizer = self._need_tokenizer()
        tools = chat_tools(fields, tokenizer.chat_template)
        # With truncation "auto", the earliest turns are dropped until the prompt leaves the reply its tokens.
        prompt_limit: int | None = None
        if fields.truncation == "auto":
            reply_tokens = fields.token_limit()
            if reply_tokens is None:
                reply_tokens = default_reply_tokens(self.engine.context_window)
                fields = fields.model_copy(update={"max_tokens": reply_tokens})
            prompt_limit = self.engine.context_window - reply_tokens

        def prompt_of(kept: list[dict]) -> list[int]:
            text = tokenizer.apply_chat_template(kept, tools=tools.template_tools if tools else None)
            return tokenizer.encode(text, add_special_tokens=False)

        def render() -> tuple[list[int], int]:
            if prompt_limit is None:
                return prompt_of(messages), 0
            _kept, prompt, dropped = fit_history(messages, prompt_of, prompt_limit)
            return prompt, dropped

        prompt, dropped = await _off_loop(render, "messages")
        response = await self._answer(request, fields, prompt, "messages", tools)
        if prompt_limit is not None:
            response.headers[DROPPED_TURNS_HEADER] = str(dropped)
        return response

    async def completion(self, request: HttpRequest) -> Response:
        """POST /v1/completions."""
        fields = await self.read(request, CompletionRequest)
        prompt = completion_prompt(fields, self.engine.vocab_size)
        if isinstance(prompt, str):
            tokenizer, text = self._need_tokenizer(), prompt
            prompt = await _off_loop(lambda: tokenizer.encode(text), "prompt")
        return await self._answer(request, fields, prompt, "prompt")

    async def embeddings(self, request: HttpRequest) -> Response:
        """POST /v1/embeddings."""
        fields = await self.read(request, EmbeddingRequest)
        if not self.engine.has_embeddings:
            raise ApiError(400, f"the model {self.model_name!r} has no embed function: recompile it with "
                                "`ember compile --embeddings`", param="model", code="unsupported_value")
        inputs = embedding_inputs(fields, self.engine.vocab_size)
        token_ids = [item for item in inputs if not isinstance(item, str)]
        if len(token_ids) < len(inputs):  # texts among them
            tokenizer = self._need_tokenizer()
            token_ids = await _off_loop(lambda: [tokenizer.encode(item) if isinstance(item, str) else item
                                                 for item in inputs], "input")
        check_embedding_lengths([len(ids) for ids in token_ids], self.engine.context_window)
        try:
            future = self.scheduler.embed(token_ids)
        except GenerationError as err:
            raise request_error(err, "input") from None
        waiting = asyncio.wrap_future(future)
        await wait_unless_disconnected(request, waiting, future.cancel)  # a client gone drops the job's rest
        try:
            hidden = waiting.result()
        except NEVER_CAUGHT:
            raise
        except GenerationError as err:  # the engine refused an input (a full KV cache)
            raise request_error(err, "input") from None
        except BaseException as err:
            raise generation_error(err) from None
        vectors = [pooled_embedding(states, self.pooling) for states in hidden]
        return JSONResponse(embedding_response(vectors, self.model_name, sum(len(ids) for ids in token_ids),
                                               fields.encoding_format))

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, "this artifact has no tokenizer: send prompt token ids to /v1/completions",
                           param="prompt", code="unsupported_value")
        return self.tokenizer

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    async def _answer(self, request: HttpRequest, fields: ChatRequest | CompletionRequest, prompt_ids: list[int],
                      prompt_param: str, tools: ToolPlan | None = None) -> Response:
        """Generate for `prompt_ids`: the whole answer, or its SSE stream; a client gone mid-way cancels it."""
        engine = self.engine
        params = sampling_params(fields, len(prompt_ids), engine.context_window, engine.vocab_size, prompt_param)
        check_choices(fields.n, engine.max_batch, tools)
        processor = await self._processor(fields, tools)
        processors: LogitsProcessor | list[LogitsProcessor | None] | None = processor
        if processor is not None and fields.n > 1:  # each choice advances a grammar state of its own
            processors = [processor, *[await self._processor(fields, tools) for _ in range(fields.n - 1)]]
        try:
            stream = await self.scheduler.submit(prompt_ids, params, processors, n=fields.n)
        except GenerationError as err:
            raise request_error(err) from None
        reply = Reply.to(fields, self.model_name, self._token_text, tools)
        if not fields.stream:
            return JSONResponse(reply.whole(await _unless_disconnected(request, stream)))
        return StreamingResponse(_events(reply, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _processor(self, fields: ChatRequest | CompletionRequest,
                         tools: ToolPlan | None) -> LogitsProcessor | None:
        """The token mask that `response_format`, or a tool_choice that makes the reply a call, holds one reply to."""
        response_format = fields.response_format
        processor = None if response_format is None else \
            await _off_loop(lambda: self.constraints.mask(response_format), "response_format")
        if tools is not None and tools.enforced:  # the reply must be a call: held to the calls' grammar
            if processor is not None:
                raise ApiError(400, "response_format cannot apply to a reply that tool_choice makes a tool call",
                               param="response_format", code="invalid_value")
            processor = await _off_loop(lambda: self.constraints.grammar_mask(call_grammar(tools), "tool_choice"),
                                        "tool_choice")
        return processor


def _answer_errors_in_openai_shape(app: fastapi.FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: HttpRequest, err: ApiError) -> Response:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: HttpRequest, err: HTTPException) -> Response:
        code = "not_found" if err.status_code == 404 else None
        return JSONResponse(ApiError(err.status_code, str(err.detail), code=code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def bug(_request: HttpRequest, err: Exception) -> Response:
        log.error("internal error answering a request", exc_info=err)
        return JSONResponse(internal_error(err).body(), status_code=500)


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
               allowed_origins: Sequence[str] = (), pooling: str = "mean") -> ASGIApp:
    """The ASGI application serving `scheduler`'s engine as the model `model_name` (embeddings pooled by
    `pooling`, one of `engine.POOLINGS`).

    `allowed_origins`: web origins (or `*`) whose pages' scripts may call the API from a browser: the
    answers carry CORS headers for them, and their preflight requests are answered. Others are refused
    by the browser itself, as without CORS; the page at / is same-origin and needs none."""
    app = fastapi.FastAPI(title="ember", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=[DROPPED_TURNS_HEADER],
                           max_age=600)
    _answer_errors_in_openai_shape(app)
    api, metrics = _Api(scheduler, model_name, api_key, pooling), _Metrics()
    page = chat_page_html(api_key is not None)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completion)
    app.post("/v1/embeddings")(api.embeddings)

    @app.get("/v1/models")
    async def models(request: HttpRequest) -> Response:
        api.authorize(request)
        return JSONResponse({"object": "list", "data": [api.card]})

    @app.get("/v1/models/{model:path}")
    async def model(request: HttpRequest, model: str) -> Response:
        # The openai client's models.retrieve(name); `path` because a model name may hold a slash.
        api.authorize(request)
        check_model(model, model_name)
        return JSONResponse(api.card)

    @app.get("/")
    async def chat_page() -> Response:
        # No API key here: the page holds no secret, and it asks for the key when the API wants one.
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(_prometheus(scheduler, metrics.responses), media_type="text/plain; version=0.0.4")

    return metrics.middleware(_guarded(app))


def chat_page_html(needs_key: bool) -> str:
    """The chat page, told whether the API needs a key: it then asks for one instead of calling the API without."""
    page = CHAT_PAGE.read_text(encoding="utf-8")
    return page.replace('data-api-key="optional"', 'data-api-key="required"', 1) if needs_key else page


async def _events(reply: Reply, stream: TokenStream) -> AsyncIterator[str]:
    """A streamed request's server-sent events, ending in `[DONE]`; an error after the status line was sent
    goes in the stream."""
    offsets: dict[int, int] = {}  # characters streamed so far, by choice
    try:
        async for event in stream:
            offset = offsets.get(event.index, 0)
            for chunk in reply.chunks(event, offset, event.index not in offsets):
                yield sse(chunk)
            offsets[event.index] = offset + len(event.text)
    except NEVER_CAUGHT:
        raise
    except BaseException as err:
        if not isinstance(err, EmberError):
            log.error("internal error in a stream", exc_info=err)
        yield sse(generation_error(err).body())
    finally:
        stream.cancel()  # the client went away (or the stream ended): free the sequence now
    yield sse("[DONE]")


async def _collect(stream: TokenStream) -> list[StreamEvent]:
    return [event async for event in stream]


async def read_body(request: HttpRequest) -> bytes:
    """The request's body, refused with 413 past `MAX_BODY_BYTES`; a client that leaves before sending all of it
    is one line in the log (nobody is left to answer), not an internal error."""
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", code="body_too_large")
    except ClientDisconnect:
        log.info("%s %s: the client closed the connection before sending its whole body", request.method,
                 request.url.path)
        raise ApiError(499, "the client closed the connection", code="client_closed") from None
    return bytes(body)


async def wait_unless_disconnected(request: HttpRequest, task: asyncio.Future[Any],
                                  on_cancel: Callable[[], object] | None = None) -> None:
    """Wait for `task`; when the client disconnects first, cancel it (and call `on_cancel`) and raise a 499."""
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
            if on_cancel is not None:
                on_cancel()
    # A task just cancelled is not done yet: it takes the cancellation on its next step.
    if not task.done() or task.cancelled():
        raise ApiError(499, "the client closed the connection", code="client_closed")


async def _unless_disconnected(request: HttpRequest, stream: TokenStream) -> list[StreamEvent]:
    """All of `stream`'s events, or cancel the request when the client disconnects before they are in."""
    task = asyncio.ensure_future(_collect(stream))
    await wait_unless_disconnected(request, task, stream.cancel)
    try:
        return task.result()
    except NEVER_CAUGHT:
        raise
    except BaseException as err:
        if not isinstance(err, EmberError):
            log.error("internal error answering a request", exc_info=err)
        raise generation_error(err) from None


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
    metric("ember_embedding_tokens_total", "counter", "Input tokens run through the embed function "
           "(/v1/embeddings).", [("", stats.embedded_tokens)])
    histogram("ember_time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", stats.ttft)
    histogram("ember_time_per_output_token_seconds", "Seconds per generated token after the first, per request.",
              stats.tpot)
    return "\n".join(lines) + "\n"


class Server:
    """An HTTP server for `scheduler`, listening from construction on; `run` it or `start` it in a thread."""

    def __init__(self, scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, allowed_origins: Sequence[str] = (), pooling: str = "mean") -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self._socket = listen(host, port)
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(create_app(scheduler, model_name, api_key, allowed_origins, pooling),
                                log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (ends in /v1)."""
        return self.page_url + "v1"

    @property
    def page_url(self) -> str:
        """The URL of the chat page (ends in /)."""
        return http_url(self.host, self.port)

    def run(self) -> None:
        """Serve until interrupted (Ctrl-C, SIGTERM)."""
        serve_on(self._server, self._socket)

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


def http_url(host: str, port: int) -> str:
    """The http URL of host:port, ending in /, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def serve_on(server: uvicorn.Server, listener: socket.socket) -> None:
    """Run `server` on the `listen`ing socket until it exits, then close the socket."""
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


def listen(host: str, port: int) -> socket.socket:
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
