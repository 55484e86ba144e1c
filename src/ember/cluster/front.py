"""The cluster's one OpenAI endpoint: an HTTP proxy in front of the replicas.

Each request goes to the replica the router picks (router.py) and its answer comes back as the replica's
server wrote it, so the API and its errors are `ember serve`'s. A replica that fails before answering
(its process died, its connection broke) is dropped from this request and the request goes to another:
nothing had reached the client yet. A streamed answer is relayed event by event, each event whole; if its
replica dies before the stream's last event (chat's `data: [DONE]`, Anthropic's `message_stop`, a Response's
completion), the client gets its API's error event (`_lost_stream_events`), never a stream cut short without a
word nor one continued by another replica. The front's own errors are in the shape of the route's API. /health
and /metrics are the front's own: per-replica load, routing and restarts, and each replica's own metrics labelled
with its index.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlparse

from ember.cluster.router import Router, routing_key
from ember.core.errors import EmberError
from ember.serving import anthropic_messages, prometheus
from ember.serving.protocol import ApiError, internal_error, sse
from ember.serving.server import (
    ANTHROPIC_PATHS,
    MAX_BODY_BYTES,
    error_response,
    read_body,
    wait_unless_disconnected,
)

try:
    import aiohttp
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.types import Receive, Scope, Send
except ImportError as err:
    raise EmberError(f"ember serve --ray needs aiohttp and starlette ({err.name} is missing): "
                     "pip install 'ember[cluster]'") from None

log = logging.getLogger(__name__)

REPLICA_HEADER = "X-Ember-Replica"  # which replica answered, on every relayed response
# Hop-by-hop and framing headers: the front writes its own.
_NOT_RELAYED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "date",
                          "server"})
_BROKEN = (aiohttp.ClientError, OSError, asyncio.IncompleteReadError)
RESPONSES_PATH = "/v1/responses"
# The event types that end a stream, for the APIs that name their events.
_LAST_EVENTS = {"anthropic": frozenset({"message_stop", "error"}),
                "responses": frozenset({"response.completed", "response.incomplete", "response.failed"})}
_Answer = TypeVar("_Answer")
METRICS_TIMEOUT = 2.0  # seconds a replica's /metrics may take before /metrics leaves it out


class _LostError(Exception):
    """The replica broke off before its answer reached the client: another may answer instead."""


def create_front(router: Router) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI application relaying every request but /health and /metrics to `router`'s replicas."""
    front = _Front(router)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await front.lifespan(receive, send)
        if scope["type"] != "http":
            return
        request = HttpRequest(scope, receive)
        release: Callable[[], Awaitable[None]] | None = None
        try:
            if scope["path"] == "/health":
                response = front.health()
            elif scope["path"] == "/metrics":
                response = PlainTextResponse(await front.metrics(), media_type=prometheus.CONTENT_TYPE)
            else:
                response, release = await front.relay(request)
        except ApiError as err:
            response = error_response(scope["path"], err)
        except Exception as err:  # a bug: a 500 in the route's API's shape, and the front goes on
            log.error("internal error relaying a request", exc_info=err)
            response = error_response(scope["path"], internal_error(err))
        try:
            await response(scope, receive, send)
        finally:
            if release is not None:
                await release()

    return app


