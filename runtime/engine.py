"""The model engine: paged KV cache of several sequences, chunked prefill, batched decode.

Sequences are identified by integer ids. A prompt longer than the compiled prefill
chunk is fed chunk by chunk; decode advances any set of sequences by one token in
one call. Every length is checked against the artifact's bounds before TVM sees
it, so an overflow is an error that says which limit was hit.

Sliding-window layers keep every token in the cache; their attention kernels mask
keys by position, and the compiler makes prefill chunks no longer than the window.
A longrope model's cached keys are computed again from a sequence's tokens when it
passes the length where the rotary factors switch (`runtime/longrope.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import tvm
from tvm import runtime as tvm_runtime

from ember.core.errors import GenerationError
from ember.runtime.artifact import Artifact
from ember.runtime.longrope import LongropeKeys
from ember.runtime.lora import AdapterSlots, check_adapter_choice

if TYPE_CHECKING:
    from ember.core.manifest import Manifest
    from ember.runtime.tokenizer import Tokenizer

_ShapeTuple = tvm_runtime.ShapeTuple
POOLINGS = ("mean", "last")  # how `pooled_embedding` makes one vector of an input's hidden states


def pooled_embedding(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """One float32 vector of an input's hidden states [n, hidden_size] (`Engine.embed`): their mean or the last
    token's, divided by its L2 norm as llama.cpp's server does (a zero vector stays zero)."""
    if pooling not in POOLINGS:
        raise GenerationError(f"pooling {pooling!r}: choose one of {', '.join(POOLINGS)}")
    vector = hidden.mean(axis=0, dtype=np.float64) if pooling == "mean" else hidden[-1].astype(np.float64)
    norm = np.linalg.norm(vector)
    return (vector / norm if norm > 0 else vector).astype(np.float32)


def _builtin(name: str):
    return tvm.get_global_func(f"vm.builtin.{name}")


class SequenceChecks:
    """The checks an engine makes on sequence ids, lengths and token ids before its model sees them, over its
    `_lengths` (sequence id -> tokens held), `max_batch`, `context_window` and `vocab_size`: one copy for `Engine`
    and for the cluster's chain of pipeline stages, so both refuse alike."""

    _lengths: dict[int, int]
    max_batch: int
    context_window: int
    vocab_size: int

    def _check_free_slot(self) -> None:
        if len(self._lengths) >= self.max_batch:
            raise GenerationError(f"at most {self.max_batch} sequences at once (compiled --max-batch)")

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._lengths:
            raise GenerationError(f"unknown sequence id {seq_id}")

    def _fork_length(self, parent: int, length: int | None) -> int:
        """The tokens of `parent` a fork shares: `length`, checked, or all of them."""
        length = self._lengths[parent] if length is None else length
        if not 0 < length <= self._lengths[parent]:
            raise GenerationError(f"cannot fork sequence {parent} at {length}: it has {self._lengths[parent]} tokens")
        return length

    def _check_truncate(self, seq_id: int, length: int) -> None:
        if not 0 <= length <= self._lengths[seq_id]:
            raise GenerationError(f"sequence {seq_id} has only {self._lengths[seq_id]} tokens")

    def _check_context(self, new_tokens: dict[int, int]) -> None:
        for seq_id, new in new_tokens.items():
            if self._lengths[seq_id] + new > self.context_window:
                raise GenerationError(
                    f"sequence {seq_id} would hold {self._lengths[seq_id] + new} tokens, more than the "
                    f"context window of {self.context_window}; shorten the prompt or max_new_tokens"
                )

    def _check_tokens(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        tokens = np.asarray(token_ids, dtype=np.int64)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise GenerationError(f"token ids must be in [0, {self.vocab_size}), got {tokens.min()}..{tokens.max()}")
        return tokens.astype(np.int32)


class ArtifactView(Protocol):
    """What an engine's users read of its artifact: where it lies, its manifest and its tokenizer (an `Artifact`, or
    a pipeline front's view of one without its weights)."""

    @property
    def path(self) -> Path: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...


class SequenceEngine(Protocol):
    """What the scheduler, the server and `generate` use of an engine: its sizes and `Engine`'s sequence calls, each
    as `Engine` documents it. `Engine` and the cluster's `PipelineEngine` (stages on several machines) satisfy it,
    neither naming it."""

    prefill_chunk: int
    max_batch: int
    context_window: int
    vocab_size: int
    page_size: int
    kv_capacity: int
    verify_tokens: int
    has_embeddings: bool
    @property
    def adapters(self) -> Mapping[str, Path]: ...

    @property
    def artifact(self) -> ArtifactView: ...

    def set_adapter(self, seq_id: int, name: str | None, scale: float = 1.0) -> None: ...

    def add_sequence(self) -> int: ...

    def fork_sequence(self, parent: int, length: int | None = None) -> int: ...

    def remove_sequence(self, seq_id: int) -> None: ...

    def truncate(self, seq_id: int, length: int) -> None: ...

    def length(self, seq_id: int) -> int: ...

    def prefill(self, seq_id: int, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray: ...

    def verify(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray: ...

    def embed(self, token_ids: Sequence[int]) -> np.ndarray: ...

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray: ...


class Engine(SequenceChecks):
    """Runs an artifact's prefill and decode over one paged KV cache."""

    def __init__(self, artifact: Artifact, max_context: int | None = None) -> None:
        self.artifact = artifact
        kv = artifact.manifest.kv_cache
        self.prefill_chunk = kv["prefill_chunk"]
        self.max_batch = kv["max_batch"]
        self.context_window = max_context or kv["max_context"]
        self.vocab_size = int(artifact.manifest.model["vocab_size"])
        self.page_size = kv["page_size"]
        # Tokens the `verify` entry takes at once (0: an artifact compiled before it existed).
        verify = artifact.manifest.entry_functions.get("verify")
        self.verify_tokens = verify.get("max_tokens", 0) if verify else 0
        self.has_embeddings = "embed" in artifact.manifest.entry_functions  # `ember compile --embeddings`
        # Longrope's rotary factors follow each sequence's length (prefill and verify are told it).
        long_above = kv["rope"].get("long_factors_above")
        self._longrope = LongropeKeys(int(long_above)) if long_above is not None else None
        self._vm = artifact.vm
        self._params = artifact.params
        # Adapter slots (`ember compile --lora-rank`): `load_adapter` fills them; a sequence's (slot, scale) is fed
        # to every call that runs it, (0, 0.0) being the base model.
        lora = artifact.manifest.lora
        self._slots = AdapterSlots(lora, artifact.adapter_stacks) if lora is not None else None
        self._adapter_of: dict[int, tuple[int, float]] = {}
        # Every page is allocated now: max_batch full contexts, or fewer tokens in all
        # when that is what the artifact's memory budget holds.
        self.kv_capacity = min(self.context_window * self.max_batch, kv["max_total_tokens"])
        self.kv_cache = self._vm["create_paged_kv_cache"](
            _ShapeTuple([self.max_batch]), _ShapeTuple([self.kv_capacity]), _ShapeTuple([self.prefill_chunk]),
            # Windowed layers keep every token (the cache's own per-sequence window, which drops pages, stays off).
            _ShapeTuple([self.page_size]), _ShapeTuple([0]),
        )
        self._lengths: dict[int, int] = {}
        self._ids = itertools.count()
        self._f_add = _builtin("kv_state_add_sequence")
        self._f_remove = _builtin("kv_state_remove_sequence")
        self._f_fork = _builtin("kv_state_fork_sequence")
        self._f_popn = _builtin("kv_state_popn")
        self._f_begin = _builtin("kv_state_begin_forward")
        self._f_end = _builtin("kv_state_end_forward")

    @property
    def adapters(self) -> Mapping[str, Path]:
        """The LoRA adapters loaded, by name in slot order: each one's directory."""
        if self._slots is None:
            return {}
        return {name: adapter.path for name, (_slot, adapter) in self._slots.adapters.items()}

    def load_adapter(self, name: str, path: Path) -> None:
        """Load the PEFT LoRA adapter at `path` into a free adapter slot as `name` (`ember.runtime.lora`)."""
        if self._slots is None:
            raise GenerationError(f"LoRA adapter {name}: this artifact has no adapter slots; recompile it with "
                                  "`ember compile --lora-rank R`")
        self._slots.load(name, path)

    def set_adapter(self, seq_id: int, name: str | None, scale: float = 1.0) -> None:
        """Run `seq_id` from now on with the adapter loaded as `name` at `scale` (None: the base model). A prefix
        cached under one adapter is another adapter's wrong context: the scheduler keys its cache on both."""
        self._check_known(seq_id)
        if name is None:
            self._adapter_of.pop(seq_id, None)
            return
        check_adapter_choice(tuple(self.adapters), name, scale)
        assert self._slots is not None
        self._adapter_of[seq_id] = (self._slots.slot(name), float(scale))

    def add_sequence(self) -> int:
        """Start an empty sequence; returns its id."""
        self._check_free_slot()
        seq_id = next(self._ids)
        self._f_add(self.kv_cache, seq_id)
        self._lengths[seq_id] = 0
        if self._longrope is not None:
            self._longrope.add(seq_id)
        return seq_id

    def fork_sequence(self, parent: int, length: int | None = None) -> int:
        """A new sequence sharing `parent`'s first `length` tokens (all by default)."""
        self._check_known(parent)
        self._check_free_slot()
        length = self._fork_length(parent, length)
        child = next(self._ids)
        self._f_fork(self.kv_cache, parent, child, length)
        self._lengths[child] = length
        if self._longrope is not None:
            self._longrope.fork(parent, child, length)
        if parent in self._adapter_of:
            self._adapter_of[child] = self._adapter_of[parent]
        return child

    def remove_sequence(self, seq_id: int) -> None:
        """Free a sequence's pages."""
        self._check_known(seq_id)
        self._f_remove(self.kv_cache, seq_id)
        del self._lengths[seq_id]
        self._adapter_of.pop(seq_id, None)
        if self._longrope is not None:
            self._longrope.remove(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop the tokens of `seq_id` after the first `length`."""
        self._check_known(seq_id)
        self._check_truncate(seq_id, length)
        drop = self._lengths[seq_id] - length
        if drop:
            self._f_popn(self.kv_cache, seq_id, drop)
            self._lengths[seq_id] = length
            if self._longrope is not None:
                self._longrope.truncate(seq_id, length)

    def length(self, seq_id: int) -> int:
        """Tokens currently cached for `seq_id`."""
        self._check_known(seq_id)
        return self._lengths[seq_id]

    def prefill(self, seq_id: int, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append `token_ids` to `seq_id`; logits [n, vocab] for all tokens, or [vocab] for the last."""
        self._check_known(seq_id)
        if not token_ids:
            raise GenerationError("prefill needs at least one token")
        self._check_room({seq_id: len(token_ids)})
        tokens = self._check_tokens(token_ids)
        new_length = self._lengths[seq_id] + len(tokens)
        self._rotate_for(seq_id, new_length)
        logits = self._prefill_chunks(seq_id, tokens, all_logits, new_length)
        if self._longrope is not None:
            self._longrope.appended(seq_id, tokens)
        return logits

    def _prefill_chunks(self, seq_id: int, tokens: np.ndarray, all_logits: bool, new_length: int) -> np.ndarray:
        """`prefill`'s work once checked: `tokens` appended chunk by chunk, `seq_id` holding `new_length` tokens
        after them."""
        end = self._prompt_end(new_length)
        outputs = []
        for begin in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[begin: begin + self.prefill_chunk]
            last = begin + len(chunk) >= len(tokens)
            # Without all_logits only the last row of the last chunk is used.
            positions = np.arange(len(chunk), dtype=np.int32) if all_logits else np.array([len(chunk) - 1], np.int32)
            logits = self._forward("prefill", [seq_id], [len(chunk)], chunk[None, :], positions, *end)
            if all_logits or last:
                outputs.append(logits[0])
        logits = np.concatenate(outputs, axis=0)
        return logits if all_logits else logits[-1]

    def _rotate_for(self, seq_id: int, new_length: int) -> None:
        """Before `seq_id` grows to `new_length` tokens: where longrope's factors for that length are not those its
        cached keys were rotated with (`runtime/longrope.py`), compute its tokens again with them, as transformers'
        `generate` does on the step that first passes the original context."""
        if self._longrope is None or (stale := self._longrope.stale(seq_id, new_length)) is None:
            return
        self._f_remove(self.kv_cache, seq_id)  # pages a fork shares with its parent stay the parent's
        self._f_add(self.kv_cache, seq_id)
        self._lengths[seq_id] = 0
        self._prefill_chunks(seq_id, np.asarray(stale, np.int32), False, new_length)
        self._longrope.rotated(seq_id, new_length)

    def verify(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append a few tokens to `seq_id` (a pending token and guesses); logits [n, vocab] at every one.

        The artifact's `verify` entry runs them in kernels sized for a few rows, as decode's are;
        more tokens than it takes, or an artifact compiled without it, go through `prefill`."""
        if not 0 < len(token_ids) <= self.verify_tokens:
            return self.prefill(seq_id, token_ids, all_logits=True)
        self._check_known(seq_id)
        self._check_room({seq_id: len(token_ids)})
        tokens = self._check_tokens(token_ids)
        new_length = self._lengths[seq_id] + len(tokens)
        self._rotate_for(seq_id, new_length)
        logits = self._forward("verify", [seq_id], [len(tokens)], tokens[None, :], *self._prompt_end(new_length))[0]
        if self._longrope is not None:
            self._longrope.appended(seq_id, tokens)
        return logits

    def embed(self, token_ids: Sequence[int]) -> np.ndarray:
        """The hidden states [n, hidden_size] after the final norm of `token_ids` read as one sequence, through
        a temporary sequence that is removed afterwards (a free sequence slot and KV pages are needed)."""
        if not self.has_embeddings:
            raise GenerationError("this artifact has no embed function: recompile it with `ember compile "
                                  "--embeddings`")
        if not token_ids:
            raise GenerationError("an input to embed needs at least one token")
        seq_id = self.add_sequence()
        try:
            self._check_room({seq_id: len(token_ids)})
            tokens = self._check_tokens(token_ids)
            chunks = [self._forward("embed", [seq_id], [len(chunk)], chunk[None, :])[0].copy()
                      for chunk in np.array_split(tokens, range(self.prefill_chunk, len(tokens), self.prefill_chunk))]
        finally:
            self.remove_sequence(seq_id)
        return np.concatenate(chunks, axis=0)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence; logits [len(seq_ids), vocab]."""
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise GenerationError("decode needs one token per sequence")
        for seq_id in seq_ids:
            self._check_known(seq_id)
        self._check_room({seq_id: 1 for seq_id in seq_ids})
        tokens = self._check_tokens(token_ids)
        for seq_id in seq_ids:
            self._rotate_for(seq_id, self._lengths[seq_id] + 1)
        if self._slots is None:
            logits = self._forward("decode", list(seq_ids), [1] * len(seq_ids), tokens[:, None])[:, 0, :]
        else:
            logits = self._decode_by_adapter(list(seq_ids), tokens)
        if self._longrope is not None:
            for seq_id, token in zip(seq_ids, tokens):
                self._longrope.appended(seq_id, [token])
        return logits

    def _decode_by_adapter(self, seq_ids: list[int], tokens: np.ndarray) -> np.ndarray:
        """`decode`'s step with the batch grouped by adapter slot (the base first), so that the adapter kernel's
        threads, each on a contiguous run of the batch, read each adapter's bytes once (`schedules/lora.py`); the
        logits in `seq_ids`' order."""
        order = np.argsort([self._adapter_of.get(seq_id, (-1, 0.0))[0] for seq_id in seq_ids], kind="stable")
        logits = self._forward("decode", [seq_ids[i] for i in order], [1] * len(seq_ids), tokens[order, None])[:, 0, :]
        # The VM's own buffer, viewed (`_forward`): copied back into order only where the batch was reordered.
        return logits if np.array_equal(order, np.arange(len(order))) else logits[np.argsort(order)]

    def _prompt_end(self, new_length: int) -> tuple[np.ndarray, ...]:
        """The `prompt_end` input of prefill and verify where the artifact takes one (longrope): the sequence's
        length once the whole prompt is appended, the same for each of its chunks; otherwise nothing."""
        return (np.array([new_length], np.int32),) if self._longrope is not None else ()

    def _forward(self, function: str, seq_ids: list[int], counts: list[int], *inputs: np.ndarray) -> np.ndarray:
        """Run the entry `function` on `inputs` (then the KV cache and the weights), appending `counts[i]`
        tokens to sequence `seq_ids[i]`; its first output (logits, or `embed`'s hidden states).

        On a CPU the logits are the VM's own output buffer, viewed, not copied: each call returns a new
        buffer, which the array keeps alive. A copy of a batch's logits was a measurable share of a small
        model's decode step (docs/benchmarks.md#schedule-measurements)."""
        if self._slots is not None:  # each token's adapter slot and scale, its sequence's
            adapters = [self._adapter_of.get(seq_id, (0, 0.0)) for seq_id in seq_ids]
            inputs += (np.repeat(np.array([slot for slot, _ in adapters], np.int32), counts),
                       np.repeat(np.array([scale for _, scale in adapters], np.float32), counts))
        self._f_begin(self.kv_cache, _ShapeTuple(seq_ids), _ShapeTuple(counts))
        out = self._vm[function](*(tvm_runtime.tensor(x, self.artifact.device) for x in inputs), self.kv_cache,
                                 *self._params)
        self._f_end(self.kv_cache)
        for seq_id, count in zip(seq_ids, counts):
            self._lengths[seq_id] += count
        logits = out[0]
        return np.from_dlpack(logits) if self.artifact.device.type == "cpu" else logits.numpy()

    def _check_room(self, new_tokens: dict[int, int]) -> None:
        self._check_context(new_tokens)
        pages = sum(-(-(length + new_tokens.get(seq_id, 0)) // self.page_size)
                    for seq_id, length in self._lengths.items())
        if pages * self.page_size > self.kv_capacity:
            raise GenerationError(
                f"the KV cache is full: its {self.kv_capacity} tokens (what the artifact's memory budget holds) "
                f"would not hold all {len(self._lengths)} sequences; remove finished ones, or recompile with a "
                "larger --memory-budget or a smaller --max-batch"
            )

