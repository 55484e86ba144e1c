"""`ember serve`: an HTTP API over the scheduler (FastAPI + uvicorn, the `serve` extra) that speaks OpenAI's API,
Anthropic's Messages API and llama-server's utility endpoints.

The routes are `serving/routes.py`'s table (docs/serving.md lists them): OpenAI's chat and text completions
(streamed as server-sent events ending in `data: [DONE]`, or whole; `n` choices fork one prefilled prompt), Responses
and embeddings (artifacts compiled with `--embeddings`; pooled as `--pooling` says), the models; Anthropic's
messages and their token count; llama-server's /tokenize, /detokenize, /apply-template, /props and /health;
/metrics (Prometheus text), and a web chat page at / (static/chat.html, which streams through
/v1/chat/completions); CORS answers for the web origins the caller allows, none by default. Every request runs
through one `Scheduler`, which this module only wraps and routes to: bodies are parsed, checked and answered by
`serving/protocol.py` (OpenAI), `responses.py`, `anthropic_messages.py` and `utilities.py`, a Responses or
Messages request generated as the chat request it maps to; prompts tokenized off the event loop, `response_format`
JSON and `tool_choice` calls enforced by a token mask (`serving/constrained.py`, `serving/tool_calls.py`), and every
failure answered in its API's error shape, OpenAI's `{"error": {"message", "type", "param", "code"}}` or
Anthropic's `{"type": "error", "error": {"type", "message"}}` (400 bad fields, 401 API key, 404 unknown model or
path, 413 body too large, 429 queue full, 500 a bug), never a traceback: whatever one request raises, a Rust panic
from the tokenizer included, the server goes on. Unknown request fields are ignored, as by vLLM and llama.cpp's
server. FastAPI is imported only here, so the rest of the runtime runs without it.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ember.core.errors import EmberError, GenerationError

# The serve extra, checked before the modules of the APIs it serves import pydantic (which FastAPI brings).
try:
    import fastapi
    import uvicorn
    from fastapi import Depends
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import generate_latest  # noqa: F401 (the serve extra's, which serving.prometheus uses)
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HttpRequest
    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as err:
    raise EmberError(f"ember serve needs FastAPI, uvicorn and prometheus_client ({err.name} is missing): "
                     "pip install 'ember[serve]'") from None

from ember.runtime.engine import pooled_embedding
from ember.runtime.generate import LogitsProcessor
from ember.runtime.history import default_reply_tokens, fit_history
from ember.runtime.tokenizer import Tokenizer
from ember.serving import anthropic_messages, prometheus, responses, utilities
from ember.serving.anthropic_messages import CountTokensRequest, MessagesReply, MessagesRequest
from ember.serving.constrained import JsonConstraints
from ember.serving.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NEVER_CAUGHT,
    ApiError,
    ApiModel,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    FieldNames,
    Reply,
    ReplyShape,
    adapter_choice,
    chat_messages,
    chat_tools,
    check_choices,
    check_embedding_lengths,
    check_model,
    completion_prompts,
    embedding_inputs,
    embedding_response,
    generation_error,
    internal_error,
    model_card,
    parse_request,
    request_error,
    sampling_params,
    template_messages,
)
from ember.serving.responses import RESPONSES_FIELDS, ResponsesReply, ResponsesRequest
from ember.serving.routes import ROUTES
from ember.serving.scheduler import Histogram, Scheduler, StreamEvent, TokenStream
from ember.serving.tool_calls import ToolPlan, call_grammar
from ember.serving.utilities import DetokenizeRequest, TemplateRequest, TokenizeRequest

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused with 413 before it is parsed
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"
# How many of a `truncation: "auto"` chat's earliest turns were dropped to fit the context window.
DROPPED_TURNS_HEADER = "X-Dropped-Turns"
# The paths /metrics counts responses by (a model's card by its route's, whatever the model), and those answering
# errors in Anthropic's shape.
_ENDPOINTS = frozenset(route.path for route in ROUTES if "{" not in route.path)
ANTHROPIC_PATHS = frozenset(route.path for route in ROUTES if route.errors == "anthropic")
_Result = TypeVar("_Result")
_Body = TypeVar("_Body", bound=ApiModel)


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


def error_response(path: str, error: ApiError) -> JSONResponse:
    """The response answering `error` on `path`: in Anthropic's shape on its routes, else in OpenAI's."""
    body = anthropic_messages.error_body(error) if path in ANTHROPIC_PATHS else error.body()
    return JSONResponse(body, status_code=error.status)


def _guarded(app: ASGIApp) -> ASGIApp:
    """Wrap an ASGI app so that a failure no handler caught (a `BaseException` such as a Rust panic, which
    Starlette's error middleware lets through as it catches only `Exception`) is answered with a 500."""
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
            await error_response(scope["path"], internal_error(err))(scope, receive, send)

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


class _EventStream(Protocol):
    """A submitted request's events, as the scheduler's `TokenStream` gives them; `cancel()` ends the request."""

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    def cancel(self) -> None: ...


class _PromptStreams:
    """The streams of a completion request's prompts as one: each prompt's events in turn, their choices numbered
    prompt-major (choice i of prompt p is p * n + i), as OpenAI numbers them. Every prompt generates at once in
    the scheduler; the events of those after the first wait in their own queues until they are read."""

    def __init__(self, streams: Sequence[TokenStream]) -> None:
        self.streams = streams

    def cancel(self) -> None:
        """Stop every prompt's request."""
        for stream in self.streams:
            stream.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        for prompt, stream in enumerate(self.streams):
            async for event in stream:
                yield replace(event, index=prompt * stream.choices + event.index)


@dataclass(frozen=True)
class _ChatPrompt:
    """A chat rendered for generation: its request (with the reply's tokens, if `truncation: "auto"` chose them),
    its prompt's token ids, its tools, and how many of its earliest turns were dropped (None: none could be)."""

    fields: ChatRequest
    prompt_ids: list[int]
    tools: ToolPlan | None
    dropped: int | None


class _Api:
    """What the routes do, over one scheduler serving one model."""

    def __init__(self, scheduler: Scheduler, model_name: str, api_key: str | None, pooling: str = "mean",
                 metrics: _Metrics | None = None) -> None:
        self.scheduler = scheduler
        self.counted = metrics or _Metrics()
        self.pooling = pooling
        self.engine = scheduler.engine
        self.model_name = model_name
        self.api_key = api_key
        self.tokenizer: Tokenizer | None = self.engine.artifact.tokenizer
        self.constraints = JsonConstraints(self.engine.artifact, self.engine.vocab_size)
        created = int(time.time())
        self.card = model_card(model_name, created, self.engine.context_window)
        # The LoRA adapters the engine loaded (`ember serve --lora`), each a model of its own name.
        self.adapters = tuple(self.engine.adapters)
        self.adapter_cards = {name: model_card(name, created, self.engine.context_window, parent=model_name)
                              for name in self.adapters}
        self.page = chat_page_html(api_key is not None)

    def authorize(self, request: HttpRequest) -> None:
        """Refuse a request without the server's API key, if it has one: as OpenAI's clients send it
        (`Authorization: Bearer KEY`) or as Anthropic's (`x-api-key: KEY`)."""
        if self.api_key is None:
            return
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        given = bearer.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        if not given:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def read(self, request: HttpRequest, schema: type[_Body]) -> _Body:
        """The request's body, checked against `schema` (and, where it names one, against the model served)."""
        fields = parse_request(await read_body(request), schema)
        model = getattr(fields, "model", None)
        if isinstance(model, str):
            check_model(model, self.model_name, self.adapters)
        return fields

    async def chat(self, request: HttpRequest) -> Response:
        """POST /v1/chat/completions."""
        fields = await self.read(request, ChatRequest)
        chat = await self._chat_prompt(fields, chat_messages(fields), CHAT_FIELDS)
        stream = await self._generate(chat.fields, [chat.prompt_ids], CHAT_FIELDS, chat.tools)
        reply = Reply.to(chat.fields, chat.fields.model, self._token_text, chat.tools)
        return _with_dropped_turns(await _respond(request, stream, reply), chat)

    async def responses(self, request: HttpRequest) -> Response:
        """POST /v1/responses: read into a chat request, generated as a chat, answered as a Response."""
        body = await self.read(request, ResponsesRequest)
        fields = responses.chat_request(body)
        chat = await self._chat_prompt(fields, template_messages(fields.messages), RESPONSES_FIELDS)
        stream = await self._generate(chat.fields, [chat.prompt_ids], RESPONSES_FIELDS, chat.tools)
        return _with_dropped_turns(await _respond(request, stream, ResponsesReply(body, body.model, chat.tools)),
                                   chat)

    async def messages(self, request: HttpRequest) -> Response:
        """POST /v1/messages: read into a chat request, generated as a chat, answered as Anthropic's Message."""
        body = await self.read(request, MessagesRequest)
        fields = anthropic_messages.chat_request(body)
        chat = await self._chat_prompt(fields, template_messages(fields.messages), CHAT_FIELDS)
        reply = MessagesReply(body, body.model, chat.tools, len(chat.prompt_ids), self._need_tokenizer().decode)
        return await _respond(request, await self._generate(chat.fields, [chat.prompt_ids], CHAT_FIELDS, chat.tools),
                              reply)

    async def count_tokens(self, request: HttpRequest) -> Response:
        """POST /v1/messages/count_tokens: the tokens of the prompt /v1/messages would render."""
        fields = anthropic_messages.chat_request(await self.read(request, CountTokensRequest))
        chat = await self._chat_prompt(fields, template_messages(fields.messages), CHAT_FIELDS)
        return JSONResponse({"input_tokens": len(chat.prompt_ids)})

    async def completion(self, request: HttpRequest) -> Response:
        """POST /v1/completions."""
        fields = await self.read(request, CompletionRequest)
        prompts = completion_prompts(fields, self.engine.vocab_size)

        def tokenized() -> tuple[list[list[int]], list[str]]:
            """Each prompt's token ids, and with `echo` its text (token ids' decoded)."""
            ids = [self._need_tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
                   for prompt in prompts]
            echo = [prompt if isinstance(prompt, str) else self._need_tokenizer("echo").decode(prompt)
                    for prompt in prompts] if fields.echo else []
            return ids, echo

        prompt_ids, echo = await _off_loop(tokenized, "prompt")
        stream = await self._generate(fields, prompt_ids, COMPLETION_FIELDS)
        reply = Reply.to(fields, fields.model, self._token_text, echo=echo, prompts=len(prompt_ids))
        return await _respond(request, stream, reply)

    async def embeddings(self, request: HttpRequest) -> Response:
        """POST /v1/embeddings."""
        fields = await self.read(request, EmbeddingRequest)
        if fields.model in self.adapters:
            raise ApiError(400, f"the model {fields.model!r} is a LoRA adapter of {self.model_name!r}; embeddings are "
                                f"the base model's: ask {self.model_name!r}", param="model", code="unsupported_value")
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

    async def tokenize(self, request: HttpRequest) -> Response:
        """POST /tokenize (llama-server's)."""
        body = await self.read(request, TokenizeRequest)
        tokenizer = self._need_tokenizer("content")
        ids = await _off_loop(lambda: tokenizer.encode(body.content, add_special_tokens=body.add_special), "content")
        if not body.with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = await _off_loop(lambda: self.constraints.token_bytes(ids), "with_pieces")
        return JSONResponse({"tokens": utilities.token_pieces(ids, pieces)})

    async def detokenize(self, request: HttpRequest) -> Response:
        """POST /detokenize (llama-server's)."""
        body = await self.read(request, DetokenizeRequest)
        tokenizer = self._need_tokenizer("tokens")
        utilities.check_token_ids(body.tokens, tokenizer.vocab_size)
        return JSONResponse({"content": await _off_loop(lambda: tokenizer.decode(body.tokens), "tokens")})

    async def apply_template(self, request: HttpRequest) -> Response:
        """POST /apply-template (llama-server's): the prompt text /v1/chat/completions would generate after."""
        body = await self.read(request, TemplateRequest)
        fields = ChatRequest.model_validate({"model": self.model_name, "messages": body.messages, "tools": body.tools,
                                             "tool_choice": body.tool_choice,
                                             "parallel_tool_calls": body.parallel_tool_calls})
        tokenizer = self._need_tokenizer("messages")
        tools = chat_tools(fields, tokenizer.chat_template)
        messages = template_messages(fields.messages)
        text = await _off_loop(lambda: tokenizer.apply_chat_template(messages, tools=_template_tools(tools)),
                               "messages")
        return JSONResponse({"prompt": text})

    async def props(self) -> Response:
        """GET /props (llama-server's)."""
        tokenizer, engine = self.tokenizer, self.engine
        return JSONResponse(utilities.props(
            self.model_name, engine.artifact.path, engine.context_window, engine.max_batch,
            tokenizer.chat_template if tokenizer else None, tokenizer.bos_token if tokenizer else None,
            tokenizer.eos_token if tokenizer else None))

    async def models(self) -> Response:
        """GET /v1/models: the model, then its LoRA adapters."""
        return JSONResponse({"object": "list", "data": [self.card, *self.adapter_cards.values()]})

    async def model(self, model: str) -> Response:
        """GET /v1/models/NAME: the openai client's models.retrieve(name) (a name may hold a slash)."""
        check_model(model, self.model_name, self.adapters)
        return JSONResponse(self.adapter_cards.get(model, self.card))

    async def lora_adapters(self) -> Response:
        """GET /lora-adapters (llama-server's): the adapters loaded, by id, with their paths."""
        return JSONResponse(utilities.lora_adapters(self.engine.adapters))

    async def chat_page(self) -> Response:
        """GET /: the chat page, which holds no secret and asks for the API key when the API wants one."""
        return HTMLResponse(self.page)

    async def health(self) -> Response:
        """GET /health."""
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        """GET /metrics: Prometheus text."""
        return PlainTextResponse(_prometheus(self.scheduler, self.counted.responses),
                                 media_type=prometheus.CONTENT_TYPE)

    def _need_tokenizer(self, param: str = "prompt") -> Tokenizer:
        if self.tokenizer is None:
            hint = ": send prompt token ids to /v1/completions" if param == "prompt" else ""
            raise ApiError(400, f"this artifact has no tokenizer{hint}", param=param, code="unsupported_value")
        return self.tokenizer

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)

    async def _chat_prompt(self, fields: ChatRequest, messages: list[dict[str, Any]], names: FieldNames) -> _ChatPrompt:
        """The chat's prompt rendered through the chat template with its tools; with truncation "auto", the
        earliest turns dropped until the prompt leaves the reply its tokens."""
        tokenizer = self._need_tokenizer()
        tools = chat_tools(fields, tokenizer.chat_template)
        prompt_limit: int | None = None
        if fields.truncation == "auto":
            reply_tokens = fields.token_limit()
            if reply_tokens is None:
                reply_tokens = default_reply_tokens(self.engine.context_window)
                fields = fields.model_copy(update={"max_tokens": reply_tokens})
            prompt_limit = self.engine.context_window - reply_tokens

        def prompt_of(kept: list[dict]) -> list[int]:
            text = tokenizer.apply_chat_template(kept, tools=_template_tools(tools))
            return tokenizer.encode(text, add_special_tokens=False)

        def render() -> tuple[list[int], int | None]:
            if prompt_limit is None:
                return prompt_of(messages), None
            _kept, prompt, dropped = fit_history(messages, prompt_of, prompt_limit)
            return prompt, dropped

        prompt, dropped = await _off_loop(render, names.prompt)
        return _ChatPrompt(fields, prompt, tools, dropped)

    async def _generate(self, fields: ChatRequest | CompletionRequest, prompts: list[list[int]], names: FieldNames,
                        tools: ToolPlan | None = None) -> _EventStream:
        """Submit each prompt (`fields.n` choices of each) to the scheduler: their events as one stream."""
        engine = self.engine
        params = [sampling_params(fields, len(ids), engine.context_window, engine.vocab_size, names) for ids in prompts]
        check_choices(fields.n, engine.max_batch, tools)
        streams: list[TokenStream] = []
        try:
            for ids, prompt_params in zip(prompts, params):
                processors = await self._processors(fields, tools, names)
                streams.append(await self.scheduler.submit(ids, prompt_params, processors, n=fields.n,
                                                           adapter=adapter_choice(fields, self.adapters)))
        except BaseException as err:
            for stream in streams:
                stream.cancel()
            if isinstance(err, GenerationError):
                raise request_error(err) from None
            raise
        return streams[0] if len(streams) == 1 else _PromptStreams(streams)

    async def _processors(self, fields: ChatRequest | CompletionRequest, tools: ToolPlan | None,
                          names: FieldNames) -> LogitsProcessor | list[LogitsProcessor | None] | None:
        """The token masks of one prompt's choices (one for a single choice): each advances a grammar state of its
        own."""
        processor = await self._processor(fields, tools, names)
        if processor is None or fields.n == 1:
            return processor
        return [processor, *[await self._processor(fields, tools, names) for _ in range(fields.n - 1)]]

    async def _processor(self, fields: ChatRequest | CompletionRequest, tools: ToolPlan | None,
                         names: FieldNames) -> LogitsProcessor | None:
        """The token mask that `response_format`, or a tool_choice that makes the reply a call, holds one reply to."""
        response_format, param = fields.response_format, names.response_format
        processor = None if response_format is None else \
            await _off_loop(lambda: self.constraints.mask(response_format, param), param)
        if tools is not None and tools.enforced:  # the reply must be a call: held to the calls' grammar
            if processor is not None:
                raise ApiError(400, f"{param} cannot apply to a reply that tool_choice makes a tool call",
                               param=param, code="invalid_value")
            processor = await _off_loop(lambda: self.constraints.grammar_mask(call_grammar(tools), "tool_choice"),
                                        "tool_choice")
        return processor


