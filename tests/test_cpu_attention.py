"""ember's CPU decode attention kernel against TVM's own paged-KV decode kernel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

from ember.schedules.attention import CHUNK, paged_decode_attention
from ember.targets.registry import resolve_target

PAGE = 16


def _decode(func: tvm.tirx.PrimFunc, q, pages, lengths) -> tuple[np.ndarray, np.ndarray]:
    target = resolve_target("cpu").target
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    num_pages = [-(-length // PAGE) for length in lengths]
    table = np.random.default_rng(1).permutation(pages.shape[0])[: sum(num_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    last = np.array([length - (n - 1) * PAGE if n else 0 for length, n in zip(lengths, num_pages)], np.int32)
    zeros = np.zeros(len(lengths), np.int32)
    out = tvm.runtime.tensor(np.zeros(q.shape, q.dtype))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    args = [tvm.runtime.tensor(a) for a in (q, pages, indptr, table, last, zeros, zeros)]
    lib["main"](*args, out, lse, 0, 1.0, 10000.0, float(1 / np.sqrt(q.shape[-1])))
    return out.numpy(), lse.numpy()


@pytest.mark.parametrize(
    "kv_heads, qo_heads, head_dim, dtype, lengths",
    [
        (4, 12, 64, "float32", [129]),  # the 110M benchmark shape: groups of 3, several chunks
        (2, 2, 32, "float32", [1, CHUNK, CHUNK + 1, 0, 100]),  # batch; one token, chunk edges, empty
        (1, 4, 12, "float32", [17]),  # head dim not a multiple of the vector width
        (2, 4, 16, "float16", [40]),
    ],
)
def test_decode_attention_matches_tvm_kernel(kv_heads, qo_heads, head_dim, dtype, lengths):
    rng = np.random.default_rng(0)
    total_pages = sum(-(-length // PAGE) for length in lengths) + 2
    q = rng.standard_normal((len(lengths), qo_heads, head_dim)).astype(dtype)
    pages = rng.standard_normal((total_pages, 2, kv_heads, PAGE, head_dim)).astype(dtype)
    lanes = resolve_target("cpu").vector_bits // 32
    ours = _decode(paged_decode_attention(kv_heads, qo_heads, head_dim, dtype, PAGE, lanes, "ours"), q, pages, lengths)
    theirs = _decode(_attention_decode_cpu(kv_heads, qo_heads, head_dim, dtype, False, {}), q, pages, lengths)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(ours[0].astype(np.float32), theirs[0].astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=tol, atol=tol)


def test_compiled_models_use_embers_decode_attention(tiny_models):
    """The pipeline really swaps the kernel in (TVM names it `batch_decode_paged_kv_cpu` in the module)."""
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline
    from ember.ir_passes.module_utils import KERNEL_SOURCE_ATTR
    from ember.ir_passes.quant_formats import FORMATS
    from ember.ir_passes.specialize_cpu_attention import DECODE_ATTENTION_SYMBOL

    target = resolve_target("cpu")
    imported = import_hf_model(tiny_models.checkpoint("llama"), target.target, "float32")
    kernels = pipeline.to_kernels(imported.mod, target, pipeline.LowerOptions(FORMATS["q0f32"], 64, 4))
    sources = [str(func.attrs[KERNEL_SOURCE_ATTR]) for _, func in kernels.functions_items()
               if (func.attrs or {}).get("global_symbol") == DECODE_ATTENTION_SYMBOL]
    assert sources == ["ember.ir_passes.specialize_cpu_attention"]
