"""Swap TVM's serial CPU decode attention for ember's parallel, vectorized one.

Rewrites one PrimFunc: TVM's `batch_decode_paged_kv_cpu` (found by its exported
symbol: `TIRPagedKVCache` adds it on llvm targets as `tir_attention_decode_cpu`, and
the module may name it either way), which its runtime calls for every decode step of
every layer, becomes
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

# The exported symbol of TVM's CPU decode attention (`_decode_kernels._attention_decode_cpu`).
DECODE_ATTENTION_SYMBOL = "batch_decode_paged_kv_cpu"


def specialize_cpu_attention(target: TargetSpec) -> tvm.transform.Pass:
    """A pass replacing the KV cache's CPU decode attention kernel with ember's."""

    @tvm.transform.module_pass(opt_level=0, name="SpecializeCPUAttention")
    def _specialize(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        found = [(gv.name_hint, func) for gv, func in mod.functions_items()
                 if isinstance(func, tirx.PrimFunc) and (func.attrs or {}).get("global_symbol") == DECODE_ATTENTION_SYMBOL]
        if not found:
            return mod
        ((name, original),) = found
        queries, pages = original.params[:2]  # buffer-typed parameters
        _, num_qo_heads, head_dim = queries.shape
        _, _, num_kv_heads, page_size, _ = pages.shape
        kernel = paged_decode_attention(
            num_kv_heads=int(num_kv_heads), num_qo_heads=int(num_qo_heads), head_dim=int(head_dim),
            dtype=str(queries.dtype), page_size=int(page_size), lanes=max(target.vector_bits // 32, 1),
            symbol=str(original.attrs["global_symbol"]),
        )
        return replace_functions(mod, {name: kernel.with_attr(KERNEL_SOURCE_ATTR, __name__)})

    return _specialize