class _Front:
    """The proxy's state: the router and one HTTP client session for all replicas."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._session: aiohttp.ClientSession | None = None
        self.retried = 0  # requests sent to another replica after theirs failed before answering
        self.lost_streams = 0  # streams ended with an error event because their replica died

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client session, made on the serving event loop."""
        if self._session is None:
            # No total timeout: a long generation is no failure; a dead replica's socket is closed by its OS.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                                  auto_decompress=False)
        return self._session

    async def lifespan(self, receive: Receive, send: Send) -> None:
        """Answer the server's startup and shutdown; the client session closes at shutdown."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def relay(self, request: HttpRequest) -> tuple[Response, Callable[[], Awaitable[None]]]:
        """The replica's response to `request`, and what to call once it has been sent."""
        body = await read_body(request)
        key = routing_key(request.url.path, body) if request.method == "POST" else None
        headers = {name: value for name, value in request.headers.items() if name.lower() not in _NOT_RELAYED}
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[int] = set()
        while True:
            replica = self.router.pick(key, frozenset(tried))
            if replica is None:
                raise ApiError(503, "no replica is serving right now (each one that died is being replaced); "
                                    "retry shortly", code="no_replica", kind="server_error")
            try:
                response, release = await _unless_disconnected(
                    request, self._ask(replica.index, replica.info["url"] + target, request.method, headers,
                                       body))
            except _LostError as err:
                self.router.done(replica)
                log.warning("ember: replica %d failed before answering (%s); trying another", replica.index, err)
                tried.add(replica.index)
                self.retried += 1
                continue
            except BaseException:
                self.router.done(replica)
                raise

            async def finish(replica=replica, release=release) -> None:
                try:
                    await release()
                finally:
                    self.router.done(replica)

            return response, finish

    async def _ask(self, index: int, url: str, method: str, headers: dict[str, str],
                   body: bytes) -> tuple[Response, Callable[[], Awaitable[None]]]:
        """Replica `index`'s response, whole or (for an event stream) from its first whole event on."""
        try:
            upstream = await self.session.request(method, url, data=body, headers=headers)
        except _BROKEN as err:
            raise _LostError(str(err) or type(err).__name__) from None
        relayed = {name: value for name, value in upstream.headers.items() if name.lower() not in _NOT_RELAYED}
        relayed[REPLICA_HEADER] = str(index)

        async def release() -> None:  # a stream's connection is not reused: its client may have left mid-way
            upstream.close()

        try:
            if upstream.content_type != "text/event-stream":
                content = await upstream.read()
                upstream.release()  # read to its end: the connection serves the next request
                return Response(content, upstream.status, relayed), _nothing
            first = await _next_event(upstream)
            if first is None:
                raise _LostError("the stream ended before its first event")
        except _BROKEN as err:
            await release()
            raise _LostError(str(err) or type(err).__name__) from None
        except BaseException:
            await release()
            raise
        stream = self._events(index, urlparse(url).path, first, upstream)
        return StreamingResponse(stream, upstream.status, relayed), release

    async def _events(self, index: int, path: str, first: bytes,
                      upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The replica's events, each whole; if the replica dies before the stream's last event, its API's error
        event."""
        event: bytes | None = first
        last = first
        while event is not None:
            yield event
            if _ends_stream(path, event):
                return
            last = event
            try:
                event = await _next_event(upstream)
            except _BROKEN:
                event = None
        self.lost_streams += 1
        log.warning("ember: replica %d died mid-stream; the stream ends with an error event", index)
        lost = ApiError(503, f"the replica generating this stream (replica {index}) stopped mid-answer; what was "
                             "streamed is all there is: send the request again", code="replica_lost",
                        kind="server_error")
        for text in _lost_stream_events(path, lost, first, last):
            yield text.encode()

    def health(self) -> Response:
        """GET /health: 200 while any replica serves, 503 when none does; each replica's state either way."""
        replicas = self.router.snapshot()
        alive = sum(replica["alive"] for replica in replicas)
        status = "ok" if alive == len(replicas) else "degraded" if alive else "unavailable"
        return JSONResponse({"status": status, "replicas": replicas, "retried": self.retried,
                             "lost_streams": self.lost_streams}, status_code=200 if alive else 503)

    async def metrics(self) -> str:
        """GET /metrics: the front's figures per replica, then every live replica's own, labelled replica="i"."""
        replicas = self.router.snapshot()

        def per_replica(key: str) -> list[tuple[tuple[str, ...], float]]:
            return [((str(r["replica"]),), float(r[key])) for r in replicas]

        front = [
            prometheus.gauge("ember_cluster_replica_up", "1 while the replica serves, 0 while it is replaced.",
                             per_replica("alive"), labels=("replica",)),
            prometheus.gauge("ember_cluster_replica_in_flight", "Requests the front has relayed to the replica and "
                             "not yet answered.", per_replica("in_flight"), labels=("replica",)),
            prometheus.counter("ember_cluster_requests_routed_total", "Requests the front sent to the replica.",
                               per_replica("routed"), labels=("replica",)),
            prometheus.counter("ember_cluster_prefix_routed_total", "Requests sent to the replica because it "
                               "answered their prompt's start before (prefix-cache-aware routing).",
                               per_replica("prefix_routed"), labels=("replica",)),
            prometheus.counter("ember_cluster_replica_restarts_total", "Times the replica died and was replaced.",
                               per_replica("restarts"), labels=("replica",)),
            prometheus.counter("ember_cluster_retried_requests_total", "Requests sent to another replica after "
                               "theirs failed before answering.", [((), self.retried)]),
            prometheus.counter("ember_cluster_lost_streams_total", "Streams ended with an error event because "
                               "their replica died.", [((), self.lost_streams)]),
        ]
        alive = [r for r in replicas if r["alive"]]
        texts = await asyncio.gather(*[self._replica_metrics(r["url"]) for r in alive])
        own = [family for replica, text in zip(alive, texts)
               for family in _labelled(text, str(replica["replica"]))]
        return prometheus.exposition(front + prometheus.merged(own))

    async def _replica_metrics(self, url: str) -> str:
        """A replica's /metrics text; empty when it does not answer in time."""
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT)) as got:
                return await got.text() if got.status == 200 else ""
        except (*_BROKEN, asyncio.TimeoutError):
            return ""


