"""Where ember's CPU attention kernels find a cached key or value, as TIR expressions.

Two page layouts share the kernels (`decode_attention.py`, `prefill_attention.py`):

    FloatPages      TVM's: pages[page, K or V, kv head, slot, dim] in the model's dtype
    PackedPageRows  a `--kv-quant` cache's (`ember.ir.kv_cache.KVRows`): per page, side and slot a
                    row of every KV head's values (int8 or float16), then any float32 scales

A kernel declares its parameters in the layout's declared shapes (what TVM's runtime
checks and allocates) and reads them through views in the real ones: `value` is an
element as float32, `scale` multiplies a whole dot product or value row (1 for floats),
and `prefetch` asks for the cache lines of one token's key or value of one KV head.
"""

from __future__ import annotations

from tvm import tirx
from tvm.runtime import DataType
from tvm.script import tirx as T

from ember.ir.kv_cache import KVRows
from ember.schedules.common import prefetch

LINE_BYTES = 64


class FloatPages:
    """TVM's paged layout: keys and values as the model computed them."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str) -> None:
        self.num_kv_heads, self.head_dim, self.page_size = num_kv_heads, head_dim, page_size
        self.q_heads, self.q_dim = num_qo_heads, head_dim  # queries and outputs: [tokens, q_heads, q_dim]
        self.values_dtype = self.scales_dtype = dtype

    def page_shape(self, num_pages):
        return (num_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)

    values_shape = scales_shape = page_shape

    def value(self, values, page, part, slot, h, i):
        return T.Cast("float32", values[page, part, h, slot, i])

    def scale(self, scales, page, part, slot, h) -> tirx.PrimExpr:
        return T.float32(1)

    @property
    def prefetch(self):
        """A macro: prefetches of the lines of the head's row, `head_dim` contiguous elements."""
        head_dim, element_bytes = self.head_dim, DataType(self.values_dtype).bits // 8
        per_line = LINE_BYTES // element_bytes
        # Rows follow each other, so they start on a line when they fill whole lines.
        lines = _lines_touched(head_dim * element_bytes, aligned=head_dim * element_bytes % LINE_BYTES == 0)

        @T.macro
        def prefetch_row(values, scales, page, part, slot, h):
            for line in T.unroll(lines):
                T.evaluate(prefetch(T.address_of(values[page, part, h, slot, T.min(line * per_line, head_dim - 1)])))

        return prefetch_row


class PackedPageRows:
    """A `--kv-quant` cache's layout: a row of values (and scales, if the rows have them) per page slot and side."""

    def __init__(self, rows: KVRows, page_size: int) -> None:
        self.rows, self.head_dim, self.page_size = rows, rows.head_dim, page_size
        self.q_heads, self.q_dim = rows.stored_qo_heads, 1
        self.values_dtype, self.scales_dtype = rows.value_dtype, "float32"

    def page_shape(self, num_pages):
        return (num_pages, 2, self.rows.stored_kv_heads, self.page_size, 1)

    def values_shape(self, num_pages):
        return (num_pages, 2, self.page_size, self.rows.row_values)

    def words_shape(self, num_pages):
        """The pages as float32 words, a row of `stored_kv_heads` per slot: how the cache's own kernels move rows."""
        return (num_pages, 2, self.page_size, self.rows.stored_kv_heads)

    scales_shape = words_shape  # the scales are the last words of each row

    def value(self, values, page, part, slot, h, i):
        return T.Cast("float32", values[page, part, slot, h * self.head_dim + i])

    def scale(self, scales, page, part, slot, h):
        if self.rows.scale_bytes == 0:
            return T.float32(1)
        return scales[page, part, slot, self.rows.scale_word + h]

    @property
    def prefetch(self):
        """A macro: prefetches of the lines of the head's values and of the line with its scale, if any."""
        head_dim, scale_word, has_scales = self.head_dim, self.rows.scale_word, self.rows.scale_bytes > 0
        value_bytes = self.rows.value_bytes
        per_line = LINE_BYTES // value_bytes
        # Rows of `row_bytes` hold the heads: a head's values start on a line only if every row and head does.
        aligned = self.rows.row_bytes % LINE_BYTES == 0 and head_dim * value_bytes % LINE_BYTES == 0
        lines = _lines_touched(head_dim * value_bytes, aligned=aligned)

        @T.macro
        def prefetch_row(values, scales, page, part, slot, h):
            for line in T.unroll(lines):
                T.evaluate(prefetch(T.address_of(values[page, part, slot, h * head_dim + T.min(
                    line * per_line, head_dim - 1)])))
            if has_scales:
                T.evaluate(prefetch(T.address_of(scales[page, part, slot, scale_word + h])))

        return prefetch_row


def _lines_touched(row_bytes: int, aligned: bool) -> int:
    """Cache lines a row of `row_bytes` can touch: one more than it fills when it may start inside a line
    (the prefetches step a line at a time and the last aims at the row's last element)."""
    return -(-row_bytes // LINE_BYTES) + (0 if aligned else 1)
