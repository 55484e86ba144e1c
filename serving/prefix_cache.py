"""Prefix caching: which engine sequence already holds the longest prefix of a new prompt.

The scheduler registers every sequence it runs here with the token ids in its KV cache,
and keeps a finished request's sequence as a cache entry instead of freeing it. A new
request whose prompt starts with tokens some sequence holds forks that sequence's pages
(`Engine.fork_sequence`, which shares whole pages and copies a partly shared last one)
and prefills only the rest. Finished entries are evicted least recently used first when
a request needs their sequence slot or KV pages.

A sequence run with a LoRA adapter holds that adapter's keys and values: it matches only prompts
for the same adapter at the same scale (`adapter`, None for the base model).

A flat table, not a radix tree: every entry is an engine sequence, and the engine holds
at most `max_batch` of them (running ones included), so a lookup compares the prompt with
a handful of token lists, vectorised, in microseconds next to a prefill. A tree would pay
node bookkeeping on every step for no faster lookup at this size; what it would share
(common prefixes stored once) TVM's paged cache shares already, page by page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np


class PrefixCache:
    """Token ids held by each engine sequence, running or finished; finished ones in LRU order."""

    def __init__(self, min_prefix: int) -> None:
        self.min_prefix = max(min_prefix, 1)  # shorter shared prefixes are not worth a fork
        self._tokens: dict[int, list[int]] = {}
        self._adapters: dict[int, Hashable] = {}  # the adapter each sequence runs with, where it has one
        self._finished: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def add(self, seq_id: int, tokens: Sequence[int], adapter: Hashable = None) -> None:
        """Register a running sequence that holds `tokens`, run with `adapter`."""
        self._tokens[seq_id] = list(tokens)
        if adapter is not None:
            self._adapters[seq_id] = adapter

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Record tokens just written to a running sequence's KV cache."""
        self._tokens[seq_id].extend(tokens)

    def finish(self, seq_id: int) -> None:
        """Keep a sequence whose request ended as an entry, the most recently used."""
        self._finished[seq_id] = None

    def remove(self, seq_id: int) -> None:
        """Forget a sequence (freed, evicted, or taken over by a new request)."""
        self._tokens.pop(seq_id, None)
        self._adapters.pop(seq_id, None)
        self._finished.pop(seq_id, None)

    def is_finished(self, seq_id: int) -> bool:
        """Whether `seq_id` is a cache entry (its request ended) rather than a running sequence."""
        return seq_id in self._finished

    def length(self, seq_id: int) -> int:
        """Tokens held by `seq_id`."""
        return len(self._tokens[seq_id])

    def finished(self) -> list[int]:
        """Cache entries, least recently used first."""
        return list(self._finished)

    def match(self, prompt: Sequence[int], adapter: Hashable = None) -> tuple[int | None, int]:
        """(sequence, length) of the longest prefix of `prompt` minus its last token that a sequence run with
        `adapter` holds, at least `min_prefix` tokens; (None, 0) if none. A matched entry becomes the most
        recently used. The last prompt token is always left to prefill: it gives the first logits."""
        usable = len(prompt) - 1
        if usable < self.min_prefix or not self._tokens:
            return None, 0
        target = np.asarray(prompt[:usable], dtype=np.int64)
        best, best_length = None, 0
        for seq_id, tokens in self._tokens.items():
            n = min(len(tokens), usable)
            if n <= best_length or self._adapters.get(seq_id) != adapter:
                continue
            differ = np.flatnonzero(np.asarray(tokens[:n], dtype=np.int64) != target[:n])
            length = int(differ[0]) if differ.size else n
            if length > best_length:
                best, best_length = seq_id, length
        if best is None or best_length < self.min_prefix:
            return None, 0
        if best in self._finished:
            self._finished.move_to_end(best)
        return best, best_length