def _labelled(text: str, replica: str) -> list:
    """A replica's metric families, labelled with its index; none if its text is no exposition."""
    try:
        return prometheus.labelled(text, "replica", replica)
    except ValueError:
        return []


async def _unless_disconnected(request: HttpRequest, answer: Awaitable[_Answer]) -> _Answer:
    """`answer`'s result, or cancel it (which closes the replica's connection, and so stops its generation) when
    the client disconnects first, as `ember serve` does."""
    task = asyncio.ensure_future(answer)
    await wait_unless_disconnected(request, task)
    return task.result()


async def _nothing() -> None:
    return None


def _api(path: str) -> str:
    """Whose stream format `path` speaks: "anthropic", "responses" or "openai" (chat and completions)."""
    return "anthropic" if path in ANTHROPIC_PATHS else "responses" if path == RESPONSES_PATH else "openai"


def _event_data(event: bytes) -> tuple[str | None, bytes]:
    """A server-sent event's type (None if it names none) and its data."""
    name, data = None, b""
    for line in event.split(b"\n"):
        if line.startswith(b"event: "):
            name = line[len(b"event: "):].decode(errors="replace")
        elif line.startswith(b"data: "):
            data = line[len(b"data: "):]
    return name, data


def _ends_stream(path: str, event: bytes) -> bool:
    """Whether `event` is the last its API sends on `path`: chat's and completions' `data: [DONE]`, Anthropic's
    `message_stop` (or `error`), a Response's completion or failure."""
    name, data = _event_data(event)
    api = _api(path)
    return name in _LAST_EVENTS[api] if api in _LAST_EVENTS else data == b"[DONE]"


def _lost_stream_events(path: str, error: ApiError, first: bytes, last: bytes) -> list[str]:
    """The events ending a stream on `path` whose replica died after relaying `first` ... `last`, in its API's
    shape: Anthropic's `error` event; the Responses API's `error` event numbered after `last`, then the Response
    (as `first`, `response.created`, gave it) failed; chat's and completions' error chunk and `[DONE]`."""
    api = _api(path)
    if api == "anthropic":
        return [sse(anthropic_messages.error_body(error), "error")]
    if api == "responses":
        created, previous = _event_json(first), _event_json(last)
        sequence = previous.get("sequence_number", -1) + 1
        response = created.get("response")
        response = response if isinstance(response, dict) else {}
        failed = {**response, "status": "failed", "error": {"code": error.code, "message": error.message}}
        return [sse({"type": "error", "sequence_number": sequence, "code": error.code, "message": error.message,
                     "param": None}, "error"),
                sse({"type": "response.failed", "sequence_number": sequence + 1, "response": failed},
                    "response.failed")]
    return [sse(error.body()), sse("[DONE]")]


def _event_json(event: bytes) -> dict:
    """A server-sent event's data as a JSON object (empty if it is none)."""
    try:
        data = json.loads(_event_data(event)[1])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


async def _next_event(upstream: aiohttp.ClientResponse) -> bytes | None:
    """The stream's next whole server-sent event (ending in a blank line); None at its end. An event cut off by
    the connection's end raises `IncompleteReadError`, as a broken connection raises its own error."""
    event = await upstream.content.readuntil(b"\n\n", max_size=MAX_BODY_BYTES)
    if not event:
        return None
    if not event.endswith(b"\n\n"):
        raise asyncio.IncompleteReadError(event, None)
    return event
