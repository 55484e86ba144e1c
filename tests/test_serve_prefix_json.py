"""`ember serve`'s prefix cache and constrained JSON output, on the tiny llama (context 256, pages of
16 tokens, max_batch 4, random weights; the served cache hit on a 300-token system prompt runs on its
1024-token-context twin, `tiny_llama_long`).

The prefix cache forks TVM's paged KV sequences: the first tests hold TVM's fork to what the
cache relies on (a fork at any position, mid-page or at the parent's end, while the parent
keeps decoding). Outputs served from the cache are compared with `generate()` on a separate
engine. JSON output comes from random weights: only the token mask makes it valid.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from helpers import prompt_ids
from test_serve import TIMEOUT, Served, _reference

from ember.runtime import Engine, SamplingParams, generate
from ember.serving import Scheduler
from ember.serving.prefix_cache import PrefixCache

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SYSTEM = prompt_ids(150, seed=3)  # a shared "system prompt" of 150 tokens (the context is 256)
LONG_SYSTEM = prompt_ids(300, seed=3)  # the served one's, on the tiny llama with a 1024-token context


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop_token_ids=())


def _solo_logits(artifact, ids: list[int]) -> np.ndarray:
    engine = Engine(artifact)
    return engine.prefill(engine.add_sequence(), ids)


@pytest.mark.parametrize("parent_length, fork_at", [(150, 16), (150, 37), (150, 64), (150, 150), (144, 144)],
                         ids=["page-aligned", "mid-page", "chunk-aligned", "parent's end mid-page",
                              "parent's end on a page boundary"])
def test_a_fork_shares_the_prefix_while_the_parent_keeps_decoding(tiny_llama, parent_length, fork_at):
    """TVM shares the whole pages before the fork point, copies a partly shared page, and gives the
    parent a block of its own to append to: parent and child then decode in one batch, each as if alone."""
    artifact = tiny_llama.artifact
    parent_ids = prompt_ids(parent_length, seed=1)
    child_ids = parent_ids[:fork_at] + prompt_ids(30, seed=2)[1:]
    engine = Engine(artifact)
    parent = engine.add_sequence()
    engine.prefill(parent, parent_ids)
    child = engine.fork_sequence(parent, fork_at)
    grandchild = engine.fork_sequence(child, fork_at)
    child_logits = engine.prefill(child, child_ids[fork_at:])
    rows = engine.decode([parent, child, grandchild], [5, 6, 7])
    expected = {
        "child prefill": (child_logits, _solo_logits(artifact, child_ids)),
        "parent decode": (rows[0], _solo_logits(artifact, parent_ids + [5])),
        "child decode": (rows[1], _solo_logits(artifact, child_ids + [6])),
        "grandchild decode": (rows[2], _solo_logits(artifact, parent_ids[:fork_at] + [7])),
    }
    for what, (got, solo) in expected.items():
        np.testing.assert_allclose(got, solo, atol=1e-4, err_msg=what)
        assert got.argmax() == solo.argmax(), what
    assert engine.length(parent) == parent_length + 1 and engine.length(child) == len(child_ids) + 1


def test_prefix_cache_matches_the_longest_prefix_and_keeps_lru_order():
    cache = PrefixCache(min_prefix=4)
    cache.add(10, [1, 2, 3, 4, 5, 6])
    cache.add(11, [1, 2, 3, 4, 5, 9, 9, 9])
    cache.add(12, [1, 2, 3])
    for seq_id in (10, 11, 12):
        cache.finish(seq_id)
    assert cache.match([1, 2, 3, 4, 5, 9, 9, 9, 0]) == (11, 8)
    assert cache.match([1, 2, 3, 4, 5, 9, 9, 9]) == (11, 7)  # the last prompt token is always prefilled
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == (10, 6)
    assert cache.match([1, 2, 3, 7, 7]) == (None, 0)  # 3 shared tokens: under min_prefix
    assert cache.finished() == [12, 11, 10]  # a match makes an entry the most recently used
    cache.add(13, [1, 2, 3, 4, 5, 6, 7])  # a running sequence matches too
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (13, 7) and not cache.is_finished(13)
    cache.remove(11)
    assert cache.match([1, 2, 3, 4, 5, 9, 9, 9, 0]) == (10, 5)


def _run(scheduler, ids, max_tokens):
    return [t for event in scheduler.submit_sync(ids, _greedy(max_tokens)) for t in event.token_ids]


def _solo(artifact, ids, max_tokens):
    return list(generate(Engine(artifact), ids, _greedy(max_tokens)).tokens())


@pytest.mark.parametrize("cache", [True, False], ids=["prefix cache", "no prefix cache"])
def test_scheduler_prefills_only_what_follows_a_cached_prefix(tiny_llama, cache):
    first, second = SYSTEM + prompt_ids(20, seed=4)[1:], SYSTEM + prompt_ids(30, seed=5)[1:]
    with Scheduler(Engine(tiny_llama.artifact), prefix_cache=cache) as scheduler:
        assert _run(scheduler, first, 20) == _solo(tiny_llama.artifact, first, 20)
        assert _run(scheduler, second, 20) == _solo(tiny_llama.artifact, second, 20)
        stats = scheduler.stats()
    hit = len(SYSTEM) if cache else 0
    assert (stats.prefix_cache_hits, stats.prefix_cache_hit_tokens) == (int(cache), hit)
    assert stats.prefill_tokens == len(first) + len(second) - hit
    assert stats.prefix_cache_sequences == (2 if cache else 0)
    # Each entry holds its prompt and the generated tokens but the last (never fed), in whole pages.
    assert stats.prefix_cache_tokens == (sum(-(-(len(ids) + 19) // 16) * 16 for ids in (first, second))
                                         if cache else 0)


def test_cache_entries_are_evicted_lru_when_a_request_needs_their_slot(tiny_llama):
    """max_batch 4: four finished requests fill every sequence slot; a fifth evicts the least recently
    used entry, a hit evicts the next one (never the entry it forks), and a later request for an
    evicted prefix misses."""
    prompts = [prompt_ids(40, seed=10 + i) for i in range(5)]
    with Scheduler(Engine(tiny_llama.artifact)) as scheduler:
        for ids in prompts:  # prompts[0]'s entry goes for prompts[4]
            _run(scheduler, ids, 4)
        assert scheduler.stats().prefix_cache_sequences == 4
        hit = prompts[2] + [7, 8, 9]
        assert _run(scheduler, hit, 6) == _solo(tiny_llama.artifact, hit, 6)  # evicts prompts[1]'s entry
        for ids in (prompts[0], prompts[1]):
            _run(scheduler, ids + [7, 8], 4)
        stats = scheduler.stats()
    # 40 prompt tokens, or more if the entry's first generated tokens happen to be 7, 8.
    assert stats.prefix_cache_hits == 1 and stats.prefix_cache_hit_tokens >= 40


def test_a_request_takes_over_the_entry_when_the_kv_cache_holds_only_one_of_them(tiny_llama):
    """A KV cache of one context (256 tokens): the entry (176 tokens) and a request reserving a whole
    context cannot both be there, so the request continues the entry's own sequence, cut to the
    shared prefix; the outputs are still each request's solo run."""
    engine = Engine(tiny_llama.artifact)
    engine.kv_capacity = engine.context_window  # what the scheduler admits by: as if the cache were smaller
    first, second = SYSTEM + [9] * 10, SYSTEM + [11] * 20
    with Scheduler(engine) as scheduler:
        assert _run(scheduler, first, 16) == _solo(tiny_llama.artifact, first, 16)
        assert _run(scheduler, second, 256 - len(second)) == _solo(tiny_llama.artifact, second, 256 - len(second))
        stats = scheduler.stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_hit_tokens, stats.prefix_cache_sequences) == (1, 150, 1)
    assert stats.finished == {"length": 2}


