"""Continuous batching: many requests served by one engine loop in a background thread.

Requests join and leave between steps. What runs next is `BatchPolicy`'s decision (serving/batch_policy.py:
first-in-first-out admission within the batch and the KV pages, prefix-cache reuse and eviction, one bounded
prefill chunk and one batched decode a step); this module is the loop that carries it out on the engine,
samples, and hands each request its events. A cancelled request (a client gone) leaves at the next step and
its pages are freed.

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

A request for `n` choices (OpenAI's `n`) is admitted as a group of n sequences: the first reads the
prompt, the others fork its pages once it is read, and each samples its first token from the same
logits with its own generator (choice i of a seeded request: `choice_seed`). Cancelling one cancels all.
`embed` runs `Engine.embed` on this thread between steps, in a sequence slot and KV pages that no
admitted request needs, evicting prefix cache entries as a new request would.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ember.core.errors import GenerationError
from ember.runtime.engine import SequenceEngine
from ember.runtime.generate import Decoding, LogitsProcessor
from ember.runtime.lora import check_adapter_choice
from ember.runtime.sampling import MAX_SEED, SamplingParams, TokenLogprob
from ember.runtime.speculative import Speculation
from ember.serving.batch_policy import DEFAULT_MAX_DECODE_STALL, Admission, BatchPolicy, Limits, PlannedRequest

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
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
    index: int = 0  # the choice it belongs to, of a request for several
    cached_tokens: int = 0  # on the last event: prompt tokens a prefix cache hit did not prefill


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed`: the seed itself for the first (a request for one
    choice answers as the first of several), a distinct one derived from both for the others."""
    if seed is None or index == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**64, index]).generate_state(1, np.uint64)[0]) % MAX_SEED


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
    embedded_tokens: int = 0  # input tokens run through `embed`


# Events held for one event loop: (request, its queue, the event or the error that ends it).
_Outbox = list[tuple["_Request", asyncio.Queue, "StreamEvent | BaseException"]]


