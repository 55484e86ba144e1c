"""The scheduler's loop on an engine without a model (tests/stub_engine.py): the policy's decisions
(tests/test_batch_policy.py) carried out on the engine, each request's tokens and events, cancellation, failures,
and what it refuses. No TVM compile, a few milliseconds a test: each checks the engine calls a step made, or the
pages held, not only tokens.
"""

from __future__ import annotations

import asyncio

import pytest
from stub_engine import StubEngine, expected_tokens

from ember.core.errors import GenerationError
from ember.runtime.sampling import SamplingParams
from ember.serving.scheduler import QueueFullError, Scheduler


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=tokens, stop_token_ids=())


def _tokens(events) -> list[int]:
    return [token for event in events for token in event.token_ids]


def _prompt(length: int, start: int = 1) -> list[int]:
    return [(start + i) % 60 + 1 for i in range(length)]


def test_tokens_do_not_depend_on_what_runs_beside_them():
    """Four requests at once, each a different prompt: each gets exactly the tokens it gets alone."""
    engine = StubEngine()
    prompts = [_prompt(5 + i, start=i * 11) for i in range(4)]
    with Scheduler(engine, prefix_cache=False) as scheduler:
        engine.released.clear()  # all four queued before any forward ends, so they decode in one batch
        streams = [scheduler.submit_sync(p, _greedy(12)) for p in prompts]
        engine.released.set()
        results = [_tokens(stream) for stream in streams]
    assert results == [expected_tokens(p, 12) for p in prompts]
    assert any(call.entry == "decode" and len(call.seq_ids) > 1 for call in engine.calls), "never batched"


def test_admission_waits_for_pages_first_in_first_out():
    """A cache of 4 pages of 16 tokens holds two requests of 20 prompt + 12 new tokens (2 pages each): the third
    and fourth wait, and are admitted in arrival order as the first two finish; the cache never overfills."""
    engine = StubEngine(max_batch=4, kv_capacity=64, page_size=16)
    with Scheduler(engine, prefix_cache=False) as scheduler:
        streams = [scheduler.submit_sync(_prompt(20, start=i), _greedy(12)) for i in range(4)]
        results = [_tokens(stream) for stream in streams]
    assert results == [expected_tokens(_prompt(20, start=i), 12) for i in range(4)]
    prefills = [call.seq_ids[0] for call in engine.calls if call.entry == "prefill"]
    first_prefill = {seq: prefills.index(seq) for seq in set(prefills)}
    assert sorted(first_prefill, key=first_prefill.get) == sorted(first_prefill)  # sequences started in order
    decodes_before_third = [call for call in engine.calls[:engine.calls.index(
        next(call for call in engine.calls if call.entry == "prefill" and call.seq_ids[0] == 2))]
        if call.entry == "decode"]
    assert len(decodes_before_third) >= 11, "the third request started before the first two could finish"


def test_a_request_that_can_never_fit_is_refused_not_queued():
    engine = StubEngine(kv_capacity=64, context_window=128)
    with Scheduler(engine) as scheduler, pytest.raises(GenerationError):
        list(scheduler.submit_sync(_prompt(60), _greedy(60)))


def test_a_full_queue_refuses_with_queue_full():
    engine = StubEngine(max_batch=1, kv_capacity=64)
    with Scheduler(engine, max_queue=1, prefix_cache=False) as scheduler:
        async def burst():
            streams = [await scheduler.submit(_prompt(10, start=i), _greedy(40)) for i in range(3)]
            return streams

        with pytest.raises(QueueFullError):
            asyncio.run(burst())


def test_n_choices_read_the_prompt_once_and_fork_it():
    """A request for 3 choices prefills its prompt once; the two other choices fork its pages."""
    engine = StubEngine()
    with Scheduler(engine, prefix_cache=False) as scheduler:
        async def run():
            stream = await scheduler.submit(_prompt(24), _greedy(6), n=3)
            return [event async for event in stream]

        events = asyncio.run(run())
    assert sorted({event.index for event in events}) == [0, 1, 2]
    for index in range(3):
        assert _tokens(e for e in events if e.index == index) == expected_tokens(_prompt(24), 6)
    assert sum(sum(call.counts) for call in engine.calls if call.entry == "prefill") == 24
    assert [length for _, length in engine.forks] == [24, 24]