@pytest.fixture(scope="module")
def served(tiny_llama):
    server = Served(tiny_llama.artifact_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def long_served(tiny_llama_long):
    """A server over the tiny llama with a 1024-token context."""
    served = Served(tiny_llama_long.artifact_dir)
    yield served
    served.close()


def _stream_ttft(served, ids, max_tokens):
    """(text, seconds to the first streamed token) of one greedy completion."""
    start, first, pieces = time.perf_counter(), None, []
    for chunk in served.client.completions.create(model=served.name, prompt=ids, max_tokens=max_tokens,
                                                  temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        pieces.extend(c.text for c in chunk.choices)
    return "".join(pieces), first


def test_served_prefix_cache_hit_has_the_solo_output_and_shows_in_metrics(long_served, tiny_llama_long, capsys):
    served, artifact = long_served, tiny_llama_long.artifact
    first, second = LONG_SYSTEM + prompt_ids(40, seed=6)[1:], LONG_SYSTEM + prompt_ids(40, seed=7)[1:]
    before = served.metrics()
    text_first, ttft_first = _stream_ttft(served, first, 24)
    text_second, ttft_second = _stream_ttft(served, second, 24)
    after = served.metrics()
    assert text_first == _reference(artifact, first, 24)[0]
    assert text_second == _reference(artifact, second, 24)[0]

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta("ember_prefix_cache_hits_total") == 1
    assert delta("ember_prefix_cache_hit_tokens_total") == len(LONG_SYSTEM)
    assert delta("ember_prefill_tokens_total") == len(first) + len(second) - len(LONG_SYSTEM)
    assert after["ember_prefix_cache_sequences"] >= 1 and after["ember_prefix_cache_tokens"] > 0
    assert after["ember_running_sequences"] == 0 and after["ember_kv_cache_tokens_used"] == 0
    with capsys.disabled():  # a figure for the log, never an assertion
        print(f"\n  TTFT, tiny llama, {len(first)}-token prompts: miss {ttft_first * 1e3:.2f} ms, "
              f"hit on {len(LONG_SYSTEM)} tokens {ttft_second * 1e3:.2f} ms")


def test_concurrent_streams_sharing_prefixes_match_their_solo_runs(served, tiny_llama):
    """16 streaming clients at once, each prompt one of two 100-token system prompts plus a tail of
    1..60 tokens, max_tokens 1..40: forks from running and cached sequences, each stream its solo run."""
    rng = np.random.default_rng(2)
    systems = [prompt_ids(100, seed=20), prompt_ids(100, seed=21)]
    jobs = []
    for i in range(16):
        ids = systems[i % 2] + prompt_ids(int(rng.integers(2, 62)), seed=30 + i)[1:]
        max_tokens = int(rng.integers(1, 41))
        jobs.append((ids, max_tokens, _reference(tiny_llama.artifact, ids, max_tokens)[0]))
    before = served.metrics()

    async def one(client, ids, max_tokens):
        stream = await client.completions.create(model=served.name, prompt=ids, max_tokens=max_tokens,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    results = served.concurrently(one, jobs)
    for (ids, max_tokens, expected), text in zip(jobs, results):
        assert text == expected, f"prompt of {len(ids)} tokens, max_tokens {max_tokens}"
    after = served.metrics()
    assert after["ember_prefix_cache_hits_total"] - before["ember_prefix_cache_hits_total"] >= 8
    assert after["ember_running_sequences"] == 0 and after["ember_kv_cache_tokens_used"] == 0


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def test_json_schema_output_always_validates(served):
    """20 chat requests at once, greedy and sampled: every reply parses and matches the schema, and
    ends because the JSON is complete (the schema bounds it well within max_tokens)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def one(client, i):
        return await client.chat.completions.create(
            model=served.name, messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            response_format=response_format, max_tokens=180, temperature=0 if i % 4 == 0 else 1.0, seed=i)

    async def run_all():
        client = served.async_client()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(20))), TIMEOUT)
        finally:
            await client.close()

    for reply in asyncio.run(run_all()):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_output_streamed(served):
    chunks = served.client.completions.create(model=served.name, prompt="A JSON object:", max_tokens=200,
                                              temperature=0, stream=True,
                                              extra_body={"response_format": {"type": "json_object"}})
    pieces, finish = [], None
    for chunk in chunks:
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and isinstance(json.loads("".join(pieces)), dict)
