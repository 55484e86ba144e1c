"""Speculative decoding: guess the next few tokens cheaply, check them in one forward, keep the agreed ones.

Decode reads every weight once per token, so on a CPU its speed is the memory
bandwidth's. A verify step instead feeds the pending token and k guessed tokens in
one forward with logits at every position (`Engine.verify`: the artifact's `verify`
entry, whose kernels are sized for a few rows as decode's are): the weights are read once
for k + 1 positions. The logits at position i are what decode
would give after the pending token and the first i guesses, so the request's own
sampler (`Decoding.step`: penalties, grammar and stops included) picks the token there.
While it picks the guess, the next position's logits are valid too; at the first token
that differs the step ends, that token is kept (plain decoding would have produced it
from the same logits) and the cache is cut back past the rejected guesses
(`Engine.truncate`). Every step emits at least one token, at most k + 1.

Greedy output is therefore the plain greedy output, token for token (up to the float
summation order of a (k+1)-token forward against a 1-token one). With sampling, both
proposers guess deterministically: their distribution q is a point mass on the guess x,
for which the standard speculative-sampling rule (accept x with probability
min(1, p(x) / q(x)) = p(x), else draw from the residual (p - q)+, normalised: p without x)
is exactly "draw t from p, accept if t == x, else emit t". Each emitted token is one
draw from the target distribution p, so the output distribution is unchanged.

Proposers:

- `PromptLookup` (`--speculate ngram`): the tokens that followed the latest earlier
  occurrence of the last n tokens (n = 3, then 2, then 1) in the prompt and output.
  Free, and right whenever the output copies its input (edits, summaries, code).
- `DraftModel` (`--draft ARTIFACT`): a smaller artifact with the same tokenizer decodes
  k tokens greedily in its own engine, its sequence kept in step with the history.

The number of guesses adapts as in transformers' assisted generation: +2 after a step
that accepted them all, -1 after one that rejected one, between 1 and `max_guesses`.
A step with no guess (no n-gram match) is a plain decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ember.core.errors import GenerationError

if TYPE_CHECKING:
    from ember.runtime.engine import Engine, SequenceEngine
    from ember.runtime.generate import Decoding

# At most 7 guesses: with the pending token, the 8 tokens an artifact's `verify` entry takes at once.
DEFAULT_GUESSES, MAX_GUESSES = 4, 7


class Proposer(Protocol):
    """Guesses up to `k` tokens to follow `history` (the prompt and the tokens generated so far)."""

    def propose(self, history: list[int], k: int) -> list[int]: ...


class PromptLookup:
    """Guesses the continuation of the latest earlier occurrence of the history's last n-gram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise GenerationError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: list[int], k: int) -> list[int]:
        tokens = np.asarray(history, dtype=np.int64)
        # Earlier occurrences of the last token: every n-gram match ends at one of them. Each n then
        # checks its n - 1 earlier tokens at all of them at once (a vector comparison per token).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            found = ends[ends >= n - 1]
            for back in range(1, n):
                found = found[tokens[found - back] == tokens[-1 - back]]
            if found.size:
                end = int(found[-1])  # the latest
                return tokens[end + 1:end + 1 + k].tolist()
        return []


class DraftModel:
    """Guesses by greedy decoding with a smaller model (an `Engine` over another artifact), in one
    sequence of the draft's engine that follows whichever history it is asked about: make one per
    draft engine and reuse it across generations."""

    def __init__(self, engine: Engine, target: Engine) -> None:
        _check_same_tokenizer(engine, target)
        self.engine = engine
        self._seq: int | None = None
        self._cached: list[int] = []  # the tokens in the draft's sequence

    def propose(self, history: list[int], k: int) -> list[int]:
        engine = self.engine
        if self._seq is None:
            self._seq = engine.add_sequence()
        # Keep the longest prefix the draft already holds, but feed at least the last token: its logits
        # are the first guess's.
        shared = 0
        for cached, token in zip(self._cached, history):
            if cached != token:
                break
            shared += 1
        shared = min(shared, len(history) - 1)
        k = min(k, engine.context_window - len(history) + 1)
        if k < 1:
            return []
        engine.truncate(self._seq, shared)
        logits = engine.prefill(self._seq, history[shared:])
        guesses = [int(np.argmax(logits))]
        for _ in range(k - 1):
            guesses.append(int(np.argmax(engine.decode([self._seq], [guesses[-1]])[0])))
        self._cached = [*history, *guesses[:-1]]
        return guesses

    def close(self) -> None:
        """Free the draft's sequence."""
        if self._seq is not None:
            self.engine.remove_sequence(self._seq)
            self._seq, self._cached = None, []