def test_a_prompt_that_starts_as_a_finished_one_prefills_only_the_rest():
    """Prefix reuse: the second request's first 32 tokens (two pages) are the first's; it forks them from the
    cache entry the first left and prefills its own 5."""
    engine = StubEngine()
    shared = _prompt(32)
    with Scheduler(engine) as scheduler:
        assert _tokens(scheduler.submit_sync(shared + [7, 8, 9], _greedy(4))) == expected_tokens(shared + [7, 8, 9], 4)
        before = len(engine.calls)
        second = shared + [20, 21, 22, 23, 24]
        assert _tokens(scheduler.submit_sync(second, _greedy(4))) == expected_tokens(second, 4)
        stats = scheduler.stats()
    prefilled = sum(sum(call.counts) for call in engine.calls[before:] if call.entry == "prefill")
    assert prefilled == 5 and engine.forks[-1][1] == 32
    assert stats.prefix_cache_hits == 1 and stats.prefix_cache_hit_tokens == 32


def test_cache_entries_are_evicted_for_a_request_never_waited_for():
    """Finished requests fill every sequence slot and most pages as cache entries; a new request with another
    prompt evicts them (oldest first) at once and runs."""
    engine = StubEngine(max_batch=2, kv_capacity=96, page_size=16)
    with Scheduler(engine) as scheduler:
        for start in (1, 20):
            list(scheduler.submit_sync(_prompt(30, start=start), _greedy(2)))
        assert scheduler.stats().prefix_cache_sequences == 2
        fresh = _prompt(40, start=40)
        assert _tokens(scheduler.submit_sync(fresh, _greedy(8))) == expected_tokens(fresh, 8)
    assert engine.removed[:1] == [0], engine.removed  # the least recently used entry went first


def test_a_long_prompt_arriving_mid_stream_is_read_a_chunk_per_step():
    """While a stream decodes, a 100-token prompt is read at most one chunk (32) per step, each step still
    decoding the stream: it never waits for the whole prompt."""
    engine = StubEngine(prefill_chunk=32, context_window=256, kv_capacity=512, step_seconds=0.002)
    with Scheduler(engine, prefix_cache=False, max_decode_stall=10.0) as scheduler:
        running = scheduler.submit_sync(_prompt(4), _greedy(120))
        first = next(running)  # the stream is decoding
        long = scheduler.submit_sync(_prompt(100, start=5), _greedy(2))
        assert _tokens(long) == expected_tokens(_prompt(100, start=5), 2)
        assert _tokens([first, *running]) == expected_tokens(_prompt(4), 120)
    long_seq = next(call.seq_ids[0] for call in engine.calls if call.entry == "prefill" and sum(call.counts) > 4)
    chunks = [index for index, call in enumerate(engine.calls)
              if call.entry == "prefill" and call.seq_ids[0] == long_seq]
    assert len(chunks) >= 4 and all(engine.calls[i].counts[0] <= 32 for i in chunks)
    for a, b in zip(chunks, chunks[1:]):  # between two chunks of the prompt, the stream decoded
        assert any(call.entry == "decode" for call in engine.calls[a + 1:b]), engine.calls[a:b + 1]


def test_cancelling_a_stream_frees_its_pages_at_the_next_step():
    engine = StubEngine(step_seconds=0.005)  # 60 steps: the stream is still running when its caller leaves
    with Scheduler(engine, prefix_cache=False) as scheduler:
        stream = scheduler.submit_sync(_prompt(40), _greedy(60))
        next(stream)
        stream.close()  # the caller leaves
        for _ in range(200):
            if scheduler.stats().running == 0:
                break
            asyncio.run(asyncio.sleep(0.005))
        stats = scheduler.stats()
    assert stats.running == 0 and stats.kv_tokens_reserved == 0 and stats.finished["cancelled"] == 1
    assert engine.pages_held() == 0


def test_a_request_whose_sequence_cannot_be_made_fails_and_the_next_is_served():
    """The engine raising while a request is admitted (a bug, not the request's fault) fails that request with the
    error, and the scheduler goes on: before, its thread died and every waiting stream hung."""
    engine = StubEngine()
    real_add = engine.add_sequence
    failures = iter([RuntimeError("no slot, by a bug")])

    def add_sequence() -> int:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real_add()

    engine.add_sequence = add_sequence
    with Scheduler(engine) as scheduler:
        with pytest.raises(RuntimeError, match="no slot, by a bug"):
            _tokens(scheduler.submit_sync(_prompt(6), _greedy(3)))
        assert _tokens(scheduler.submit_sync(_prompt(6), _greedy(3))) == expected_tokens(_prompt(6), 3)
