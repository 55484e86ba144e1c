"""Longrope's two factor sets over a paged KV cache: which set each sequence's cached keys were rotated with.

A longrope model (Phi-3, Phi-3.5, Phi-4-mini) rotates q and k with its short factors while the sequence holds at
most `original_max_position_embeddings` tokens, with its long ones past that, for every position alike: the
logits of each step are those of one forward over the whole sequence so far. transformers' `generate` keeps it
so by dropping its cache and recomputing the whole sequence on the step that first passes the length; ember's
entries choose the set per token (the prompt's end in prefill and verify, the token's own position in decode,
`ember.ir_passes.longrope_choice`), and this record tells the engine when a sequence's cached keys belong to
the other set and must be computed again from its tokens: once, when it first passes the length, or when it is
truncated back below it and grows again.
"""

from __future__ import annotations

from collections.abc import Iterable


class LongropeKeys:
    """Per sequence: its tokens, and whether its cached keys were rotated with the long factors."""

    def __init__(self, long_above: int) -> None:
        self.long_above = long_above  # a sequence longer than this many tokens takes the long factors
        self._tokens: dict[int, list[int]] = {}
        self._long: dict[int, bool] = {}

    def add(self, seq_id: int) -> None:
        self._tokens[seq_id], self._long[seq_id] = [], False

    def fork(self, parent: int, child: int, length: int) -> None:
        self._tokens[child], self._long[child] = self._tokens[parent][:length], self._long[parent]

    def remove(self, seq_id: int) -> None:
        del self._tokens[seq_id], self._long[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        del self._tokens[seq_id][length:]

    def stale(self, seq_id: int, new_length: int) -> list[int] | None:
        """The tokens to compute again (rotated for `new_length`) before `seq_id` grows to `new_length`, if its
        cached keys were rotated with the other set; else None."""
        tokens = self._tokens[seq_id]
        return tokens if tokens and self._long[seq_id] != (new_length > self.long_above) else None

    def rotated(self, seq_id: int, new_length: int) -> None:
        """`seq_id`'s tokens were computed again, rotated for `new_length`."""
        self._long[seq_id] = new_length > self.long_above

    def appended(self, seq_id: int, tokens: Iterable[int]) -> None:
        """`tokens` were appended to `seq_id`, rotated for its length after them."""
        self._tokens[seq_id].extend(int(t) for t in tokens)
        self._long[seq_id] = len(self._tokens[seq_id]) > self.long_above
