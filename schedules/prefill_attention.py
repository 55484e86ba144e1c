"""ember's CPU prefill attention: query blocks in parallel, scores and softmax in vectors.

TVM's `TIRPagedKVCache` ships two CPU prefill kernels, both one serial scalar loop:
`batch_prefill_ragged_kv` (the new tokens attending to each other, causally) and
`batch_prefill_paged_kv_cpu` (the new tokens attending to the tokens already cached,
for a prompt fed in chunks). The ragged one scores every query against every key,
masked ones included, and took a large share of a 110M model's prefill (measured in
docs/benchmarks.md#schedule-measurements). These kernels have the same signatures and
results, so the KV cache runtime calls them unchanged (`ir_passes/specialize_cpu_attention.py`
swaps them in):

    parallel (sequence, block of BLOCK_ROWS query rows, KV head)
      qs[r, g] = Q[row r, head g of the group] * scale * log2(e)    # the block's (row, head) pairs
      for each chunk of `keys` keys up to the block's causal limit
        kt = the chunk's keys, transposed [head_dim, keys];  vc = its values
        per tile of `row_tile` pairs (`prefill_tile`: as many as the vector registers hold):
          s[t, :] = qs[t] @ kt                   # vector over keys: no horizontal sums; the tile's
                                                 #   pairs are independent FMA chains on each kt load
          per pair: mask keys past its row's causal limit
            m' = max(m, s) (vector folds); rescale o, d once per chunk
            p[t, :] = 2^(s - m')                 # vector_math.exp2: no libm call per score
          o[t] += p[t] @ vc                      # vector over the head dim, each vc row loaded once per tile
      out = o / d;  lse = m + log2(d)            # base 2, as the runtime's state merge expects

The sizes are measured (`scripts/bench_attention.py`; docs/benchmarks.md#schedule-measurements): one
pair at a time, 8-row blocks and 32-key chunks left two 16-lane score chains waiting on the FMA latency;
these sizes take much less time over cached keys and in a short prompt's causal attention (32-row blocks
transpose each key chunk once for 96 pairs; 64-key chunks halve the softmax's share).

Causal blocks grow in cost with their position, and TVM's thread pool hands each
thread one contiguous range of tasks, so tasks visit the blocks in the order
0, n-1, 1, n-2, ... that balances the two halves. Rotary embedding must already be
applied to q and k (ember's models use `RopeMode.NORMAL`); the kernels check it.
Both kernels also read a `--kv-quant` cache's rows (`kv_storage.py`: int8 with scales, or
float16), converted to float32 as a chunk of keys and values is loaded.

The paged kernel also serves windowed layers (`window`): each (row, head) pair sees the
keys whose positions lie in (its query's position - window, its query's position], by the
positions the runtime passes, and a block reads only the keys its rows can see (handed
every page, or, `window_pages`, those of each sequence's last `window` cached tokens). The ragged kernel stays
causal: the compiler keeps prefill chunks no longer than the window, so no new token can
fall out of a newer one's window.

With attention sinks (`CacheShape.sinks`), the last KV-head count of query heads carry each KV
head's sinks and the layer's window: a row's online softmax starts from its sink (one term of that
score) where the keys handed hold the row's own key (the ragged kernel's always do, the paged one's
never in a prefill), so the runtime's merge counts it once; and every row sees through the window
its carrier holds, by position.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ember.ir.kv_cache import KVRows
from ember.ir.tvmscript import parsed_once
from ember.schedules.decode_attention import (
    capped,
    carried_window,
    distance_biased,
    last_page_length,
    length_info_shape,
    skipped_slots,
    starting_max,
)
from ember.schedules.kv_storage import FloatPages, PackedPageRows
from ember.schedules.vector_math import MAX_REDUCED_LANES, exp2, reduce_lanes

# Query rows per task: each chunk of keys is transposed once for all their (row, head) pairs.
BLOCK_ROWS = 32
# Keys per softmax rescale, at most: the scores' max and sum fold that many lanes (`reduce_lanes`).
MAX_KEYS = MAX_REDUCED_LANES
# Initial running max, as in TVM's kernels: a row without keys gets output 0, lse -5e4.
_START_MAX = -5e4


def prefill_tile(lanes: int, head_dim: int) -> tuple[int, int]:
    """(pairs per register tile, keys per chunk) for `lanes`-wide float32 vectors.

    A tile's scores are row_tile x keys / lanes accumulators, its outputs row_tile x head_dim / lanes,
    each within half the level's vector registers (32 at 512 bits, else 16, as `int8_matmul` counts)
    so that neither loop spills: AVX-512 with head dim 64 takes 4 pairs of 64 keys, AVX2 one pair of
    64 keys, NEON one pair of 32 keys."""
    budget = (32 if lanes >= 16 else 16) // 2
    keys = min(MAX_KEYS, budget * lanes)
    widest = max(keys // lanes, -(-head_dim // lanes))  # accumulators of a pair in the wider loop
    return max(1, budget // widest), keys



def _padded(rows: int, row_tile: int) -> int:
    """`rows` (query row x head pairs) rounded up to whole register tiles."""
    return -(-rows // row_tile) * row_tile


def _macros(group: int, head_dim: int, dtype: str, row_tile: int, key_chunk: int, block: int, softcap: float,
            slopes: tuple[float, ...], sinks: int):
    """The parts both kernels share, as TVMScript macros; `block` is a task's (row, head) pairs in whole tiles,
    `sinks` the first query head that carries attention sinks (`CacheShape.sinks`; 0: none)."""
    log2e = math.log2(math.e)

    @T.macro
    def start_rows(q, q_start, row0, rows, h, sm_scale, qs, o, m, d, q_pos, first_key_position, kv_len):
        # Every pair of the block's tiles starts clean: a last tile's pairs past the rows score zeros, unused.
        # A row's sink joins its denominator as one term where the keys handed hold the row's own key.
        for rg in T.serial(block):
            if sinks > 0:
                with_sink: T.let[T.bool] = (rg < rows * group) & (
                    q_pos[q_start + row0 + T.min(rg, rows * group - 1) // group] - first_key_position < kv_len)
                m[rg] = starting_max(q, q_start + row0 + T.min(rg, rows * group - 1) // group, sinks + h,
                                     rg % group, with_sink, True)
                d[rg] = T.if_then_else(with_sink, T.float32(1.0), T.float32(0.0))
            else:
                m[rg] = T.float32(_START_MAX)
                d[rg] = T.float32(0.0)
            for i in T.vectorized(head_dim):
                qs[rg, i] = T.if_then_else(rg < rows * group, T.Cast("float32", q[
                    q_start + row0 + T.min(rg, rows * group - 1) // group, h * group + rg % group, i]), T.float32(0)
                ) * sm_scale * T.float32(log2e)
                o[rg, i] = T.float32(0)

    @T.macro
    def attend(qs, o, m, d, kt, vc, s, p, red, rows, keys, first_key, low_base, limit_base, causal, kv_len, h,
               distance_base):
        for tile in T.serial((rows * group + row_tile - 1) // row_tile):
            # Scores of the tile's pairs: row_tile x key_chunk / lanes independent FMA chains.
            for r in T.unroll(row_tile):
                for j in T.vectorized(key_chunk):
                    s[r, j] = T.float32(0)
            for i in T.serial(head_dim):
                for r in T.unroll(row_tile):
                    for j in T.vectorized(key_chunk):
                        s[r, j] = s[r, j] + qs[tile * row_tile + r, i] * kt[i, j]
            for r in T.serial(row_tile):
                rg: T.let[T.int32] = tile * row_tile + r
                # Keys from `low` and before `limit` are visible to this pair's row.
                limit: T.let[T.int32] = T.if_then_else(causal > 0, T.min(limit_base + rg // group + 1, kv_len), kv_len)
                for j in T.vectorized(key_chunk):
                    red[j] = T.if_then_else(_visible(first_key + j, low_base, rg // group, limit), distance_biased(
                        capped(s[r, j], softcap), slopes, h * group + rg % group,
                        distance_base + first_key + j - rg // group), T.float32(_START_MAX))
                reduce_lanes(red, key_chunk, True)
                m_new: T.let[T.float32] = T.max(m[rg], red[0])
                rescale: T.let[T.float32] = exp2(m[rg] - m_new)
                for j in T.vectorized(key_chunk):
                    p[r, j] = T.if_then_else(_visible(first_key + j, low_base, rg // group, limit), exp2(
                        distance_biased(capped(s[r, j], softcap), slopes, h * group + rg % group,
                                        distance_base + first_key + j - rg // group) - m_new), T.float32(0))
                    red[j] = p[r, j]
                reduce_lanes(red, key_chunk, False)
                d[rg] = d[rg] * rescale + red[0]
                m[rg] = m_new
                for i in T.vectorized(head_dim):
                    o[rg, i] = o[rg, i] * rescale
            # Outputs: each value row loaded once for the tile's pairs.
            for j in T.serial(keys):
                for r in T.unroll(row_tile):
                    for i in T.vectorized(head_dim):
                        o[tile * row_tile + r, i] = o[tile * row_tile + r, i] + p[r, j] * vc[j, i]

    @T.macro
    def finish_rows(output, lse, q_start, row0, rows, h, o, m, d):
        for rg in T.serial(rows * group):
            # A row without keys keeps TVM's (output 0, lse -5e4).
            total: T.let[T.float32] = T.if_then_else(d[rg] > T.float32(0), d[rg], T.float32(1.0))
            for i in T.vectorized(head_dim):
                output[q_start + row0 + rg // group, h * group + rg % group, i] = T.Cast(dtype, o[rg, i] / total)
            lse[q_start + row0 + rg // group, h * group + rg % group] = m[rg] + T.log2(total)
        if sinks > 0:  # the carrier's own output: nothing (the graph drops it)
            for r in T.serial(rows):
                for i in T.vectorized(head_dim):
                    output[q_start + row0 + r, sinks + h, i] = T.Cast(dtype, T.float32(0))
                lse[q_start + row0 + r, sinks + h] = T.float32(_START_MAX)

    return start_rows, attend, finish_rows


def _visible(key, low_base, row, limit):
    """Key index `key` lies in [low_base + row, limit); a `low_base` of the constant 0 (no window) leaves the low
    bound out of the code."""
    if isinstance(low_base, tirx.IntImm) and low_base.value == 0:
        return key < limit
    return tirx.all(key >= low_base + row, key < limit)


def _balanced_block(position, blocks):
    """The query block a task at `position` of a sequence's `blocks` takes: 0, n-1, 1, n-2, ..."""
    return T.if_then_else(position % 2 == 0, position // 2, blocks - 1 - position // 2)


class _Ragged:
    """Where the keys and values are, as TIR expressions over a kernel's KV buffers `kv` (a list).

    Here kv = [k, v, kv_indptr]: the new tokens' keys and values, [tokens, heads, dim]."""

    def start(self, kv, b):
        """Sequence b's first entry in the KV index (a token, or a page-table slot)."""
        return kv[2][b]

    def length(self, kv, b):
        """Sequence b's number of keys."""
        return kv[2][b + 1] - kv[2][b]

    def row(self, kv, start, pos, h, i, part):
        """Element i of head h of the key (`part` 0) or value (1) at `pos` of the sequence at `start`, as float32
        before its scale."""
        return T.Cast("float32", kv[part][start + pos, h, i])

    def scale(self, kv, start, pos, h, part):
        """The scale of that key's or value's row of head h (1: floats are stored as they are)."""
        return T.float32(1)


class _PackedRagged(_Ragged):
    """As `_Ragged`, for a `--kv-quant` cache's new tokens: kv = [k, v, kv_indptr, k scales, v scales], k and v
    rows of [tokens, values of a row] (`KVRows`) with any float32 scales in [tokens, words of a row]."""

    def __init__(self, rows: KVRows) -> None:
        self.rows = rows

    def row(self, kv, start, pos, h, i, part):
        return T.Cast("float32", kv[part][start + pos, h * self.rows.head_dim + i])

    def scale(self, kv, start, pos, h, part):
        if self.rows.scale_bytes == 0:
            return T.float32(1)
        return kv[3 + part][start + pos, self.rows.scale_word + h]


class _Paged:
    """As `_Ragged`, with kv = [values, page_indptr, page_values, length_info, scales]: keys and values
    in cache pages, read through `storage` (`kv_storage.py`). With `window_pages`, length_info is [3, batch]
    and the keys start `skipped_slots` into the first page (`decode_attention`'s helpers)."""

    def __init__(self, storage: FloatPages | PackedPageRows, window_pages: bool = False) -> None:
        self.storage, self.page_size, self.window_pages = storage, storage.page_size, window_pages

    def start(self, kv, b):
        """The page-table slot of sequence b's first page, in slots: its keys begin `skipped_slots` in."""
        return kv[1][b] * self.page_size + skipped_slots(kv[3], b, self.window_pages)

    def length(self, kv, b):
        pages = kv[1][b + 1] - kv[1][b]
        return T.if_then_else(pages > 0, (pages - 1) * self.page_size + last_page_length(kv[3], b, self.window_pages)
                              - skipped_slots(kv[3], b, self.window_pages), 0)

    def row(self, kv, start, pos, h, i, part):
        page, slot = kv[2][(start + pos) // self.page_size], (start + pos) % self.page_size
        return self.storage.value(kv[0], page, part, slot, h, i)

    def scale(self, kv, start, pos, h, part):
        page, slot = kv[2][(start + pos) // self.page_size], (start + pos) % self.page_size
        return self.storage.scale(kv[4], page, part, slot, h)


def _attention_tasks(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, lanes: int,
                     source: _Ragged | _Paged, window: int = 0, softcap: float = 0.0,
                     slopes: tuple[float, ...] = (), sinks: bool = False):
    """The kernels' parallel loop as a macro: every (sequence, query block, KV head) task; with a `window`,
    each row sees the keys within it of its query's position (and none after it), by the positions given; with
    `sinks`, the last `num_kv_heads` of the `num_qo_heads` carry attention sinks (`CacheShape.sinks`)."""
    if sinks and window:
        raise ValueError("with sinks, each layer's window comes with them; the kernel takes no window of its own")
    heads = num_qo_heads - num_kv_heads if sinks else num_qo_heads  # the model's query heads
    group = heads // num_kv_heads
    row_tile, key_chunk = prefill_tile(lanes, head_dim)
    block = _padded(BLOCK_ROWS * group, row_tile)  # a task's (row, head) pairs, in whole register tiles
    start_rows, attend, finish_rows = _macros(group, head_dim, dtype, row_tile, key_chunk, block, softcap, slopes,
                                              heads if sinks else 0)

    def _limit_base(kv_len, q_len, row0, first_position, first_key_position, layer_window):
        """Row r of the block sees keys before limit_base + r + 1: causally from the end of the keys, or, with a
        window, up to its own position."""
        if isinstance(layer_window, int):
            return first_position - first_key_position if layer_window else kv_len - q_len + row0
        return T.if_then_else(layer_window > 0, first_position - first_key_position, kv_len - q_len + row0)

    def _low_base(first_position, first_key_position, layer_window):
        """Row r of the block sees keys from low_base + r (a chain's rows are consecutive positions): none before
        its window, or all (the constant 0; a window carried with sinks: one far before every key)."""
        if isinstance(layer_window, int):
            return first_position - layer_window + 1 - first_key_position if layer_window else T.int32(0)
        return T.if_then_else(layer_window > 0, first_position - layer_window + 1 - first_key_position,
                              T.int32(-(1 << 30)))

    def _window(q, token, h):
        """The window the rows of KV head `h` see through: the kernel's, or the one their sinks carry."""
        return carried_window(q, token, heads + h, group) if sinks else window

    def _causal(causal, layer_window):
        """Windowed rows are bounded by their own positions: causal whatever the runtime says."""
        if isinstance(layer_window, int):
            return T.int32(1) if layer_window else causal
        return T.if_then_else(layer_window > 0, T.int32(1), causal)

    @T.macro
    def attention_tasks(q, q_indptr, kv, output, lse, causal, sm_scale, batch_size, qo_len, q_pos, k_pos):
        blocks: T.let[T.int32] = (qo_len + BLOCK_ROWS - 1) // BLOCK_ROWS  # per sequence, at most
        for task in T.parallel(batch_size * blocks * num_kv_heads):
            with T.sblock("attention"):
                T.reads()
                T.writes()
                qs = T.sblock_alloc_buffer((block, head_dim), "float32")
                o = T.sblock_alloc_buffer((block, head_dim), "float32")
                m = T.sblock_alloc_buffer((block,), "float32")
                d = T.sblock_alloc_buffer((block,), "float32")
                kt = T.sblock_alloc_buffer((head_dim, key_chunk), "float32")
                key_scale = T.sblock_alloc_buffer((key_chunk,), "float32")
                vc = T.sblock_alloc_buffer((key_chunk, head_dim), "float32")
                s = T.sblock_alloc_buffer((row_tile, key_chunk), "float32")
                p = T.sblock_alloc_buffer((row_tile, key_chunk), "float32")
                red = T.sblock_alloc_buffer((key_chunk,), "float32")
                h: T.let[T.int32] = task % num_kv_heads
                b: T.let[T.int32] = task // num_kv_heads // blocks
                position: T.let[T.int32] = task // num_kv_heads % blocks
                q_start: T.let[T.int32] = q_indptr[b]
                q_len: T.let[T.int32] = q_indptr[b + 1] - q_start
                kv_start: T.let[T.int32] = source.start(kv, b)
                kv_len: T.let[T.int32] = source.length(kv, b)
                own_blocks: T.let[T.int32] = (q_len + BLOCK_ROWS - 1) // BLOCK_ROWS
                if position < own_blocks:
                    row0: T.let[T.int32] = _balanced_block(position, own_blocks) * BLOCK_ROWS
                    rows: T.let[T.int32] = T.min(BLOCK_ROWS, q_len - row0)
                    # Row r sees keys from low_base + r and before limit_base + r + 1 (key indices).
                    limit_base: T.let[T.int32] = _limit_base(kv_len, q_len, row0, q_pos[q_start + row0], k_pos[b],
                                                             _window(q, q_start + row0, h))
                    begin: T.let[T.int32] = T.max(_low_base(q_pos[q_start + row0], k_pos[b],
                                                            _window(q, q_start + row0, h)), 0)
                    end: T.let[T.int32] = T.if_then_else(_causal(causal, _window(q, q_start + row0, h)) > 0,
                                                         T.max(T.min(kv_len, limit_base + rows), 0), kv_len)
                    start_rows(q, q_start, row0, rows, h, sm_scale, qs, o, m, d, q_pos, k_pos[b], kv_len)
                    for chunk in T.serial((end - begin + key_chunk - 1) // key_chunk):
                        first: T.let[T.int32] = begin + chunk * key_chunk
                        keys: T.let[T.int32] = T.min(key_chunk, end - first)
                        for j in T.serial(key_chunk):
                            key_scale[j] = T.if_then_else(j < keys, source.scale(
                                kv, kv_start, first + T.min(j, keys - 1), h, 0), T.float32(0))
                        for j, i in T.grid(key_chunk, head_dim):
                            kt[i, j] = (source.row(kv, kv_start, first + T.min(j, keys - 1), h, i, 0)
                                        * key_scale[j])
                        for j in T.serial(keys):
                            value_scale: T.let[T.float32] = source.scale(kv, kv_start, first + j, h, 1)
                            for i in T.vectorized(head_dim):
                                vc[j, i] = source.row(kv, kv_start, first + j, h, i, 1) * value_scale
                        # A key's distance from its row's query: key index + distance_base - the row (in the block).
                        attend(qs, o, m, d, kt, vc, s, p, red, rows, keys, first,
                               _low_base(q_pos[q_start + row0], k_pos[b], _window(q, q_start + row0, h)), limit_base,
                               _causal(causal, _window(q, q_start + row0, h)), kv_len, h,
                               k_pos[b] - q_pos[q_start + row0])
                    finish_rows(output, lse, q_start, row0, rows, h, o, m, d)

    return attention_tasks


@parsed_once
def ragged_prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, lanes: int,
                             symbol: str, rows: KVRows | None = None, softcap: float = 0.0,
                             slopes: tuple[float, ...] = (), sinks: bool = False):
    """Replacement for TVM's `batch_prefill_ragged_kv`: new tokens' q, k, v in [tokens, heads, dim]; with `rows`,
    a `--kv-quant` cache's: k and v rows as it stores them, q and the output at the front of its word rows.
    `lanes` is the float32 vector width, `softcap` the soft-cap of the scores (0: none), `slopes` the heads' ALiBi
    slopes, `sinks` whether the last `num_kv_heads` query heads carry attention sinks."""
    source = _PackedRagged(rows) if rows else _Ragged()
    q_heads, q_dim = (rows.stored_qo_heads, 1) if rows else (num_qo_heads, head_dim)
    kv_shape = (rows.stored_kv_heads, 1) if rows else (num_kv_heads, head_dim)
    # The new tokens' keys and values as the kernel reads them: as given, or the rows' values and float32 scales.
    kv_values = ((rows.row_values,), rows.value_dtype) if rows else ((num_kv_heads, head_dim), dtype)
    kv_scales = ((rows.stored_kv_heads,), "float32") if rows else ((num_kv_heads, head_dim), dtype)
    attention_tasks = _attention_tasks(num_kv_heads, num_qo_heads, head_dim, dtype, lanes, source,
                                       softcap=softcap, slopes=slopes, sinks=sinks)

    @T.prim_func(s_tir=True)
    def prefill_ragged(
        q_handle: T.handle,
        q_indptr_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        kv_indptr_handle: T.handle,
        q_rope_position_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len_total = T.int32()
        q_indptr_offset = T.int32()
        kv_indptr_offset = T.int32()
        q_rope_offset = T.int32()
        k_rope_offset = T.int32()
        queries = T.match_buffer(q_handle, (qo_len, q_heads, q_dim), dtype)
        q_indptr = T.match_buffer(q_indptr_handle, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        keys = T.match_buffer(k_handle, (kv_len_total, *kv_shape), dtype)
        values = T.match_buffer(v_handle, (kv_len_total, *kv_shape), dtype)
        kv_indptr = T.match_buffer(kv_indptr_handle, (batch_size + 1,), "int32", elem_offset=kv_indptr_offset)
        q_positions = T.match_buffer(q_rope_position_handle, (qo_len,), "int32", elem_offset=q_rope_offset)
        k_positions = T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_offset)
        outputs = T.match_buffer(output_handle, (qo_len, q_heads, q_dim), dtype)
        lses = T.match_buffer(lse_handle, (qo_len, q_heads), "float32")
        assert rotary_mode == 0, "ember's prefill attention needs rotary embedding applied before attention"
        q = T.decl_buffer((qo_len, num_qo_heads, head_dim), dtype, data=queries.data,
                          strides=(q_heads * q_dim, head_dim, 1))
        output = T.decl_buffer((qo_len, num_qo_heads, head_dim), dtype, data=outputs.data,
                               strides=(q_heads * q_dim, head_dim, 1))
        lse = T.decl_buffer((qo_len, num_qo_heads), "float32", data=lses.data, strides=(q_heads, 1))
        k = T.decl_buffer((kv_len_total, *kv_values[0]), kv_values[1], data=keys.data)
        v = T.decl_buffer((kv_len_total, *kv_values[0]), kv_values[1], data=values.data)
        k_scales = T.decl_buffer((kv_len_total, *kv_scales[0]), kv_scales[1], data=keys.data)
        v_scales = T.decl_buffer((kv_len_total, *kv_scales[0]), kv_scales[1], data=values.data)
        attention_tasks(q, q_indptr, [k, v, kv_indptr, k_scales, v_scales], output, lse, causal, sm_scale,
                        batch_size, qo_len, q_positions, k_positions)

    return prefill_ragged


@parsed_once
def paged_prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str, page_size: int,
                            lanes: int, symbol: str, storage: FloatPages | PackedPageRows | None = None,
                            window: int = 0, window_pages: bool = False, softcap: float = 0.0,
                            slopes: tuple[float, ...] = (), sinks: bool = False):
    """Replacement for TVM's `batch_prefill_paged_kv_cpu` (and, with `window_pages`, its sliding-window variant):
    keys and values in cache pages, laid out as `storage` says (`kv_storage.py`; TVM's float pages by default),
    seen through `window` if given, scores soft-capped at `softcap` and biased by distance with `slopes` (ALiBi)
    if given, with attention sinks if `sinks` (the last `num_kv_heads` query heads carry them). `lanes` is the
    float32 vector width."""
    storage = storage or FloatPages(num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
    q_heads, q_dim = storage.q_heads, storage.q_dim
    attention_tasks = _attention_tasks(num_kv_heads, num_qo_heads, head_dim, dtype, lanes,
                                       _Paged(storage, window_pages), window, softcap, slopes, sinks)

    @T.prim_func(s_tir=True)
    def prefill_paged(
        q_handle: T.handle,
        q_indptr_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_values_handle: T.handle,
        last_page_len_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_offset = T.int32()
        page_indptr_offset = T.int32()
        values_offset = T.int32()
        length_offset = T.int32()
        k_rope_offset = T.int32()
        q_rope_offset = T.int32()
        queries = T.match_buffer(q_handle, (qo_len, q_heads, q_dim), dtype)
        q_indptr = T.match_buffer(q_indptr_handle, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        pages = T.match_buffer(pages_handle, storage.page_shape(max_num_pages), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=values_offset)
        length_info = T.match_buffer(last_page_len_handle, length_info_shape(batch_size, window_pages), "int32",
                                     elem_offset=length_offset)
        k_positions = T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_offset)
        q_positions = T.match_buffer(q_rope_position_handle, (qo_len,), "int32", elem_offset=q_rope_offset)
        outputs = T.match_buffer(output_handle, (qo_len, q_heads, q_dim), dtype)
        lses = T.match_buffer(lse_handle, (qo_len, q_heads), "float32")
        assert rotary_mode == 0, "ember's prefill attention needs rotary embedding applied before attention"
        q = T.decl_buffer((qo_len, num_qo_heads, head_dim), dtype, data=queries.data,
                          strides=(q_heads * q_dim, head_dim, 1))
        output = T.decl_buffer((qo_len, num_qo_heads, head_dim), dtype, data=outputs.data,
                               strides=(q_heads * q_dim, head_dim, 1))
        lse = T.decl_buffer((qo_len, num_qo_heads), "float32", data=lses.data, strides=(q_heads, 1))
        values = T.decl_buffer(storage.values_shape(max_num_pages), storage.values_dtype, data=pages.data)
        scales = T.decl_buffer(storage.scales_shape(max_num_pages), storage.scales_dtype, data=pages.data)
        attention_tasks(q, q_indptr, [values, page_indptr, page_values, length_info, scales], output, lse, causal,
                        sm_scale, batch_size, qo_len, q_positions, k_positions)

    return prefill_paged
