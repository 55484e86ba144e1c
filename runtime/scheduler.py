"""Continuous batching: many requests served by one engine loop in a background thread.

Requests join and leave between steps. Each step prefills at most one chunk of the
oldest prompt still being read, then decodes every request that has a token to feed
in ONE batched `Engine.decode` call, so a long prompt holds running streams back by
one chunk at most. While other requests decode, that chunk is cut to what the engine
prefills in `max_decode_stall` seconds (at its measured speed, in whole KV pages, at
least one page): prefill costs about the same per token in any chunk of a page or more,
so a 2,000-token prompt arriving mid-stream delays each step of the running streams by
that bound instead of a whole compiled chunk, and its own first token comes a few
decode steps later. With nothing decoding, prompts are read in whole compiled chunks.

A request is admitted (given a sequence) only while the KV cache can hold every
admitted request's prompt plus its `max_new_tokens`: the cache can never fill up under
a running request, and the others wait in the queue, first in first out. A cancelled
request (a client gone) leaves at the next step and its pages are freed.

With the prefix cache (`runtime/prefix_cache.py`, on unless the model has a sliding
window, which TVM cannot fork), a request that ended keeps its sequence as a cache entry,
and a new prompt that starts with tokens a running or cached sequence holds forks its
pages and prefills only the rest. Entries are evicted least recently used first as soon
as a request needs their sequence slot or KV pages, so the cache never makes a request
wait; admission counts their pages as the engine does. When only the matched entry stands
in the way, the request takes that entry's sequence over (truncated to the shared prefix).

Sampling, stop tokens and stop strings are `generate.Decoding`'s, the same as a single
`generate()`: a greedy request's text does not depend on what else runs beside it, within
float rounding. Two things change the last bits of logits, never more: a fork (attention
over shared pages is computed in a separate pass and merged, for the forked sequence and
for the one it was forked from, whose pages are split) and a prompt read in shorter chunks
while others decode (attention over its earlier chunks is merged the same way).
With a `speculation` (`ember serve --speculate ngram` or `--draft`), a step in which one
request is decoding and no prompt is being read verifies that request's guessed tokens in one
forward instead (`runtime/speculative.py`), cutting the cache back as each row is sampled;
with more requests decoding, the batched step already reads the weights once for several tokens.
`submit` (async) and `submit_sync` hand out the events of one request; an async caller's event
loop gets the events of a step for all its requests in one callback after the step.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ember.core.errors import GenerationError
from ember.runtime.engine import Engine
from ember.runtime.generate import Decoding, LogitsProcessor
from ember.runtime.prefix_cache import PrefixCache
from ember.runtime.sampling import SamplingParams, TokenLogprob
from ember.runtime.speculative import Speculation

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
# Seconds a prompt's prefill may hold back the running streams' next decode step. Each chunk streams
# every weight once more, so a bound that cuts prompts into small chunks costs throughput: on the
# 1B-shape q4f32 model (Zen 5, 2 threads, `bench_serve`'s 32 requests of 16-128-token prompts at 8
# streams, Python API), 0.05 s cut them into 146 chunks of one or two pages, the prompts took 5.44 s
# of a 12.2 s run and 3.69 s when read whole; 0.1 s: 61 chunks, 4.15 s, a 10.5 s run (1.16x); 0.2 s:
# 35 chunks, 10.0 s. On the ~110M model a 128-token prompt takes 20 ms, under either bound.
DEFAULT_MAX_DECODE_STALL = 0.1
# Seconds; Prometheus-style upper bounds, the last one +Inf.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class QueueFullError(GenerationError):
    """The scheduler's queue of waiting requests is full; try again later."""


