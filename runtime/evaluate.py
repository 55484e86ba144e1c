"""Quality of an artifact on a text: perplexity, and divergence from another artifact.

Both score a text the same way: its tokens (no special tokens) are cut into
consecutive windows of `window - 1` tokens, each window is prefilled after <s> in a
fresh sequence with logits at every position (chunked by the artifact's prefill
chunk), and every token of the text is predicted exactly once. This is the scoring
of `scripts/train_demo_model.py`, so the demo model's figure from PyTorch at
training time and ember's figure are comparable.

Divergence compares two artifacts of the same model (say q4f32 against q0f32) on
the same windows: mean KL(reference || candidate) of the next-token distributions
and how often their top-1 tokens agree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from ember.core.errors import GenerationError
from ember.runtime.engine import Engine
from ember.runtime.tokenizer import Tokenizer


@dataclass
class Perplexity:
    """Per-token perplexity of a text."""

    perplexity: float
    tokens: int
    windows: int


@dataclass
class Divergence:
    """How far a candidate's next-token distributions are from a reference's."""

    mean_kl: float  # nats per token, KL(reference || candidate)
    max_kl: float
    top1_agreement: float  # fraction of positions where both argmaxes agree
    tokens: int


@dataclass
class Comparison:
    """Two artifacts of one model scored on the same windows."""

    candidate: Perplexity
    reference: Perplexity
    divergence: Divergence


def scoring_windows(token_ids: list[int], bos_id: int | None, window: int) -> list[list[int]]:
    """<s> + consecutive spans of `window - 1` tokens covering `token_ids` once (see `iter_scoring_windows`)."""
    return list(iter_scoring_windows(token_ids, bos_id, window))


def iter_scoring_windows(token_ids: Iterable[int], bos_id: int | None, window: int) -> Iterator[list[int]]:
    """<s> + consecutive spans of `window - 1` tokens covering `token_ids` once, made as the
    tokens arrive.

    A model without <s> gets plain spans of `window` tokens overlapping by one: the
    first token of the text is then the only one not predicted.
    """
    if window < 2:
        raise GenerationError(f"the scoring window must hold at least 2 tokens, got {window}")
    start = [] if bos_id is None else [bos_id]
    current = list(start)
    for token in token_ids:
        current.append(token)
        if len(current) == window:
            yield current
            current = [token] if bos_id is None else list(start)
    if len(current) > 1:
        yield current


def stream_token_ids(tokenizer: Tokenizer, text: TextIO, max_tokens: int | None = None,
                     piece_chars: int = 2**16) -> Iterator[int]:
    """The token ids (no special tokens) of the text read from `text`, tokenized `piece_chars`
    characters at a time, and no more than `max_tokens`.

    Memory stays bounded however long the text. Pieces end after a newline followed by a
    non-space, else before a space followed by a non-space: byte-level BPE's pre-tokenizers
    (GPT-2's, Llama 3's) split there anyway, so the ids equal those of the whole text; a
    SentencePiece-style tokenizer may differ by a token per piece.
    """
    name = getattr(text, "name", "the text")
    # A piece joins the carry to a new chunk; both, at 4 UTF-8 bytes a character, stay within what the tokenizer
    # encodes at once.
    piece_chars = max(1, min(piece_chars, tokenizer.max_text_bytes // 8))
    carry, count = "", 0
    while max_tokens is None or count < max_tokens:
        try:
            chunk = text.read(piece_chars)
        except UnicodeDecodeError as err:
            raise GenerationError(f"{name}: not UTF-8 text ({err.reason} in byte {err.object[err.start:err.end]!r})") \
                from None
        carry += chunk
        cut = _piece_end(carry) if chunk else len(carry)
        ids = tokenizer.encode(carry[:cut], add_special_tokens=False) if cut else []
        carry = carry[cut:]
        if max_tokens is not None:
            ids = ids[: max_tokens - count]
        count += len(ids)
        yield from ids
        if not chunk:
            return


def _piece_end(text: str) -> int:
    """Where to end a piece of `text` for tokenizing it apart (see `stream_token_ids`); len(text) if nowhere."""
    for pattern in _PIECE_ENDS:
        ends = [match.end() for match in pattern.finditer(text)]
        if ends and ends[-1] > 0:
            return ends[-1]
    return len(text)


_PIECE_ENDS = (re.compile(r"\n(?=\S)"), re.compile(r"(?=\s\S)"))


def perplexity(engine: Engine, windows: Iterable[list[int]]) -> Perplexity:
    """Perplexity of the text cut into `windows` (see `scoring_windows`) under `engine`'s artifact."""
    scores = _NegativeLogLikelihood()
    for ids in windows:
        scores.add(_log_softmax(_window_logits(engine, ids)), ids)
    return scores.perplexity()


def compare(candidate: Engine, reference: Engine, windows: Iterable[list[int]]) -> Comparison:
    """Both artifacts' perplexity, and the candidate's divergence from the reference, in one pass."""
    candidate_scores, reference_scores = _NegativeLogLikelihood(), _NegativeLogLikelihood()
    kl_sum, kl_max, agree, count = 0.0, 0.0, 0, 0
    for ids in windows:
        p_log = _log_softmax(_window_logits(reference, ids))
        q_log = _log_softmax(_window_logits(candidate, ids))
        reference_scores.add(p_log, ids)
        candidate_scores.add(q_log, ids)
        kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((p_log.argmax(-1) == q_log.argmax(-1)).sum())
        count += len(kl)
    candidate_ppl, reference_ppl = candidate_scores.perplexity(), reference_scores.perplexity()
    return Comparison(candidate_ppl, reference_ppl, Divergence(kl_sum / count, kl_max, agree / count, count))


class _NegativeLogLikelihood:
    """Sums -log p(next token) over windows."""

    def __init__(self) -> None:
        self.nll, self.tokens, self.windows = 0.0, 0, 0

    def add(self, log_probs: np.ndarray, ids: list[int]) -> None:
        targets = np.asarray(ids[1:])
        self.nll -= float(log_probs[np.arange(len(targets)), targets].sum())
        self.tokens += len(targets)
        self.windows += 1

    def perplexity(self) -> Perplexity:
        if self.tokens == 0:
            raise GenerationError("the text has no tokens to score")
        return Perplexity(math.exp(self.nll / self.tokens), self.tokens, self.windows)


def _window_logits(engine: Engine, ids: list[int]) -> np.ndarray:
    """Logits predicting ids[1:], float64."""
    seq = engine.add_sequence()
    try:
        return engine.prefill(seq, ids[:-1], all_logits=True).astype(np.float64)
    finally:
        engine.remove_sequence(seq)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
