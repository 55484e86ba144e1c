"""`--kv-quant`: keys and values stored as int8 rows with a float32 scale per token and head (q8), or as float16.

The cache is TVM's paged runtime with ember's kernels (`ir_passes/quantize_kv_cache.py`),
so what must hold: logits stay within a stated tolerance of transformers' float cache
over 64 decode steps (the rounding is the only difference: q8, 1/254 of each head's
largest key or value; f16, 2^-11 of each value), the demo's perplexity within 0.5% of the
float cache (q8), the memory report at <= 0.3x (q8) and 0.5x (f16) the float32 bytes per
token, and everything the runtime does with a cache (chunked prefill, batches, forks,
rollback) the same as for one sequence alone.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import assert_logits_close, prompt_ids, run_ember

import ember
from ember.core.errors import EmberError
from ember.core.manifest import read_manifest
from ember.driver.compiler import CompileOptions, compile_model

DECODE_STEPS = 64
# Max |logit difference| / max |logit| against transformers' float cache, as measured over prefill and 64 decode
# steps: q8, 0.06% (GPT-2) to 1.2% (llama) on these random tiny models, whose head dim of 16 makes each head's
# rounding large next to a real model's (the demo: mean KL 1e-5 nats/token); f16, 0.002% (GPT-2) to 0.06% (llama);
# ember's float cache stays within 2.4e-6.
TOLERANCE = {"q8": 2.5e-2, "f16": 1.5e-3}
# f16 on every frontend kind (a cache that rotates keys, a graph with learned positions), q8 on every rotary variant.
# Windows: Mistral's on every layer (the plain kernels see through it), Gemma 3's on some (the window's slots).
# Attention sinks: gpt-oss's (their carrier heads ride in the packed cache's query words).
CASES = [("q8", "llama", "builtin"), ("q8", "llama3_rope", "builtin"), ("q8", "qwen2", "builtin"),
         ("q8", "gpt2", "torch-export"), ("f16", "llama", "builtin"), ("f16", "gpt2", "torch-export"),
         ("q8", "mistral", "builtin"), ("f16", "gemma3", "torch-export"), ("q8", "gpt_oss", "torch-export")]


@pytest.mark.parametrize("kv_quant,name,frontend", CASES)
@pytest.mark.slow
def test_cache_decode_tracks_transformers(tiny_models, kv_quant, name, frontend):
    """100 prompt tokens (two prefill chunks: the second attends to cached rows), then 64 decode steps, against
    transformers' float forward and cached decoding. The builtin models have the cache rotate keys (the pass moves
    rotary embedding into the graph); GPT-2's graph has learned positions."""
    model = tiny_models.kv_quantized(name, frontend, kv_quant)
    engine = model.engine()
    ids = prompt_ids(100, seed=21)
    continuation = prompt_ids(DECODE_STEPS + 1, seed=22)[1:]
    seq = engine.add_sequence()
    assert_logits_close(engine.prefill(seq, ids, all_logits=True), model.reference_logits(ids),
                        f"{name}: {kv_quant} cache prefill", tol=TOLERANCE[kv_quant])
    expected = model.reference_decode_logits(ids, continuation)
    actual = np.stack([engine.decode([seq], [token])[0] for token in continuation])
    assert_logits_close(actual, expected, f"{name}: {kv_quant} cache, {DECODE_STEPS} decode steps",
                        tol=TOLERANCE[kv_quant])
    # Quantization changes the logits, but not so little that the test could not tell the caches apart.
    assert np.abs(actual - expected).max() > 1e-6


@pytest.mark.parametrize("kv_quant", ["q8", "f16"])
def test_cache_batches_forks_and_rolls_back_like_one_sequence(tiny_models, kv_quant):
    """Two sequences decoded as a batch equal each run alone; a sequence forked mid-page (its rows copied) continues
    as a fresh prefill of the same tokens does; decoding, truncating and decoding again repeats the logits."""
    model = tiny_models.kv_quantized("llama", kv_quant=kv_quant)
    first, second = prompt_ids(37, seed=23), prompt_ids(53, seed=24)
    steps = prompt_ids(6, seed=25)

    def alone(ids):
        engine = model.engine()
        seq = engine.add_sequence()
        engine.prefill(seq, ids)
        return np.stack([engine.decode([seq], [token])[0] for token in steps])

    engine = model.engine()
    a, b = engine.add_sequence(), engine.add_sequence()
    engine.prefill(a, first)
    engine.prefill(b, second)
    batched = np.stack([engine.decode([a, b], [token, token]) for token in steps], axis=1)
    assert_logits_close(batched[0], alone(first), f"{kv_quant} cache: first of a batch of two", tol=1e-5)
    assert_logits_close(batched[1], alone(second), f"{kv_quant} cache: second of a batch of two", tol=1e-5)

    parent = engine.add_sequence()
    engine.prefill(parent, second)
    child = engine.fork_sequence(parent, 37)  # 37 = two pages and 5 rows of a third: copied by the page kernel
    forked = np.stack([engine.decode([child], [token])[0] for token in steps])
    assert_logits_close(forked, alone(second[:37]), f"{kv_quant} cache: forked mid-page", tol=1e-5)

    engine.truncate(child, 37)
    again = np.stack([engine.decode([child], [token])[0] for token in steps])
    assert_logits_close(again, forked, f"{kv_quant} cache: decoded again after truncate", tol=1e-6)


