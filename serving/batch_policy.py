"""The scheduler's policy: which waiting request gets a sequence next, which prefix cache entries make room for it,
and what each step prefills and decodes, decided from the requests, the sequence slots and the KV pages alone.

`Scheduler` (serving/scheduler.py) runs the loop: it asks this policy, carries each answer out on the engine and
tells the policy what happened (a sequence made, tokens written, a request ended). The policy calls no engine,
takes no lock and reads no clock (a prefill's duration is handed to it), so every rule below is tested on plain
data (tests/test_batch_policy.py).

- **Admission, first in first out.** The head of the queue (a request for `n` choices counts as its n sequences)
  is admitted while the batch has a slot for each and the KV tokens reserved by running requests (prompt plus
  `max_new_tokens`, page-rounded) leave room for its own reservation; otherwise everything behind it waits too,
  so a large request is never starved by small ones. The cache can never fill up under a running request.
- **Cache entries never make a request wait.** A finished request's sequence kept by the prefix cache is evicted,
  least recently used first, as soon as a slot or pages are needed. A prompt that starts with tokens a running or
  cached sequence of the same LoRA adapter holds forks its pages; when the matched entry alone stands in the way,
  the request takes that entry over, cut to the shared part.
- **A long prompt holds running streams back by one bounded chunk.** Each step reads one chunk of the oldest
  prompt not yet read, then decodes every request with a token to feed (one whose prompt that chunk completed
  included). While others decode, the chunk is cut to the whole pages prefill reads in `max_decode_stall` seconds
  at its measured speed (one page until measured); with nothing decoding, prompts go in whole compiled chunks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Self, TypeVar

from ember.serving.prefix_cache import PrefixCache

# Seconds a prompt's prefill may hold back the running streams' next decode step. Each chunk streams every
# weight once more, so a bound that cuts prompts into small chunks costs throughput (docs/benchmarks.md,
# "Schedule measurements").
DEFAULT_MAX_DECODE_STALL = 0.1


@dataclass(frozen=True)
class Limits:
    """What the engine holds: sequences decoded at once, KV cache tokens, tokens a page, the compiled chunk."""

    max_batch: int
    kv_capacity: int
    page_size: int
    prefill_chunk: int

    def pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole KV pages, as the engine allocates them."""
        return -(-tokens // self.page_size) * self.page_size


class PlannedRequest:
    """A request's scheduling state; the scheduler's own request type adds its decoding and delivery."""

    def __init__(self, prompt_ids: list[int], reserve: int, index: int = 0,
                 adapter: tuple[str, float] | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.adapter = adapter  # the LoRA adapter (name, scale) it runs with; None: the base model
        self.reserve = reserve  # KV tokens held for it: prompt + max_new_tokens within the context, page-rounded
        self.index = index  # the choice it is, of a request for several
        self.followers: list[Self] = []  # choices 1..n-1: they fork this one's pages once its prompt is read
        self.leader: Self | None = None  # for a follower, the choice 0 whose prompt it shares
        self.seq_id: int | None = None
        self.prefilled = 0
        self.reused = 0  # prompt tokens whose KV pages were forked from a cached or running sequence
        self.pending: int | None = None  # the last sampled token, to feed at the next decode step
        self.cancelled = False

    @property
    def group(self) -> list[Self]:
        """This request and the choices that share its prompt."""
        return [self, *self.followers]

    @property
    def seq(self) -> int:
        """The sequence of a running request: it has one from its admission to its end."""
        assert self.seq_id is not None, "a request that is not running has no sequence"
        return self.seq_id


R = TypeVar("R", bound=PlannedRequest)


@dataclass
class Admission(Generic[R]):
    """A waiting request the policy has admitted: what the engine must do to give it a sequence."""

    request: R  # the first choice of its group
    parent: int | None  # the sequence whose first `shared` tokens its prompt starts with, if any
    shared: int
    take_over: bool  # `parent` is a cache entry that becomes this request's sequence, cut to `shared` tokens
    evicted: list[int] = field(default_factory=list)  # cache entries to free first, in this order


class BatchPolicy(Generic[R]):
    """The waiting queue, the running requests, their KV reservations and the prefix cache's entries."""

    def __init__(self, limits: Limits, prefix_cache: bool = True,
                 max_decode_stall: float = DEFAULT_MAX_DECODE_STALL) -> None:
        self.limits = limits
        self.max_decode_stall = max_decode_stall
        self.waiting: deque[R] = deque()  # a group of choices waits as its first
        self.running: list[R] = []  # oldest first
        self.reserved = 0  # KV tokens reserved by running requests
        # A shared prefix shorter than a page saves less prefill than the fork costs.
        self.prefix = PrefixCache(limits.page_size) if prefix_cache else None
        self.cached_tokens = 0  # page-rounded lengths of the cache entries
        self._prefill_seconds_per_token: float | None = None  # measured on the chunks read so far

    def withdraw(self, request: R) -> bool:
        """Take a waiting request's group out of the queue; False if it is not waiting."""
        if request not in self.waiting:
            return False
        self.waiting.remove(request)
        return True

    def next_admission(self) -> Admission[R] | None:
        """Admit the head of the queue if its group fits now (the request leaves the queue; the cache entries
        named in the answer are forgotten), or None. `started` or `abandoned` must follow before the next call."""
        if not self.waiting:
            return None
        request = self.waiting[0]
        sequences = len(request.group)
        reserve = request.reserve * sequences
        if len(self.running) + sequences > self.limits.max_batch or self.reserved + reserve > self.limits.kv_capacity:
            return None
        self.waiting.popleft()
        parent, shared = self.prefix.match(request.prompt_ids, request.adapter) if self.prefix else (None, 0)
        take_over = (parent is not None and self.prefix is not None and self.prefix.is_finished(parent)
                     and not self._fits(reserve, parent, sequences))
        if take_over:
            assert parent is not None
            self._forget(parent)
        return Admission(request, parent, shared, take_over, self._evict_for(reserve, keep=parent, sequences=sequences))

    def started(self, admission: Admission[R], seq_id: int) -> None:
        """The engine made `admission`'s sequence: its group runs from now on."""
        request = admission.request
        request.seq_id = seq_id
        if admission.parent is not None:
            request.prefilled = request.reused = admission.shared
        if self.prefix:
            self.prefix.add(seq_id, request.prompt_ids[:admission.shared], request.adapter)
        self.reserved += request.reserve * len(request.group)
        self.running.extend(request.group)

    def forked(self, follower: R, seq_id: int) -> None:
        """A follower's sequence now shares its leader's prompt pages."""
        follower.seq_id = seq_id
        follower.prefilled = len(follower.prompt_ids)
        if self.prefix:
            self.prefix.add(seq_id, follower.prompt_ids, follower.adapter)

    def room_for(self, tokens: int) -> list[int] | None:
        """The cache entries to free (least recently used first) for a sequence of `tokens` that no admitted request
        needs, forgotten now; None when running requests hold the slots or reserve the pages."""
        reserve = self.limits.pages(tokens)
        if len(self.running) >= self.limits.max_batch or self.reserved + reserve > self.limits.kv_capacity:
            return None
        return self._evict_for(reserve, keep=None)

    def next_prefill(self) -> tuple[R, int] | None:
        """The oldest running prompt not yet read (a follower's is its leader's), and how many tokens to read."""
        live = [request for request in self.running if not request.cancelled]
        reading = next((request for request in live
                        if request.leader is None and request.prefilled < len(request.prompt_ids)), None)
        if reading is None:
            return None
        return reading, self.chunk_size(decoding=any(request.pending is not None for request in live))

    def decode_batch(self) -> list[tuple[R, int]]:
        """The running requests with a token to feed, oldest first, and the token."""
        return [(request, request.pending) for request in self.running
                if not request.cancelled and request.pending is not None]

    def chunk_size(self, decoding: bool) -> int:
        """Prompt tokens to prefill this step: a whole compiled chunk, or while other requests decode,
        the whole KV pages the engine reads in `max_decode_stall` seconds (one page until it is timed)."""
        chunk, page = self.limits.prefill_chunk, self.limits.page_size
        if not decoding:
            return chunk
        rate = self._prefill_seconds_per_token
        tokens: float
        if rate is None:  # not timed yet: a page, unless the stall is unbounded
            tokens = chunk if math.isinf(self.max_decode_stall) else page
        else:
            tokens = min(self.max_decode_stall / rate, chunk)
        return min(max(int(tokens) // page, 1) * page, chunk)

    def timed_prefill(self, tokens: int, seconds: float) -> None:
        """Fold one chunk's prefill time into the running seconds-per-token figure (chunks shorter than a
        page, mostly fixed cost, would overstate it)."""
        if tokens < self.limits.page_size:
            return
        rate, previous = seconds / tokens, self._prefill_seconds_per_token
        self._prefill_seconds_per_token = rate if previous is None else (previous + rate) / 2

    def wrote(self, seq_id: int, tokens: list[int]) -> None:
        """Tokens just written to a running sequence's KV cache."""
        if self.prefix:
            self.prefix.extend(seq_id, tokens)

    def ended(self, request: R, keep: bool, length: int) -> None:
        """A request ended; with `keep`, its sequence of `length` tokens stays as a cache entry, the most recently
        used (the caller frees it otherwise)."""
        if request.seq_id is not None and self.prefix:
            if keep:
                self.prefix.finish(request.seq_id)
                self.cached_tokens += self.limits.pages(length)
            else:
                self.prefix.remove(request.seq_id)
        if request in self.running:
            self.running.remove(request)
            self.reserved -= request.reserve

    def keeps(self, how: str, length: int) -> bool:
        """Whether a request that ended `how` with `length` tokens cached stays a cache entry: one that ran to its
        end does; an error may have left it half-written, and a client gone wants its pages back at once."""
        return self.prefix is not None and how in ("stop", "length") and length > 0

    def drain(self) -> list[R]:
        """Empty the queue: every waiting request, followers included."""
        waiting = [member for leader in self.waiting for member in leader.group]
        self.waiting.clear()
        return waiting

    def evict_all(self) -> list[int]:
        """Forget every cache entry; the sequences to free."""
        entries = self.prefix.finished() if self.prefix else []
        for seq_id in entries:
            self._forget(seq_id)
        return entries

    def _fits(self, reserve: int, keep: int, sequences: int) -> bool:
        """Whether `sequences` new sequences reserving `reserve` KV tokens fit beside the running ones and the
        cache entry `keep` once every other entry is evicted."""
        assert self.prefix is not None
        return (len(self.running) + sequences + 1 <= self.limits.max_batch and
                self.reserved + self.limits.pages(self.prefix.length(keep)) + reserve <= self.limits.kv_capacity)

    def _evict_for(self, reserve: int, keep: int | None, sequences: int = 1) -> list[int]:
        """Forget cache entries other than `keep`, least recently used first, until `sequences` new sequences
        reserving `reserve` KV tokens fit (the caller checked that they can); the entries forgotten."""
        prefix, evicted = self.prefix, list[int]()
        if not prefix:  # no cache, no entries
            return evicted
        for seq_id in prefix.finished():
            if (len(self.running) + len(prefix.finished()) + sequences <= self.limits.max_batch and
                    self.reserved + self.cached_tokens + reserve <= self.limits.kv_capacity):
                break
            if seq_id != keep:
                self._forget(seq_id)
                evicted.append(seq_id)
        return evicted

    def _forget(self, seq_id: int) -> None:
        """Drop cache entry `seq_id` from the cache and its pages from the count."""
        assert self.prefix is not None
        self.cached_tokens -= self.limits.pages(self.prefix.length(seq_id))
        self.prefix.remove(seq_id)
