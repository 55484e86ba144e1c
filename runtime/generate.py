"""Streaming text generation on top of the engine.

`generate` returns a `Generation`: iterate it for text pieces as they are decoded;
afterwards `.stats` holds token counts and prefill/decode speed. Text is decoded
incrementally from all generated ids, so multi-byte characters split across
tokens are emitted whole, and text that could still become a stop string is
held back until it cannot. That per-request state is a `Decoding`, which the
scheduler (`serving/scheduler.py`) steps for many sequences decoded in one batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import numpy as np

from ember.core.errors import GenerationError
from ember.runtime.engine import ArtifactView, SequenceEngine
from ember.runtime.sampling import SamplingParams, TokenLogprob, sample_token, token_logprob
from ember.runtime.speculative import Speculation, speculative_tokens
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


LogitsProcessor = Callable[[list[int], np.ndarray], np.ndarray]
"""Called with the tokens generated so far and the next token's logits [vocab]; returns the logits to
sample from (e.g. -inf where a grammar forbids a token). Log-probabilities are reported from its output."""


class Decoding:
    """One request's sampling and text state, advanced one token at a time by whoever runs the
    engine: `Generation` for a single sequence, the scheduler for many in one batch."""

    def __init__(self, engine: SequenceEngine, prompt_ids: list[int], params: SamplingParams,
                 logits_processor: LogitsProcessor | None = None) -> None:
        params.validate()
        tokenizer = engine.artifact.tokenizer
        if params.stop_strings and tokenizer is None:
            raise GenerationError("stop strings need a tokenizer; this artifact has none")
        if params.logit_bias and max(params.logit_bias) >= engine.vocab_size:
            raise GenerationError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary of "
                                  f"{engine.vocab_size} tokens")
        self._stop_ids = set(params.stop_token_ids) if params.stop_token_ids is not None else \
            end_of_sequence_ids(engine.artifact)
        self.params = params
        self.tokenizer = tokenizer
        self.logits_processor = logits_processor
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token when params.logprobs is set
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.finished = False
        self._history = list(prompt_ids)
        # numpy takes seeds >= 0: a negative int64 seed is its two's complement, distinct from every other seed.
        self._rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        # Incremental detokenization: `_text` is the text of token_ids[:_read], decoded through windows that start
        # at `_window` (a token after which all characters were whole), so a step decodes a few tokens, not all.
        self._text = ""
        self._window = 0
        self._read = 0
        self._searched = 0  # characters of `_text` that hold no stop string's start
        self._emitted = 0  # characters of `_text` given out

    @property
    def history(self) -> list[int]:
        """The prompt and the tokens generated so far."""
        return self._history

    def step(self, logits: np.ndarray) -> int | None:
        """Sample the token after `logits`; None for a stop token. Sets `finished` when the request ends."""
        if self.logits_processor is not None:
            logits = self.logits_processor(self.token_ids, logits)
        token = sample_token(logits, self.params, self._rng, self._history, self.token_ids)
        if token in self._stop_ids:
            self._finish("stop")
            return None
        self._history.append(token)
        self.token_ids.append(token)
        self.stats.new_tokens += 1
        if self.params.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.params.logprobs))
        if self.stats.new_tokens >= self.params.max_new_tokens:
            self._finish("length")
        return token

    def out_of_room(self) -> None:
        """End the request because the context window holds no next token."""
        self.stats.context_full = True
        self._finish("length")

    def text(self) -> str:
        """The text decoded since the last call that can be given out now: whole UTF-8 characters
        that cannot become a stop string, or all the rest once finished. A stop string ends the request.

        Each call decodes only the tokens since the last whole character (and the window before them, for
        the decoder's view of where words start): decoding all tokens each step cost 82 us at 1,000 tokens
        and 162 us at 2,000 (the demo's tokenizer, Zen 5), per sequence and step."""
        if not self._read_new_tokens():
            return ""  # an incomplete UTF-8 sequence; wait for its next byte
        text, stops = self._text, self.params.stop_strings
        start = max(0, self._searched - max((len(stop) for stop in stops), default=1) + 1)
        hit = min((i for i in (text.find(stop, start) for stop in stops) if i >= 0), default=-1)
        self._searched = len(text)
        if hit >= 0:
            self._finish("stop")
            end = hit
        elif self.finished:
            end = len(text)
        else:
            end = len(text) - _held_back(text, stops)
        if end <= self._emitted:
            return ""
        piece, self._emitted = text[self._emitted: end], end
        return piece

    def _read_new_tokens(self) -> bool:
        """Append the text of the tokens generated since the last read to `_text`; False while the newest
        of them end inside a UTF-8 character (not read yet, unless the request is finished)."""
        ids, tokenizer = self.token_ids, self.tokenizer
        if self._read == len(ids):
            return True
        if tokenizer is None:
            raise GenerationError("text needs a tokenizer; this artifact has none")
        before = tokenizer.decode(ids[self._window: self._read])
        after = tokenizer.decode(ids[self._window:])
        if after.endswith("\ufffd") and not self.finished:
            return False
        if after.startswith(before):
            self._text += after[len(before):]
        else:  # a decoder that rewrote the window's text given more tokens: decode everything
            self._text = tokenizer.decode(ids)
        self._window, self._read = self._read, len(ids)
        return True

    def _finish(self, reason: str) -> None:
        self.stats.finish_reason = reason
        self.finished = True


class Generation:
    """An in-progress generation: iterate for text pieces; `.token_ids` and `.stats` after."""

    def __init__(self, engine: SequenceEngine, tokenizer: Tokenizer | None, seq_id: int,
                 new_input_ids: list[int], params: SamplingParams, speculation: Speculation | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.seq_id = seq_id
        self.params = params
        self.prompt_ids = list(new_input_ids)
        self.decoding = Decoding(engine, self.prompt_ids, params)
        self.speculation = speculation  # verify guessed tokens in one forward (`runtime/speculative.py`)

    @property
    def token_ids(self) -> list[int]:
        """Tokens generated so far (stop tokens excluded)."""
        return self.decoding.token_ids

    @property
    def stats(self) -> GenerationStats:
        """Counts, speeds and finish reason."""
        return self.decoding.stats

    def tokens(self) -> Generator[int, None, None]:
        """Generate token ids (stop tokens excluded)."""
        start = time.perf_counter()
        cached_before = self.engine.length(self.seq_id)
        logits = self.engine.prefill(self.seq_id, self.prompt_ids)
        self.stats.prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if self.speculation is not None:
            yield from speculative_tokens(self.engine, self.seq_id, self.decoding, logits, self.speculation)
        else:
            yield from self._decoded_tokens(logits)
        self.stats.decode_seconds = time.perf_counter() - start
        # The last sampled token is not in the cache when a stop token did not end the request; feed it,
        # if it fits, so a chat can continue.
        missing = cached_before + len(self.prompt_ids) + len(self.token_ids) - self.engine.length(self.seq_id)
        if missing == 1 and self.engine.length(self.seq_id) < self.engine.context_window:
            self.engine.decode([self.seq_id], [self.token_ids[-1]])

    def _decoded_tokens(self, logits: np.ndarray) -> Iterator[int]:
        """Tokens sampled from `logits` on, one decode step each."""
        while True:
            token = self.decoding.step(logits)
            if token is None:
                break
            yield token
            if self.decoding.finished:
                break
            if self.engine.length(self.seq_id) + 1 > self.engine.context_window:
                self.decoding.out_of_room()
                break
            logits = self.engine.decode([self.seq_id], [token])[0]

    def __iter__(self) -> Iterator[str]:
        if self.tokenizer is None:
            raise GenerationError("this artifact has no tokenizer; use Generation.tokens() for token ids")
        tokens = self.tokens()
        for _ in tokens:
            piece = self.decoding.text()
            if piece:
                yield piece
            if self.stats.finish_reason == "stop":  # a stop string: the token after it is not fed
                tokens.close()
                return
        piece = self.decoding.text()
        if piece:
            yield piece

    def text(self) -> str:
        """Run to the end and return all generated text."""
        return "".join(self)


def generate(engine: SequenceEngine, prompt: str | list[int], params: SamplingParams, seq_id: int | None = None,
             speculation: Speculation | None = None) -> Generation:
    """Start generating after `prompt` (text, or token ids) in a new or existing sequence, verifying
    `speculation`'s guesses several tokens per forward if given."""
    tokenizer = engine.artifact.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("this artifact has no tokenizer; pass token ids")
        prompt = tokenizer.encode(prompt)
    if seq_id is None:
        seq_id = engine.add_sequence()
    return Generation(engine, tokenizer, seq_id, list(prompt), params, speculation)


def end_of_sequence_ids(artifact: ArtifactView) -> set[int]:
    """The tokens that end a generation unless a request names its own: the model's and its tokenizer's."""
    model_eos = artifact.manifest.model.get("eos_token_ids") or []
    return set(model_eos) | set(artifact.tokenizer.eos_token_ids if artifact.tokenizer else ())


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                longest = max(longest, n)
                break
    return longest
