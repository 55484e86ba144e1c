"""The `serve --ray` front's relaying, without Ray: the front (`cluster/front.py`) under uvicorn before one replica,
an `ember serve` app over the demo model (its compact tool template), and the official `openai` and `anthropic`
clients reading what the front relays.

A whole stream of each API (chat, the Responses API, Anthropic Messages) comes through exactly as the replica wrote
it, with no error added after its last event; a replica that dies mid-stream (its connection cut after a few events)
ends the stream with that API's own error event; the front's own refusals on Anthropic's routes are in Anthropic's
shape. Everything listens on 127.0.0.1 and is stopped by its own handle.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")
pytest.importorskip("llguidance")

import uvicorn  # noqa: E402

from ember.cluster.front import create_front  # noqa: E402
from ember.cluster.router import Router  # noqa: E402
from ember.serving.server import create_app, http_url, listen, serve_on  # noqa: E402

TIMEOUT = 60  # seconds; catches a hang, never a speed
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]
EVENTS_BEFORE_DYING = 4  # body messages a dying replica sends before its connection is cut


class _DiedError(Exception):
    """The stand-in for a replica's process dying mid-answer."""


def _dying_after(app, events: int):
    """`app`, whose streamed answers are cut (the connection closed without the stream's end) after `events` body
    messages."""
    async def dying(scope, receive, send):
        sent = 0

        async def send_some(message):
            nonlocal sent
            if message["type"] == "http.response.body" and message.get("more_body"):
                sent += 1
                if sent > events:
                    raise _DiedError
            await send(message)

        await app(scope, receive, send_some)

    return dying


@contextmanager
def _serving(app, lifespan: str = "off"):
    """`app` under uvicorn on a free port of 127.0.0.1, from a thread; its URL (ending in /)."""
    listener = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", access_log=False, lifespan=lifespan))
    thread = threading.Thread(target=serve_on, args=(server, listener), daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield http_url(*listener.getsockname()[:2])
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class _Front:
    """A front before one replica, and the two clients for it."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.openai = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        self.anthropic = anthropic.Anthropic(base_url=url.rstrip("/"), api_key="unused", max_retries=0,
                                             timeout=TIMEOUT)


@contextmanager
def _front(replica_url: str | None, name: str):
    router = Router(1)
    if replica_url is not None:
        router.set_alive(0, {"url": replica_url.rstrip("/")})
    with _serving(create_front(router), lifespan="on") as url:
        yield _Front(url, name)


@pytest.fixture(scope="module")
def replica_app(demo_builds):
    """The `ember serve` app of the demo model with its tool template, and the model's name."""
    import ember
    from ember.runtime import Engine, load_artifact
    from ember.serving import Scheduler

    artifact = demo_builds.get("cpu", "q0f32")
    engine = Engine(load_artifact(artifact))
    template = (Path(ember.__file__).parent / "demo_model" / "chat_template_tools.jinja").read_text()
    engine.artifact.tokenizer.use_chat_template(template, "the demo's tool template")
    scheduler = Scheduler(engine)
    try:
        yield create_app(scheduler, artifact.name), artifact.name
    finally:
        scheduler.close()


def _streams(client: _Front, tokens: int = 24):
    """Each API's stream of one greedy answer through `client`'s front: (chat chunks, Responses events, Anthropic
    events and its final message)."""
    chat = list(client.openai.chat.completions.create(model=client.name, messages=QUESTION, max_tokens=tokens,
                                                      temperature=0, stream=True))
    with client.openai.responses.stream(model=client.name, input="Weather in Oslo?", max_output_tokens=tokens,
                                        temperature=0) as stream:
        responses = [event.type for event in stream]
    with client.anthropic.messages.stream(model=client.name, messages=QUESTION, max_tokens=tokens,
                                          extra_body={"temperature": 0}) as stream:
        messages = [event.type for event in stream]
        final = stream.get_final_message()
    return chat, responses, messages, final


def test_whole_streams_come_through_as_the_replica_wrote_them(replica_app):
    """Through the front, each API's stream ends on its own last event, with no error after it, and says what the
    replica says directly."""
    app, name = replica_app
    with _serving(app) as replica_url:
        direct = _streams(_Front(replica_url, name))
        with _front(replica_url, name) as front:
            relayed = _streams(front)
    chat, responses, messages, final = relayed
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices) == \
        "".join(chunk.choices[0].delta.content or "" for chunk in direct[0] if chunk.choices)
    assert responses == direct[1] and responses[-1] in ("response.completed", "response.incomplete")
    assert messages == direct[2] and messages[-1] == "message_stop" and "error" not in messages
    assert final.content[0].text == direct[3].content[0].text


