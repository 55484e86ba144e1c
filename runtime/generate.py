"""Streaming text generation on top of the engine.

`generate` returns a `Generation`: iterate it for text pieces as they are decoded;
afterwards `.stats` holds token counts and prefill/decode speed. Text is decoded
incrementally from all generated ids, so multi-byte characters split across
tokens are emitted whole, and text that could still become a stop string is
held back until it cannot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ember.errors import GenerationError
from ember.runtime.engine import Engine
from ember.runtime.sampling import SamplingParams, sample_token
from ember.runtime.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    """Counts and speeds of one generation."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # as OpenAI's: "stop" (a stop token or string), "length" (out of room)
    context_full: bool = False  # "length" because the context window was full, not max_new_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of prefill."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the first (which prefill produced)."""
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


class Generation:
    """An in-progress generation: iterate for text pieces; `.token_ids` and `.stats` after."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, seq_id: int,
                 new_input_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        self.engine = engine
        self.tokenizer = tokenizer
        self.seq_id = seq_id
        self.params = params
        self.prompt_ids = list(new_input_ids)
        self.token_ids: list[int] = []
        self.stats = GenerationStats(prompt_tokens=len(new_input_ids))
        if params.stop_token_ids is not None:
            self._stop_ids = set(params.stop_token_ids)
        else:
            model_eos = engine.artifact.manifest.model.get("eos_token_ids") or []
            self._stop_ids = set(model_eos) | set(tokenizer.eos_token_ids if tokenizer else ())
        if params.stop_strings and tokenizer is None:
            raise GenerationError("stop strings need a tokenizer; this artifact has none")

    def tokens(self) -> Iterator[int]:
        """Generate token ids (stop tokens excluded)."""
        rng = np.random.default_rng(self.params.seed)
        history = self.prompt_ids.copy()
        start = time.perf_counter()
        logits = self.engine.prefill(self.seq_id, self.prompt_ids)
        self.stats.prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        while True:
            token = sample_token(logits, self.params, rng, history)
            if token in self._stop_ids:
                self.stats.finish_reason = "stop"
                break
            history.append(token)
            self.token_ids.append(token)
            self.stats.new_tokens += 1
            yield token
            if self.stats.new_tokens >= self.params.max_new_tokens:
                self.stats.finish_reason = "length"
                break
            if self.engine.length(self.seq_id) + 1 > self.engine.context_window:
                self.stats.finish_reason, self.stats.context_full = "length", True
                break
            logits = self.engine.decode([self.seq_id], [token])[0]
        self.stats.decode_seconds = time.perf_counter() - start
        # The last sampled token is not in the cache yet; feed it, if it fits, so a chat can continue.
        if self.token_ids and self.engine.length(self.seq_id) < self.engine.context_window:
            self.engine.decode([self.seq_id], [self.token_ids[-1]])

    def __iter__(self) -> Iterator[str]:
        if self.tokenizer is None:
            raise GenerationError("this artifact has no tokenizer; use Generation.tokens() for token ids")
        emitted = ""
        stops = self.params.stop_strings
        tokens = self.tokens()
        for _ in tokens:
            text = self.tokenizer.decode(self.token_ids)
            hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                if hit > len(emitted):
                    yield text[len(emitted): hit]
                self.stats.finish_reason = "stop"
                tokens.close()
                return
            safe = len(text) - _held_back(text, stops)
            if text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence; wait for its next byte
            if safe > len(emitted):
                yield text[len(emitted): safe]
                emitted = text[:safe]
        text = self.tokenizer.decode(self.token_ids)
        if len(text) > len(emitted):
            yield text[len(emitted):]

    def text(self) -> str:
        """Run to the end and return all generated text."""
        return "".join(self)


def generate(engine: Engine, prompt: str | list[int], params: SamplingParams, seq_id: int | None = None) -> Generation:
    """Start generating after `prompt` (text, or token ids) in a new or existing sequence."""
    tokenizer = engine.artifact.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("this artifact has no tokenizer; pass token ids")
        prompt = tokenizer.encode(prompt)
    if seq_id is None:
        seq_id = engine.add_sequence()
    return Generation(engine, tokenizer, seq_id, list(prompt), params)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                longest = max(longest, n)
                break
    return longest
