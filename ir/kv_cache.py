"""The paged KV cache every ember model attends through: TVM's `TIRPagedKVCache`, sized by the model.

Built here for both kinds of graph: the hand-written Llama family (`frontend/llama.py`)
with the cache applying rotary embeddings itself (`RopeMode.NORMAL`), and imported
graphs, where `ir_passes/specialize_attention.py` adds it with the graph rotating q and k
(`RopeMode.NONE`). Whoever adds it records its shape on the module (`KV_CACHE_ATTR`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import tvm
from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv_cache
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from ember.core.errors import ModelError
from ember.ir.attributes import KERNEL_SOURCE_ATTR, KV_CACHE_ATTR
from ember.ir.module_utils import replace_functions
from ember.ir.tvmscript import parsed_once

# `create_paged_kv_cache`'s arguments, chosen by the runtime.
CREATE_ARGUMENTS = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size", "support_sliding_window")

# The packed function `create_paged_kv_cache` calls, handing TVM's cache runtime its sizes and kernels.
CREATE_FUNCTION = "vm.builtin.paged_attention_kv_cache_create"


class CreateArg(IntEnum):
    """Positions of `CREATE_FUNCTION`'s arguments (after the function's name) that ember's passes read or replace,
    in TVM 0.27's order. An attention slot holds `("tirx", kernel)`, or an empty tuple for none; the runtime refuses
    a request that needs a kernel it was not given."""

    QO_HEADS = 2
    KV_HEADS = 3
    QK_DIM = 4
    V_DIM = 5
    ROPE_MODE = 8
    DTYPE_EXAMPLE = 12  # an empty tensor of the cache's dtype
    APPEND = 13
    APPEND_MLA = 14  # null where no layer is MLA
    RAGGED = 15
    PREFILL = 16
    DECODE = 17
    PREFILL_SLIDING_WINDOW = 18
    DECODE_SLIDING_WINDOW = 19
    TREE_PREFILL_PAGED = 20
    TREE_PREFILL = 21
    MLA_PREFILL = 22
    MERGE = 23
    SPLIT = 24
    COPY_PAGE = 25
    DEBUG_READ = 26
    COMPACT = 27


# Attention slots no ember runtime path uses: it decodes chains, never token trees, and no model it builds is MLA.
NEVER_CALLED_ATTENTION = (CreateArg.TREE_PREFILL_PAGED, CreateArg.TREE_PREFILL, CreateArg.MLA_PREFILL)
SLIDING_WINDOW_ATTENTION = (CreateArg.PREFILL_SLIDING_WINDOW, CreateArg.DECODE_SLIDING_WINDOW)


def create_spec() -> dict:
    """`create_paged_kv_cache`'s `nn.Module.export_tvm` spec (a fresh dict: export_tvm consumes its "$" entry)."""
    return {**{name: int for name in CREATE_ARGUMENTS}, "$": {"param_mode": "none", "effect_mode": "none"}}

# The kernel builders `TIRPagedKVCache` calls, by their names in its module. Each parses TVMScript on every call
# (0.9 s of a CPU model's compile, 2.3 s of a CUDA model's), so they are memoized there: caches of one process
# with the same heads, dtype, rotary embedding and target (pipeline stages, tuning, a test session) share the
# kernels. The page copies are left as they are: they take the symbolic page size, and parse in 0.02 s.
SHARED_KERNEL_BUILDERS = (
    "_attention_decode", "_attention_decode_cpu", "_attention_prefill", "_attention_prefill_cpu",
    "_attention_prefill_mla", "_attention_prefill_ragged", "_attention_prefill_ragged_cpu", "_compact_kv_copy",
    "_compact_kv_copy_cpu", "_kv_cache_debug_get_kv", "_kv_cache_transpose_append", "_kv_cache_transpose_append_mla",
    "_merge_state_inplace", "_merge_state_inplace_cpu", "llama_rope_with_position_map", "tree_attn",
    "tree_attn_cpu", "tree_attn_with_paged_kv_cache", "tree_attn_with_paged_kv_cache_cpu",
)


