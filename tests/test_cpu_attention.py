"""ember's CPU attention kernels against TVM's own paged-KV kernels, which they replace."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu
from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu, _attention_prefill_ragged_cpu

from ember.schedules.decode_attention import CHUNK, paged_decode_attention
from ember.schedules.prefill_attention import (
    BLOCK_ROWS,
    paged_prefill_attention,
    prefill_tile,
    ragged_prefill_attention,
)
from ember.targets.registry import resolve_target

PAGE = 16
HOST_LANES = resolve_target("cpu").vector_bits // 32  # float32 lanes of this machine's vectors


def _run(func: tvm.tirx.PrimFunc, q: np.ndarray, inputs: list[np.ndarray], flags: list[int]):
    """Output and lse of an attention kernel: (q, *inputs, output, lse, *flags, rope scale, theta, sm_scale)."""
    target = resolve_target("cpu").target
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    out = tvm.runtime.tensor(np.zeros(q.shape, q.dtype))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    args = [tvm.runtime.tensor(a) for a in (q, *inputs)]
    lib["main"](*args, out, lse, *flags, 1.0, 10000.0, float(1 / np.sqrt(q.shape[-1])))
    return out.numpy(), lse.numpy()


def _page_table(pages: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """indptr, page ids (scattered over `pages`) and last-page lengths of sequences of `lengths`."""
    num_pages = [-(-length // PAGE) for length in lengths]
    table = np.random.default_rng(1).permutation(pages.shape[0])[: sum(num_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
    last = np.array([length - (n - 1) * PAGE if n else 0 for length, n in zip(lengths, num_pages)], np.int32)
    return [indptr, table, last]


def _decode(func: tvm.tirx.PrimFunc, q, pages, lengths) -> tuple[np.ndarray, np.ndarray]:
    zeros = np.zeros(len(lengths), np.int32)
    return _run(func, q, [pages, *_page_table(pages, lengths), zeros, zeros], [0])


def _assert_same(ours, theirs, dtype):
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(ours[0].astype(np.float32), theirs[0].astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=tol, atol=tol)


# Float32 lanes of AVX-512, AVX2 and NEON: each vector width the kernels are built for.
LANES = (16, 8, 4)
DECODE_CASES = [
    (4, 12, 64, "float32", [129]),  # the 110M benchmark shape: groups of 3, several chunks
    (2, 2, 32, "float32", [1, CHUNK, CHUNK + 1, 0, 100, CHUNK - 1]),  # batch; one token, chunk edges, empty
    (1, 4, 12, "float32", [17]),  # head dim not a multiple of the vector width
    (2, 4, 16, "float16", [40]),
]


# Every case at this machine's lanes; the batch (one token, chunk edges, short last chunks) at every level's.
@pytest.mark.parametrize("case, lanes", [(case, lanes) for case in range(len(DECODE_CASES)) for lanes in LANES
                                         if lanes == HOST_LANES or case == 1])
def test_decode_attention_matches_tvm_kernel(case, lanes):
    kv_heads, qo_heads, head_dim, dtype, lengths = DECODE_CASES[case]
    rng = np.random.default_rng(0)
    total_pages = sum(-(-length // PAGE) for length in lengths) + 2
    q = rng.standard_normal((len(lengths), qo_heads, head_dim)).astype(dtype)
    pages = rng.standard_normal((total_pages, 2, kv_heads, PAGE, head_dim)).astype(dtype)
    ours = _decode(paged_decode_attention(kv_heads, qo_heads, head_dim, dtype, PAGE, lanes, "ours"), q, pages,
                   lengths)
    theirs = _decode(_attention_decode_cpu(kv_heads, qo_heads, head_dim, dtype, False, {}), q, pages, lengths)
    _assert_same(ours, theirs, dtype)


PREFILL_CASES = [
    (4, 12, 64, "float32", [128], 1),  # the 110M benchmark's prompt: 4 query blocks, 2 or 4 key chunks
    # batch: one token, key chunk edges (32 and 64 keys), query block edges
    (2, 2, 32, "float32", [1, 33, 65, BLOCK_ROWS - 1, BLOCK_ROWS + 1, 100], 1),
    (1, 4, 12, "float32", [17, 3], 0),  # not causal; head dim not a multiple of the vector width
    (2, 4, 16, "float16", [40], 1),
    (1, 6, 128, "float32", [70], 1),  # a long head dim: fewer pairs per register tile; groups of 6 fill tiles unevenly
]
# Every case at this machine's lanes; the batch edges and the long head dim at every level's.
PREFILL_RUNS = [(case, lanes) for case in range(len(PREFILL_CASES)) for lanes in LANES
                if lanes == HOST_LANES or case in (1, 4)]


def test_prefill_tiles_fit_the_vector_registers():
    """Score and output accumulators of a register tile stay within half the registers of each level."""
    assert prefill_tile(16, 64) == (4, 64) and prefill_tile(16, 128) == (2, 64)
    assert prefill_tile(8, 64) == (1, 64) and prefill_tile(4, 64) == (1, 32)
    for lanes in LANES:
        for head_dim in (12, 32, 64, 80, 128, 256):
            row_tile, keys = prefill_tile(lanes, head_dim)
            registers = 32 if lanes >= 16 else 16
            assert row_tile >= 1 and keys & (keys - 1) == 0 and keys <= 64
            assert row_tile * keys // lanes <= registers // 2
            assert row_tile == 1 or row_tile * -(-head_dim // lanes) <= registers // 2


def _ragged_case(case: int) -> tuple[np.ndarray, list[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Queries, inputs and TVM's output for PREFILL_CASES[case], new tokens attending to each other."""
    kv_heads, qo_heads, head_dim, dtype, lengths, causal = PREFILL_CASES[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((sum(lengths), qo_heads, head_dim)).astype(dtype)
    k, v = rng.standard_normal((2, sum(lengths), kv_heads, head_dim)).astype(dtype)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = [indptr, k, v, indptr, np.zeros(sum(lengths), np.int32), np.zeros(len(lengths), np.int32)]
    theirs = _run(_attention_prefill_ragged_cpu(kv_heads, qo_heads, head_dim, head_dim, dtype, {}), q, inputs,
                  [causal, 0])
    return q, inputs, theirs


def _paged_case(case: int) -> tuple[np.ndarray, list[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """As `_ragged_case`, for a later prompt chunk: the new queries against everything cached, new tokens included."""
    kv_heads, qo_heads, head_dim, dtype, lengths, causal = PREFILL_CASES[case]
    rng = np.random.default_rng(0)
    cached = [length + extra for length, extra in zip(lengths, (37, 0, 5, 16, 64, 3))]
    pages = rng.standard_normal((sum(-(-n // PAGE) for n in cached) + 2, 2, kv_heads, PAGE, head_dim)).astype(dtype)
    q = rng.standard_normal((sum(lengths), qo_heads, head_dim)).astype(dtype)
    q_indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = [q_indptr, pages, *_page_table(pages, cached), np.zeros(len(lengths), np.int32),
              np.zeros(sum(lengths), np.int32)]
    theirs = _run(_attention_prefill_cpu(kv_heads, qo_heads, head_dim, dtype, False, {}), q, inputs, [causal, 0])
    return q, inputs, theirs


# TVM's kernel runs once per case, whatever the lanes of ours.
_REFERENCES = {"ragged": functools.cache(_ragged_case), "paged": functools.cache(_paged_case)}


@pytest.mark.parametrize("case, lanes", PREFILL_RUNS)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_prefill_attention_matches_tvm_kernel(kind, case, lanes):
    kv_heads, qo_heads, head_dim, dtype, _lengths, causal = PREFILL_CASES[case]
    q, inputs, theirs = _REFERENCES[kind](case)
    kernel = (ragged_prefill_attention(kv_heads, qo_heads, head_dim, dtype, lanes, "ours") if kind == "ragged" else
              paged_prefill_attention(kv_heads, qo_heads, head_dim, dtype, PAGE, lanes, "ours"))
    _assert_same(_run(kernel, q, inputs, [causal, 0]), theirs, dtype)


# Llama: the three plain kernels and rope; Gemma 3's local and global layers: the sliding-window two as well.
@pytest.mark.parametrize("name, exported, windowed", [("llama", False, False), ("gemma3", True, True)])
def test_compiled_models_use_embers_kv_cache_kernels(tiny_models, name, exported, windowed):
    """The pipeline really swaps the attention and rope kernels in (TVM names them by symbol in the module)."""
    from ember.frontend.hf import import_hf_model
    from ember.ir.attributes import KERNEL_SOURCE_ATTR
    from ember.ir.quant_formats import FORMATS
    from ember.ir_passes import pipeline
    from ember.ir_passes.specialize_cpu_attention import ATTENTION_SYMBOLS
    from ember.schedules.rope import ROPE_SYMBOL

    target = resolve_target("cpu")
    imported = import_hf_model(tiny_models.checkpoint(name), target.target, "float32", exported=exported)
    kernels = pipeline.to_kernels(pipeline.with_entries(imported.mod, target), target,
                                  pipeline.LowerOptions(FORMATS["q0f32"], 16, 4))
    swapped = (*ATTENTION_SYMBOLS, *(() if exported else (ROPE_SYMBOL,)))  # an exported graph rotates q and k itself
    sources = {str(func.attrs["global_symbol"]): str(func.attrs[KERNEL_SOURCE_ATTR])
               for _, func in kernels.functions_items() if (func.attrs or {}).get("global_symbol") in swapped}
    attention = [s for s in ATTENTION_SYMBOLS if windowed or not s.endswith("_sliding_window")]
    assert sources == {**dict.fromkeys(attention, "ember.ir_passes.specialize_cpu_attention"),
                       **({} if exported else {ROPE_SYMBOL: "ember.ir_passes.specialize_cpu_rope"})}


def _prefetched_lines(storage, page: int, part: int, slot: int, head: int) -> set[int]:
    """The 64-byte lines, counted from the start of the pages, that `storage.prefetch` asks for."""
    from tvm.script import tirx as T

    num_pages = page + 1
    views = {"values": (storage.values_shape(num_pages), storage.values_dtype),
             "scales": (storage.scales_shape(num_pages), storage.scales_dtype)}

    @T.prim_func(s_tir=True)
    def prefetch_one(pages_handle: T.handle):
        pages = T.match_buffer(pages_handle, storage.page_shape(num_pages), "float32")
        values = T.decl_buffer(*views["values"], data=pages.data)
        scales = T.decl_buffer(*views["scales"], data=pages.data)
        storage.prefetch(values, scales, page, part, slot, head)

    mod = tvm.IRModule({"main": prefetch_one})
    with tvm.transform.PassContext(config={"tirx.UnrollLoop": {"explicit_unroll": True}}):
        mod = tvm.tirx.transform.StmtSimplify()(tvm.tirx.transform.UnrollLoop()(mod))
    # TIR has no visitor in TVM 0.27's Python API: read the constant indices off the printed script.
    loads = re.findall(r"llvm.prefetch.*?T.address_of\((values|scales)\[([\d, ]+)\]\)", str(mod))
    assert loads
    lines = set()
    for view, indices in loads:
        shape, dtype = views[view]
        flat = np.ravel_multi_index([int(i) for i in indices.split(",")], [int(d) for d in shape])
        lines.add(int(flat) * np.dtype(dtype).itemsize // 64)
    return lines


@pytest.mark.parametrize("storage", ["float32 64", "float16 64", "float32 24", "q8 4x64", "q8 2x80", "f16 4x64",
                                     "f16 2x24"])
def test_kv_prefetch_covers_every_line_a_token_reads(storage):
    """Decode attention prefetches a token's key and value rows ahead: every line they touch, in each layout."""
    from ember.ir.kv_cache import KV_ROWS
    from ember.schedules.kv_storage import FloatPages, PackedPageRows

    kind, size = storage.split()
    if kind in KV_ROWS:
        kv_heads, head_dim = map(int, size.split("x"))
        layout = PackedPageRows(KV_ROWS[kind](kv_heads * 3, kv_heads, head_dim), PAGE)
        rows = layout.rows

        def read(page, part, slot, head):  # the head's values, then its float32 scale if the rows have scales
            row = ((page * 2 + part) * PAGE + slot) * rows.row_bytes
            values = set(range(row + head * head_dim * rows.value_bytes,
                               row + (head + 1) * head_dim * rows.value_bytes))
            scale = row + rows.scale_word * 4 + head * 4
            return values | (set(range(scale, scale + 4)) if rows.scale_bytes else set())
    else:
        kv_heads, head_dim, element = 2, int(size), np.dtype(kind).itemsize
        layout = FloatPages(kv_heads * 2, kv_heads, head_dim, PAGE, kind)

        def read(page, part, slot, head):
            row = (((page * 2 + part) * kv_heads + head) * PAGE + slot) * head_dim * element
            return set(range(row, row + head_dim * element))
    slots_read = [(0, 0, 0, 0), *((2, 1, slot, head) for slot in range(PAGE) for head in range(kv_heads))]
    for page, part, slot, head in slots_read:
        touched = {byte // 64 for byte in read(page, part, slot, head)}  # slots put rows at every offset in a line
        assert touched <= _prefetched_lines(layout, page, part, slot, head), (page, part, slot, head)