def _settle(future: concurrent.futures.Future, outcome: object) -> None:
    """End `future` with `outcome` (an exception, or its result) unless its caller cancelled it meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _put_events(batch: _Outbox) -> None:
    for _request, events, item in batch:
        events.put_nowait(item)


class _Request(PlannedRequest):
    """A request as the engine loop sees it: its scheduling state, decoding and delivery."""

    def __init__(self, prompt_ids: list[int], decoding: Decoding, reserve: int,
                 emit: Callable[[StreamEvent | BaseException], None], index: int = 0,
                 adapter: tuple[str, float] | None = None) -> None:
        super().__init__(prompt_ids, reserve, index, adapter)
        self.decoding = decoding
        self.emit = emit
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.cached: int | None = None  # during a verify step, the tokens of its sequence that are checked
        self.sent = 0  # tokens already handed out in events


@dataclass
class _EmbedJob:
    """Inputs to run through `Engine.embed`, one per engine step; their hidden states go to `future`."""

    inputs: list[list[int]]
    future: concurrent.futures.Future
    outputs: list[np.ndarray] = field(default_factory=list)


class Scheduler:
    """Serves many generation requests over one engine with continuous batching (a background thread)."""

    def __init__(self, engine: SequenceEngine, max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int | None = None,
                 prefix_cache: bool = True, max_decode_stall: float = DEFAULT_MAX_DECODE_STALL,
                 speculation: Speculation | None = None) -> None:
        if max_queue < 1:
            raise GenerationError(f"max_queue must be at least 1, got {max_queue}")
        if not max_decode_stall >= 0:
            raise GenerationError(f"max_decode_stall must be a number of seconds >= 0, got {max_decode_stall}")
        self.engine = engine
        self.max_queue = max_queue
        self.prefill_chunk = min(prefill_chunk or engine.prefill_chunk, engine.prefill_chunk)
        self.speculation = speculation
        # Its queue is shared with callers' threads, the rest is the engine thread's: used with the lock held.
        self._policy: BatchPolicy[_Request] = BatchPolicy(
            Limits(engine.max_batch, engine.kv_capacity, engine.page_size, self.prefill_chunk), prefix_cache,
            max_decode_stall)
        self._cond = threading.Condition()
        self._embedding: deque[_EmbedJob] = deque()
        self._embedded_tokens = 0
        self._kv_used = 0
        self._finished: Counter[str] = Counter()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._ttft = Histogram(TTFT_BUCKETS)
        self._tpot = Histogram(TPOT_BUCKETS)
        self._prefill_tokens = 0
        self._prefix_hits = 0
        self._prefix_hit_tokens = 0
        self._closed = False
        # Events of async requests for each caller's event loop, sent once per step (engine thread only).
        self._outbox: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self._thread = threading.Thread(target=self._loop, name="ember-scheduler", daemon=True)
        self._thread.start()

    @property
    def max_decode_stall(self) -> float:
        """Seconds a prompt's prefill may hold back the running streams' next decode step."""
        return self._policy.max_decode_stall

    async def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
                     logits_processor: LogitsProcessor | Sequence[LogitsProcessor | None] | None = None,
                     n: int = 1, adapter: tuple[str, float] | None = None) -> TokenStream:
        """Queue a request for `n` choices (with n > 1, a logits processor is one per choice), run with the LoRA
        `adapter` (name, scale) the engine loaded, or the base model; iterate the returned stream for the events
        of all. Raises `GenerationError` for a request that can never run, `QueueFullError` when the queue is
        full."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()

        def emit(item: StreamEvent | BaseException) -> None:
            # Held until the engine thread's step ends (`_deliver_events`): one wake-up of the caller's
            # event loop for the whole batch's events, not one per request.
            self._outbox.setdefault(loop, []).append((request, events, item))

        request = self._enqueue(prompt_ids, params, logits_processor, emit, n, adapter)
        return TokenStream(self, request, events)

    def submit_sync(self, prompt_ids: Sequence[int], params: SamplingParams,
                    logits_processor: LogitsProcessor | None = None,
                    adapter: tuple[str, float] | None = None) -> Iterator[StreamEvent]:
        """`submit` for synchronous code: queue the request now, iterate for its events
        (closing the iterator early cancels the request)."""
        events: queue.SimpleQueue[StreamEvent | BaseException] = queue.SimpleQueue()
        request = self._enqueue(prompt_ids, params, logits_processor, events.put, adapter=adapter)

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
        """Stop a request and the other choices of its group; their sequences are freed before the next step."""
        with self._cond:
            leader = request.leader or request
            if leader.cancelled:
                return
            for member in leader.group:
                member.cancelled = True
            if self._policy.withdraw(leader):
                self._finished["cancelled"] += len(leader.group)
            self._cond.notify()

    def embed(self, inputs: Sequence[Sequence[int]]) -> concurrent.futures.Future:
        """Queue token-id inputs for `Engine.embed`; the future's result is their hidden states [n_i, hidden]
        (cancel it to drop the rest). Raises `GenerationError` for an input that can never run."""
        engine = self.engine
        if not engine.has_embeddings:
            raise GenerationError("this artifact has no embed function: recompile it with `ember compile "
                                  "--embeddings`")
        job = _EmbedJob([[int(token) for token in ids] for ids in inputs], concurrent.futures.Future())
        for ids in job.inputs:
            if not ids:
                raise GenerationError("an input is empty: it needs at least one token")
            if min(ids) < 0 or max(ids) >= engine.vocab_size:
                raise GenerationError(f"input token ids must be in [0, {engine.vocab_size})")
            if len(ids) > engine.context_window or self._policy.limits.pages(len(ids)) > engine.kv_capacity:
                raise GenerationError(f"an input is {len(ids)} tokens, more than the context window of "
                                      f"{engine.context_window} tokens")
        with self._cond:
            if self._closed:
                raise GenerationError("the scheduler is closed")
            if len(self._policy.waiting) + len(self._embedding) >= self.max_queue:
                raise QueueFullError(f"{len(self._policy.waiting) + len(self._embedding)} requests are already waiting "
                                     f"(--max-queue {self.max_queue}); try again later")
            self._embedding.append(job)
            self._cond.notify()
        return job.future

    def stats(self) -> SchedulerStats:
        """Queue, batch, KV cache and latency figures now."""
        with self._cond:
            policy = self._policy
            return SchedulerStats(
                queued=len(policy.waiting), running=len(policy.running), kv_tokens_used=self._kv_used,
                kv_tokens_free=self.engine.kv_capacity - self._kv_used, kv_tokens_reserved=policy.reserved,
                finished=dict(self._finished), prompt_tokens=self._prompt_tokens,
                generated_tokens=self._generated_tokens, ttft=self._ttft.copy(), tpot=self._tpot.copy(),
                prefill_tokens=self._prefill_tokens, prefix_cache_hits=self._prefix_hits,
                prefix_cache_hit_tokens=self._prefix_hit_tokens,
                prefix_cache_sequences=len(policy.prefix.finished()) if policy.prefix else 0,
                prefix_cache_tokens=policy.cached_tokens,
                speculative_proposed=self.speculation.stats.proposed if self.speculation else 0,
                speculative_accepted=self.speculation.stats.accepted if self.speculation else 0,
                embedded_tokens=self._embedded_tokens,
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

    def _enqueue(self, prompt_ids: Sequence[int], params: SamplingParams,
                 logits_processor: LogitsProcessor | Sequence[LogitsProcessor | None] | None,
                 emit: Callable[[StreamEvent | BaseException], None], n: int = 1,
                 adapter: tuple[str, float] | None = None) -> _Request:
        engine = self.engine
        prompt = [int(token) for token in prompt_ids]
        if not prompt:
            raise GenerationError("the prompt is empty: it needs at least one token")
        if min(prompt) < 0 or max(prompt) >= engine.vocab_size:
            raise GenerationError(f"prompt token ids must be in [0, {engine.vocab_size})")
        if len(prompt) > engine.context_window:
            raise GenerationError(f"the prompt is {len(prompt)} tokens, more than the context window of "
                                  f"{engine.context_window} tokens")
        processors = self._choice_processors(logits_processor, n)
        if adapter is not None:
            check_adapter_choice(tuple(engine.adapters), *adapter)
        reserve = self._policy.limits.pages(min(len(prompt) + params.max_new_tokens, engine.context_window))
        if reserve * n > engine.kv_capacity:
            raise GenerationError(f"the prompt and max_new_tokens need {reserve * n} KV cache tokens"
                                  f"{f' for {n} choices' if n > 1 else ''}; the cache holds {engine.kv_capacity}")
        request, *followers = [
            _Request(prompt, Decoding(engine, prompt, dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                                      processors[i]), reserve, emit, index=i, adapter=adapter) for i in range(n)]
        request.followers = followers
        for follower in followers:
            follower.leader = request
        with self._cond:
            if self._closed:
                raise GenerationError("the scheduler is closed")
            if len(self._policy.waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._policy.waiting)} requests are already waiting (--max-queue "
                                     f"{self.max_queue}); try again later")
            self._policy.waiting.append(request)
            self._cond.notify()
        return request

    def _choice_processors(self, logits_processor: LogitsProcessor | Sequence[LogitsProcessor | None] | None,
                           n: int) -> list[LogitsProcessor | None]:
        """One logits processor (or None) per choice, once `n` is checked: choices share a prompt's pages."""
        if not 1 <= n <= self.engine.max_batch:
            raise GenerationError(f"n: {n} choices; this artifact decodes at most {self.engine.max_batch} sequences "
                                  "at once (compiled --max-batch)")
        if logits_processor is None or callable(logits_processor):
            if n > 1 and logits_processor is not None:
                raise GenerationError("several choices need one logits processor each")
            return [logits_processor] * n
        if len(logits_processor) != n:
            raise GenerationError(f"{len(logits_processor)} logits processors for {n} choices")
        return list(logits_processor)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._policy.waiting or self._policy.running or self._embedding):
                    self._cond.wait()
                if self._closed:
                    break
                cancelled = [request for request in self._policy.running if request.cancelled]
                self._admit()
                embedding = self._embedding_admitted()
            for request in cancelled:
                self._end(request, "cancelled")
            if embedding is not None:
                self._embed_one(embedding)
            try:
                self._step()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # a bug, not a request's fault (a Rust panic included): fail the batch
                log.exception("scheduler step failed")
                for request in list(self._policy.running):
                    self._end(request, "error", err)
            self._deliver_events()
            used = self._kv_tokens_used()
            with self._cond:
                self._kv_used = used
        shutdown = GenerationError("the server is shutting down")
        with self._cond:
            waiting = self._policy.drain()
            jobs, self._embedding = list(self._embedding), deque()
        for job in jobs:
            _settle(job.future, shutdown)
        for request in waiting + list(self._policy.running):
            self._end(request, "error", shutdown)
        self._deliver_events()
        with self._cond:  # the engine may outlive the scheduler: give its sequence slots back
            for seq_id in self._policy.evict_all():
                self.engine.remove_sequence(seq_id)

    def _embedding_admitted(self) -> _EmbedJob | None:
        """The oldest embedding job, if its next input fits in a sequence slot and KV pages no admitted request
        needs, once cache entries are evicted for it (lock held); cancelled jobs are dropped."""
        if any(job.future.cancelled() for job in self._embedding):
            self._embedding = deque(job for job in self._embedding if not job.future.cancelled())
        if not self._embedding:
            return None
        job = self._embedding[0]
        evicted = self._policy.room_for(len(job.inputs[len(job.outputs)]))
        if evicted is None:
            return None
        for seq_id in evicted:
            self.engine.remove_sequence(seq_id)
        return job

    def _embed_one(self, job: _EmbedJob) -> None:
        """Run a job's next input through `Engine.embed`; the job ends with its last input or a failure."""
        ids, failure = job.inputs[len(job.outputs)], None
        try:
            job.outputs.append(self.engine.embed(ids))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # this job's failure only: the engine removed its temporary sequence
            failure = err
        with self._cond:
            self._embedded_tokens += len(ids)
            ended = failure is not None or len(job.outputs) == len(job.inputs)
            if ended:
                self._embedding.remove(job)
        if ended:
            _settle(job.future, failure if failure is not None else job.outputs)

    def _deliver_events(self) -> None:
        """Hand each event loop the events its requests got since the last call, in one callback.
        A wake-up per event took a measurable share of the engine thread at 8 streams
        (docs/benchmarks.md#schedule-measurements)."""
        outbox, self._outbox = self._outbox, {}
        for loop, batch in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_events, batch)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                for request, _events, _item in batch:
                    request.cancelled = True

    def _admit(self) -> None:
        """Give sequences to the waiting requests the policy admits, oldest first (called with the lock held)."""
        while (admission := self._policy.next_admission()) is not None:
            request = admission.request
            try:
                seq = self._make_sequence(admission)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # a bug, not the request's fault: it fails, the scheduler goes on
                log.exception("admitting a request failed")
                for member in request.group:
                    self._end(member, "error", err)
                continue
            self._policy.started(admission, seq)
            if admission.parent is not None:
                self._prefix_hits += 1
                self._prefix_hit_tokens += admission.shared

    def _make_sequence(self, admission: Admission[_Request]) -> int:
        """Carry out an admission on the engine: free the evicted entries, then take the matched entry over (cut
        to the shared prompt), fork a matching sequence, or add a new one."""
        engine, parent = self.engine, admission.parent
        for seq_id in admission.evicted:
            engine.remove_sequence(seq_id)
        if parent is None:
            seq = engine.add_sequence()
            if admission.request.adapter is not None:  # a fork or a taken-over entry has the parent's already
                engine.set_adapter(seq, *admission.request.adapter)
            return seq
        if admission.take_over:
            engine.truncate(parent, admission.shared)
            return parent
        return engine.fork_sequence(parent, admission.shared)

    def _step(self) -> None:
        """One chunk of the oldest unread prompt, then one batched decode of every request with a token."""
        reading = self._policy.next_prefill()
        if reading:
            request, size = reading
            chunk = request.prompt_ids[request.prefilled: request.prefilled + size]
            start = time.perf_counter()
            try:
                logits = self.engine.prefill(request.seq, chunk)
            except Exception as err:
                for member in request.group:
                    self._end(member, "error", err)
            else:
                self._policy.timed_prefill(len(chunk), time.perf_counter() - start)
                with self._cond:
                    self._prefill_tokens += len(chunk)
                    self._policy.wrote(request.seq, chunk)
                request.prefilled += len(chunk)
                if request.prefilled == len(request.prompt_ids):
                    group = self._fork_followers(request)
                    for member in group:  # each choice samples from the same logits: its own copy
                        self._advance(member, logits.copy() if len(group) > 1 else logits)
        batch = self._policy.decode_batch()
        if len(batch) == 1 and not reading and self.speculation is not None and \
                self._verify(*batch[0], self.speculation):
            return
        if batch:
            rows = self.engine.decode([request.seq for request, _ in batch], [token for _, token in batch])
            with self._cond:
                for request, token in batch:
                    self._policy.wrote(request.seq, [token])
            for (request, _), row in zip(batch, rows):
                self._advance(request, row)

    def _fork_followers(self, request: _Request) -> list[_Request]:
        """Give the other choices of `request`, whose prompt is now read, sequences sharing its pages; the
        choices to sample a first token for (those not cancelled meanwhile)."""
        group = [request]
        for follower in request.followers:
            if follower.cancelled:
                continue
            seq = self.engine.fork_sequence(request.seq)
            with self._cond:
                self._policy.forked(follower, seq)
            group.append(follower)
        return group

    def _verify(self, request: _Request, pending: int, speculation: Speculation) -> bool:
        """A speculative step for `request`: its `pending` token and `speculation`'s guesses in one forward,
        each row sampled in turn until one disagrees. False if there was nothing to guess (decode it)."""
        decoding, engine, seq_id = request.decoding, self.engine, request.seq
        guesses = speculation.guess(decoding, engine.context_window - engine.length(seq_id))
        if not guesses:
            return False
        start, fed = engine.length(seq_id), [pending, *guesses]
        rows = engine.verify(seq_id, fed)
        accepted = 0
        for position, row in enumerate(rows):
            # What a plain decode step would have cached by this row (`_end` cuts the cache back to it).
            request.cached = cached = start + position + 1
            with self._cond:
                self._policy.wrote(seq_id, [fed[position]])
            self._advance(request, row)
            if request.seq_id is None or request.pending is None or position == len(guesses) or \
                    request.pending != guesses[position]:
                break
            accepted += 1
        if request.seq_id is not None:
            engine.truncate(seq_id, cached)
        request.cached = None
        with self._cond:
            speculation.record(len(guesses), accepted)
        return True

    def _advance(self, request: _Request, logits: np.ndarray) -> None:
        """Sample a request's next token from `logits` and hand out what it produced."""
        decoding = request.decoding
        try:
            token = decoding.step(logits)
            if token is not None and not decoding.finished and \
                    self.engine.length(request.seq) + 1 > self.engine.context_window:
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
            self._end(request, decoding.stats.finish_reason, StreamEvent(text, new, logprobs, index=request.index))
        elif text or new:
            request.emit(StreamEvent(text, new, logprobs, prompt_tokens=len(request.prompt_ids),
                                     completion_tokens=len(decoding.token_ids), index=request.index))

    def _end(self, request: _Request, how: str, last: StreamEvent | BaseException | None = None) -> None:
        """Free a running request's sequence, or keep it as a prefix cache entry if the request ran to
        its end, and count it; `last` is its final event or error."""
        generated = len(request.decoding.token_ids)
        if request.seq_id is not None and request.cached is not None:  # ended inside a verify step
            self.engine.truncate(request.seq_id, request.cached)
        with self._cond:
            length = self.engine.length(request.seq_id) if request.seq_id is not None else 0
            keep = self._policy.keeps(how, length)
            self._policy.ended(request, keep, length)
            if request.seq_id is not None:
                if not keep:
                    self.engine.remove_sequence(request.seq_id)
                request.seq_id = None
            self._finished[how] += 1
            if request.leader is None:  # a group of choices read its prompt once
                self._prompt_tokens += len(request.prompt_ids)
            self._generated_tokens += generated
            # A request that generated a token has its first token's time.
            if how in ("stop", "length") and generated > 1 and request.first_token is not None:
                self._tpot.observe((time.monotonic() - request.first_token) / (generated - 1))
            self._kv_used = self._kv_tokens_used()
        if isinstance(last, StreamEvent):
            last.finish_reason = how
            last.prompt_tokens, last.completion_tokens = len(request.prompt_ids), generated
            last.cached_tokens = (request.leader or request).reused
        if last is not None and not request.cancelled:
            request.emit(last)

    def _kv_tokens_used(self) -> int:
        """KV cache tokens in the pages of running sequences (engine thread only)."""
        return sum(self._policy.limits.pages(self.engine.length(request.seq_id))
                   for request in self._policy.running if request.seq_id is not None)


class TokenStream:
    """The events of one submitted request, as an async iterator; `cancel()` frees its sequence."""

    def __init__(self, scheduler: Scheduler, request: _Request,
                 events: asyncio.Queue[StreamEvent | BaseException]) -> None:
        self._scheduler = scheduler
        self._request = request
        self._events = events
        self._unfinished = len(request.group)  # choices whose last event has not come yet

    @property
    def prompt_tokens(self) -> int:
        """Length of the request's prompt."""
        return len(self._request.prompt_ids)

    @property
    def choices(self) -> int:
        """How many choices the request asked for: its events carry their `index`."""
        return len(self._request.group)

    def cancel(self) -> None:
        """Stop the request and all its choices (a client that went away); harmless once it has ended."""
        self._scheduler.cancel(self._request)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._unfinished = 0
            raise item
        if item.finish_reason is not None:
            self._unfinished -= 1
        return item
