"""`--frontend torch-export`: models compiled from the graph transformers' own code traces.

No hand-written definition is involved: transformers builds the model, torch.export
traces its full-sequence forward, and `ir_passes/specialize_attention.py` gives its
attention the paged KV cache. The result must match transformers (prefill at every
position, decode on the cache, greedy tokens), equal ember's hand-written frontend
on the same checkpoint, and batch sequences like it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import assert_batched_equals_solo, assert_logits_close, prompt_ids

from ember.core.errors import ModelError
from ember.runtime import SamplingParams, generate

# Llama and Qwen2 (GQA, tied and untied embeddings, q/k/v biases) also have ember's hand-written definition; the
# others have none (see `models.EXPORTED_MODELS` and `models.FAMILIES` for what each family brings: learned and
# cumsum-counted positions, LayerNorm, GELU, fused projections, parallel residuals, partial and interleaved rotary,
# multi-query, Phi-3's window, Gemma's head dim of 256). `tests/test_families_*.py` check the whole table.
EXPORTED = ("llama", "qwen2", "gpt2", "gpt_neox", "phi3", "gemma")
MORE_FAMILIES = ("gptj", "opt", "falcon")  # checked on prefill and decode
BOTH_FRONTENDS = ("llama", "qwen2")
DECODE_STEPS = 16


@pytest.mark.parametrize("name", EXPORTED + MORE_FAMILIES)
@pytest.mark.slow
def test_exported_prefill_and_decode_match_transformers(tiny_models, name):
    """100 prompt tokens (two prefill chunks) at every position against transformers' forward, then 16 decode
    steps on the paged cache against transformers' own cached decoding."""
    model = tiny_models.exported(name)
    engine = model.engine()
    ids = prompt_ids(100, seed=3)
    continuation = prompt_ids(DECODE_STEPS + 1, seed=4)[1:]
    seq = engine.add_sequence()
    assert_logits_close(engine.prefill(seq, ids, all_logits=True), model.reference_logits(ids),
                        f"{name}: exported prefill")
    expected = model.reference_decode_logits(ids, continuation)
    for step, token in enumerate(continuation):
        assert_logits_close(engine.decode([seq], [token])[0], expected[step],
                            f"{name}: exported decode step {step + 1}")


@pytest.mark.parametrize("name", BOTH_FRONTENDS)
def test_exported_equals_the_builtin_frontend(tiny_models, name):
    """The same checkpoint through torch.export and through ember's Llama definition: the same logits."""
    ids = prompt_ids(40, seed=5)
    logits = []
    for model in (tiny_models.exported(name), tiny_models[name]):
        engine = model.engine()
        seq = engine.add_sequence()
        rows = [engine.prefill(seq, ids, all_logits=True)]
        rows += [engine.decode([seq], [token]) for token in prompt_ids(4, seed=6)]
        logits.append(np.concatenate(rows))
    scale = np.abs(logits[1]).max()
    assert np.abs(logits[0] - logits[1]).max() <= 1e-5 * scale


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_greedy_tokens_equal_transformers_generate(tiny_models, name):
    model = tiny_models.exported(name)
    ids = prompt_ids(60, seed=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=())
    assert list(generate(model.engine(), ids, params).tokens()) == model.reference_greedy(ids, 32)


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_interleaved_sequences_equal_their_solo_runs(tiny_models, name):
    """Two sequences prefilled and decoded together in one batch give each its solo logits."""
    model = tiny_models.exported(name)
    prompts = [prompt_ids(30, seed=9), prompt_ids(45, seed=10)]
    steps = [prompt_ids(6, seed=11), prompt_ids(6, seed=12)]
    assert_batched_equals_solo(model, prompts, steps)


def test_attention_without_a_causal_mask_is_refused():
    """A bidirectional attention (no causal mask) cannot be cached: refused, naming the operator."""
    import torch

    from ember.frontend.torch_export import import_module
    from ember.ir_passes.specialize_attention import specialize_attention

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.qkv = torch.nn.Linear(16, 48)
            self.head = torch.nn.Linear(16, 32)

        def forward(self, input_ids, use_cache=False):
            x = self.embed(input_ids)
            q, k, v = (t.view(1, -1, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # no is_causal
            return self.head(out.transpose(1, 2).reshape(1, -1, 16))

    forward, _shapes = import_module(Encoder().eval(), max_seq_len=64)
    with pytest.raises(ModelError, match="softmax <- .*: attention without a causal mask"):
        specialize_attention(tvm.target.Target("llvm"))(forward)


def test_attention_with_a_distance_bias_keeps_its_slope():
    """An additive bias linear in the distance on top of a causal mask (ALiBi, here one slope for every head) is
    compiled with its slope, not as plain causal attention (`test_attention_masks.py` has per-head slopes and the
    biases refused)."""
    import torch

    from ember.frontend.torch_export import import_module
    from ember.ir_passes.specialize_attention import specialize_attention

    class AlibiDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.qkv = torch.nn.Linear(16, 48)
            self.head = torch.nn.Linear(16, 32)

        def forward(self, input_ids, use_cache=False):
            x = self.embed(input_ids)
            n = input_ids.shape[1]
            q, k, v = (t.view(1, n, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
            positions = torch.arange(n)
            distance = (positions[None, :] - positions[:, None]).float()
            bias = torch.where(distance > 0, float("-inf"), distance * 0.5)  # causal, plus a linear penalty
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return self.head(out.transpose(1, 2).reshape(1, n, 16))

    forward, _shapes = import_module(AlibiDecoder().eval(), max_seq_len=64)
    from ember.ir.kv_cache import recorded_scores

    assert recorded_scores(specialize_attention(tvm.target.Target("llvm"))(forward))[1] == pytest.approx((0.5, 0.5))


@pytest.mark.slow
@pytest.mark.parametrize("name", ("llama", "gpt2"))
def test_analyze_measures_an_exported_artifact(tiny_models, name):
    """`ember analyze --measure` rebuilds an artifact's kernels by importing its graph again: the kernels it
    times are the artifact's (it refuses otherwise). Llama's projections keep their checkpoint names and map
    onto the roofline's operators; GPT-2's have no such operators and are timed without a prediction."""
    from helpers import run_ember

    model = tiny_models.exported(name)
    result = run_ember("analyze", str(model.artifact_dir), "--measure", "--prompt-len", "16", "--wide")
    assert result.returncode == 0, result.stderr
    assert "Prefill: 1 sequence x 16 tokens" in result.stdout and "Decode: one step" in result.stdout
    if name == "llama":
        assert "q_proj+k_proj+v_proj" in result.stdout and "gate_proj+up_proj" in result.stdout
