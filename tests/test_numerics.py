"""ember's compiled models against transformers in float32, for every supported family.

Each tiny model has random weights (nonzero q/k/v biases for Qwen2, random norm
scales), so a dropped bias, a wrong RoPE variant, a sliding-window off-by-one or a
broken chunk boundary changes the logits far beyond the 1e-4 tolerance.
"""

from __future__ import annotations

import pytest
from helpers import assert_logits_close, prompt_ids
from models import TINY_MODELS

from ember.runtime import SamplingParams, generate

# 40 tokens: one prefill chunk, longer than Mistral's 16-token window.
# 100 tokens: two chunks (64 + 36), so chunked prefill meets the window and RoPE offsets.
PROMPT_LENGTHS = (40, 100)
DECODE_STEPS = 16
GREEDY_TOKENS = 32

MODELS = list(TINY_MODELS)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_match_transformers(tiny_models, name, length):
    """Prefill logits at every prompt position, then 16 decode steps, match transformers."""
    model = tiny_models[name]
    engine = model.engine()
    ids = prompt_ids(length, seed=length)
    continuation = prompt_ids(DECODE_STEPS + 1, seed=length + 1)[1:]
    expected = model.reference_logits(ids + continuation)

    seq = engine.add_sequence()
    prefill = engine.prefill(seq, ids, all_logits=True)
    assert_logits_close(prefill, expected[:length], f"{name}: prefill of {length} tokens")
    for step, token in enumerate(continuation):
        logits = engine.decode([seq], [token])[0]
        assert_logits_close(logits, expected[length + step], f"{name}: decode step {step + 1} after {length} tokens")
    assert engine.length(seq) == length + DECODE_STEPS


@pytest.mark.parametrize("name", MODELS)
def test_prefill_last_logits_equal_all_logits_row(tiny_models, name):
    """`prefill(all_logits=False)` returns the last row that `all_logits=True` computes."""
    model = tiny_models[name]
    engine = model.engine()
    ids = prompt_ids(100, seed=7)
    last = engine.prefill(engine.add_sequence(), ids)
    full = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    assert last.shape == (model.artifact.manifest.model["vocab_size"],)
    assert_logits_close(last, full[-1], f"{name}: last-position prefill")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_transformers_generate(tiny_models, name):
    """32 greedy tokens are identical to transformers' `generate(do_sample=False)`."""
    model = tiny_models[name]
    ids = prompt_ids(100, seed=11)
    expected = model.reference_greedy(ids, GREEDY_TOKENS)
    assert len(expected) == GREEDY_TOKENS

    params = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_TOKENS, stop_token_ids=())
    generation = generate(model.engine(), ids, params)
    assert list(generation.tokens()) == expected
    assert generation.token_ids == expected
    assert generation.stats.new_tokens == GREEDY_TOKENS
    assert generation.stats.finish_reason == "length"


def test_tiny_models_exercise_their_features(tiny_models):
    """The premises of the comparisons above: each tiny model has the feature it stands for."""
    from safetensors.numpy import load_file

    expected = {
        "llama": dict(tie_word_embeddings=False, rope_scaling=None, sliding_window=None, attention_bias=False),
        "llama3_rope": dict(tie_word_embeddings=True, sliding_window=None, attention_bias=False),
        "mistral": dict(tie_word_embeddings=False, rope_scaling=None, sliding_window=16, attention_bias=False),
        "qwen2": dict(tie_word_embeddings=True, rope_scaling=None, sliding_window=None, attention_bias=True),
    }
    for name, features in expected.items():
        model = tiny_models[name]
        config = model.artifact.manifest.model
        assert {key: config[key] for key in features} == features, name
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2), f"{name}: GQA"
        tensors = load_file(str(model.model_dir / "model.safetensors"))
        assert ("lm_head.weight" in tensors) == (not config["tie_word_embeddings"]), name
    scaling = tiny_models["llama3_rope"].artifact.manifest.model["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}
    biases = load_file(str(tiny_models["qwen2"].model_dir / "model.safetensors"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert biases[f"model.layers.0.self_attn.{proj}.bias"].std() > 0.3, f"qwen2 {proj} bias is not random"

