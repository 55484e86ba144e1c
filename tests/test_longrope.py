"""Longrope (Phi-3, Phi-4-mini) against transformers: short factors up to `original_max_position_embeddings`
tokens, long ones past it, for every position of the sequence alike (`ir_passes/longrope_choice.py`,
`runtime/longrope.py`).

The tiny Phi-4-mini of the families table (switch at 32 tokens) compiled with prefill chunks of 16, so a prompt
past the switch is prefilled in chunks that each see fewer tokens than the prompt. The definition every step must
meet: transformers' logits of one forward over the sequence up to that token (what its `generate` computes, by
dropping its cache when the sequence first passes the switch). Each mutation below moves one piece of the
mechanism and must leave that definition by more than the bound: the checks can fail.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from families import full_forward_logits
from helpers import assert_logits_close, assert_one_line_error, prompt_ids, run_ember

SWITCH = 32  # the family's original_max_position_embeddings
CHUNK = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def phi4(tiny_models, tmp_path_factory):
    """The tiny Phi-4-mini compiled with prefill chunks of 16 (the shared artifact's chunk holds 3 windows)."""
    import artifact_cache
    from conftest import TinyModel

    from ember.driver.compiler import CompileOptions, compile_model

    model_dir = tiny_models.checkpoint("phi4_mini")
    options = CompileOptions(quantization="q0f32", prefill_chunk=CHUNK, max_batch=4, frontend="torch-export",
                             show_progress=False)
    out = tmp_path_factory.mktemp("longrope") / "phi4-chunk16"
    artifact_cache.build(artifact_cache.artifact_key("tiny-phi4_mini-chunk16", options, [model_dir]), out,
                         lambda dest: compile_model(model_dir, dest, options))
    return TinyModel("phi4_mini", model_dir, out)


def test_the_artifact_records_the_switch_and_takes_the_prompt_end(phi4):
    manifest = phi4.artifact.manifest
    assert manifest.kv_cache["rope"]["long_factors_above"] == SWITCH
    assert manifest.entry_inputs("prefill") == ["input_ids", "logit_positions", "prompt_end", "kv_cache"]
    assert manifest.entry_inputs("verify") == ["input_ids", "prompt_end", "kv_cache"]
    assert manifest.entry_inputs("decode") == ["input_ids", "kv_cache"]


@pytest.mark.parametrize("length", [5, CHUNK + 4, SWITCH, SWITCH + 1, 3 * CHUNK + 5])
def test_prefill_in_chunks_matches_transformers_on_both_sides_of_the_switch(phi4, length):
    ids = prompt_ids(length, seed=length)
    engine = phi4.engine()
    assert_logits_close(engine.prefill(engine.add_sequence(), ids, all_logits=True),
                        full_forward_logits(phi4, ids), f"prefill of {length} tokens")


def test_the_short_and_long_factors_differ_enough_to_be_seen(phi4):
    """The bound tells the factor sets apart: the first SWITCH tokens prefilled alone (short factors) leave
    transformers' rows for them in a longer prompt (long factors) by far more than 1e-4."""
    ids = prompt_ids(SWITCH + 8, seed=3)
    engine = phi4.engine()
    short = engine.prefill(engine.add_sequence(), ids[:SWITCH], all_logits=True)
    assert np.abs(short - full_forward_logits(phi4, ids)[:SWITCH]).max() > 1e-2


def test_decode_across_the_switch_computes_the_keys_again(phi4):
    """A prompt below the switch decoded past it: each step equals one forward over the sequence so far (the step
    that passes the switch recomputes the cached keys with the long factors)."""
    ids = prompt_ids(SWITCH + 10, seed=5)
    engine = phi4.engine()
    seq = engine.add_sequence()
    engine.prefill(seq, ids[:SWITCH - 4])
    for position in range(SWITCH - 4, len(ids)):
        assert_logits_close(engine.decode([seq], [ids[position]])[0],
                            full_forward_logits(phi4, ids[:position + 1])[-1], f"decode at position {position}")


def test_a_decode_batch_mixes_sequences_on_both_sides_of_the_switch(phi4):
    """Four sequences, two below the switch, one crossing it in this step, one past it: each its own factors."""
    prompts = [prompt_ids(n, seed=60 + n) for n in (6, SWITCH - 3, SWITCH, SWITCH + 9)]
    engine = phi4.engine()
    seqs = [engine.add_sequence() for _ in prompts]
    for seq, ids in zip(seqs, prompts):
        engine.prefill(seq, ids)
    nexts = [prompt_ids(4, seed=70 + i)[1:] for i in range(len(prompts))]
    for step in range(3):
        logits = engine.decode(seqs, [n[step] for n in nexts])
        for i, ids in enumerate(prompts):
            sequence = ids + nexts[i][:step + 1]
            assert_logits_close(logits[i], full_forward_logits(phi4, sequence)[-1], f"sequence {i}, step {step}")


def test_verify_across_the_switch_matches_transformers(phi4):
    """Speculative decoding's verify of 6 tokens that carry the sequence past the switch."""
    ids = prompt_ids(SWITCH + 3, seed=8)
    engine = phi4.engine()
    seq = engine.add_sequence()
    engine.prefill(seq, ids[:SWITCH - 3])
    assert_logits_close(engine.verify(seq, ids[SWITCH - 3:]), full_forward_logits(phi4, ids)[SWITCH - 3:],
                        "verify across the switch")


def test_a_fork_and_a_truncation_back_below_the_switch_take_the_short_factors_again(phi4):
    ids = prompt_ids(SWITCH + 6, seed=9)
    engine = phi4.engine()
    parent = engine.add_sequence()
    engine.prefill(parent, ids)  # long factors
    child = engine.fork_sequence(parent, 20)
    assert_logits_close(engine.decode([child], [ids[20]])[0], full_forward_logits(phi4, ids[:21])[-1],
                        "a fork at 20 tokens of a long parent")
    engine.truncate(parent, SWITCH - 2)
    assert_logits_close(engine.prefill(parent, ids[SWITCH - 2:SWITCH]), full_forward_logits(phi4, ids[:SWITCH])[-1],
                        "a truncated sequence grown back to the switch")
    assert_logits_close(engine.decode([parent], [ids[SWITCH]])[0], full_forward_logits(phi4, ids[:SWITCH + 1])[-1],
                        "and past it")


def test_prefill_told_each_chunk_s_own_end_fails_the_comparison(phi4, monkeypatch):
    """Mutation: prefill chunks rotated by the tokens seen so far (each chunk's own end) instead of the prompt's."""
    from ember.runtime import engine as engine_module

    def chunk_end(self, seq_id, tokens, all_logits, new_length):
        outputs = [real(self, seq_id, tokens[begin:begin + CHUNK], True, self._lengths[seq_id] + len(
            tokens[begin:begin + CHUNK])) for begin in range(0, len(tokens), CHUNK)]
        logits = np.concatenate(outputs)
        return logits if all_logits else logits[-1]

    real = engine_module.Engine._prefill_chunks
    monkeypatch.setattr(engine_module.Engine, "_prefill_chunks", chunk_end)
    ids = prompt_ids(3 * CHUNK + 5, seed=11)
    engine = phi4.engine()
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_logits_close(engine.prefill(engine.add_sequence(), ids, all_logits=True),
                            full_forward_logits(phi4, ids), "chunks told their own end")


def test_decode_that_keeps_the_short_keys_fails_the_comparison(phi4, monkeypatch):
    """Mutation: the keys cached with the short factors are kept when the sequence passes the switch (as a cache
    that only rotates new tokens would)."""
    from ember.runtime.longrope import LongropeKeys

    monkeypatch.setattr(LongropeKeys, "stale", lambda self, seq_id, new_length: None)
    ids = prompt_ids(SWITCH + 4, seed=12)
    engine = phi4.engine()
    seq = engine.add_sequence()
    engine.prefill(seq, ids[:SWITCH])
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_logits_close(engine.decode([seq], [ids[SWITCH]])[0], full_forward_logits(phi4, ids[:SWITCH + 1])[-1],
                            "short keys kept")


def test_a_switch_one_token_late_fails_the_comparison(phi4):
    """Mutation: the runtime's switch moved by one (the graph's stays): the prompt of exactly SWITCH + 1 tokens is
    then rotated with the short factors."""
    ids = prompt_ids(SWITCH + 1, seed=13)
    engine = phi4.engine()
    engine._longrope.long_above += 1
    seq = engine.add_sequence()
    engine.prefill(seq, ids[:SWITCH])
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_logits_close(engine.decode([seq], [ids[SWITCH]])[0], full_forward_logits(phi4, ids)[-1],
                            "switch one token late")


def test_pipeline_stages_are_refused_in_one_line(tiny_models, tmp_path):
    out = tmp_path / "pipe"
    result = run_ember("compile", str(tiny_models.checkpoint("phi4_mini")), "-o", str(out), "--frontend",
                       "torch-export", "--pipeline-stages", "2", "--no-progress")
    assert_one_line_error(result, "--pipeline-stages 2: the model's longrope factors switch when a sequence passes "
                                  f"{SWITCH} tokens")
    assert not out.exists()


@pytest.mark.parametrize("forgery", ["a string switch", "a switch without prompt_end", "prompt_end without a switch"])
def test_a_forged_switch_is_refused_in_one_line(phi4, tmp_path, forgery):
    from ember.core.errors import ArtifactError
    from ember.core.manifest import MANIFEST_NAME, manifest_digest, read_manifest

    forged = tmp_path / "forged"
    shutil.copytree(phi4.artifact_dir, forged)
    data = json.loads((forged / MANIFEST_NAME).read_text())
    if forgery == "a string switch":
        data["kv_cache"]["rope"]["long_factors_above"] = "32"
    elif forgery == "a switch without prompt_end":
        data["entry_functions"]["prefill"]["inputs"].remove({"name": "prompt_end", "shape": [1], "dtype": "int32"})
    else:
        del data["kv_cache"]["rope"]["long_factors_above"]
    data["manifest_sha256"] = manifest_digest(data)
    (forged / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="long_factors_above") as err:
        read_manifest(forged)
    assert "\n" not in str(err.value)