def _memoize_tvm_kernel_builders() -> None:
    for name in SHARED_KERNEL_BUILDERS:
        setattr(tvm_kv_cache, name, parsed_once(getattr(tvm_kv_cache, name)))


_memoize_tvm_kernel_builders()


@dataclass(frozen=True)
class CacheShape:
    """What the cache holds and how it treats positions."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_window: int
    rope_theta: float | None = None  # None: the graph applies rotary embeddings, the cache none
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # Per layer, the sliding window its attention reads through (a query at position p sees the keys at positions
    # p - window + 1 .. p), 0 for the whole context; empty: no layer has a window.
    layer_windows: tuple[int, ...] = ()
    # Every layer's scores become softcap * tanh(scores / softcap) before the mask (0: not capped).
    softcap: float = 0.0
    # ALiBi: every layer's head h adds alibi_slopes[h] * (key position - query position) to its scores (one slope:
    # every head alike; empty: no such bias).
    alibi_slopes: tuple[float, ...] = ()
    # Attention sinks (gpt-oss): every layer's heads have a learned logit that joins their softmax's denominator
    # (a key no value comes with). The graph hands each layer's sinks to the kernels as extra query heads, one per
    # KV head after the model's (`cache_heads`), whose first `num_heads // num_kv_heads` values are the sinks of
    # that KV head's query heads and whose next value is the layer's window (0: none). The kernels add a sink once
    # per query, in the part of the attention that holds the query's own key, so that the runtime's merge of
    # partial attentions counts it once; that needs each part's exact key positions, which TVM's sliding-window
    # slots do not give, so every layer is a plain one and the kernels mask each by the window it carries.
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.sinks and self.num_heads // self.num_kv_heads >= self.head_dim:
            raise ModelError(f"attention sinks with {self.num_heads // self.num_kv_heads} query heads per key/value "
                             f"head of {self.head_dim} values: ember's kernels carry a KV head's sinks and its "
                             "layer's window in one query head")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if len(set(self.layer_windows) - {0}) > 1:
            raise ModelError(f"attention layers read through windows of {sorted(set(self.layer_windows) - {0})} "
                             "tokens; ember's KV cache holds one window size for all windowed layers")

    @property
    def cache_heads(self) -> int:
        """The query heads the runtime's attention takes: the model's, and the sinks' carriers where it has them."""
        return self.num_heads + (self.num_kv_heads if self.sinks else 0)

    @property
    def window(self) -> int:
        """The window of the windowed layers (0: none has one)."""
        return max(self.layer_windows, default=0)

    @property
    def window_pages(self) -> bool:
        """Windowed layers are handed only their window's pages: where some layers have no window (TVM's
        "mha_sliding" kind, whose kernels are separate). Where every layer has one, all are plain layers whose
        kernels see through the window (TVM's cache allocates no workspace for a model of sliding layers alone)."""
        return bool(self.window) and 0 in self.layer_windows and not self.sinks


