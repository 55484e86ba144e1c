"""The engine's KV-cache bookkeeping: several sequences, forks, rewinds and limits."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from helpers import assert_logits_close, prompt_ids

from ember.core.errors import GenerationError
from ember.ir_passes.memory_report import MemoryReport
from ember.runtime import Engine

STEPS = 6


def run_alone(model, ids: list[int], continuation: list[int]) -> np.ndarray:
    """Logits [1 + len(continuation), vocab]: prefill's last row, then one row per decode step."""
    engine = model.engine()
    seq = engine.add_sequence()
    rows = [engine.prefill(seq, ids)]
    rows += [engine.decode([seq], [token])[0] for token in continuation]
    return np.stack(rows)


def test_interleaved_sequences_match_each_alone(tiny_llama):
    """Prefill A, prefill B, then batched decode of [A, B] equals A alone and B alone."""
    ids_a, ids_b = prompt_ids(70, seed=1), prompt_ids(23, seed=2)
    cont_a, cont_b = prompt_ids(STEPS + 1, seed=3)[1:], prompt_ids(STEPS + 1, seed=4)[1:]
    alone_a, alone_b = run_alone(tiny_llama, ids_a, cont_a), run_alone(tiny_llama, ids_b, cont_b)

    engine = tiny_llama.engine()
    seq_a, seq_b = engine.add_sequence(), engine.add_sequence()
    assert_logits_close(engine.prefill(seq_a, ids_a), alone_a[0], "A prefill")
    assert_logits_close(engine.prefill(seq_b, ids_b), alone_b[0], "B prefill")
    for step in range(STEPS):
        logits = engine.decode([seq_a, seq_b], [cont_a[step], cont_b[step]])
        assert logits.shape == (2, alone_a.shape[1])
        assert_logits_close(logits[0], alone_a[step + 1], f"A decode step {step + 1}")
        assert_logits_close(logits[1], alone_b[step + 1], f"B decode step {step + 1}")
    assert (engine.length(seq_a), engine.length(seq_b)) == (len(ids_a) + STEPS, len(ids_b) + STEPS)


def test_batched_decode_order_and_subsets(tiny_llama):
    """Decoding [B, A], then only A, keeps each sequence's own state."""
    ids_a, ids_b = prompt_ids(30, seed=5), prompt_ids(45, seed=6)
    cont_a, cont_b = prompt_ids(4, seed=7)[1:], prompt_ids(4, seed=8)[1:]
    alone_a, alone_b = run_alone(tiny_llama, ids_a, cont_a), run_alone(tiny_llama, ids_b, cont_b)

    engine = tiny_llama.engine()
    seq_a, seq_b = engine.add_sequence(), engine.add_sequence()
    engine.prefill(seq_a, ids_a)
    engine.prefill(seq_b, ids_b)
    logits = engine.decode([seq_b, seq_a], [cont_b[0], cont_a[0]])
    assert_logits_close(logits[0], alone_b[1], "B first in the batch")
    assert_logits_close(logits[1], alone_a[1], "A second in the batch")
    assert_logits_close(engine.decode([seq_a], [cont_a[1]])[0], alone_a[2], "A decoded alone")
    logits = engine.decode([seq_a, seq_b], [cont_a[2], cont_b[1]])
    assert_logits_close(logits[0], alone_a[3], "A after decoding alone")
    assert_logits_close(logits[1], alone_b[2], "B after skipping a step")


def test_fork_continues_like_parent(tiny_llama):
    """A child forked from the whole parent, and one forked mid-prompt, continue correctly."""
    ids = prompt_ids(50, seed=9)
    cont = prompt_ids(STEPS + 1, seed=10)[1:]
    other = prompt_ids(STEPS + 1, seed=11)[1:]
    engine = tiny_llama.engine()
    parent = engine.add_sequence()
    engine.prefill(parent, ids)

    child = engine.fork_sequence(parent)
    assert engine.length(child) == len(ids)
    same, different = run_alone(tiny_llama, ids, cont), run_alone(tiny_llama, ids, other)
    for step in range(STEPS):
        logits = engine.decode([parent, child], [cont[step], other[step]])
        assert_logits_close(logits[0], same[step + 1], f"parent decode step {step + 1}")
        assert_logits_close(logits[1], different[step + 1], f"child decode step {step + 1}")

    # Fork at a position inside a KV page (page size 16): the child sees only the prefix.
    prefix = 37
    partial = engine.fork_sequence(parent, prefix)
    assert engine.length(partial) == prefix
    expected = run_alone(tiny_llama, ids[:prefix], cont[:3])
    for step in range(3):
        assert_logits_close(engine.decode([partial], [cont[step]])[0], expected[step + 1], f"fork@{prefix} step {step}")

    engine.remove_sequence(child)
    with pytest.raises(GenerationError, match="unknown sequence"):
        engine.decode([child], [cont[0]])


