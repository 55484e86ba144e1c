"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty.

Semantics follow Hugging Face's logits processors in their order (repetition
penalty, temperature, top-k, top-p), so a seed-free greedy run matches
`transformers.generate` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.errors import GenerationError


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

    def validate(self) -> None:
        """Raise `GenerationError` naming the first bad option."""
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise GenerationError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: list[int]) -> int:
    """Pick one token id from a [vocab] logits vector."""
    logits = logits.astype(np.float64, copy=True)
    if params.repetition_penalty != 1.0 and history:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(logits))
    logits /= params.temperature
    if 0 < params.top_k < logits.size:
        kth = np.partition(logits, -params.top_k)[-params.top_k]
        logits[logits < kth] = -np.inf
    probs = np.exp(logits - logits.max())
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