@dataclass
class StreamEvent:
    """What one request produced since its previous event; the last event has `finish_reason`."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token of `token_ids` when the request asked for logprobs
    finish_reason: str | None = None  # "stop" or "length" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all tokens generated so far


@dataclass
class Histogram:
    """Counts of observations at or below each bound, Prometheus-style (cumulative when rendered)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Histogram:
        """A snapshot that later observations do not change."""
        return Histogram(self.bounds, list(self.counts), self.total, self.count)


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics."""

    queued: int
    running: int
    kv_tokens_used: int  # in pages held by running sequences
    kv_tokens_free: int  # not held by running sequences: cache entries' pages count as free (evicted on demand)
    kv_tokens_reserved: int  # prompt + max_new_tokens of every admitted request, page-rounded
    finished: dict[str, int]  # requests by how they ended: stop, length, cancelled, error
    prompt_tokens: int  # of requests that ended
    generated_tokens: int
    ttft: Histogram  # seconds from submit to the first token
    tpot: Histogram  # seconds per output token after the first, one observation per request
    prefill_tokens: int  # prompt tokens run through the model (a prefix cache hit skips the rest)
    prefix_cache_hits: int  # requests that forked a cached or running sequence's pages
    prefix_cache_hit_tokens: int  # prompt tokens those requests did not prefill
    prefix_cache_sequences: int  # finished sequences kept as cache entries
    prefix_cache_tokens: int  # in the pages of those entries
    speculative_proposed: int = 0  # guessed tokens checked by verify steps
    speculative_accepted: int = 0  # of those, the ones the model agreed with


# Events held for one event loop: (request, its queue, the event or the error that ends it).
_Outbox = list[tuple["_Request", asyncio.Queue, "StreamEvent | BaseException"]]


def _put_events(batch: _Outbox) -> None:
    for _request, events, item in batch:
        events.put_nowait(item)


class _Request:
    """A request as the engine loop sees it."""

    def __init__(self, prompt_ids: list[int], decoding: Decoding, reserve: int,
                 emit: Callable[[StreamEvent | BaseException], None]) -> None:
        self.prompt_ids = prompt_ids
        self.decoding = decoding
        self.reserve = reserve
        self.emit = emit
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.seq_id: int | None = None
        self.prefilled = 0
        self.pending: int | None = None  # the last sampled token, to feed at the next decode step
        self.cached: int | None = None  # during a verify step, the tokens of its sequence that are checked
        self.sent = 0  # tokens already handed out in events
        self.cancelled = False


class Scheduler:
    """Serves many generation requests over one engine with continuous batching (a background thread)."""

    def __init__(self, engine: Engine, max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int | None = None,
                 prefix_cache: bool = True, max_decode_stall: float = DEFAULT_MAX_DECODE_STALL,
                 speculation: Speculation | None = None) -> None:
        if max_queue < 1:
            raise GenerationError(f"max_queue must be at least 1, got {max_queue}")
        if not max_decode_stall >= 0:
            raise GenerationError(f"max_decode_stall must be a number of seconds >= 0, got {max_decode_stall}")
        self.engine = engine
        self.max_queue = max_queue
        self.prefill_chunk = min(prefill_chunk or engine.prefill_chunk, engine.prefill_chunk)
        self.max_decode_stall = max_decode_stall
        self.speculation = speculation
        self._prefill_seconds_per_token: float | None = None  # measured on the chunks read so far
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # oldest first; only the engine thread changes it
        self._reserved = 0
        self._kv_used = 0
        self._finished: Counter[str] = Counter()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._ttft = Histogram(TTFT_BUCKETS)
        self._tpot = Histogram(TPOT_BUCKETS)
        # A shared prefix shorter than a page saves less prefill than the fork costs.
        self._prefix = PrefixCache(engine.page_size) if prefix_cache and not engine.sliding_window else None
        self._cached_tokens = 0  # page-rounded lengths of the cache entries
        self._prefill_tokens = 0
        self._prefix_hits = 0
        self._prefix_hit_tokens = 0
        self._closed = False
        # Events of async requests for each caller's event loop, sent once per step (engine thread only).
        self._outbox: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self._thread = threading.Thread(target=self._loop, name="ember-scheduler", daemon=True)
        self._thread.start()

    async def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
                     logits_processor: LogitsProcessor | None = None) -> TokenStream:
        """Queue a request; iterate the returned stream for its events. Raises `GenerationError`
        for a request that can never run, `QueueFullError` when the queue is full."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()

        def emit(item: StreamEvent | BaseException) -> None:
            # Held until the engine thread's step ends (`_deliver_events`): one wake-up of the caller's
            # event loop for the whole batch's events, not one per request.
            self._outbox.setdefault(loop, []).append((request, events, item))

        request = self._enqueue(prompt_ids, params, logits_processor, emit)
        return TokenStream(self, request, events)

    def submit_sync(self, prompt_ids: Sequence[int], params: SamplingParams,
                    logits_processor: LogitsProcessor | None = None) -> Iterator[StreamEvent]:
        """`submit` for synchronous code: queue the request now, iterate for its events
        (closing the iterator early cancels the request)."""
        events: queue.SimpleQueue[StreamEvent | BaseException] = queue.SimpleQueue()
        request = self._enqueue(prompt_ids, params, logits_processor, events.put)

        def iterate() -> Iterator[StreamEvent]:
            try:
                while True:
                    item = events.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finish_reason is not None:
                        return
            finally:
                self.cancel(request)

        return iterate()

    def cancel(self, request: _Request) -> None:
        """Stop a request; its sequence is freed before the next engine step."""
        with self._cond:
            if request.cancelled:
                return
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self._finished["cancelled"] += 1
            self._cond.notify()

    def stats(self) -> SchedulerStats:
        """Queue, batch, KV cache and latency figures now."""
        with self._cond:
            return SchedulerStats(
                queued=len(self._waiting), running=len(self._running), kv_tokens_used=self._kv_used,
                kv_tokens_free=self.engine.kv_capacity - self._kv_used, kv_tokens_reserved=self._reserved,
                finished=dict(self._finished), prompt_tokens=self._prompt_tokens,
                generated_tokens=self._generated_tokens, ttft=self._ttft.copy(), tpot=self._tpot.copy(),
                prefill_tokens=self._prefill_tokens, prefix_cache_hits=self._prefix_hits,
                prefix_cache_hit_tokens=self._prefix_hit_tokens,
                prefix_cache_sequences=len(self._prefix.finished()) if self._prefix else 0,
                prefix_cache_tokens=self._cached_tokens,
                speculative_proposed=self.speculation.stats.proposed if self.speculation else 0,
                speculative_accepted=self.speculation.stats.accepted if self.speculation else 0,
            )

    def close(self) -> None:
        """Stop the engine loop; requests still queued or running end with an error."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _enqueue(self, prompt_ids: Sequence[int], params: SamplingParams, logits_processor: LogitsProcessor | None,
                 emit: Callable[[StreamEvent | BaseException], None]) -> _Request:
        engine = self.engine
        prompt = [int(token) for token in prompt_ids]
        if not prompt:
            raise GenerationError("the prompt is empty: it needs at least one token")
        if min(prompt) < 0 or max(prompt) >= engine.vocab_size:
            raise GenerationError(f"prompt token ids must be in [0, {engine.vocab_size})")
        if len(prompt) > engine.context_window:
            raise GenerationError(f"the prompt is {len(prompt)} tokens, more than the context window of "
                                  f"{engine.context_window} tokens")
        decoding = Decoding(engine, prompt, params, logits_processor)
        reserve = self._pages(min(len(prompt) + params.max_new_tokens, engine.context_window))
        if reserve > engine.kv_capacity:
            raise GenerationError(f"the prompt and max_new_tokens need {reserve} KV cache tokens; the cache holds "
                                  f"{engine.kv_capacity}")
        request = _Request(prompt, decoding, reserve, emit)
        with self._cond:
            if self._closed:
                raise GenerationError("the scheduler is closed")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (--max-queue "
                                     f"{self.max_queue}); try again later")
            self._waiting.append(request)
            self._cond.notify()
        return request

    def _pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole KV pages, as the engine allocates them."""
        page = self.engine.page_size
        return -(-tokens // page) * page

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._running:
                    self._cond.wait()
                if self._closed:
                    break
                cancelled = [request for request in self._running if request.cancelled]
                self._admit()
            for request in cancelled:
                self._end(request, "cancelled")
            try:
                self._step()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # a bug, not a request's fault (a Rust panic included): fail the batch
                log.exception("scheduler step failed")
                for request in list(self._running):
                    self._end(request, "error", err)
            self._deliver_events()
            used = self._kv_tokens_used()
            with self._cond:
                self._kv_used = used
        shutdown = GenerationError("the server is shutting down")
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting + list(self._running):
            self._end(request, "error", shutdown)
        self._deliver_events()
        with self._cond:  # the engine may outlive the scheduler: give its sequence slots back
            for seq_id in self._prefix.finished() if self._prefix else ():
                self._evict(seq_id)

    def _deliver_events(self) -> None:
        """Hand each event loop the events its requests got since the last call, in one callback.
        Measured at 8 streams (~110M q4f32, Zen 5): a wake-up per event took 6% of the engine thread."""
        outbox, self._outbox = self._outbox, {}
        for loop, batch in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_events, batch)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                for request, _events, _item in batch:
                    request.cancelled = True

    def _admit(self) -> None:
        """Give sequences to waiting requests, oldest first, while the batch and the KV cache have room
        (called with the lock held). Cache entries are evicted for them, and never make them wait."""
        engine = self.engine
        while self._waiting and len(self._running) < engine.max_batch:
            request = self._waiting[0]
            if self._reserved + request.reserve > engine.kv_capacity:
                break
            self._waiting.popleft()
            parent, length = self._prefix.match(request.prompt_ids) if self._prefix else (None, 0)
            if parent is not None and self._prefix.is_finished(parent) and not self._fits(request.reserve, parent):
                self._prefix.remove(parent)
                self._cached_tokens -= self._pages(engine.length(parent))
                engine.truncate(parent, length)
                request.seq_id = parent
            self._evict_for(request.reserve, keep=parent)
            if request.seq_id is None:
                request.seq_id = engine.add_sequence() if parent is None else engine.fork_sequence(parent, length)
            if parent is not None:
                request.prefilled = length
                self._prefix_hits += 1
                self._prefix_hit_tokens += length
            if self._prefix:
                self._prefix.add(request.seq_id, request.prompt_ids[:length])
            self._reserved += request.reserve
            self._running.append(request)

    def _fits(self, reserve: int, keep: int) -> bool:
        """Whether a new sequence reserving `reserve` KV tokens fits beside the running ones and the cache
        entry `keep` once every other entry is evicted (lock held)."""
        return (len(self._running) + 2 <= self.engine.max_batch and
                self._reserved + self._pages(self.engine.length(keep)) + reserve <= self.engine.kv_capacity)

    def _evict_for(self, reserve: int, keep: int | None) -> None:
        """Evict cache entries other than `keep`, least recently used first, until a new sequence reserving
        `reserve` KV tokens fits (lock held; the caller checked that it can)."""
        entries = self._prefix.finished() if self._prefix else []
        for seq_id in entries:
            if (len(self._running) + len(self._prefix.finished()) < self.engine.max_batch and
                    self._reserved + self._cached_tokens + reserve <= self.engine.kv_capacity):
                return
            if seq_id != keep:
                self._evict(seq_id)

    def _evict(self, seq_id: int) -> None:
        """Free a cache entry's sequence (lock held)."""
        self._cached_tokens -= self._pages(self.engine.length(seq_id))
        self._prefix.remove(seq_id)
        self.engine.remove_sequence(seq_id)

    def _step(self) -> None:
        """One chunk of the oldest unread prompt, then one batched decode of every request with a token."""
        live = [request for request in self._running if not request.cancelled]
        reading = [request for request in live if request.prefilled < len(request.prompt_ids)]
        if reading:
            request = reading[0]
            size = self._chunk_size(decoding=any(other.pending is not None for other in live))
            chunk = request.prompt_ids[request.prefilled: request.prefilled + size]
            start = time.perf_counter()
            try:
                logits = self.engine.prefill(request.seq_id, chunk)
            except Exception as err:
                self._end(request, "error", err)
            else:
                self._measure_prefill(len(chunk), time.perf_counter() - start)
                with self._cond:
                    self._prefill_tokens += len(chunk)
                    if self._prefix:
                        self._prefix.extend(request.seq_id, chunk)
                request.prefilled += len(chunk)
                if request.prefilled == len(request.prompt_ids):
                    self._advance(request, logits)
        batch = [request for request in live if request.pending is not None]
        if len(batch) == 1 and not reading and self.speculation is not None and self._verify(batch[0]):
            return
        if batch:
            fed = [request.pending for request in batch]
            rows = self.engine.decode([request.seq_id for request in batch], fed)
            for request, token in zip(batch, fed):
                if self._prefix:
                    self._prefix.extend(request.seq_id, [token])
            for request, row in zip(batch, rows):
                self._advance(request, row)

    def _verify(self, request: _Request) -> bool:
        """A speculative step for `request`: its pending token and the proposer's guesses in one forward,
        each row sampled in turn until one disagrees. False if there was nothing to guess (decode it)."""
        decoding, engine, seq_id = request.decoding, self.engine, request.seq_id
        guesses = self.speculation.guess(decoding, engine.context_window - engine.length(seq_id))
        if not guesses:
            return False
        start, fed = engine.length(seq_id), [request.pending, *guesses]
        rows = engine.verify(seq_id, fed)
        accepted = 0
        for position, row in enumerate(rows):
            # What a plain decode step would have cached by this row (`_end` cuts the cache back to it).
            request.cached = start + position + 1
            if self._prefix:
                with self._cond:
                    self._prefix.extend(seq_id, [fed[position]])
            self._advance(request, row)
            if request.seq_id is None or request.pending is None or position == len(guesses) or \
                    request.pending != guesses[position]:
                break
            accepted += 1
        if request.seq_id is not None:
            engine.truncate(seq_id, request.cached)
        request.cached = None
        with self._cond:
            self.speculation.record(len(guesses), accepted)
        return True

    def _chunk_size(self, decoding: bool) -> int:
        """Prompt tokens to prefill this step: a whole compiled chunk, or while other requests decode,
        the whole KV pages the engine reads in `max_decode_stall` seconds (one page until it is timed)."""
        if not decoding:
            return self.prefill_chunk
        page = self.engine.page_size
        rate = self._prefill_seconds_per_token
        if rate is None:  # not timed yet: a page, unless the stall is unbounded
            tokens = self.prefill_chunk if math.isinf(self.max_decode_stall) else page
        else:
            tokens = min(self.max_decode_stall / rate, self.prefill_chunk)
        return min(max(int(tokens) // page, 1) * page, self.prefill_chunk)

    def _measure_prefill(self, tokens: int, seconds: float) -> None:
        """Fold one chunk's prefill time into the running seconds-per-token figure (chunks shorter than a
        page, mostly fixed cost, would overstate it)."""
        if tokens < self.engine.page_size:
            return
        rate, previous = seconds / tokens, self._prefill_seconds_per_token
        self._prefill_seconds_per_token = rate if previous is None else (previous + rate) / 2

    def _advance(self, request: _Request, logits: np.ndarray) -> None:
        """Sample a request's next token from `logits` and hand out what it produced."""
        decoding = request.decoding
        try:
            token = decoding.step(logits)
            if token is not None and not decoding.finished and \
                    self.engine.length(request.seq_id) + 1 > self.engine.context_window:
                decoding.out_of_room()
            text = decoding.text() if decoding.tokenizer is not None else ""
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a logits processor's or the tokenizer's failure, a Rust panic (a
            # BaseException) included, ends this request only: the scheduler's thread goes on
            self._end(request, "error", err)
            return
        request.pending = None if decoding.finished else token
        now = time.monotonic()
        if request.first_token is None:
            request.first_token = now
            with self._cond:
                self._ttft.observe(now - request.submitted)
        new = decoding.token_ids[request.sent:]
        logprobs = decoding.logprobs[request.sent:]
        request.sent = len(decoding.token_ids)
        if decoding.finished:
            self._end(request, decoding.stats.finish_reason, StreamEvent(text, new, logprobs))
        elif text or new:
            request.emit(StreamEvent(text, new, logprobs, prompt_tokens=len(request.prompt_ids),
                                     completion_tokens=len(decoding.token_ids)))

    def _end(self, request: _Request, how: str, last: StreamEvent | BaseException | None = None) -> None:
        """Free a running request's sequence, or keep it as a prefix cache entry if the request ran to
        its end, and count it; `last` is its final event or error."""
        generated = len(request.decoding.token_ids)
        if request.seq_id is not None and request.cached is not None:  # ended inside a verify step
            self.engine.truncate(request.seq_id, request.cached)
        with self._cond:
            if request.seq_id is not None:
                if self._prefix and how in ("stop", "length") and self.engine.length(request.seq_id):
                    self._prefix.finish(request.seq_id)
                    self._cached_tokens += self._pages(self.engine.length(request.seq_id))
                else:  # an error may have left it half-written; a client gone wants its pages back at once
                    if self._prefix:
                        self._prefix.remove(request.seq_id)
                    self.engine.remove_sequence(request.seq_id)
                request.seq_id = None
            if request in self._running:
                self._running.remove(request)
                self._reserved -= request.reserve
            self._finished[how] += 1
            self._prompt_tokens += len(request.prompt_ids)
            self._generated_tokens += generated
            if how in ("stop", "length") and generated > 1:
                self._tpot.observe((time.monotonic() - request.first_token) / (generated - 1))
            self._kv_used = self._kv_tokens_used()
        if isinstance(last, StreamEvent):
            last.finish_reason = how
            last.prompt_tokens, last.completion_tokens = len(request.prompt_ids), generated
        if last is not None and not request.cancelled:
            request.emit(last)

    def _kv_tokens_used(self) -> int:
        """KV cache tokens in the pages of running sequences (engine thread only)."""
        return sum(self._pages(self.engine.length(request.seq_id))
                   for request in self._running if request.seq_id is not None)


class TokenStream:
    """The events of one submitted request, as an async iterator; `cancel()` frees its sequence."""

    def __init__(self, scheduler: Scheduler, request: _Request,
                 events: asyncio.Queue[StreamEvent | BaseException]) -> None:
        self._scheduler = scheduler
        self._request = request
        self._events = events
        self._done = False

    @property
    def prompt_tokens(self) -> int:
        """Length of the request's prompt."""
        return len(self._request.prompt_ids)

    def cancel(self) -> None:
        """Stop the request (a client that went away); harmless once it has ended."""
        self._scheduler.cancel(self._request)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item