def test_truncate_rewinds_the_cache(tiny_llama):
    """After truncate(seq, n), prefilling new tokens equals a fresh run of ids[:n] + new."""
    ids, new = prompt_ids(60, seed=12), prompt_ids(10, seed=13)[1:]
    engine = tiny_llama.engine()
    seq = engine.add_sequence()
    engine.prefill(seq, ids)
    engine.decode([seq], [new[0]])
    engine.truncate(seq, 25)
    assert engine.length(seq) == 25
    logits = engine.prefill(seq, new, all_logits=True)
    expected = tiny_llama.reference_logits(ids[:25] + new)[25:]
    assert_logits_close(logits, expected, "prefill after truncate")


def test_context_window_overflow_raises(tiny_llama):
    """Prompts and decode steps past the context window raise GenerationError naming the limit."""
    engine = tiny_llama.engine()
    window = engine.context_window
    assert window == 256
    seq = engine.add_sequence()
    with pytest.raises(GenerationError, match=rf"context window of {window}"):
        engine.prefill(seq, prompt_ids(window + 1))
    assert engine.length(seq) == 0, "a refused prefill must not change the sequence"

    engine.prefill(seq, prompt_ids(window))  # exactly full is allowed (4 prefill chunks)
    with pytest.raises(GenerationError, match=rf"{window + 1} tokens, more than the context window of {window}"):
        engine.decode([seq], [5])
    assert engine.length(seq) == window


def test_kv_capacity_in_a_memory_budget():
    """The KV cache gets what the budget leaves after weights and workspace, at most max_batch contexts."""
    report = MemoryReport(weight_bytes=1000, kv_bytes_per_token=10, workspace_bytes={"decode": 100, "prefill": 300},
                          context_window=256)
    assert report.kv_capacity(1300 + 10 * 700, max_batch=4) == 700
    assert report.max_context(1300 + 10 * 700) == 256
    assert report.kv_capacity(10**9, max_batch=4) == 4 * 256
    assert report.kv_capacity(1000, max_batch=4) == 0


def test_kv_cache_full_raises(tiny_llama):
    """An artifact whose budget holds fewer tokens than max_batch contexts allocates only those, and
    refuses (counting whole pages) a step that would not fit, naming the budget."""
    manifest = copy.deepcopy(tiny_llama.artifact.manifest)
    manifest.kv_cache["max_total_tokens"] = 64  # 4 pages of 16
    engine = Engine(dataclasses.replace(tiny_llama.artifact, manifest=manifest))
    assert engine.kv_capacity == 64
    seq_a, seq_b = engine.add_sequence(), engine.add_sequence()
    engine.prefill(seq_a, prompt_ids(30))
    engine.prefill(seq_b, prompt_ids(31, seed=1))  # 2 + 2 pages
    engine.decode([seq_a, seq_b], [5, 6])  # 31 and 32 tokens: still 2 pages each
    with pytest.raises(GenerationError, match="the KV cache is full: its 64 tokens .*memory budget"):
        engine.decode([seq_b], [7])
    engine.remove_sequence(seq_a)
    engine.decode([seq_b], [7])


def test_generation_stops_at_the_context_window(tiny_llama):
    """generate() ends with finish_reason 'length' and context_full instead of raising."""
    from ember.runtime import SamplingParams, generate

    engine = tiny_llama.engine()
    ids = prompt_ids(250)
    generation = generate(engine, ids, SamplingParams(temperature=0, max_new_tokens=50, stop_token_ids=()))
    tokens = list(generation.tokens())
    assert generation.stats.finish_reason == "length" and generation.stats.context_full
    assert len(ids) + len(tokens) == engine.context_window + 1  # the last token is sampled, never cached


def test_bad_requests_raise_generation_errors(tiny_llama):
    """Too many sequences, out-of-vocabulary ids, empty prefill and mismatched decode are refused."""
    engine = tiny_llama.engine()
    seqs = [engine.add_sequence() for _ in range(engine.max_batch)]
    with pytest.raises(GenerationError, match="at most 4 sequences"):
        engine.add_sequence()
    with pytest.raises(GenerationError, match="at most 4 sequences"):
        engine.fork_sequence(seqs[0], 0)
    with pytest.raises(GenerationError, match=r"token ids must be in \[0, 256\)"):
        engine.prefill(seqs[0], [1, 256])
    with pytest.raises(GenerationError, match="at least one token"):
        engine.prefill(seqs[0], [])
    with pytest.raises(GenerationError, match="one token per sequence"):
        engine.decode(seqs[:2], [1])
    engine.remove_sequence(seqs[-1])
    engine.add_sequence()
