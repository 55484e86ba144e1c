"""An engine without a model, for testing the serving layer's policy in milliseconds: `Engine`'s own sequence
methods, bookkeeping and checks (ids, lengths, slots, pages, context), with the KV cache's builtins and the model
replaced.

Its logits make the next token a function of the sequence's last token and its length alone, so that a greedy
request's tokens are known in advance (`expected_tokens`) and do not depend on batching or forking. Every forward
is recorded (`calls`: entry, sequence ids, token counts), for tests to check what the scheduler ran in each step.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ember.runtime.engine import Engine

VOCAB = 64


def next_token(last: int, length: int) -> int:
    """The token the stub's greedy argmax picks after `last` as the sequence's `length`-th token."""
    return (last * 7 + length * 3 + 1) % VOCAB


def expected_tokens(prompt: list[int], count: int) -> list[int]:
    """A greedy request's first `count` tokens for `prompt`."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens[-1], len(tokens)))
    return tokens[len(prompt):]


@dataclass(frozen=True)
class Call:
    entry: str
    seq_ids: tuple[int, ...]
    counts: tuple[int, ...]


class StubEngine(Engine):
    """`Engine` over no model: `max_batch` sequences, a KV cache of `kv_capacity` tokens in pages of `page_size`."""

    def __init__(self, max_batch: int = 4, kv_capacity: int = 256, page_size: int = 16, prefill_chunk: int = 32,
                 context_window: int = 128, step_seconds: float = 0.0) -> None:
        # Not super().__init__, which would load a model.
        self.artifact = SimpleNamespace(tokenizer=None, manifest=SimpleNamespace(model={"eos_token_ids": []}))
        self.prefill_chunk, self.max_batch, self.context_window = prefill_chunk, max_batch, context_window
        self.vocab_size, self.page_size, self.kv_capacity = VOCAB, page_size, kv_capacity
        self.verify_tokens, self.has_embeddings = 0, False
        self.kv_cache = None
        self._longrope = None  # no longrope switch: sequences never computed again
        self._slots, self._adapter_of = None, {}  # no adapter slots
        self._lengths: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}
        self._ids = itertools.count()
        self.calls: list[Call] = []
        self.removed: list[int] = []
        self.forks: list[tuple[int, int]] = []  # (parent, tokens shared)
        self._lock = threading.Lock()
        self.step_seconds = step_seconds  # how long each forward takes, to let requests arrive mid-stream
        self.released = threading.Event()  # cleared, every forward waits until it is set: requests queue meanwhile
        self.released.set()

    # The KV cache's builtins, as `Engine`'s sequence methods call them (their checks and lengths are Engine's own):
    # here they keep each sequence's tokens, which the stub's logits are computed from.
    def _f_add(self, _cache: None, seq_id: int) -> None:
        self._tokens[seq_id] = []

    def _f_fork(self, _cache: None, parent: int, child: int, length: int) -> None:
        self._tokens[child] = self._tokens[parent][:length]
        self.forks.append((parent, length))

    def _f_remove(self, _cache: None, seq_id: int) -> None:
        del self._tokens[seq_id]
        self.removed.append(seq_id)

    def _f_popn(self, _cache: None, seq_id: int, drop: int) -> None:
        del self._tokens[seq_id][-drop:]

    def pages_held(self) -> int:
        return sum(-(-length // self.page_size) for length in self._lengths.values())

    def _forward(self, function: str, seq_ids: list[int], counts: list[int], *inputs: np.ndarray) -> np.ndarray:
        """Rows of logits for the positions the entry returns: prefill's `positions` (its second input) or each
        token; each row one-hot at `next_token` of the token read there."""
        tokens = inputs[0].reshape(-1)
        self.released.wait(timeout=30)
        if self.step_seconds:
            time.sleep(self.step_seconds)
        with self._lock:
            self.calls.append(Call(function, tuple(seq_ids), tuple(counts)))
        rows, offset = [], 0
        for seq_id, count in zip(seq_ids, counts):
            self._tokens[seq_id].extend(int(t) for t in tokens[offset:offset + count])
            self._lengths[seq_id] += count
            held = self._tokens[seq_id]
            rows.append([next_token(held[i], i + 1) for i in range(len(held) - count, len(held))])
            offset += count
        if function == "prefill":
            positions = inputs[1]
            picked = [rows[0][int(p)] for p in positions]
            return self._one_hot([picked])
        return self._one_hot(rows)

    @staticmethod
    def _one_hot(rows: list[list[int]]) -> np.ndarray:
        logits = np.zeros((len(rows), max(map(len, rows)), VOCAB), np.float32)
        for r, row in enumerate(rows):
            for c, token in enumerate(row):
                logits[r, c, token] = 10.0
        return logits