def paged_kv_cache(shape: CacheShape, dtype: str, target: Target, max_batch_size: tirx.Var,
                   max_total_seq_len: tirx.Var, prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                   support_sliding_window: tirx.Var) -> PagedKVCache:
    """The cache for `shape` in `dtype`; the sizes are the runtime's."""
    rope = shape.rope_theta is not None
    # Windowed layers among others are TVM's "mha_sliding" kind: the runtime hands their attention kernels the pages
    # of the last `layer_sliding_window_size` tokens, and those kernels mask the rest by position. Every token stays
    # cached; the runtime never enables its per-sequence window, which drops pages.
    kinds = ["mha_sliding" if window else "mha" for window in shape.layer_windows] if shape.window_pages else "mha"
    if shape.window and not shape.window_pages and "cpu" not in target.keys:
        raise ModelError(f"every attention layer reads through a sliding window of {shape.window} tokens, which "
                         f"ember's CPU kernels compute and TVM's {target.kind.name} kernels do not; compile for a CPU")
    if (shape.softcap or shape.alibi_slopes or shape.sinks) and "cpu" not in target.keys:
        what = (f"soft-capped at {shape.softcap:g}" if shape.softcap else "biased by distance (ALiBi)"
                if shape.alibi_slopes else "with attention sinks")
        raise ModelError(f"attention scores {what}, which ember's CPU kernels compute and TVM's {target.kind.name} "
                         "kernels do not; compile for a CPU")
    return TIRPagedKVCache(
        attn_kind=kinds,
        max_batch_size=max_batch_size,
        max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size,
        page_size=page_size,
        support_sliding_window=support_sliding_window,
        layer_partition=relax.ShapeExpr([0, shape.num_layers]),
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.cache_heads,
        num_key_value_heads=shape.num_kv_heads,
        qk_head_dim=shape.head_dim,
        v_head_dim=shape.head_dim,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=RopeMode.NORMAL if rope else RopeMode.NONE,
        rope_scale=1,
        rope_theta=shape.rope_theta if rope else 10000.0,  # read only with a rope mode
        rope_scaling=shape.rope_scaling,
        rope_ext_factors=relax.op.null_value(),
        rotary_dim=shape.head_dim,
        enable_disaggregation=False,
        dtype=dtype,
        target=target,
        layer_sliding_window_size=shape.window or shape.context_window,
    )


@dataclass(frozen=True)
class KVRows:
    """How a packed KV cache (`--kv-quant`, `ir_passes/quantize_kv_cache.py`) stores a token.

    Per layer, token and side (K or V), one row of bytes: each KV head's `head_dim` values
    in `value_dtype`, then, where the format has them, the heads' float32 scales (one per
    token and head: the attention kernels multiply a whole dot product by it).

    TVM's cache runtime allocates pages in the dtype of the q/k/v it is handed and checks
    that tensor against its head counts and head dim, so the cache is declared with a head
    dim of 1 and "heads" that are float32 words: a row is `stored_kv_heads` words, and the
    fused q/k/v of a token, `(num_qo_heads + 2 * num_kv_heads) * head_dim` floats, is read
    as `stored_qo_heads + 2 * stored_kv_heads` words without a copy (so `stored_qo_heads`
    words hold the real queries, and attention's output, at their front).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    value_dtype: ClassVar[str]
    scale_bytes: ClassVar[int]  # per head: 4 (a float32 scale) or 0 (values stored as they are)

    @property
    def value_bytes(self) -> int:
        return tvm.runtime.DataType(self.value_dtype).bits // 8

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * (self.head_dim * self.value_bytes + self.scale_bytes)

    @property
    def row_values(self) -> int:
        """A row's length in values (its scales, if any, counted in value-sized pieces)."""
        return self.row_bytes // self.value_bytes

    @property
    def stored_kv_heads(self) -> int:
        return self.row_bytes // 4

    @property
    def scale_word(self) -> int:
        """The word of a row where the scales start (after every head's values)."""
        return self.num_kv_heads * self.head_dim * self.value_bytes // 4

    @property
    def stored_qo_heads(self) -> int:
        return (self.num_qo_heads + 2 * self.num_kv_heads) * self.head_dim - 2 * self.stored_kv_heads

    def bytes_per_token(self, num_layers: int) -> int:
        return 2 * num_layers * self.row_bytes


class Int8Rows(KVRows):
    """`--kv-quant q8`: int8 values and a float32 scale per token and head (symmetric, absmax / 127;
    a new token is quantized alone, with no group statistics to update). That is `head_dim + 4`
    bytes per head where float32 takes `4 * head_dim`: 0.27x at a head dim of 64, 0.26x at 128."""

    value_dtype = "int8"
    scale_bytes = 4