@pytest.mark.slow
def test_demo_q8_cache_perplexity_and_bytes(demo_builds):
    """The demo model's perplexity on its validation text within 0.5% of the float cache's, in the same run; the
    memory report (and `inspect`) at <= 0.3x the float32 cache's bytes per token."""
    q8, reference = demo_builds.get_many([("cpu", "q0f32", True, "q8"), ("cpu", "q0f32", True, None)])
    result = run_ember("eval", str(q8), "--perplexity", str(ember.DEMO_MODEL_DIR / "validation.txt"),
                       "--reference", str(reference), "--no-progress")
    assert result.returncode == 0, result.stderr
    q8_ppl, float_ppl = (float(value) for value in re.findall(r"perplexity ([0-9.]+)", result.stdout))
    print(f"demo perplexity: q8 KV cache {q8_ppl}, float32 cache {float_ppl}")
    assert abs(q8_ppl - float_ppl) <= 0.005 * float_ppl

    q8_bytes = read_manifest(q8).memory["kv_bytes_per_token"]
    float_bytes = read_manifest(reference).memory["kv_bytes_per_token"]
    assert read_manifest(q8).kv_cache["quantization"] == "q8"
    assert q8_bytes <= 0.3 * float_bytes, (q8_bytes, float_bytes)
    inspect = run_ember("inspect", str(q8))
    assert "float32 as int8 rows, a float32 scale per token and head" in inspect.stdout


def test_kv_quant_refuses_what_it_cannot_build(tiny_models, tmp_path):
    """A GPU target is refused before anything is written, in one line naming the option."""
    with pytest.raises(EmberError, match=r"^--kv-quant q8: the quantized KV cache's kernels are CPU kernels"):
        compile_model(tiny_models.checkpoint("llama"), tmp_path / "cuda", CompileOptions(
            target="cuda:l4", kv_quant="q8", show_progress=False))
    assert not (tmp_path / "cuda").exists()


@pytest.mark.parametrize("kv_quant,bits", [("q8", 8 * (16 + 4) / 16), ("f16", 16)])
def test_measure_times_a_packed_cache_artifact(tiny_models, kv_quant, bits):
    """`analyze --measure` rebuilds the artifact's kernels with its packed cache (q and k rotated inside the cache's
    split, no rotary kernel of its own) and models its KV bytes: q8 at int8 plus the scales (10 bits at a head dim of
    16), f16 at 16 bits."""
    from ember.driver.analyze.measure import measure
    from ember.targets.hardware import Hardware

    generous = Hardware("generous", "generous", "cpu", {"fp32": 1e14}, memory_bandwidth=1e13, memory_capacity=1e12,
                        onchip_memory=2**20, source="test")
    m = measure(tiny_models.kv_quantized("llama", kv_quant=kv_quant).artifact_dir, prompt_len=16, batch=2, repeats=1,
                hardware=generous)
    assert m.precision.kvbits == bits
    for stage in (m.prefill, m.decode):
        names = {k.name for k in stage.kernels}
        assert "vm.builtin.attention_kv_cache_attention_with_fused_qkv" in names
        assert not any("rope" in name for name in names), names
        assert all(k.seconds > 0 for k in stage.kernels)


def test_f16_cache_bytes_and_inspect(tiny_models):
    """The f16 cache holds half the float32 cache's bytes per token, in the manifest and in `inspect`'s words."""
    f16, reference = tiny_models.kv_quantized("llama", kv_quant="f16"), tiny_models.quantized("llama", "q0f32")
    f16_manifest = read_manifest(f16.artifact_dir)
    assert f16_manifest.kv_cache["quantization"] == "f16"
    assert 2 * f16_manifest.memory["kv_bytes_per_token"] == read_manifest(reference.artifact_dir).memory[
        "kv_bytes_per_token"]
    inspect = run_ember("inspect", str(f16.artifact_dir))
    assert inspect.returncode == 0, inspect.stderr
    assert "float32 as float16 rows" in inspect.stdout
