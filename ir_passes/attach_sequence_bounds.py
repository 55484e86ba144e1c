"""Attach upper bounds of the symbolic sequence and batch sizes to entry functions.

Rewrites nothing in the graph; sets `tir_var_upper_bound` (and
`tir_non_negative_var`) on every Relax function that uses `seq_len`, `num_logits`
or `batch_size`. Why: `StaticPlanBlockMemory` can only plan a buffer whose size it
can bound. With `seq_len <= prefill_chunk` and `batch_size <= max_batch` every
intermediate gets a fixed-size slot allocated once, reused across calls and shared
between buffers with disjoint lifetimes, instead of a fresh allocation per op per
call. The same bounds are what the runtime must respect (the manifest records them).
"""

from __future__ import annotations

import tvm
from tvm import relax

from ember.ir_passes.module_utils import replace_functions


def attach_sequence_bounds(prefill_chunk: int, max_batch: int) -> tvm.transform.Pass:
    """A pass bounding `seq_len`/`num_logits` by `prefill_chunk` and `batch_size` by `max_batch`."""
    bounds = {"seq_len": prefill_chunk, "num_logits": prefill_chunk, "batch_size": max_batch}

    @tvm.transform.module_pass(opt_level=0, name="AttachSequenceBounds")
    def _attach(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            used = {var.name for var in relax.analysis.free_symbolic_vars(func)} | {
                var.name for var in relax.analysis.defined_symbolic_vars(func)
            }
            func_bounds = {name: bound for name, bound in bounds.items() if name in used}
            if func_bounds:
                updates[gv.name_hint] = func.with_attrs(
                    {"tir_var_upper_bound": func_bounds, "tir_non_negative_var": list(func_bounds)}
                )
        return replace_functions(mod, updates)

    return _attach
