"""A `--kv-quant` cache's own kernels: quantize new keys and values, store, copy and merge rows.

TVM's cache runtime moves keys and values only through kernels it is handed; for the
packed caches (`ir_passes/quantize_kv_cache.py`) these are ember's, over the rows of
`ember.ir.kv_cache.KVRows` (the attention kernels that read them are
`decode_attention.py` and `prefill_attention.py`, through `kv_storage.py`):

    split_and_quantize   the fused q/k/v of the new tokens -> q as it is, k and v as rows:
                         q8, per token and head, scale = absmax / 127, values round(x / scale);
                         f16, each value rounded to the nearest float16
    append_rows          each new token's k and v rows into its page slot
    copy_page_rows       a page's first rows into another page (forking a sequence mid-page)
    compact_rows         rows moved between positions (the runtime compacting a sequence)
    read_rows            rows at positions, as stored (the runtime's debug read)
    merge_states         two partial attention outputs by their log-sum-exps (base 2)

Only the split knows the rows' format; the others move whole rows as words. Every kernel
takes the shapes the runtime declares (word rows: see `KVRows`; pages as
`kv_storage.PackedPageRows` describes them) and reads them through views of their real
layout. Rotary embedding is applied before the split
(the pass moves it into the graph), so `apply_rope` must be 0.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ember.ir.kv_cache import KVRows
from ember.schedules.kv_storage import PackedPageRows
from ember.schedules.rope import Rotary


def split_and_quantize(rows: KVRows, dtype: str, symbol: str, rotary: Rotary | None = None):
    """The cache's `f_split_rotary`: (qkv, positions, q, k, v, apply_rope), q copied, k and v quantized. With
    `rotary`, q and k are rotated first where apply_rope > 0 (the runtime passes 1 for `RopeMode.NORMAL`):
    one kernel where the rotation would otherwise be one more and a concatenation of its outputs."""
    heads, head_dim, words = rows.num_kv_heads, rows.head_dim, rows.stored_kv_heads
    qo_heads = rows.num_qo_heads
    fused_words = rows.stored_qo_heads + 2 * words

    def rotated(qkv, cos_t, sin_t, apply_rope, t, h, i):
        """Element i of q or k head h of token t's fused q/k/v, rotated where `rotary` rotates."""
        return qkv[t, h, i] if rotary is None else rotary.rotate(qkv, cos_t, sin_t, apply_rope, t, h, i)

    @T.macro
    def quantize(head, t, h, values, scales, amax):
        """A staged head (`head_dim` floats) into row h's values (and scale) of token t."""
        if rows.scale_bytes > 0:
            amax[0] = T.float32(0)
            for i in T.serial(head_dim):
                amax[0] = T.max(amax[0], T.fabs(head[i]))
            inverse: T.let[T.float32] = T.if_then_else(amax[0] > 0, T.float32(127) / amax[0], T.float32(0))
            scales[t, rows.scale_word + h] = amax[0] / T.float32(127)
            for i in T.vectorized(head_dim):
                values[t, h * head_dim + i] = T.Cast(rows.value_dtype, T.round(head[i] * inverse))
        else:
            for i in T.vectorized(head_dim):
                values[t, h * head_dim + i] = T.Cast(rows.value_dtype, head[i])

    @T.prim_func(s_tir=True)
    def split(qkv_handle: T.handle, positions_handle: T.handle, q_handle: T.handle, k_handle: T.handle,
              v_handle: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        n = T.int64()
        positions_offset = T.int64()
        qkv_words = T.match_buffer(qkv_handle, (n, fused_words, 1), dtype)
        positions = T.match_buffer(positions_handle, (n,), "int32", elem_offset=positions_offset)
        q_words = T.match_buffer(q_handle, (n, rows.stored_qo_heads, 1), dtype)
        k_words = T.match_buffer(k_handle, (n, words, 1), dtype)
        v_words = T.match_buffer(v_handle, (n, words, 1), dtype)
        if rotary is None:
            assert apply_rope == 0, "this packed KV cache needs rotary embedding applied before attention"
        qkv = T.decl_buffer((n, qo_heads + 2 * heads, head_dim), dtype, data=qkv_words.data)
        q = T.decl_buffer((n, qo_heads, head_dim), dtype, data=q_words.data,
                          strides=(rows.stored_qo_heads, head_dim, 1))
        k_values = T.decl_buffer((n, rows.row_values), rows.value_dtype, data=k_words.data)
        v_values = T.decl_buffer((n, rows.row_values), rows.value_dtype, data=v_words.data)
        k_scales = T.decl_buffer((n, words), "float32", data=k_words.data)
        v_scales = T.decl_buffer((n, words), "float32", data=v_words.data)
        for t in T.parallel(n):
            with T.sblock("split"):
                T.reads()
                T.writes()
                head = T.sblock_alloc_buffer((head_dim,), dtype)
                amax = T.sblock_alloc_buffer((1,), "float32")
                cos_t = T.sblock_alloc_buffer((head_dim,), "float32")
                sin_t = T.sblock_alloc_buffer((head_dim,), "float32")
                if rotary is not None:
                    rotary.fill_angles(cos_t, sin_t, positions[t])
                for h in T.serial(qo_heads):
                    for i in T.vectorized(head_dim):
                        q[t, h, i] = rotated(qkv, cos_t, sin_t, apply_rope, t, h, i)
                for h in T.serial(heads):
                    for i in T.vectorized(head_dim):
                        head[i] = rotated(qkv, cos_t, sin_t, apply_rope, t, qo_heads + h, i)
                    quantize(head, t, h, k_values, k_scales, amax)
                    for i in T.vectorized(head_dim):
                        head[i] = qkv[t, qo_heads + heads + h, i]
                    quantize(head, t, h, v_values, v_scales, amax)

    return split


def append_rows(storage: PackedPageRows, dtype: str, symbol: str):
    """The cache's `f_transpose_append`: (pages, k rows, v rows, positions); position -1 is skipped."""
    words, page_size = storage.rows.stored_kv_heads, storage.page_size

    @T.prim_func(s_tir=True)
    def append(pages_handle: T.handle, k_handle: T.handle, v_handle: T.handle, positions_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        n = T.int64()
        num_pages = T.int64()
        positions_offset = T.int32()
        page_words = T.match_buffer(pages_handle, storage.page_shape(num_pages), dtype)
        k = T.match_buffer(k_handle, (n, words, 1), dtype)
        v = T.match_buffer(v_handle, (n, words, 1), dtype)
        positions = T.match_buffer(positions_handle, (n,), "int32", elem_offset=positions_offset)
        pages = T.decl_buffer(storage.words_shape(num_pages), dtype, data=page_words.data)
        for t in T.parallel(n):
            with T.sblock("append"):
                T.reads()
                T.writes()
                position: T.let[T.int32] = positions[t]
                if position != -1:
                    for w in T.vectorized(words):
                        pages[position // page_size, 0, position % page_size, w] = k[t, w, 0]
                        pages[position // page_size, 1, position % page_size, w] = v[t, w, 0]

    return append


def copy_page_rows(storage: PackedPageRows, dtype: str, symbol: str):
    """The cache's `f_copy_single_page`: (pages, source page, target page, rows to copy)."""

    @T.prim_func(s_tir=True)
    def copy_page(pages_handle: T.handle, source: T.int64, target: T.int64, length: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        num_pages = T.int32()
        page_words = T.match_buffer(pages_handle, storage.page_shape(num_pages), dtype)
        pages = T.decl_buffer(storage.words_shape(num_pages), dtype, data=page_words.data)
        for part, slot in T.grid(2, length):
            for w in T.serial(storage.rows.stored_kv_heads):
                pages[target, part, slot, w] = pages[source, part, slot, w]

    return copy_page


def compact_rows(storage: PackedPageRows, dtype: str, symbol: str):
    """The cache's `f_compact_copy`: (pages, per-sequence indptr, [2, n] source and target positions, batch)."""
    page_size = storage.page_size

    @T.prim_func(s_tir=True)
    def compact(pages_handle: T.handle, indptr_handle: T.handle, positions_handle: T.handle, batch_size: T.int32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        num_pages = T.int32()
        total = T.int32()
        indptr_offset = T.int32()
        positions_offset = T.int32()
        page_words = T.match_buffer(pages_handle, storage.page_shape(num_pages), dtype)
        indptr = T.match_buffer(indptr_handle, (batch_size + 1,), "int32", elem_offset=indptr_offset)
        positions = T.match_buffer(positions_handle, (2, total), "int32", elem_offset=positions_offset)
        pages = T.decl_buffer(storage.words_shape(num_pages), dtype, data=page_words.data)
        for b in T.serial(batch_size):
            for i in T.serial(indptr[b + 1] - indptr[b]):
                source: T.let[T.int32] = positions[0, indptr[b] + i]
                target: T.let[T.int32] = positions[1, indptr[b] + i]
                for part, w in T.grid(2, storage.rows.stored_kv_heads):
                    pages[target // page_size, part, target % page_size, w] = (
                        pages[source // page_size, part, source % page_size, w])

    return compact


def read_rows(storage: PackedPageRows, num_layers: int, dtype: str, symbol: str):
    """The cache's `f_debug_get_kv`: (pages, positions, k out, v out, layer), each row as stored."""
    words, page_size = storage.rows.stored_kv_heads, storage.page_size

    @T.prim_func(s_tir=True)
    def read(pages_handle: T.handle, positions_handle: T.handle, k_handle: T.handle, v_handle: T.handle,
             layer: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        n = T.int64()
        num_pages = T.int64()
        positions_offset = T.int64()
        page_words = T.match_buffer(pages_handle, storage.page_shape(num_pages), dtype)
        positions = T.match_buffer(positions_handle, (n,), "int32", elem_offset=positions_offset)
        k = T.match_buffer(k_handle, (num_layers, n, words, 1), dtype)
        v = T.match_buffer(v_handle, (num_layers, n, words, 1), dtype)
        pages = T.decl_buffer(storage.words_shape(num_pages), dtype, data=page_words.data)
        for t, w in T.grid(n, words):
            k[layer, t, w, 0] = pages[positions[t] // page_size, 0, positions[t] % page_size, w]
            v[layer, t, w, 0] = pages[positions[t] // page_size, 1, positions[t] % page_size, w]

    return read


def merge_states(rows: KVRows, dtype: str, symbol: str):
    """The cache's `f_merge_inplace`: (o, lse, o other, lse other) -> o, lse of both, per real query head."""
    heads, head_dim, q_words = rows.num_qo_heads, rows.head_dim, rows.stored_qo_heads

    @T.prim_func(s_tir=True)
    def merge(o_handle: T.handle, lse_handle: T.handle, o_other_handle: T.handle, lse_other_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        n = T.int32()
        o_words = T.match_buffer(o_handle, (n, q_words, 1), dtype)
        lse = T.match_buffer(lse_handle, (n, q_words), "float32")
        o_other_words = T.match_buffer(o_other_handle, (n, q_words, 1), dtype)
        lse_other = T.match_buffer(lse_other_handle, (n, q_words), "float32")
        o = T.decl_buffer((n, heads, head_dim), dtype, data=o_words.data, strides=(q_words, head_dim, 1))
        o_other = T.decl_buffer((n, heads, head_dim), dtype, data=o_other_words.data, strides=(q_words, head_dim, 1))
        for t in T.parallel(n):
            for h in T.serial(heads):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    top: T.let[T.float32] = T.max(lse[t, h], lse_other[t, h])
                    mine: T.let[T.float32] = T.exp2(lse[t, h] - top)
                    other: T.let[T.float32] = T.exp2(lse_other[t, h] - top)
                    for i in T.vectorized(head_dim):
                        o[t, h, i] = (o[t, h, i] * mine + o_other[t, h, i] * other) / (mine + other)
                    lse[t, h] = T.log2(mine + other) + top

    return merge
