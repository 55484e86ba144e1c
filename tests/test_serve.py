"""`ember serve` and its scheduler: the official `openai` client against a server on loopback.

Servers run in this process (a thread per server, on a free port, stopped by their own
handle), each over its own loaded artifact, so nothing else touches their engine; one
test starts `ember serve` as a subprocess and stops it by its PID. Greedy outputs are
compared with `generate()` on a separate engine: batching must not change a token.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import REPO_ROOT, Served, ember_serve, prompt_ids

from ember.cli import main
from ember.core.errors import GenerationError
from ember.runtime import Engine, SamplingParams, generate, load_artifact
from ember.runtime.sampling import sample_token, token_logprob
from ember.serving import Scheduler

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

API_KEY = "test-key"
TIMEOUT = 60  # seconds; catches a hang, never a speed


def _greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_tokens, **options)


@pytest.fixture(scope="module")
def demo_dir(demo_builds):
    """The demo model as `ember compile demo` builds it (the session's shared build; context window 256)."""
    return demo_builds.get("cpu", "q0f32")


@pytest.fixture(scope="module")
def demo(demo_dir):
    with Served(demo_dir) as served:
        yield served


@pytest.fixture(scope="module")
def demo_reference(demo_dir):
    """The demo artifact loaded apart from the server's, for `generate()` references."""
    return load_artifact(demo_dir)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    with Served(tiny_llama.artifact_dir, api_key=API_KEY) as served:
        yield served


def _reference(artifact, prompt, max_tokens: int):
    generation = generate(Engine(artifact), prompt, _greedy(max_tokens))
    text = generation.text()
    return text, generation


def test_demo_completions_and_chat_match_generate(demo, demo_reference):
    prompt = "And the LORD said unto Moses"
    text, generation = _reference(demo_reference, prompt, 24)
    whole = demo.client.completions.create(model=demo.name, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == text
    assert whole.choices[0].finish_reason == generation.stats.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(generation.prompt_ids),
                                                                          generation.stats.new_tokens)
    chunks = list(demo.client.completions.create(model=demo.name, prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == generation.stats.new_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who led Israel?"}]
    tokenizer = demo_reference.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    text, generation = _reference(demo_reference, ids, 20)
    reply = demo.client.chat.completions.create(model=demo.name, messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), generation.stats.new_tokens)
    assert reply.usage.total_tokens == len(ids) + generation.stats.new_tokens
    streamed = demo.client.chat.completions.create(model=demo.name, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert [model.id for model in demo.client.models.list()] == [demo.name]
    assert demo.client.models.retrieve(demo.name).id == demo.name
    with pytest.raises(openai.NotFoundError) as not_found:
        demo.client.models.retrieve("gpt-4o")
    assert not_found.value.code == "model_not_found" and "'gpt-4o' does not exist" in not_found.value.message


def test_demo_stop_logprobs_and_penalties(demo, demo_reference):
    prompt = "And the LORD said unto Moses"
    text, _ = _reference(demo_reference, prompt, 24)
    stop = text[5:9]
    cut = demo.client.completions.create(model=demo.name, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    scored = demo.client.completions.create(model=demo.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    logprobs = scored.choices[0].logprobs
    assert "".join(logprobs.tokens) == scored.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()))  # greedy picks the likeliest
    chat = demo.client.chat.completions.create(model=demo.name, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert [len(item.top_logprobs) for item in chat.choices[0].logprobs.content] == [2] * 4
    repeated = demo.client.completions.create(model=demo.name, prompt=prompt, max_tokens=40, temperature=0,
                                              frequency_penalty=2.0)
    assert repeated.choices[0].text != _reference(demo_reference, prompt, 40)[0]


def test_demo_logit_bias_moves_the_pick_as_openai_documents(demo, demo_reference):
    """A bias is added to a token's logit before sampling: -100 hands a greedy pick to the runner-up, +100 forces."""
    prompt = "And the LORD said unto Moses"
    _, generation = _reference(demo_reference, prompt, 1)
    first = generation.token_ids[0]
    engine = Engine(demo_reference)
    logits = engine.prefill(engine.add_sequence(), generation.prompt_ids).astype(np.float64)
    logits[first] -= 100
    runner_up = int(np.argmax(logits))
    banned = demo.client.completions.create(model=demo.name, prompt=prompt, max_tokens=1, temperature=0,
                                            logit_bias={str(first): -100})
    assert banned.choices[0].text == demo_reference.tokenizer.decode([runner_up]) != generation.text()
    forced = demo.client.chat.completions.create(model=demo.name, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, temperature=0, logit_bias={"5": 100})
    assert forced.choices[0].message.content == demo_reference.tokenizer.decode([5, 5, 5])


@pytest.fixture(scope="module")
def long_served(tiny_llama_long):
    with Served(tiny_llama_long.artifact_dir) as served:
        yield served


def test_concurrent_streams_match_their_solo_runs(long_served, tiny_llama_long):
    """32 streaming clients at once, prompts of 1..400 tokens and max_tokens 1..200 (the tiny llama
    with a 1024-token context, max_batch 8): each gets exactly its solo greedy run, whole, and
    /metrics agrees with what the clients counted."""
    served, artifact = long_served, tiny_llama_long.artifact
    rng = np.random.default_rng(1)
    vocab = artifact.manifest.model["vocab_size"]
    jobs = []
    for _ in range(32):
        length, max_tokens = int(rng.integers(1, 401)), int(rng.integers(1, 201))
        ids = [1] + rng.integers(3, vocab, length - 1).tolist()
        text, generation = _reference(artifact, ids, max_tokens)
        jobs.append((ids, max_tokens, (text, len(generation.token_ids), generation.stats.finish_reason)))
    before = served.metrics()

    async def one(client, ids, max_tokens):
        pieces, usage, finish = [], None, None
        stream = await client.completions.create(model=served.name, prompt=ids, max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return "".join(pieces), usage, finish

    results = served.concurrently(one, jobs)
    for (ids, max_tokens, expected), (text, usage, finish) in zip(jobs, results):
        assert (text, usage.completion_tokens, finish) == expected, \
            f"prompt of {len(ids)} tokens, max_tokens {max_tokens}"
        assert usage.prompt_tokens == len(ids)
    after = served.metrics()
    assert after["ember_prompt_tokens_total"] - before["ember_prompt_tokens_total"] == sum(len(j[0]) for j in jobs)
    assert after["ember_generation_tokens_total"] - before["ember_generation_tokens_total"] == \
        sum(r[1].completion_tokens for r in results)
    ok = 'ember_http_requests_total{endpoint="/v1/completions",status="200"}'
    assert after[ok] - before.get(ok, 0) == len(jobs)
    assert after["ember_running_sequences"] == 0 and after["ember_kv_cache_tokens_used"] == 0
    assert after["ember_time_to_first_token_seconds_count"] - before["ember_time_to_first_token_seconds_count"] \
        == len(jobs)


def _assert_openai_error(status: int, body, expected_status: int, *words: str, param: str | None = None) -> None:
    assert status == expected_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert "Traceback" not in error["message"] and "\n" not in error["message"]
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error


def _still_serving(served: Served, key: str = API_KEY) -> None:
    """A health check and a normal request succeed."""
    assert served.request("GET", "/health") == (200, {"status": "ok"})
    status, body = served.request("POST", "/v1/completions", json.dumps(
        {"model": served.name, "prompt": "ab", "max_tokens": 2}).encode(), {"Authorization": f"Bearer {key}"})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


BAD_REQUESTS = {
    # name: (path, body (bytes, or a dict merged over a good one), status, words in the message, param)
    "malformed JSON": ("/v1/completions", b'{"model": "x", "prompt": ', 400, ("not valid JSON",), None),
    "not UTF-8": ("/v1/completions", b'{"model": "\xff\xfe", "prompt": "a"}', 400, ("not UTF-8",), None),
    "not an object": ("/v1/completions", b"[1, 2]", 400, ("JSON object",), None),
    "no prompt": ("/v1/completions", {"prompt": None}, 400, ("prompt",), "prompt"),
    "negative max_tokens": ("/v1/completions", {"max_tokens": -1}, 400, ("max_tokens",), "max_tokens"),
    "absurd max_tokens": ("/v1/completions", {"max_tokens": 10**12}, 400, ("context window",), "max_tokens"),
    "string max_tokens": ("/v1/completions", {"max_tokens": "5"}, 400, ("max_tokens",), "max_tokens"),
    "absurd temperature": ("/v1/completions", {"temperature": 1e300}, 400, ("temperature",), "temperature"),
    "negative temperature": ("/v1/completions", {"temperature": -0.5}, 400, ("temperature",), "temperature"),
    "top_p zero": ("/v1/completions", {"top_p": 0}, 400, ("top_p",), "top_p"),
    "top_p above one": ("/v1/completions", {"top_p": 1.5}, 400, ("top_p",), "top_p"),
    "seed beyond int64": ("/v1/completions", {"seed": 2**63}, 400, ("seed",), "seed"),
    "penalty out of range": ("/v1/completions", {"presence_penalty": 3}, 400, ("presence_penalty",),
                             "presence_penalty"),
    "too many logprobs": ("/v1/completions", {"logprobs": 21}, 400, ("logprobs",), "logprobs"),
    "n above 16": ("/v1/completions", {"n": 17}, 400, ("n",), "n"),
    "logit_bias above 100": ("/v1/completions", {"logit_bias": {"5": 101}}, 400, ("logit_bias",), "logit_bias"),
    "logit_bias of no token": ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, 400,
                               ("logit_bias", "vocabulary"), "logit_bias"),
    "empty stop": ("/v1/completions", {"stop": [""]}, 400, ("stop",), "stop"),
    "token id out of range": ("/v1/completions", {"prompt": [1, 10**6]}, 400, ("token ids",), "prompt"),
    "negative token id": ("/v1/completions", {"prompt": [[-1, 2]]}, 400, ("token ids",), "prompt"),
    "no token ids": ("/v1/completions", {"prompt": []}, 400, ("empty",), "prompt"),
    "too many prompts": ("/v1/completions", {"prompt": ["a"] * 65}, 400, ("at most 64",), "prompt"),
    "echo with logprobs": ("/v1/completions", {"echo": True, "logprobs": 2}, 400, ("echo", "logprobs"), "echo"),
    "response_format type": ("/v1/completions", {"response_format": {"type": "xml"}}, 400, ("type must be",),
                             "response_format"),
    "json_schema without schema": ("/v1/completions", {"response_format": {"type": "json_schema"}}, 400,
                                   ("json_schema.schema",), "response_format"),
    "invalid JSON schema": ("/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400,
        ("invalid JSON schema", "nonsense"), "response_format"),
    "unimplemented schema keyword": ("/v1/chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}}, 400,
        ("uniqueItems",), "response_format"),
    "unknown model": ("/v1/completions", {"model": "gpt-4"}, 404, ("gpt-4",), "model"),
    "1 MB prompt": ("/v1/completions", {"prompt": "ab" * 2**19}, 400, ("context",), "prompt"),
    "body over 16 MiB": ("/v1/completions", {"prompt": "a" * (17 * 2**20)}, 413, ("16 MiB",), None),
    "unknown path": ("/v1/audio/speech", {}, 404, (), None),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, ("messages",), "messages"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, 400,
                     ("role",), "messages"),
    "image content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, ("type",), "messages"),
    "lone surrogate": ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}]}',
                       400, ("UTF-8",), None),
    "tools": ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, ("tools",), "tools"),
    "functions": ("/v1/chat/completions", {"functions": [{"name": "f"}]}, 400, ("functions",), "functions"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"top_logprobs": 2}, 400, ("logprobs",),
                                      "top_logprobs"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_requests_get_openai_errors_and_the_server_goes_on(tiny, case):
    path, body, status, words, param = BAD_REQUESTS[case]
    if isinstance(body, dict):
        good = {"model": tiny.name, "max_tokens": 4}
        good.update({"prompt": "ab"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]})
        body = json.dumps({key: value for key, value in {**good, **body}.items() if value is not None}).encode()
    body = body.replace(b'"M"', json.dumps(tiny.name).encode())
    got = tiny.request("POST", path, body, {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    _assert_openai_error(*got, status, *words, param=param)
    _still_serving(tiny)


@pytest.mark.parametrize("prompt_for", [lambda vocab_size: [1, -1], lambda vocab_size: [[2, vocab_size]]],
                         ids=["negative", "past the vocabulary"])
def test_prompt_token_ids_outside_the_vocabulary_are_refused_naming_prompt(tiny, prompt_for):
    vocab_size = tiny.scheduler.engine.vocab_size
    prompt = prompt_for(vocab_size)
    with pytest.raises(openai.BadRequestError) as caught:
        tiny.client.completions.create(model=tiny.name, prompt=prompt, max_tokens=2)
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, "prompt", "invalid_value")
    assert f"[0, {vocab_size})" in caught.value.message
    _still_serving(tiny)


class _Panic(BaseException):
    """Stands in for pyo3's PanicException, the BaseException a Rust panic inside tokenizers raises."""


def test_a_tokenizer_panic_fails_only_its_request(tiny, monkeypatch):
    """A BaseException from tokenizing or templating (in a worker thread) is that request's 500, a GenerationError
    its 400; the worker threads, the event loop and the scheduler go on serving."""
    tokenizer = tiny.scheduler.engine.artifact.tokenizer
    encode = tokenizer.encode

    def failing_encode(text: str, *args, **kwargs) -> list[int]:
        if "PANIC" in text:
            raise _Panic("called `Option::unwrap()` on a `None` value")
        if "BAD" in text:
            raise GenerationError("the text is bad")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", failing_encode)
    for _ in range(3):  # more failures than a worker thread pool could lose threads to
        with pytest.raises(openai.InternalServerError) as caught:
            tiny.client.completions.create(model=tiny.name, prompt="PANIC", max_tokens=2)
        assert caught.value.body == {"message": "internal error: _Panic", "type": "server_error", "param": None,
                                     "code": None}
        with pytest.raises(openai.InternalServerError, match="internal error: _Panic"):
            tiny.client.chat.completions.create(model=tiny.name, messages=[{"role": "user", "content": "PANIC"}],
                                                max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError) as caught:
        tiny.client.chat.completions.create(model=tiny.name, messages=[{"role": "user", "content": "BAD"}],
                                            max_tokens=2)
    assert (caught.value.param, caught.value.body["message"]) == ("messages", "the text is bad")
    _still_serving(tiny)
    reply = tiny.client.chat.completions.create(model=tiny.name, messages=[{"role": "user", "content": "a"}],
                                                max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_detokenizer_panic_in_the_scheduler_fails_only_its_request(tiny, monkeypatch, stream):
    """A BaseException from decoding generated tokens, on the scheduler's thread, ends that request with an
    error (a 500, or an error event in its stream) and leaves the scheduler serving the next ones."""
    tokenizer = tiny.scheduler.engine.artifact.tokenizer
    decode, armed = tokenizer.decode, threading.Event()

    def failing_decode(ids) -> str:
        if armed.is_set():
            armed.clear()
            raise _Panic("byte index is not a char boundary")
        return decode(ids)

    monkeypatch.setattr(tokenizer, "decode", failing_decode)
    armed.set()
    with pytest.raises(openai.APIError, match="internal error: _Panic"):
        reply = tiny.client.completions.create(model=tiny.name, prompt="ab", max_tokens=4, temperature=0,
                                               stream=stream)
        if stream:
            list(reply)
    assert not armed.is_set()
    _still_serving(tiny)


def test_unknown_fields_are_ignored(tiny):
    """Like vLLM and llama.cpp's server (OpenAI itself refuses them): clients send vendor fields."""
    reply = tiny.client.completions.create(model=tiny.name, prompt="ab", max_tokens=3, temperature=0,
                                           extra_body={"vendor_option": {"x": 1}, "user": "me"})
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_seed_repeats_a_sampled_reply(tiny):
    """Any int64 seed, negative ones included (OpenAI's API takes them), gives the same sampled text again."""
    def sampled(seed: int) -> str:
        return tiny.client.completions.create(model=tiny.name, prompt="ab", max_tokens=24, temperature=1.0,
                                              seed=seed).choices[0].text
    replies = {seed: sampled(seed) for seed in (-1, 1, -2**63, 2**63 - 1)}
    assert all(sampled(seed) == reply for seed, reply in replies.items())
    assert replies[-1] != replies[1]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_is_required(tiny, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    for method, path in (("GET", "/v1/models"), ("GET", f"/v1/models/{tiny.name}"), ("POST", "/v1/completions")):
        _assert_openai_error(*tiny.request(method, path, b"{}", headers), 401, "API key")
    if key is not None:  # the client itself refuses to send no key
        client = openai.OpenAI(base_url=tiny.server.url, api_key=key, max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    _still_serving(tiny)


def _after_a_cancel(served: Served, before: dict[str, float]) -> dict[str, float]:
    """/metrics once a request has finished cancelled since the `before` metrics (within TIMEOUT)."""
    key = 'ember_requests_finished_total{reason="cancelled"}'
    deadline = time.monotonic() + TIMEOUT
    while (now := served.metrics()).get(key, 0) <= before.get(key, 0):
        assert time.monotonic() < deadline, "the stream left early was never cancelled"
        time.sleep(0.02)
    return now


def test_disconnect_mid_stream_frees_the_sequence(tiny):
    before = tiny.metrics()
    connection = http.client.HTTPConnection(tiny.server.host, tiny.server.port, timeout=TIMEOUT)
    body = json.dumps({"model": tiny.name, "prompt": prompt_ids(20), "max_tokens": 230, "stream": True,
                       "temperature": 1.0, "seed": 0, "stop": None})
    connection.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    now = _after_a_cancel(tiny, before)
    assert now["ember_running_sequences"] == 0 and now["ember_kv_cache_tokens_used"] == 0
    assert now["ember_kv_cache_tokens_free"] == tiny.scheduler.engine.kv_capacity
    _still_serving(tiny)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_client_that_closes_mid_body_is_one_log_line_not_a_traceback(tiny, caplog, path):
    """Five clients announce a body and close after half of it: each is one INFO line naming the path, no record
    carries a traceback or says "internal error", and the server goes on serving."""
    import logging

    caplog.set_level(logging.INFO)
    body = json.dumps({"model": tiny.name, "prompt": "ab", "input": "ab", "messages": []}).encode()
    for _ in range(5):
        with socket.create_connection((tiny.server.host, tiny.server.port), timeout=TIMEOUT) as client:
            client.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                           + body[:len(body) // 2])
    deadline = time.monotonic() + TIMEOUT
    while sum("closed the connection" in r.getMessage() for r in caplog.records) < 5:
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    time.sleep(0.3)
    assert not [r for r in caplog.records if r.exc_info or "internal error" in r.getMessage()]
    lines = [r.getMessage() for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(lines) == 5 and all(path in line and "\n" not in line for line in lines), lines
    _still_serving(tiny)


def test_a_burst_over_max_queue_gets_429_then_requests_succeed(tiny_llama):
    served = Served(tiny_llama.artifact_dir, max_queue=2)
    try:
        async def burst():
            client = served.async_client()
            try:
                calls = [client.completions.create(model=served.name, prompt=prompt_ids(50, seed=i), max_tokens=150,
                                                   temperature=0, stop=None) for i in range(16)]
                return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), TIMEOUT)
            finally:
                await client.close()

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert refused and all(isinstance(r, openai.RateLimitError) or r.choices[0].text is not None for r in results)
        assert "--max-queue 2" in refused[0].body["message"] and refused[0].body["code"] == "queue_full"
        assert served.metrics()['ember_http_requests_total{endpoint="/v1/completions",status="429"}'] == len(refused)
        _still_serving(served, key="unused")
    finally:
        served.close()


def test_kv_exhaustion_makes_requests_wait_then_complete(tiny_llama):
    """A cache that holds two full contexts: four requests that each reserve one run two at a time,
    each with its solo output."""
    window = Engine(tiny_llama.artifact).context_window
    served = Served(tiny_llama.artifact_dir, kv_capacity=2 * window)
    peaks = {"running": 0, "queued": 0}
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            stats = served.scheduler.stats()
            peaks["running"] = max(peaks["running"], stats.running)
            if stats.running == 2:  # waiting while the batch (4) has room: for the KV cache
                peaks["queued"] = max(peaks["queued"], stats.queued)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompts = [prompt_ids(30 + 20 * i, seed=i) for i in range(4)]

        async def run_all():
            client = served.async_client()
            try:
                calls = [client.completions.create(model=served.name, prompt=ids, temperature=0) for ids in prompts]
                return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT)
            finally:
                await client.close()

        results = asyncio.run(run_all())
    finally:
        watching.set()
        watcher.join()
    try:
        assert peaks["running"] == 2 and peaks["queued"] >= 1, peaks
        for ids, result in zip(prompts, results):
            assert result.choices[0].text == _reference(tiny_llama.artifact, ids, window - len(ids))[0]
        _still_serving(served, key="unused")
    finally:
        served.close()


def _recording_engine(artifact):
    """An engine whose prefill and decode calls are logged as ('prefill', n) / ('decode', batch size)."""
    engine, calls = Engine(artifact), []
    prefill, decode = engine.prefill, engine.decode
    engine.prefill = lambda seq_id, ids, **kw: calls.append(("prefill", len(ids))) or prefill(seq_id, ids, **kw)
    engine.decode = lambda seq_ids, ids: calls.append(("decode", len(seq_ids))) or decode(seq_ids, ids)
    return engine, calls


@pytest.mark.parametrize("max_decode_stall", [0.0, math.inf])
def test_scheduler_interleaves_prefill_chunks_with_batched_decode(tiny_llama, max_decode_stall):
    """A long prompt arriving while a stream decodes is read a chunk per decode step: one KV page
    per step when no stall is allowed, whole compiled chunks when any is."""
    engine, calls = _recording_engine(tiny_llama.artifact)
    short, long = prompt_ids(10, seed=1), prompt_ids(200, seed=2)
    with Scheduler(engine, max_decode_stall=max_decode_stall) as scheduler:
        first = scheduler.submit_sync(short, _greedy(60, stop_token_ids=()))
        events = [next(first)]  # the short request is decoding when the long one arrives
        second = scheduler.submit_sync(long, _greedy(20, stop_token_ids=()))
        events += list(first)
        tail = list(second)
    chunk = engine.prefill_chunk if max_decode_stall else engine.page_size
    long_chunks = [n for kind, n in calls if kind == "prefill"][1:]
    assert long_chunks == [chunk] * (200 // chunk) + [200 % chunk]
    assert not any(a[0] == b[0] == "prefill" for a, b in zip(calls, calls[1:])), calls  # decode never waits two
    assert ("decode", 2) in calls  # both streams in one batched call
    for ids, got, n in ((short, events, 60), (long, tail, 20)):
        reference = generate(Engine(tiny_llama.artifact), ids, _greedy(n, stop_token_ids=()))
        list(reference.tokens())
        assert [t for e in got for t in e.token_ids] == reference.token_ids
        assert got[-1].finish_reason == "length" and got[-1].completion_tokens == n


def test_async_streams_wake_their_event_loop_once_per_step(tiny_llama):
    """The events of every request an event loop awaits come in one callback per engine step
    (not one per request and token), each stream still equal to its solo run; a request whose
    event loop closed is cancelled and its pages freed."""
    engine, calls = _recording_engine(tiny_llama.artifact)
    jobs = [(prompt_ids(5 + 7 * i, seed=i), 12 + 3 * i) for i in range(4)]

    async def run_all(scheduler):
        loop = asyncio.get_running_loop()
        wakeups = []
        send = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kwargs: wakeups.append(1) or send(*args, **kwargs)

        async def one(ids, n):
            stream = await scheduler.submit(ids, _greedy(n, stop_token_ids=()))
            return [event async for event in stream]

        results = await asyncio.wait_for(asyncio.gather(*(one(ids, n) for ids, n in jobs)), TIMEOUT)
        return results, len(wakeups)

    with Scheduler(engine) as scheduler:
        results, wakeups = asyncio.run(run_all(scheduler))
        events = sum(len(result) for result in results)
        assert wakeups <= len(calls) < events, (wakeups, len(calls), events)
        for (ids, n), result in zip(jobs, results):
            reference = generate(Engine(tiny_llama.artifact), ids, _greedy(n, stop_token_ids=()))
            list(reference.tokens())
            assert [t for event in result for t in event.token_ids] == reference.token_ids

        async def submit_and_leave():
            await scheduler.submit(jobs[0][0], _greedy(200, stop_token_ids=()))

        asyncio.run(submit_and_leave())  # the loop closes with the request running
        deadline = time.monotonic() + TIMEOUT
        while scheduler.stats().finished.get("cancelled", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = scheduler.stats()
        assert stats.finished == {"length": 4, "cancelled": 1}
        assert (stats.running, stats.kv_tokens_reserved) == (0, 0)


def test_scheduler_logits_processor_cancel_and_failure(tiny_llama):
    engine = Engine(tiny_llama.artifact)
    ids = prompt_ids(12)
    with Scheduler(engine, max_queue=8) as scheduler:
        plain = [t for e in scheduler.submit_sync(ids, _greedy(8, stop_token_ids=())) for t in e.token_ids]
        banned = plain[0]

        def ban(_generated, logits):
            logits = logits.copy()
            logits[banned] = -np.inf
            return logits

        masked = [t for e in scheduler.submit_sync(ids, _greedy(8, stop_token_ids=()), ban) for t in e.token_ids]
        assert banned not in masked and len(masked) == 8

        def broken(_generated, _logits):
            raise ValueError("a grammar bug")

        with pytest.raises(ValueError, match="grammar"):
            list(scheduler.submit_sync(ids, _greedy(8), broken))
        stream = scheduler.submit_sync(ids, _greedy(200, stop_token_ids=()))
        next(stream)
        stream.close()  # the consumer leaves: cancelled
        assert [t for e in scheduler.submit_sync(ids, _greedy(8, stop_token_ids=())) for t in e.token_ids] == plain
        deadline = time.monotonic() + TIMEOUT
        while scheduler.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = scheduler.stats()
        assert stats.finished == {"length": 3, "error": 1, "cancelled": 1}
        assert (stats.running, stats.kv_tokens_used, stats.kv_tokens_reserved) == (0, 0, 0)


@pytest.mark.parametrize("prompt, max_tokens, words", [
    ([], 4, "empty"),
    ([1] * 300, 4, "context window"),
    ([1, -5], 4, "token ids"),
])
def test_scheduler_refuses_requests_that_can_never_run(tiny_llama, prompt, max_tokens, words):
    with Scheduler(Engine(tiny_llama.artifact)) as scheduler:
        with pytest.raises(GenerationError, match=words):
            scheduler.submit_sync(prompt, _greedy(max_tokens))


def test_presence_and_frequency_penalties_follow_openai():
    logits = np.array([5.0, 4.0, 3.5, 0.0])
    rng = np.random.default_rng(0)
    generated = [0, 0, 1]
    # 5 - 2*1.0 - 0 = 3 ; 4 - 1*1.0 = 3 ; 3.5 untouched: token 2 wins
    assert sample_token(logits, _greedy(1, frequency_penalty=1.0), rng, generated, generated) == 2
    # presence: 5 - 2 = 3, 4 - 2 = 2, 3.5: token 2 wins; without generated tokens nothing changes
    assert sample_token(logits, _greedy(1, presence_penalty=2.0), rng, generated, generated) == 2
    assert sample_token(logits, _greedy(1, presence_penalty=2.0), rng, generated) == 0
    # repetition (over the prompt too, as in transformers): 5 / 2 = 2.5, 4 / 2 = 2: token 2 wins
    assert sample_token(logits, _greedy(1, repetition_penalty=2.0), rng, [0, 1]) == 2
    # logit_bias: 5 - 100 loses to 4; 0 + 10 beats 5
    assert sample_token(logits, _greedy(1, logit_bias={0: -100}), rng, []) == 1
    assert sample_token(logits, _greedy(1, logit_bias={3: 10.0}), rng, []) == 3
    assert logits.tolist() == [5.0, 4.0, 3.5, 0.0]  # the caller's logits (the engine's buffer) are not changed
    with pytest.raises(GenerationError, match="frequency_penalty"):
        _greedy(1, frequency_penalty=2.5)
    for bad in ({-1: 1.0}, {2: 100.5}, {2: float("nan")}):
        with pytest.raises(GenerationError, match="logit_bias"):
            _greedy(1, logit_bias=bad)


def test_token_logprob_is_the_log_softmax():
    logits = np.array([1.0, 3.0, 2.0, -1.0])
    expected = logits - np.log(np.exp(logits).sum())
    result = token_logprob(logits, 2, 2)
    assert result.logprob == pytest.approx(expected[2])
    assert [i for i, _ in result.top] == [1, 2] and result.top[0][1] == pytest.approx(expected[1])
    assert len(token_logprob(logits, 0, 10).top) == 4 and token_logprob(logits, 0, 0).top == []


def test_cli_serve_runs_until_stopped(tiny_llama, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    with ember_serve(tiny_llama.artifact_dir, key_file, TIMEOUT) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
        assert [model.id for model in client.models.list()] == [tiny_llama.artifact_dir.name]
        reply = client.chat.completions.create(model=tiny_llama.artifact_dir.name, max_tokens=3,
                                               messages=[{"role": "user", "content": "hello"}])
        assert reply.usage.completion_tokens <= 3


def test_cli_serve_refusals(tiny_llama, tmp_path, capsys):
    artifact = str(tiny_llama.artifact_dir)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    busy = socket.create_server(("127.0.0.1", 0))
    cases = [
        (["--api-key-file", str(tmp_path / "missing")], "--api-key-file"),
        (["--api-key-file", str(empty)], "the key is empty"),
        (["--port", str(busy.getsockname()[1])], "cannot listen on 127.0.0.1"),
        (["--host", "no-such-host.invalid"], "--host no-such-host.invalid"),
        (["--port", "70000"], "--port 70000"),
        (["--guesses", "3"], "--guesses: applies only with --speculate or --draft"),
        (["--speculate", "ngram", "--guesses", "0"], "--guesses 0: must be between 1 and 7"),
        (["--draft", str(tmp_path / "no-draft")], str(tmp_path / "no-draft")),
    ]
    try:
        for options, words in cases:
            assert main(["serve", artifact, *options]) == 1, options
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("ember: error: ") and words in err[0], err
    finally:
        busy.close()
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", artifact, "--api-key", "a", "--api-key-file", str(empty)])
    assert exit_info.value.code == 2
    capsys.readouterr()
    for stall in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", artifact, "--max-decode-stall", stall])
        assert exit_info.value.code == 2
        assert f"--max-decode-stall: not a number of seconds >= 0: '{stall}'" in capsys.readouterr().err
    for origin in ("localhost:3000", "http://localhost:3000/", "http://a.test/chat", "ftp://a.test"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", artifact, "--allow-origin", origin])
        assert exit_info.value.code == 2
        assert "--allow-origin: not a web origin (scheme://host[:port]" in capsys.readouterr().err


def test_cli_serve_refuses_cluster_options_without_ray(tiny_llama, monkeypatch, capsys):
    """--replicas and --no-prefix-routing mean something only with --ray: without it each is one line naming the
    option, exit 1, nothing served."""
    from ember.serving import server as server_module

    monkeypatch.setattr(server_module.Server, "run", lambda server: None)  # were it served: return at once
    for option in (["--replicas", "2"], ["--no-prefix-routing"]):
        assert main(["serve", str(tiny_llama.artifact_dir), "--port", "0", *option]) == 1, option
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"ember: error: {option[0]}: applies only with --ray"], err


def test_cli_serve_max_decode_stall_reaches_the_scheduler(tiny_llama, monkeypatch, capsys):
    """`--max-decode-stall` is the scheduler's bound, and without it the scheduler's default, which the help names."""
    from ember.serving import batch_policy
    from ember.serving import server as server_module

    seen = []
    # In place of serving until Ctrl-C: note the bound, return (and the server shuts down).
    monkeypatch.setattr(server_module.Server, "run", lambda server: seen.append(server.scheduler.max_decode_stall))
    for options, expected in (([], batch_policy.DEFAULT_MAX_DECODE_STALL), (["--max-decode-stall", "0.25"], 0.25),
                              (["--max-decode-stall", "inf"], math.inf)):
        assert main(["serve", str(tiny_llama.artifact_dir), "--port", "0", *options]) == 0
        assert seen.pop() == expected
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default {batch_policy.DEFAULT_MAX_DECODE_STALL:g})" in help_text


def test_cli_serve_warns_when_strangers_can_use_the_model(tiny_llama, monkeypatch, capsys):
    from ember.serving import server as server_module

    listen = server_module.listen
    # The server listens on loopback whatever --host says (tests never listen elsewhere), and returns at once.
    monkeypatch.setattr(server_module, "listen", lambda host, port: listen("127.0.0.1", port))
    monkeypatch.setattr(server_module.Server, "run", lambda server: None)
    artifact = str(tiny_llama.artifact_dir)
    cases = [
        ([], []),
        (["--allow-origin", "http://localhost:3000"], []),
        (["--host", "0.0.0.0", "--allow-origin", "*"],
         ["ember: warning: --host 0.0.0.0 without --api-key: anyone who can reach this machine can use the model",
          "ember: warning: --allow-origin '*' without --api-key: any web page opened on this machine can use the "
          "model"]),
        (["--host", "0.0.0.0", "--allow-origin", "*", "--api-key", "k"], []),
    ]
    for options, warnings in cases:
        assert main(["serve", artifact, "--port", "0", *options]) == 0
        lines = capsys.readouterr().err.strip().splitlines()
        assert re.fullmatch(r"ember: serving \S+ at http://127\.0\.0\.1:\d+/v1, chat page at "
                            r"http://127\.0\.0\.1:\d+/ \(Ctrl-C stops\)", lines[0]), lines[0]
        assert lines[1:] == warnings, options


@pytest.mark.parametrize("missing", [("fastapi",), ("fastapi", "pydantic", "pydantic_core")])  # pydantic: a bare venv
def test_runtime_imports_without_the_serve_extra(missing):
    hidden = "; ".join(f"sys.modules[{name!r}] = None" for name in missing)
    code = (f"import sys; {hidden}; import ember.runtime; "
            "from ember.serving import Scheduler\n"
            "try:\n import ember.serving.server\nexcept ember.core.errors.EmberError as err: print(err)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert "pip install 'ember[serve]'" in result.stdout


def test_connections_send_each_chunk_at_once():
    """The server's connections have Nagle's algorithm off (TCP_NODELAY), as asyncio sets it on sockets it
    accepts from a TCP listener: with it on, every streamed token after a response's first write waited for
    the client's delayed ACK on a kept-alive connection (~40 ms a token with the `openai` client)."""
    from ember.serving.server import listen

    async def accept_one() -> int:
        listener = listen("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                  socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accept_one()) != 0


def test_bench_client_reads_streams_as_the_openai_client_does(demo):
    """scripts/sse_client.py, `bench_serve.py`'s lean load generator, against the official client on one server:
    the same chunks' texts and usage; an error answer raises with its status and OpenAI-shaped body; a stream left
    early is cancelled on the server and its pages freed; the pool's connection serves request after request."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import sse_client

    ids = prompt_ids(12, seed=3)
    body = {"model": demo.name, "prompt": ids, "max_tokens": 16, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    expected = list(demo.client.completions.create(**body))
    theirs = [chunk.choices[0].text for chunk in expected if chunk.choices]

    async def read_all() -> tuple[list[list[str]], list[int], int]:
        pool = sse_client.ConnectionPool(demo.server.host, demo.server.port)
        texts, usages = [], []
        try:
            for _ in range(2):  # the second request on the first one's kept-alive connection
                chunks = [chunk async for chunk in pool.events("/v1/completions", body)]
                texts.append([chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]])
                usages.append(chunks[-1]["usage"]["completion_tokens"])
            with pytest.raises(sse_client.HTTPStatusError) as refused:
                async for _ in pool.events("/v1/completions", {**body, "max_tokens": -1}):
                    pass
            assert json.loads(refused.value.body)["error"]["param"] == "max_tokens"
            events = pool.events("/v1/completions", {**body, "max_tokens": 200, "temperature": 1.0, "seed": 0})
            await events.__anext__()
            await events.aclose()  # leaves mid-stream: the connection closes
            return texts, usages, refused.value.status
        finally:
            await pool.close()

    before = demo.metrics()
    texts, usages, status = asyncio.run(asyncio.wait_for(read_all(), TIMEOUT))
    assert texts == [theirs, theirs] and "".join(theirs)
    assert usages == [expected[-1].usage.completion_tokens] * 2
    assert status == 400
    now = _after_a_cancel(demo, before)
    assert now["ember_running_sequences"] == 0 and now["ember_kv_cache_tokens_used"] == 0
