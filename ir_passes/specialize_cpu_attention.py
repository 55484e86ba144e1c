"""Swap TVM's serial CPU decode attention for ember's parallel, vectorized one.

Rewrites one PrimFunc: `tir_attention_decode_cpu`, which `TIRPagedKVCache` adds on
llvm targets and its runtime calls for every decode step of every layer, becomes
`schedules/attention.py`'s kernel for the same head counts, head dim, page size and
dtype, with the same parameters and exported symbol. Why: TVM's kernel walks every
head and cached token in one scalar loop (9.5% of a 110M model's decode step); ember's
runs the KV heads in parallel with vector dot products and the same results (tested
against TVM's kernel). The sliding-window variant stays TVM's (ember's models do not
use it). Relax functions are untouched.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ember.ir_passes.module_utils import KERNEL_SOURCE_ATTR, replace_functions
from ember.schedules.attention import paged_decode_attention
from ember.targets.registry import TargetSpec

DECODE_ATTENTION = "tir_attention_decode_cpu"


def specialize_cpu_attention(target: TargetSpec) -> tvm.transform.Pass:
    """A pass replacing the KV cache's CPU decode attention kernel with ember's."""

    @tvm.transform.module_pass(opt_level=0, name="SpecializeCPUAttention")
    def _specialize(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        functions = {gv.name_hint: func for gv, func in mod.functions_items()}
        original = functions.get(DECODE_ATTENTION)
        if not isinstance(original, tirx.PrimFunc):
            return mod
        queries, pages = (original.buffer_map[param] for param in original.params[:2])
        _, num_qo_heads, head_dim = queries.shape
        _, _, num_kv_heads, page_size, _ = pages.shape
        kernel = paged_decode_attention(
            num_kv_heads=int(num_kv_heads), num_qo_heads=int(num_qo_heads), head_dim=int(head_dim),
            dtype=str(queries.dtype), page_size=int(page_size), lanes=max(target.vector_bits // 32, 1),
            symbol=str(original.attrs["global_symbol"]),
        )
        return replace_functions(mod, {DECODE_ATTENTION: kernel.with_attr(KERNEL_SOURCE_ATTR, __name__)})

    return _specialize