def test_a_replica_dying_mid_stream_ends_it_with_its_apis_error(replica_app):
    """Cut after a few events: chat's client raises on the error chunk, the Responses stream ends in `error` and
    `response.failed`, Anthropic's client raises on its `error` event; each names the lost replica."""
    app, name = replica_app
    with _serving(_dying_after(app, EVENTS_BEFORE_DYING)) as replica_url, _front(replica_url, name) as front:
        with pytest.raises(openai.APIError, match="stopped mid-answer"):
            list(front.openai.chat.completions.create(model=name, messages=QUESTION, max_tokens=24,
                                                      temperature=0, stream=True))
        with front.openai.responses.stream(model=name, input="Weather in Oslo?", max_output_tokens=24,
                                           temperature=0) as stream:
            events = list(stream)
        assert [event.type for event in events[-2:]] == ["error", "response.failed"]
        assert "stopped mid-answer" in events[-2].message
        assert events[-1].response.status == "failed" and events[-1].response.id == events[0].response.id
        numbers = [event.sequence_number for event in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        with pytest.raises(anthropic.APIStatusError, match="stopped mid-answer") as raised:
            with front.anthropic.messages.stream(model=name, messages=QUESTION, max_tokens=24) as stream:
                list(stream)
        assert raised.value.body["type"] == "error"


def test_the_fronts_own_refusals_on_anthropics_routes_are_in_anthropics_shape(replica_app):
    """With no replica serving, /v1/messages answers 503 as Anthropic's API would, chat as OpenAI's would."""
    _, name = replica_app
    with _front(None, name) as front:
        with pytest.raises(anthropic.APIStatusError) as raised:
            front.anthropic.messages.create(model=name, messages=QUESTION, max_tokens=4)
        assert raised.value.status_code == 503
        assert raised.value.body["type"] == "error" and "no replica" in raised.value.body["error"]["message"]
        with pytest.raises(openai.APIStatusError) as raised_openai:
            front.openai.chat.completions.create(model=name, messages=QUESTION, max_tokens=4)
        assert raised_openai.value.status_code == 503 and raised_openai.value.body["code"] == "no_replica"


def test_the_fronts_metrics_hold_its_own_and_each_replicas_labelled(replica_app):
    """/metrics parses as Prometheus text (prometheus_client's own parser): the front's per-replica families, and
    the replica's families with `replica="0"` added to every sample."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    app, name = replica_app
    with _serving(app) as replica_url, _front(replica_url, name) as front:
        front.openai.completions.create(model=name, prompt="Hello", max_tokens=2)
        with urllib.request.urlopen(front.url + "metrics", timeout=TIMEOUT) as answer:
            text = answer.read().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    up = families["ember_cluster_replica_up"]
    assert (up.type, [(s.labels, s.value) for s in up.samples]) == ("gauge", [({"replica": "0"}, 1.0)])
    assert families["ember_cluster_lost_streams"].type == "counter"
    requests = families["ember_http_requests"]
    assert requests.type == "counter" and all(s.labels["replica"] == "0" for s in requests.samples)
    assert any(s.labels["endpoint"] == "/v1/completions" and s.labels["status"] == "200" and s.value >= 1
               for s in requests.samples)
    latency = families["ember_time_to_first_token_seconds"]
    assert latency.type == "histogram" and {s.labels["replica"] for s in latency.samples} == {"0"}