def _template_tools(tools: ToolPlan | None) -> list[dict[str, Any]] | None:
    return tools.template_tools if tools else None


def _with_dropped_turns(response: Response, chat: _ChatPrompt) -> Response:
    """`response` saying how many of the chat's earliest turns `truncation: "auto"` dropped, if it could drop any."""
    if chat.dropped is not None:
        response.headers[DROPPED_TURNS_HEADER] = str(chat.dropped)
    return response


async def _respond(request: HttpRequest, stream: _EventStream, reply: ReplyShape) -> Response:
    """The whole answer once its events are in, or its event stream; a client gone mid-way cancels it."""
    if not reply.stream:
        return JSONResponse(reply.whole(await _unless_disconnected(request, stream)))
    return StreamingResponse(_events(reply, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _answer_errors_in_their_shape(app: fastapi.FastAPI) -> None:
    """Every error answered in the shape of its route's API (OpenAI's but on Anthropic's routes)."""
    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, err: ApiError) -> Response:
        return error_response(request.url.path, err)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, err: HTTPException) -> Response:
        code = "not_found" if err.status_code == 404 else None
        return error_response(request.url.path, ApiError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(Exception)
    async def bug(request: HttpRequest, err: Exception) -> Response:
        log.error("internal error answering a request", exc_info=err)
        return error_response(request.url.path, internal_error(err))


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
               allowed_origins: Sequence[str] = (), pooling: str = "mean") -> ASGIApp:
    """The ASGI application serving `scheduler`'s engine as the model `model_name` (embeddings pooled by
    `pooling`, one of `engine.POOLINGS`), its routes those of `serving/routes.py`'s table.

    `allowed_origins`: web origins (or `*`) whose pages' scripts may call the API from a browser: the
    answers carry CORS headers for them, and their preflight requests are answered. Others are refused
    by the browser itself, as without CORS; the page at / is same-origin and needs none."""
    app = fastapi.FastAPI(title="ember", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
                           expose_headers=[DROPPED_TURNS_HEADER], max_age=600)
    _answer_errors_in_their_shape(app)
    metrics = _Metrics()
    api = _Api(scheduler, model_name, api_key, pooling, metrics)
    for route in ROUTES:
        app.add_api_route(route.path, getattr(api, route.handler), methods=[route.method],
                          dependencies=[Depends(api.authorize)] if route.needs_key else None)
    return metrics.middleware(_guarded(app))


