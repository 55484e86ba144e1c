"""ember's CPU rotary embedding kernel against TVM's `fused_rope`, which it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

from ember.schedules.rope import Rotary, fused_qkv_rope
from ember.targets.registry import resolve_target

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _rope(func: tvm.tirx.PrimFunc, qkv: np.ndarray, positions: np.ndarray, heads: tuple[int, int, int],
          apply_rope: int) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=resolve_target("cpu").target)
    outputs = [tvm.runtime.tensor(np.zeros((qkv.shape[0], count, qkv.shape[2]), qkv.dtype)) for count in heads]
    lib["main"](tvm.runtime.tensor(qkv), tvm.runtime.tensor(positions), *outputs, apply_rope)
    return [output.numpy() for output in outputs]


@pytest.mark.parametrize("scaling", [{}, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("tokens, dtype, apply_rope", [(1, "float32", 1), (37, "float32", 1), (5, "float16", 1),
                                                       (3, "float32", 0)])
def test_rope_matches_tvm_kernel(scaling, tokens, dtype, apply_rope):
    """Same angle expressions; LLVM may contract llama3's smoothing into FMAs differently (~1e-7)."""
    q_heads, kv_heads, head_dim, theta = 6, 2, 32, 500000.0
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((tokens, q_heads + 2 * kv_heads, head_dim)).astype(dtype)
    positions = rng.permutation(4 * tokens)[:tokens].astype(np.int32) + 3000  # past llama3's smoothing band
    heads = (q_heads, kv_heads, kv_heads)
    ours = _rope(fused_qkv_rope(q_heads, kv_heads, Rotary(head_dim, dtype, theta, scaling)), qkv, positions, heads,
                 apply_rope)
    theirs = _rope(llama_rope_with_position_map(theta, 1.0, head_dim, q_heads, kv_heads, dtype, scaling), qkv,
                   positions, heads, apply_rope)
    tol = 1e-5 if dtype == "float32" else 1e-3
    for mine, reference in zip(ours, theirs):
        np.testing.assert_allclose(mine.astype(np.float32), reference.astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(ours[2], qkv[:, q_heads + kv_heads:])  # v passes through
