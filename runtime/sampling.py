"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition,
presence and frequency penalties; log-probabilities of the chosen and likeliest tokens.

Semantics follow Hugging Face's logits processors in their order (repetition
penalty, temperature, top-k, top-p), so a seed-free greedy run matches
`transformers.generate` token for token. OpenAI's `logit_bias` comes first (each listed
token's logit plus its bias), then its presence and frequency penalties: each token's
logit drops by `frequency_penalty` times the number of times it was generated, plus
`presence_penalty` if it was generated at all (the prompt does not count).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ember.core.errors import GenerationError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. `temperature=0` means greedy."""

    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 0.95
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's end-of-sequence tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # record each token's log-probability and this many likeliest alternatives
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `GenerationError` naming the first bad option."""
        checks = (
            ("temperature", is_finite_number(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", _is_whole(self.top_k) and self.top_k >= 0, "a whole number >= 0"),
            ("top_p", is_finite_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("repetition_penalty", is_finite_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "a finite number > 0"),
            ("max_new_tokens", _is_whole(self.max_new_tokens) and self.max_new_tokens >= 1, "a whole number >= 1"),
            ("seed", self.seed is None or _is_whole(self.seed) and -MAX_SEED <= self.seed < MAX_SEED,
             "a whole number in [-2**63, 2**63)"),
            ("stop_strings", all(isinstance(stop, str) and stop for stop in self.stop_strings),
             "non-empty strings"),
            ("presence_penalty", is_finite_number(self.presence_penalty) and abs(self.presence_penalty) <= 2,
             "a number in [-2, 2]"),
            ("frequency_penalty", is_finite_number(self.frequency_penalty) and abs(self.frequency_penalty) <= 2,
             "a number in [-2, 2]"),
            ("logprobs", self.logprobs is None or _is_whole(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
             f"a whole number in [0, {MAX_LOGPROBS}]"),
            ("logit_bias", self.logit_bias is None or all(
                _is_whole(token) and token >= 0 and is_finite_number(bias) and abs(bias) <= MAX_LOGIT_BIAS
                for token, bias in self.logit_bias.items()),
             f"token ids >= 0 mapped to numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"),
        )
        for name, valid, expected in checks:
            if not valid:
                raise GenerationError(f"{name} must be {expected}, got {getattr(self, name)!r}")


MAX_SEED = 2**63  # seeds are int64 in most APIs (OpenAI's, transformers'), negative ones included
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 100  # OpenAI's bound on a logit_bias value


def is_finite_number(value: object) -> bool:
    """A real number, finite, and not a bool: a request's temperature, a bias, an adapter's scale."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: list[int],
                 generated: Sequence[int] = ()) -> int:
    """Pick one token id from a [vocab] logits vector; `history` is prompt + `generated`."""
    occurrence_penalty = bool(params.presence_penalty or params.frequency_penalty) and len(generated) > 0
    repetition_penalty = params.repetition_penalty != 1.0 and len(history) > 0
    if params.temperature == 0 and not occurrence_penalty and not repetition_penalty and not params.logit_bias:
        return _finite_pick(logits)  # what the float64 copy below would pick, without copying the vocabulary
    logits = logits.astype(np.float64, copy=True)
    if params.logit_bias:
        tokens = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
        logits[tokens] += np.fromiter(params.logit_bias.values(), dtype=np.float64, count=len(tokens))
    if occurrence_penalty:
        seen, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        logits[seen] -= counts * params.frequency_penalty + params.presence_penalty
    if repetition_penalty:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if params.temperature == 0:
        return _finite_pick(logits)
    # Shifted first: a tiny temperature then drives the others to -inf, not the maximum to inf (inf - inf is nan).
    with np.errstate(over="ignore"):
        logits = (logits - logits[_finite_pick(logits)]) / params.temperature
    if 0 < params.top_k < logits.size:
        kth = np.partition(logits, -params.top_k)[-params.top_k]
        logits[logits < kth] = -np.inf
    probs = np.exp(logits)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def _finite_pick(logits: np.ndarray) -> int:
    """The id of the largest logit, refusing logits that hold NaN or +inf (argmax finds the first of either, so
    checking the one it picks is enough): the model's arithmetic overflowed, and no token can be sampled."""
    token = int(np.argmax(logits))
    if not np.isfinite(logits[token]):
        raise GenerationError(f"the model computed a logit of {logits[token]} (its arithmetic overflowed or its "
                              f"weights are not finite); no token can be chosen")
    return token


@dataclass
class TokenLogprob:
    """A token's log-probability, and the likeliest tokens' at its position (likeliest first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: np.ndarray, token_id: int, top_n: int) -> TokenLogprob:
    """Log-probability of `token_id` and of the `top_n` likeliest tokens under the model's
    distribution `logits` (before temperature, top-k, top-p and penalties, as vLLM reports them)."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    n = min(top_n, logprobs.size)
    top = np.argpartition(-logprobs, n - 1)[:n] if n else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-logprobs[top], kind="stable")]
    return TokenLogprob(token_id, float(logprobs[token_id]), [(int(i), float(logprobs[i])) for i in top])
