"""Swap TVM's CPU rotary embedding kernel for ember's, which computes each angle once per token.

Rewrites one PrimFunc, found by its exported symbol `fused_rope` (`TIRPagedKVCache`
adds it as `tir_split_rotary`): the KV cache runtime calls it on every layer's fused
q/k/v projection, and TVM's version calls `pow`, `cos` and `sin` for every element of
every head. It becomes `schedules/rope.py`'s kernel for the same head counts, head dim
and dtype, built from the rotary parameters the frontend records on the module
(`ROPE_ATTR`); its results agree with TVM's to float rounding (tested). Without that record, or for a
RoPE variant the kernel does not compute, TVM's kernel stays. Relax functions are
untouched.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir.module_utils import replace_functions
from ember.schedules import rope


@tvm.transform.module_pass(opt_level=0, name="SpecializeCPURope")
def specialize_cpu_rope(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Replace the KV cache's `fused_rope` with `schedules/rope.py`'s kernel."""
    updates = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and (func.attrs or {}).get("global_symbol") == rope.ROPE_SYMBOL:
            qkv, _, queries, keys = func.params[:4]  # buffer-typed parameters: [tokens, heads, head dim]
            rotary = rope.recorded_rotary(mod, head_dim=int(qkv.shape[2]), dtype=str(qkv.dtype))
            if rotary is None:
                return mod
            kernel = rope.fused_qkv_rope(num_q_heads=int(queries.shape[1]), num_kv_heads=int(keys.shape[1]),
                                         rotary=rotary)
            updates[gv.name_hint] = kernel.with_attr(KERNEL_SOURCE_ATTR, __name__)
    return replace_functions(mod, updates) if updates else mod
