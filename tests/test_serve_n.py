"""`n` choices on /v1/completions and /v1/chat/completions: the official `openai` client against the tiny llama
(--max-batch 4) served in this process (a thread, stopped by its handle). The prompt is read once and its pages
forked: /metrics' prefill token count says so.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from helpers import Served, prompt_ids

from ember.serving.scheduler import choice_seed

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

TIMEOUT = 60  # seconds; catches a hang, never a speed
PREFILL = "ember_prefill_tokens_total"


@pytest.fixture(scope="module")
def served(tiny_llama):
    with Served(tiny_llama.artifact_dir) as served:
        yield served


def _texts(reply) -> list[str]:
    assert [choice.index for choice in reply.choices] == list(range(len(reply.choices)))
    return [choice.text for choice in reply.choices]


def test_greedy_choices_are_identical_and_the_prompt_is_prefilled_once(served):
    prompt = prompt_ids(40, seed=11)  # over two KV pages: a prompt read per choice would count 160 tokens
    before = served.metrics()
    reply = served.client.completions.create(model=served.name, prompt=prompt, n=4, max_tokens=8, temperature=0,
                                             logprobs=0)
    after = served.metrics()
    assert len(set(_texts(reply))) == 1
    single = served.client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].text == single.choices[0].text
    assert after[PREFILL] - before[PREFILL] == len(prompt)
    assert after["ember_prefix_cache_hits_total"] == before["ember_prefix_cache_hits_total"]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(choice.logprobs.tokens) for choice in reply.choices)
    assert reply.usage.total_tokens == len(prompt) + reply.usage.completion_tokens


def test_seeded_choices_differ_and_repeat(served):
    def sampled(n: int) -> list[str]:
        return _texts(served.client.completions.create(model=served.name, prompt=prompt_ids(12, seed=3), n=n,
                                                       max_tokens=10, temperature=1.0, seed=1234))

    four = sampled(4)
    assert len(set(four)) == 4
    assert sampled(4) == four
    assert sampled(1) == four[:1]  # choice 0 keeps the request's own seed
    assert len({choice_seed(1234, i) for i in range(16)}) == 16 and choice_seed(None, 3) is None


def test_chat_choices_stream_with_their_indexes_and_one_usage(served):
    messages = [{"role": "user", "content": "tell me a story"}]
    whole = served.client.chat.completions.create(model=served.name, messages=messages, n=3, max_tokens=6,
                                                  temperature=1.0, seed=7)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    stream = served.client.chat.completions.create(model=served.name, messages=messages, n=3, max_tokens=6,
                                                   temperature=1.0, seed=7, stream=True,
                                                   stream_options={"include_usage": True})
    texts, finished, usages = {}, {}, []
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert set(finished) == {0, 1, 2}
    assert len(usages) == 1 and usages[0].prompt_tokens == whole.usage.prompt_tokens
    assert usages[0].completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("n, words", [(0, "greater than or equal to 1"), (17, "less than or equal to 16"),
                                      (5, "at most 4 sequences")], ids=["zero", "over 16", "over --max-batch"])
def test_bad_n_is_refused_naming_n(served, n, words):
    for create in (lambda: served.client.completions.create(model=served.name, prompt="hi", n=n, max_tokens=2),
                   lambda: served.client.chat.completions.create(model=served.name, n=n, max_tokens=2,
                                                                 messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.BadRequestError) as caught:
            create()
        assert caught.value.param == "n" and words in caught.value.message
    assert served.client.completions.create(model=served.name, prompt="hi", n=2, max_tokens=2).choices


def test_leaving_a_stream_cancels_every_choice(served):
    before = served.metrics()
    connection = http.client.HTTPConnection(served.server.host, served.server.port, timeout=TIMEOUT)
    body = json.dumps({"model": served.name, "prompt": prompt_ids(20, seed=5), "max_tokens": 200, "stream": True,
                       "n": 4, "temperature": 1.0, "seed": 0, "stop": None})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    key = 'ember_requests_finished_total{reason="cancelled"}'
    deadline = time.monotonic() + TIMEOUT
    while (now := served.metrics()).get(key, 0) < before.get(key, 0) + 4:
        assert time.monotonic() < deadline, "the choices of a stream left early were not all cancelled"
        time.sleep(0.02)
    assert now["ember_running_sequences"] == 0 and now["ember_kv_cache_tokens_used"] == 0
    assert served.client.completions.create(model=served.name, prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize("n, returns_calls, words", [(2, True, "tools"), (5, False, "at most 4")],
                         ids=["tool calls", "over --max-batch"])
def test_check_choices_refuses_what_cannot_be_read_naming_n(n, returns_calls, words):
    from types import SimpleNamespace

    from ember.serving.protocol import ApiError, check_choices

    with pytest.raises(ApiError) as caught:
        check_choices(n, 4, SimpleNamespace(returns_calls=returns_calls))
    assert (caught.value.status, caught.value.param) == (400, "n") and words in caught.value.message
    check_choices(1, 4, SimpleNamespace(returns_calls=returns_calls))