def _check_same_tokenizer(draft: SequenceEngine, target: SequenceEngine) -> None:
    """A draft must speak the target's token ids: the same vocabulary size and, where both artifacts
    have a tokenizer, the same token at every id."""
    draft_tokenizer, target_tokenizer = draft.artifact.tokenizer, target.artifact.tokenizer
    same = draft.vocab_size == target.vocab_size and (
        draft_tokenizer is None or target_tokenizer is None or
        draft_tokenizer.vocabulary() == target_tokenizer.vocabulary())
    if not same:
        raise GenerationError(
            f"the draft model {draft.artifact.path} does not share the model's tokenizer (its vocabulary of "
            f"{draft.vocab_size} tokens differs from the model's {target.vocab_size}"
            f"{'' if draft.vocab_size != target.vocab_size else ' in the tokens at some ids'}); a draft must be "
            "compiled from a model with the same tokenizer")


@dataclass
class SpeculationStats:
    """How well the guesses did over one generation."""

    verify_steps: int = 0  # forwards that checked guesses
    proposed: int = 0  # guesses checked
    accepted: int = 0  # guesses the model agreed with

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses per checked guess."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted guesses per verify step (each step also emits one token of its own)."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0


class Speculation:
    """A proposer, and how many guesses it makes next (adapted to how many were accepted)."""

    def __init__(self, proposer: Proposer, guesses: int = DEFAULT_GUESSES, max_guesses: int = MAX_GUESSES) -> None:
        if not 1 <= guesses <= max_guesses:
            raise GenerationError(f"guesses must be in [1, {max_guesses}], got {guesses}")
        self.proposer = proposer
        self.guesses, self.max_guesses = guesses, max_guesses
        self.stats = SpeculationStats()

    def guess(self, decoding: Decoding, room: int) -> list[int]:
        """The proposer's guesses to follow `decoding`'s history: at most `guesses`, none past the request's
        max_new_tokens (the step also samples a token of its own), and with the pending token no more
        than the `room` tokens left in the context window."""
        k = min(self.guesses, room - 1, decoding.params.max_new_tokens - decoding.stats.new_tokens - 1)
        return self.proposer.propose(decoding.history, k)[:k] if k > 0 else []

    def record(self, proposed: int, accepted: int) -> None:
        """Count one verify step and adapt the number of guesses."""
        self.stats.verify_steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        if accepted == proposed:
            self.guesses = min(self.max_guesses, self.guesses + 2)
        else:
            self.guesses = max(1, self.guesses - 1)


def speculative_tokens(engine: SequenceEngine, seq_id: int, decoding: Decoding, logits: np.ndarray,
                       speculation: Speculation) -> Iterator[int]:
    """Tokens sampled by `decoding`, from `logits` (the prompt's last) on, each step verifying guesses.

    Leaves the cache holding every token generated but the last (as plain decoding does), or all of
    them when a stop token ended the request.
    """
    token = decoding.step(logits)
    while token is not None:
        yield token
        if decoding.finished:
            return
        room = engine.context_window - engine.length(seq_id)
        if room < 1:
            decoding.out_of_room()
            return
        guesses = speculation.guess(decoding, room)
        if not guesses:
            token = decoding.step(engine.decode([seq_id], [token])[0])
            continue
        start = engine.length(seq_id)
        rows = engine.verify(seq_id, [token, *guesses])
        accepted = 0
        try:
            for position, row in enumerate(rows):
                token = decoding.step(row)
                if token is None or decoding.finished or position == len(guesses) or token != guesses[position]:
                    break
                yield token
                accepted += 1  # counted once the consumer takes the next token: one that stops at it
                # (a stop string) leaves it out of the cache, as plain decoding would
        finally:  # also when the consumer stops early: no unchecked guess stays cached
            # The cache keeps the pending token and the accepted guesses; the token just sampled is the
            # next pending one (a finished request's last token is fed by the caller, as after plain decoding).
            engine.truncate(seq_id, start + 1 + accepted)
        speculation.record(len(guesses), accepted)