class Float16Rows(KVRows):
    """`--kv-quant f16`: float16 values, no scales (llama.cpp's default cache type): 0.5x the
    bytes of float32, and each value read back with one conversion (`vcvtph2ps` on x86)."""

    value_dtype = "float16"
    scale_bytes = 0


# `--kv-quant` choices and the rows each stores.
KV_ROWS: dict[str, type[KVRows]] = {"q8": Int8Rows, "f16": Float16Rows}


def with_cache_shape(mod: tvm.IRModule, shape: CacheShape) -> tvm.IRModule:
    """`mod` recording what its KV cache holds (`KV_CACHE_ATTR`)."""
    return mod.with_attr(KV_CACHE_ATTR, {"num_layers": shape.num_layers, "num_heads": shape.num_heads,
                                         "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                                         "layer_windows": list(shape.layer_windows), "softcap": shape.softcap,
                                         "alibi_slopes": list(shape.alibi_slopes), "sinks": shape.sinks})


def recorded_layer_windows(mod: tvm.IRModule) -> tuple[int, ...]:
    """Each layer's window as recorded on `mod` (`with_cache_shape`; `CacheShape.layer_windows`)."""
    return tuple(int(w) for w in (mod.attrs or {}).get(KV_CACHE_ATTR, {}).get("layer_windows", []))


def recorded_scores(mod: tvm.IRModule) -> tuple[float, tuple[float, ...]]:
    """(the soft-cap of every layer's scores, 0 for none; the slopes of their distance bias) as recorded on `mod`
    (`CacheShape.softcap`, `CacheShape.alibi_slopes`)."""
    recorded = (mod.attrs or {}).get(KV_CACHE_ATTR, {})
    return float(recorded.get("softcap", 0.0)), tuple(float(s) for s in recorded.get("alibi_slopes", []))


def recorded_sinks(mod: tvm.IRModule) -> bool:
    """Whether the attention recorded on `mod` has sinks (`CacheShape.sinks`)."""
    return bool((mod.attrs or {}).get(KV_CACHE_ATTR, {}).get("sinks", False))


def cache_window(mod: tvm.IRModule) -> tuple[int, bool]:
    """(the window the attention kernels mask keys by, 0 if no layer has one or if each layer's window reaches
    them with its sinks; whether windowed layers' kernels are handed only the window's pages,
    `CacheShape.window_pages`) as recorded on `mod`."""
    if recorded_sinks(mod):
        return 0, False
    windows = recorded_layer_windows(mod)
    window = max(windows, default=0)
    return window, bool(window) and 0 in windows


def cache_functions(shape: CacheShape, dtype: str, target: Target) -> tvm.IRModule:
    """`create_paged_kv_cache` and the cache's kernels (tagged), for a graph imported without a cache."""
    cache, _ = _KVCacheFactory(shape, dtype, target).export_tvm(spec={"create_paged_kv_cache": create_spec()})
    return tag_library_kernels(cache)


class _KVCacheFactory(nn.Module):
    """Only `create_paged_kv_cache`: exported beside a graph imported without one."""

    def __init__(self, shape: CacheShape, dtype: str, target: Target) -> None:
        self.shape, self.dtype, self.target = shape, dtype, target

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        return paged_kv_cache(self.shape, self.dtype, self.target, max_batch_size, max_total_seq_len,
                              prefill_chunk_size, page_size, support_sliding_window)


def tag_library_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Mark every PrimFunc of `mod` as written by hand in `tvm.relax.frontend.nn.llm`.

    The model itself is Relax operators at this point, so every PrimFunc here is one
    of the KV cache's kernels; the schedule check accepts them as they are.
    """
    updates = {
        gv.name_hint: func.with_attr(KERNEL_SOURCE_ATTR, "tvm.relax.frontend.nn.llm.kv_cache")
        for gv, func in mod.functions_items()
        if isinstance(func, tvm.tirx.PrimFunc)
    }
    return replace_functions(mod, updates)
