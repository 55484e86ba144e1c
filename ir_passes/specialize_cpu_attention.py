"""Swap TVM's serial CPU attention kernels for ember's parallel, vectorized ones.

Rewrites the PrimFuncs found by their exported symbols (`TIRPagedKVCache` adds them on
llvm targets as `tir_attention_decode_cpu`, `tir_attention_prefill_ragged_cpu` and
`tir_attention_prefill_cpu`, and `..._sliding_window` for windowed layers; the module may
name them either way). Its runtime calls them for every layer (the sliding-window ones for
windowed layers instead of the paged two):

    batch_decode_paged_kv_cpu     decode: one new token per sequence against its pages
    batch_prefill_ragged_kv       prefill: the new tokens against each other, causally
    batch_prefill_paged_kv_cpu    prefill of a later chunk: the new tokens against the pages

Each becomes ember's kernel for the same head counts, head dim, page size and dtype,
with the same parameters and exported symbol (`schedules/decode_attention.py`,
`schedules/prefill_attention.py`). Why: TVM's kernels walk every head, query and key
in one scalar loop (decode: 9.5% of a 110M model's decode step; ragged prefill: 21% of
its prefill); ember's run in parallel with vector arithmetic and the same results
(tested against TVM's kernels). The sliding-window variants become ember's kernels for the
window the cache records (`cache_window`), masking keys by position; every kernel soft-caps
the scores and biases them by distance (ALiBi) where the cache records a cap or slopes, and adds each head's
attention sink to its softmax where the cache records sinks (`CacheShape.sinks`). ember's kernels expect
rotary embedding applied before attention (`RopeMode.NORMAL`, or a graph that rotates q and
k itself). Relax functions are untouched.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir.kv_cache import cache_window, recorded_scores, recorded_sinks
from ember.ir.module_utils import replace_functions
from ember.schedules.decode_attention import paged_decode_attention
from ember.schedules.prefill_attention import paged_prefill_attention, ragged_prefill_attention
from ember.targets.registry import TargetSpec

# The exported symbols of TVM's CPU attention kernels (`_decode_kernels`, `_prefill_kernels`).
DECODE_ATTENTION_SYMBOL = "batch_decode_paged_kv_cpu"
RAGGED_PREFILL_SYMBOL = "batch_prefill_ragged_kv"
PAGED_PREFILL_SYMBOL = "batch_prefill_paged_kv_cpu"
WINDOW_SUFFIX = "_sliding_window"
ATTENTION_SYMBOLS = (DECODE_ATTENTION_SYMBOL, RAGGED_PREFILL_SYMBOL, PAGED_PREFILL_SYMBOL,
                     DECODE_ATTENTION_SYMBOL + WINDOW_SUFFIX, PAGED_PREFILL_SYMBOL + WINDOW_SUFFIX)


def specialize_cpu_attention(target: TargetSpec) -> tvm.transform.Pass:
    """A pass replacing the KV cache's CPU attention kernels with ember's."""
    lanes = max(target.vector_bits // 32, 1)

    def replacement(symbol: str, original: tirx.PrimFunc, window: int, sliding_slots: bool, softcap: float,
                    slopes: tuple[float, ...], sinks: bool) -> tirx.PrimFunc | None:
        kind = symbol.removesuffix(WINDOW_SUFFIX)
        # The window's kernels are the sliding slots', or, where every layer has it, the plain ones.
        window_pages = kind != symbol
        window = window if window_pages or not sliding_slots else 0
        queries = original.params[0]  # buffer-typed parameters: [tokens, qo heads, head dim]
        num_qo_heads, head_dim = (int(extent) for extent in queries.shape[1:])
        dtype = str(queries.dtype)
        if symbol == RAGGED_PREFILL_SYMBOL:
            keys, values = original.params[2:4]  # [tokens, kv heads, head dim]
            if int(keys.shape[2]) != head_dim or int(values.shape[2]) != head_dim:
                return None  # different key and value widths (MLA): keep TVM's
            return ragged_prefill_attention(int(keys.shape[1]), num_qo_heads, head_dim, dtype, lanes, symbol,
                                            softcap=softcap, slopes=slopes, sinks=sinks)
        pages = original.params[1 if kind == DECODE_ATTENTION_SYMBOL else 2]
        num_kv_heads, page_size = int(pages.shape[2]), int(pages.shape[3])
        if kind == DECODE_ATTENTION_SYMBOL:
            return paged_decode_attention(num_kv_heads, num_qo_heads, head_dim, dtype, page_size, lanes, symbol,
                                          window=window, window_pages=window_pages, softcap=softcap,
                                          slopes=slopes, sinks=sinks)
        return paged_prefill_attention(num_kv_heads, num_qo_heads, head_dim, dtype, page_size, lanes, symbol,
                                       window=window, window_pages=window_pages, softcap=softcap, slopes=slopes,
                                       sinks=sinks)

    @tvm.transform.module_pass(opt_level=0, name="SpecializeCPUAttention")
    def _specialize(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        window, sliding_slots = cache_window(mod)
        softcap, slopes = recorded_scores(mod)
        sinks = recorded_sinks(mod)
        updates = {}
        for gv, func in mod.functions_items():
            symbol = (func.attrs or {}).get("global_symbol") if isinstance(func, tirx.PrimFunc) else None
            if symbol in ATTENTION_SYMBOLS:
                kernel = replacement(str(symbol), func, window, sliding_slots, softcap, slopes, sinks)
                if kernel is not None:
                    updates[gv.name_hint] = kernel.with_attr(KERNEL_SOURCE_ATTR, __name__)
        return replace_functions(mod, updates) if updates else mod

    return _specialize
