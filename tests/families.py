"""The checks every family of `models.FAMILIES` passes against transformers, shared by the test files that split
the table between pytest-xdist's workers (`test_families_*.py`).

Each family is compiled through `--frontend torch-export` at float32 and checked on prompts three
times its window (`models.WINDOW`), so windowed layers drop keys in every prefill chunk and decode
step past it; then at q4f32, compiled and generating.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_batched_equals_solo, assert_logits_close, prompt_ids
from models import WINDOW

from ember.runtime import SamplingParams, generate

PROMPT = 3 * WINDOW
GREEDY_TOKENS = 32


def full_forward_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits [len(ids), vocab] of one forward over `ids`: the definition every cached step must meet."""
    with torch.no_grad():
        return model.reference(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def check_prefill(model) -> None:
    """A prompt of three windows, in prefill chunks no longer than the window, at every position."""
    ids = prompt_ids(PROMPT, seed=21)
    engine = model.engine()
    seq = engine.add_sequence()
    assert_logits_close(engine.prefill(seq, ids, all_logits=True), full_forward_logits(model, ids),
                        f"{model.name}: prefill of {PROMPT} tokens")


def decode_reference(model, ids: list[int], start: int) -> np.ndarray:
    """transformers' logits [len(ids), vocab] for `ids[:start]` prefilled and the rest decoded one at a time: at
    every position, those of one forward over the sequence up to it. One forward over all of `ids` gives them all,
    except where the rotary factors follow the sequence's length (longrope), which one forward chooses once for
    every position: there, one forward per step.
    """
    if (getattr(model.reference.config, "rope_parameters", None) or {}).get("rope_type") != "longrope":
        return full_forward_logits(model, ids)
    return np.stack([full_forward_logits(model, ids[:max(position + 1, start)])[position]
                     for position in range(len(ids))])


def check_decode_across_the_window(model) -> None:
    """A short prompt, then decode steps on the paged cache well past the window (and past longrope's
    original context)."""
    ids = prompt_ids(PROMPT, seed=22)
    start = WINDOW // 2
    expected = decode_reference(model, ids, start)
    engine = model.engine()
    seq = engine.add_sequence()
    engine.prefill(seq, ids[:start])
    for position in range(start, PROMPT):
        assert_logits_close(engine.decode([seq], [ids[position]])[0], expected[position],
                            f"{model.name}: decode at position {position}")


def check_greedy(model) -> None:
    ids = prompt_ids(WINDOW + 4, seed=23)
    params = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_TOKENS, stop_token_ids=())
    assert list(generate(model.engine(), ids, params).tokens()) == model.reference_greedy(ids, GREEDY_TOKENS)


def check_batched_equals_solo(model) -> None:
    """Four sequences of different lengths (inside and past the window) prefilled and decoded together give each its
    solo logits."""
    prompts = [prompt_ids(n, seed=24 + n) for n in (5, WINDOW + 1, 2 * WINDOW, PROMPT - 3)]
    steps = [prompt_ids(7, seed=40 + i)[1:] for i in range(len(prompts))]
    assert_batched_equals_solo(model, prompts, steps, f"{model.name}: ")


def check_quantized_generates(model) -> None:
    """The q4f32 artifact generates tokens of the vocabulary, and its first is transformers' on the same rounded
    weights (`TinyModel.reference`) where that one is clear of the runner-up."""
    ids = prompt_ids(PROMPT, seed=25)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=())
    tokens = list(generate(model.engine(), ids, params).tokens())
    assert len(tokens) == 8 and all(0 <= t < model.artifact.manifest.model["vocab_size"] for t in tokens)
    expected = model.reference_logits(ids)[-1]
    first, second = np.sort(expected)[::-1][:2]
    if first - second > 0.05 * max(1.0, abs(first)):
        assert tokens[0] == int(np.argmax(expected)), f"{model.name}: q4f32's first token"


def family_tests(names: list[str]) -> type:
    """The checks above as a test class over `names` (each test file of the table holds one, for its share)."""

    @pytest.mark.slow
    @pytest.mark.parametrize("name", names)
    class TestFamily:
        def test_prefill_of_three_windows_matches_transformers(self, tiny_models, name):
            check_prefill(tiny_models.exported(name))

        def test_decode_across_the_window_matches_transformers(self, tiny_models, name):
            check_decode_across_the_window(tiny_models.exported(name))

        def test_greedy_tokens_equal_transformers(self, tiny_models, name):
            check_greedy(tiny_models.exported(name))

        def test_four_sequences_batched_equal_their_solo_runs(self, tiny_models, name):
            check_batched_equals_solo(tiny_models.exported(name))

        def test_q4f32_compiles_and_generates(self, tiny_models, name):
            check_quantized_generates(tiny_models.exported(name, "q4f32"))

    return TestFamily
