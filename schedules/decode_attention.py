"""ember's CPU decode attention over the paged KV cache: parallel over KV heads, vectorized.

TVM's `TIRPagedKVCache` ships one CPU decode kernel (`_attention_decode_cpu`): every
sequence and head in one serial loop, scalar dot products, and an online-softmax
rescale of the whole output row for every cached token: on the 110M benchmark model a
share of each decode step worth removing (measured in docs/benchmarks.md#schedule-measurements).

This kernel has the same signature and results, so the KV cache runtime calls it
unchanged (`ir_passes/specialize_cpu_attention.py` swaps it in). It also reads a `--kv-quant`
cache's rows (`kv_storage.py`; the q8 cache's: a dot product or value row times its scale):

    parallel (sequence, kv head)          # the query heads sharing a KV head go together
      q[g, :] = Q[b, head g] * scale * log2(e)
      for each chunk of CHUNK cached tokens
        prefetch K[t + AHEAD], V[t + AHEAD]  # pages are scattered: the CPU's prefetchers stop at each
        s[g, t] = q[g, :] . K[t, :]       # vector FMAs along the head dim, tree sum of vector halves
        m' = max(m, s[g, :]); rescale o[g, :] and d once per chunk, not per token
        p[g, t] = 2^(s[g, t] - m'); d += sum p   # vector_math.exp2: a vector per chunk, no libm call per score
        o[g, :] += p[g, t] * V[t, :]      # vector FMAs, V read once for the whole group
      out = o / d;  lse = m + log2(d)     # base 2, as the runtime's state merge expects

Scores use exp2 with log2(e) folded into the query, as TVM's kernels do; `lse` is
in the same base-2 units, since the runtime merges attention states with it.

With a `window`, the kernel starts at the first key whose position is within `window`
of the query's, so its cost stays flat past the window. Where only some layers have one
(`window_pages`), the runtime hands their kernels the pages of the last `window` tokens,
with length info as [3, batch] (last page's length, slots of the first page before the
window, sinks: none here); where all do, every page, as for a model without a window.

With attention sinks (`CacheShape.sinks`, gpt-oss's learned logit per head), the last KV-head count
of query heads carry each KV head's sinks and the layer's window, which the kernel masks by; a
query's running max and denominator start from its sink (one term of that score) where the keys
handed hold its own key, which in a forked sequence's decode only the part of its own pages does.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ember.ir.tvmscript import parsed_once
from ember.schedules.kv_storage import FloatPages, PackedPageRows
from ember.schedules.vector_math import exp2, reduce_lanes

# Cached tokens scored per softmax rescale.
CHUNK = 32
# How many tokens ahead of its reads a task prefetches keys and values (`kv_storage` `prefetch`): a page
# of 16 slots; 8 and 32 measured no different (docs/benchmarks.md#schedule-measurements).
AHEAD = 16
# Initial running max: TVM's kernels start from the same value, so an empty
# sequence yields the same (output 0, lse -5e4) that its state merge expects.
_START_MAX = -5e4


def length_info_shape(batch_size, window_pages: bool) -> tuple:
    """The runtime's length info: each sequence's last page length, and two rows more for the pages of a window."""
    return (3, batch_size) if window_pages else (batch_size,)


def last_page_length(length_info, b, window_pages: bool):
    """Tokens in sequence b's last page, from the runtime's length info."""
    return length_info[0, b] if window_pages else length_info[b]


def skipped_slots(length_info, b, window_pages: bool):
    """Slots of sequence b's first handed page before the window's first key (0 where all pages are handed)."""
    return length_info[1, b] if window_pages else T.int32(0)


def capped(score, softcap: float):
    """A base-2 score (the natural one times log2(e)) soft-capped at `softcap` as the natural one is:
    softcap * tanh(x / softcap); unchanged for a `softcap` of 0."""
    if not softcap:
        return score
    cap = T.float32(softcap * math.log2(math.e))
    return cap * T.tanh(score / cap)


def distance_biased(score, slopes: tuple[float, ...], head, distance):
    """A base-2 score plus the head's ALiBi bias, slope * distance (natural units, converted); unchanged without
    slopes. One slope serves every head."""
    if not slopes:
        return score
    slope = T.float32(slopes[0] * math.log2(math.e))
    for index in range(1, len(slopes)):
        slope = T.if_then_else(head == index, T.float32(slopes[index] * math.log2(math.e)), slope)
    return score + slope * T.Cast("float32", distance)


def starting_max(queries, token, carrier, g, holds_own_key, sinks: bool):
    """The running maximum an online softmax starts from, with a denominator of one term of that score: without
    `sinks`, TVM's -5e4 (a term nothing is weighed against); with them, where the keys handed `holds_own_key`, the
    sink logit of query head `g` of the group (`carrier`'s value `g`, in base 2), so that the sink joins the
    denominator once, in the partial attention the runtime's merge then weighs with the rest."""
    if not sinks:
        return T.float32(_START_MAX)
    sink = T.Cast("float32", queries[token, carrier, g]) * T.float32(math.log2(math.e))
    return T.if_then_else(holds_own_key, sink, T.float32(_START_MAX))


def first_visible(query_position, first_key_position, window):
    """The index (in the keys handed) of the first key a query at `query_position` sees through `window`
    (0 without one): a constant, or the window a layer's sinks carry (`carried_window`), 0 for none."""
    if isinstance(window, int):
        return T.max(query_position - window + 1 - first_key_position, 0) if window else T.int32(0)
    return T.if_then_else(window > 0, T.max(query_position - window + 1 - first_key_position, 0), 0)


def carried_window(queries, token, carrier, group: int):
    """The window of the layer whose sinks `carrier` carries (`CacheShape.sinks`: the value after the sinks)."""
    return T.Cast("int32", queries[token, carrier, group])


@parsed_once
def paged_decode_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                           page_size: int, lanes: int, symbol: str, storage: FloatPages | PackedPageRows | None = None,
                           window: int = 0, window_pages: bool = False, softcap: float = 0.0,
                           slopes: tuple[float, ...] = (), sinks: bool = False):
    """The decode attention PrimFunc for these sizes; `lanes` is the float32 vector width.

    `symbol` is the exported name the KV cache runtime looks up (TVM's kernel's); `storage`
    the page layout (`kv_storage.py`), TVM's float pages by default; `window` the sliding window
    of the layers it serves (0: the whole context), `window_pages` whether it is handed only the
    window's pages (TVM's sliding-window slot); `softcap` the soft-cap of the scores (0: none), `slopes` the heads'
    ALiBi slopes (none: no distance bias); `sinks` whether the last `num_kv_heads` query heads carry attention
    sinks (`CacheShape.sinks`): each KV head's first values, its query heads' sink logits, then the layer's
    window, which the kernel masks keys by."""
    storage = storage or FloatPages(num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
    if sinks and (window or window_pages):
        raise ValueError("with sinks, each layer's window comes with them; the kernel takes no window of its own")
    heads = num_qo_heads - num_kv_heads if sinks else num_qo_heads  # the model's query heads
    group = heads // num_kv_heads
    lanes = 1 << (min(lanes, head_dim, 16).bit_length() - 1)  # a power of two, at most 16
    while head_dim % lanes:
        lanes //= 2
    log2e = math.log2(math.e)

    @T.prim_func(s_tir=True)
    def decode_attention(
        q_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_values_handle: T.handle,
        last_page_len_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,  # rotary embedding is applied before the cache (RopeMode.NORMAL)
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        batch_size = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        indptr_offset = T.int32()
        values_offset = T.int32()
        k_rope_offset = T.int32()
        q_rope_offset = T.int32()
        length_offset = T.int32()
        queries = T.match_buffer(q_handle, (batch_size, storage.q_heads, storage.q_dim), dtype)
        pages = T.match_buffer(pages_handle, storage.page_shape(max_num_pages), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch_size + 1,), "int32", elem_offset=indptr_offset)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=values_offset)
        length_info = T.match_buffer(last_page_len_handle, length_info_shape(batch_size, window_pages), "int32",
                                     elem_offset=length_offset)
        key_positions = T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_offset)
        query_positions = T.match_buffer(q_rope_position_handle, (batch_size,), "int32", elem_offset=q_rope_offset)
        outputs = T.match_buffer(output_handle, (batch_size, storage.q_heads, storage.q_dim), dtype)
        lses = T.match_buffer(lse_handle, (batch_size, storage.q_heads), "float32")
        query_heads = T.decl_buffer((batch_size, num_qo_heads, head_dim), dtype, data=queries.data,
                                    strides=(storage.q_heads * storage.q_dim, head_dim, 1))
        values = T.decl_buffer(storage.values_shape(max_num_pages), storage.values_dtype, data=pages.data)
        scales = T.decl_buffer(storage.scales_shape(max_num_pages), storage.scales_dtype, data=pages.data)
        output = T.decl_buffer((batch_size, num_qo_heads, head_dim), dtype, data=outputs.data,
                               strides=(storage.q_heads * storage.q_dim, head_dim, 1))
        lse = T.decl_buffer((batch_size, num_qo_heads), "float32", data=lses.data, strides=(storage.q_heads, 1))

        for task in T.parallel(batch_size * num_kv_heads):
            with T.sblock("attention"):
                T.reads()
                T.writes()
                q = T.sblock_alloc_buffer((group, head_dim), "float32")
                o = T.sblock_alloc_buffer((group, head_dim), "float32")
                s = T.sblock_alloc_buffer((group, CHUNK), "float32")
                acc = T.sblock_alloc_buffer((lanes,), "float32")
                m = T.sblock_alloc_buffer((group,), "float32")
                d = T.sblock_alloc_buffer((group,), "float32")
                m_new = T.sblock_alloc_buffer((1,), "float32")
                token_page = T.sblock_alloc_buffer((CHUNK,), "int32")  # where each token of the chunk is cached
                token_slot = T.sblock_alloc_buffer((CHUNK,), "int32")
                b: T.let[T.int32] = task // num_kv_heads
                h: T.let[T.int32] = task % num_kv_heads
                first_page: T.let[T.int32] = page_indptr[b]
                num_pages: T.let[T.int32] = page_indptr[b + 1] - first_page
                skipped: T.let[T.int32] = skipped_slots(length_info, b, window_pages)
                length: T.let[T.int32] = T.if_then_else(
                    num_pages > 0,
                    (num_pages - 1) * page_size + last_page_length(length_info, b, window_pages) - skipped, 0)
                begin: T.let[T.int32] = first_visible(
                    query_positions[b], key_positions[b],
                    carried_window(query_heads, b, heads + h, group) if sinks else window)
                for g in T.serial(group):
                    # d starts at one term of score m: a sink where these keys hold the query's own, else nothing.
                    m[g] = starting_max(query_heads, b, heads + h, g, query_positions[b] - key_positions[b] < length,
                                        sinks)
                    d[g] = T.float32(1.0)
                    for i in T.vectorized(head_dim):
                        q[g, i] = T.Cast("float32", query_heads[b, h * group + g, i]) * sm_scale * T.float32(log2e)
                        o[g, i] = T.float32(0.0)
                for chunk in T.serial((length - begin + CHUNK - 1) // CHUNK):
                    rows: T.let[T.int32] = T.min(CHUNK, length - begin - chunk * CHUNK)
                    for t in T.serial(rows):
                        pos: T.let[T.int32] = begin + chunk * CHUNK + t
                        token_page[t] = page_values[first_page + (skipped + pos) // page_size]
                        token_slot[t] = (skipped + pos) % page_size
                        if pos + AHEAD < length:
                            ahead: T.let[T.int32] = skipped + pos + AHEAD
                            ahead_page: T.let[T.int32] = page_values[first_page + ahead // page_size]
                            for part in T.unroll(2):
                                storage.prefetch(values, scales, ahead_page, part, ahead % page_size, h)
                        for g in T.serial(group):
                            for i in T.vectorized(lanes):
                                acc[i] = T.float32(0.0)
                            for i_o in T.unroll(head_dim // lanes):
                                for i in T.vectorized(lanes):
                                    acc[i] = acc[i] + q[g, i_o * lanes + i] * storage.value(
                                        values, token_page[t], 0, token_slot[t], h, i_o * lanes + i)
                            reduce_lanes(acc, lanes, False)
                            s[g, t] = distance_biased(
                                capped(acc[0] * storage.scale(scales, token_page[t], 0, token_slot[t], h), softcap),
                                slopes, h * group + g, key_positions[b] + pos - query_positions[b])
                    for g in T.serial(group):
                        m_new[0] = m[g]
                        for t in T.serial(rows):
                            m_new[0] = T.max(m_new[0], s[g, t])
                        rescale: T.let[T.float32] = T.exp2(m[g] - m_new[0])
                        d[g] = d[g] * rescale
                        for i in T.vectorized(head_dim):
                            o[g, i] = o[g, i] * rescale
                        m[g] = m_new[0]
                        # The whole chunk in vectors; lanes past `rows` (last chunk) are never read.
                        for t in T.vectorized(CHUNK):
                            s[g, t] = exp2(s[g, t] - m_new[0])
                        for t in T.serial(rows):
                            d[g] = d[g] + s[g, t]
                    for t in T.serial(rows):
                        value_scale: T.let[T.float32] = storage.scale(scales, token_page[t], 1, token_slot[t], h)
                        for g in T.serial(group):
                            for i in T.vectorized(head_dim):
                                o[g, i] = o[g, i] + s[g, t] * value_scale * storage.value(
                                    values, token_page[t], 1, token_slot[t], h, i)
                for g in T.serial(group):
                    for i in T.vectorized(head_dim):
                        output[b, h * group + g, i] = T.Cast(dtype, o[g, i] / d[g])
                    lse[b, h * group + g] = m[g] + T.log2(d[g])
                if sinks:  # the carrier's own output: nothing (the graph drops it)
                    for i in T.vectorized(head_dim):
                        output[b, heads + h, i] = T.Cast(dtype, T.float32(0))
                    lse[b, heads + h] = T.float32(_START_MAX)

    return decode_attention
