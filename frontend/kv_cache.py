"""The paged KV cache every ember model attends through: TVM's `TIRPagedKVCache`, sized by the model.

Both frontends build it here: the hand-written Llama family with the cache applying
rotary embeddings itself (`RopeMode.NORMAL`), graphs imported by `torch.export`
with the graph rotating q and k (`RopeMode.NONE`; see `ir_passes/specialize_attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

# `create_paged_kv_cache`'s arguments, chosen by the runtime.
CREATE_ARGUMENTS = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size", "support_sliding_window")


def create_spec() -> dict:
    """`create_paged_kv_cache`'s `nn.Module.export_tvm` spec (a fresh dict: export_tvm consumes its "$" entry)."""
    return {**{name: int for name in CREATE_ARGUMENTS}, "$": {"param_mode": "none", "effect_mode": "none"}}


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


def paged_kv_cache(shape: CacheShape, dtype: str, target: Target, max_batch_size: tirx.Var,
                   max_total_seq_len: tirx.Var, prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                   support_sliding_window: tirx.Var) -> PagedKVCache:
    """The cache for `shape` in `dtype`; the sizes are the runtime's."""
    rope = shape.rope_theta is not None
    return TIRPagedKVCache(
        attn_kind="mha",
        max_batch_size=max_batch_size,
        max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size,
        page_size=page_size,
        support_sliding_window=support_sliding_window,
        layer_partition=relax.ShapeExpr([0, shape.num_layers]),
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
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
        # Only read for per-layer sliding kinds (Gemma-style); Mistral's window is
        # enabled per sequence by the runtime (`support_sliding_window`).
        layer_sliding_window_size=shape.context_window,
    )


class KVCacheFactory(nn.Module):
    """Only `create_paged_kv_cache`: exported beside a graph imported without one."""

    def __init__(self, shape: CacheShape, dtype: str, target: Target) -> None:
        self.shape, self.dtype, self.target = shape, dtype, target

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        return paged_kv_cache(self.shape, self.dtype, self.target, max_batch_size, max_total_seq_len,
                              prefill_chunk_size, page_size, support_sliding_window)
