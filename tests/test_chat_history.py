"""Fitting a long chat into the context window: `runtime/history.py`, and `ember serve`'s `truncation: "auto"`
(what the chat page sends) checked against transformers' rendering of the demo model's chat template.

No browser here: tests/test_serve_browser.py drives the page itself.
"""

from __future__ import annotations

import http.client
import json

import pytest

from ember.runtime import load_artifact
from ember.runtime.engine import Engine
from ember.runtime.history import MAX_DEFAULT_REPLY_TOKENS, default_reply_tokens, fit_history
from ember.serving import Scheduler

pytest.importorskip("fastapi")
from ember.serving.server import DROPPED_TURNS_HEADER, Server

TIMEOUT = 60  # seconds; catches a hang, never a speed
CONTEXT = 256  # the demo model's context window


def _words(messages: list[dict]) -> list[int]:
    """A stand-in tokenizer: one token per word of every message, and one for each message's role."""
    return [0 for message in messages for _ in [message["role"], *message["content"].split()]]


def _turn(n: int, words: int = 4) -> list[dict]:
    return [{"role": "user", "content": f"question {n} " + "w " * (words - 2)},
            {"role": "assistant", "content": f"answer {n} " + "w " * (words - 2)}]


def test_fit_history_drops_the_earliest_turns_keeping_the_system_message():
    system = [{"role": "system", "content": "be brief"}]
    messages = system + _turn(1) + _turn(2) + _turn(3) + [{"role": "user", "content": "last one"}]
    assert len(_words(messages)) == 3 + 3 * 10 + 3
    assert fit_history(messages, _words, 36) == (messages, _words(messages), 0)
    kept, prompt, dropped = fit_history(messages, _words, 35)
    assert (kept, dropped) == (system + _turn(2) + _turn(3) + messages[-1:], 1)
    assert prompt == _words(kept)
    kept, _prompt, dropped = fit_history(messages, _words, 16)
    assert (kept, dropped) == (system + _turn(3) + messages[-1:], 2)


def test_fit_history_drops_a_turn_with_the_tool_calls_and_results_it_led_to():
    tool_turn = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": ""},
                 {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "it is sunny"}]
    last = [{"role": "user", "content": "thanks"}]
    kept, _prompt, dropped = fit_history(tool_turn + last, _words, len(_words(last)))
    assert (kept, dropped) == (last, 1)


def test_fit_history_gives_the_last_turn_alone_when_even_it_does_not_fit():
    messages = [{"role": "developer", "content": "rules"}, *_turn(1), {"role": "user", "content": "a b c d e f"}]
    kept, prompt, dropped = fit_history(messages, _words, 3)
    assert kept == [messages[0], messages[-1]] and dropped == 1 and len(prompt) == 9 > 3


def test_the_default_reply_budget_is_a_quarter_of_the_context_window_up_to_a_cap():
    assert default_reply_tokens(256) == 64
    assert default_reply_tokens(131072) == MAX_DEFAULT_REPLY_TOKENS == 1024
    assert default_reply_tokens(2) == 1


@pytest.fixture(scope="module")
def demo_server(demo_builds):
    """`ember serve`'s server on the demo model (context window 256) in this process, without an API key."""
    artifact_dir = demo_builds.get("cpu", "q0f32")
    scheduler = Scheduler(Engine(load_artifact(artifact_dir)))
    server = Server(scheduler, artifact_dir.name, port=0)
    server.start()
    yield server
    server.stop()
    scheduler.close()


@pytest.fixture(scope="module")
def reference_tokenizer():
    transformers = pytest.importorskip("transformers")
    import ember

    return transformers.AutoTokenizer.from_pretrained(ember.DEMO_MODEL_DIR)


def _post_chat(server: Server, body: dict) -> tuple[int, http.client.HTTPMessage, dict]:
    """(status, headers (any case), JSON body) of a whole (not streamed) chat request."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps({"model": server.model_name, **body}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        connection.close()


def _conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You answer in the words of the King James Bible."}]
    for n in range(turns):
        messages += [{"role": "user", "content": f"Tell me of the {n}th king of Israel, and of his sons."},
                     {"role": "assistant", "content": "And he reigned forty years in Jerusalem, and slept with his "
                                                      "fathers, and his son reigned in his stead."}]
    return messages + [{"role": "user", "content": "And what became of his house?"}]


def test_truncation_auto_drops_the_fewest_earliest_turns_that_leave_room_for_the_reply(demo_server,
                                                                                      reference_tokenizer):
    messages = _conversation(9)

    def prompt_tokens(kept: list[dict]) -> int:
        return len(reference_tokenizer.apply_chat_template(kept, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])

    assert prompt_tokens(messages) > CONTEXT  # without dropping, the prompt alone overflows
    status, headers, reply = _post_chat(demo_server, {"messages": messages, "temperature": 0, "truncation": "auto"})
    assert status == 200, reply
    dropped = int(headers[DROPPED_TURNS_HEADER])
    assert 1 <= dropped < 9
    kept = messages[:1] + messages[1 + 2 * dropped:]
    budget = CONTEXT // 4  # no max_tokens: the default reply budget
    assert reply["usage"]["prompt_tokens"] == prompt_tokens(kept) <= CONTEXT - budget
    assert prompt_tokens(messages[:1] + messages[1 + 2 * (dropped - 1):]) > CONTEXT - budget  # one fewer: no room
    assert reply["usage"]["completion_tokens"] <= budget
    # The reply is the one to the kept turns, sent as they are.
    status, headers, alone = _post_chat(demo_server, {"messages": kept, "temperature": 0, "max_tokens": budget})
    assert status == 200 and DROPPED_TURNS_HEADER not in headers
    assert reply["choices"][0] == alone["choices"][0]


def test_truncation_auto_keeps_a_chat_that_fits_whole_and_honours_max_tokens(demo_server):
    messages = _conversation(1)
    status, headers, reply = _post_chat(demo_server, {"messages": messages, "temperature": 0, "max_tokens": 8,
                                                      "truncation": "auto"})
    assert status == 200 and headers[DROPPED_TURNS_HEADER] == "0"
    assert reply["usage"]["completion_tokens"] == 8 and reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("truncation", [None, "disabled"])
def test_without_truncation_a_chat_over_the_context_window_is_refused(demo_server, truncation):
    body = {"messages": _conversation(9)} | ({"truncation": truncation} if truncation else {})
    status, headers, reply = _post_chat(demo_server, body)
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert DROPPED_TURNS_HEADER not in headers


def test_truncation_auto_refuses_a_last_message_that_cannot_fit(demo_server):
    status, _headers, reply = _post_chat(demo_server, {"messages": _conversation(2), "max_tokens": CONTEXT,
                                                       "truncation": "auto"})
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    status, _headers, reply = _post_chat(demo_server, {"messages": _conversation(0), "truncation": "everything"})
    assert status == 400 and reply["error"]["param"] == "truncation", reply


@pytest.mark.parametrize("api_key", [None, "a-key"])
def test_the_chat_page_is_told_whether_the_api_needs_a_key(demo_server, api_key):
    server = Server(demo_server.scheduler, demo_server.model_name, port=0, api_key=api_key)
    server.start()
    try:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
        connection.request("GET", "/")
        page = connection.getresponse().read().decode()
        connection.close()
    finally:
        server.stop()
    assert ('<html lang="en" data-api-key="required">' in page) == (api_key is not None)
    assert ('<html lang="en" data-api-key="optional">' in page) == (api_key is None)