def chat_page_html(needs_key: bool) -> str:
    """The chat page, told whether the API needs a key: it then asks for one instead of calling the API without."""
    page = CHAT_PAGE.read_text(encoding="utf-8")
    return page.replace('data-api-key="optional"', 'data-api-key="required"', 1) if needs_key else page


async def _events(reply: ReplyShape, stream: _EventStream) -> AsyncIterator[str]:
    """A streamed request's server-sent events, as its API shapes them; an error after the status line was sent
    goes in the stream."""
    try:
        for text in reply.opening():
            yield text
        async for event in stream:
            for text in reply.feed(event):
                yield text
    except NEVER_CAUGHT:
        raise
    except BaseException as err:
        if not isinstance(err, EmberError):
            log.error("internal error in a stream", exc_info=err)
        for text in reply.failure(generation_error(err)):
            yield text
    finally:
        stream.cancel()  # the client went away (or the stream ended): free the sequence now
    for text in reply.closing():
        yield text


async def _collect(stream: _EventStream) -> list[StreamEvent]:
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


async def _unless_disconnected(request: HttpRequest, stream: _EventStream) -> list[StreamEvent]:
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

    def one(value: float) -> list[tuple[tuple[str, ...], float]]:
        return [((), value)]

    return prometheus.exposition([
        prometheus.counter("ember_http_requests_total", "HTTP responses by endpoint and status.",
                           [((endpoint, str(status)), n) for (endpoint, status), n in sorted(responses.items())],
                           labels=("endpoint", "status")),
        prometheus.counter("ember_requests_finished_total", "Generation requests by how they ended.",
                           [((reason,), n) for reason, n in sorted(stats.finished.items())], labels=("reason",)),
        prometheus.counter("ember_prompt_tokens_total", "Prompt tokens of finished requests.",
                           one(stats.prompt_tokens)),
        prometheus.counter("ember_generation_tokens_total", "Tokens generated by finished requests.",
                           one(stats.generated_tokens)),
        prometheus.gauge("ember_queue_depth", "Requests waiting for a sequence.", one(stats.queued)),
        prometheus.gauge("ember_running_sequences", "Requests holding a sequence in the KV cache.", one(stats.running)),
        prometheus.gauge("ember_kv_cache_tokens_used", "KV cache tokens in pages held by running sequences.",
                         one(stats.kv_tokens_used)),
        prometheus.gauge("ember_kv_cache_tokens_free", "KV cache tokens not held by running sequences (prefix cache "
                         "entries' count as free: they are evicted on demand).", one(stats.kv_tokens_free)),
        prometheus.gauge("ember_kv_cache_tokens_reserved", "KV cache tokens promised to running requests "
                         "(prompt + max_tokens).", one(stats.kv_tokens_reserved)),
        prometheus.counter("ember_prefill_tokens_total", "Prompt tokens run through the model (prefix cache hits "
                           "skip theirs).", one(stats.prefill_tokens)),
        prometheus.counter("ember_prefix_cache_hits_total", "Requests that reused a cached or running sequence's "
                           "KV pages.", one(stats.prefix_cache_hits)),
        prometheus.counter("ember_prefix_cache_hit_tokens_total", "Prompt tokens not prefilled thanks to the prefix "
                           "cache.", one(stats.prefix_cache_hit_tokens)),
        prometheus.gauge("ember_prefix_cache_sequences", "Finished sequences kept as prefix cache entries.",
                         one(stats.prefix_cache_sequences)),
        prometheus.gauge("ember_prefix_cache_tokens", "KV cache tokens in the pages of prefix cache entries.",
                         one(stats.prefix_cache_tokens)),
        prometheus.counter("ember_speculative_proposed_tokens_total", "Guessed tokens checked by speculative verify "
                           "steps (ember serve --speculate/--draft).", one(stats.speculative_proposed)),
        prometheus.counter("ember_speculative_accepted_tokens_total", "Guessed tokens the model agreed with.",
                           one(stats.speculative_accepted)),
        prometheus.counter("ember_embedding_tokens_total", "Input tokens run through the embed function "
                           "(/v1/embeddings).", one(stats.embedded_tokens)),
        _histogram("ember_time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
                   stats.ttft),
        _histogram("ember_time_per_output_token_seconds", "Seconds per generated token after the first, per request.",
                   stats.tpot),
    ])


def _histogram(name: str, helptext: str, hist: Histogram):
    return prometheus.histogram(name, helptext, hist.bounds, hist.counts, hist.total)


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
