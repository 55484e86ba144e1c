"""Attach upper bounds of the symbolic sequence and batch sizes to functions and kernels.

Rewrites nothing in the graph; sets `tir_var_upper_bound` (and
`tir_non_negative_var`) on every Relax function that uses `seq_len`, `num_logits`,
`batch_size` or `verify_len`, and `tir_var_upper_bound` on every PrimFunc whose shapes use them.
Why: `StaticPlanBlockMemory` can only plan a buffer whose size it can bound. With
`seq_len <= prefill_chunk` and `batch_size <= max_batch` every intermediate gets a
fixed-size slot allocated once, reused across calls and shared between buffers
with disjoint lifetimes, instead of a fresh allocation per op per call. The
schedules read the kernels' bounds to tell a decode GEMV (a few rows) from a
prefill GEMM. The same bounds are what the runtime must respect (the manifest
records them). Runs after legalization, so fused kernels carry them too.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ember.ir.attributes import VERIFY_LEN, VERIFY_TOKENS
from ember.ir.module_utils import replace_functions


def attach_sequence_bounds(prefill_chunk: int, max_batch: int) -> tvm.transform.Pass:
    """A pass bounding `seq_len`/`num_logits` by `prefill_chunk`, `batch_size` by `max_batch` and
    `verify`'s length by VERIFY_TOKENS."""
    bounds = {"seq_len": prefill_chunk, "num_logits": prefill_chunk, "batch_size": max_batch,
              VERIFY_LEN: VERIFY_TOKENS}

    @tvm.transform.module_pass(opt_level=0, name="AttachSequenceBounds")
    def _attach(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                used = {var.name for var in relax.analysis.free_symbolic_vars(func)} | {
                    var.name for var in relax.analysis.defined_symbolic_vars(func)
                }
                func_bounds = {name: bound for name, bound in bounds.items() if name in used}
                if func_bounds:
                    updates[gv.name_hint] = func.with_attrs(
                        {"tir_var_upper_bound": func_bounds, "tir_non_negative_var": list(func_bounds)}
                    )
            elif isinstance(func, tirx.PrimFunc):
                used = {var.name for param in func.params for var in _shape_vars(param)}
                kernel_bounds = {name: bound for name, bound in bounds.items() if name in used}
                if kernel_bounds:
                    updates[gv.name_hint] = func.with_attr("tir_var_upper_bound", kernel_bounds)
        return replace_functions(mod, updates)

    return _attach


def _shape_vars(param: tirx.Var) -> list[tirx.Var]:
    """Symbolic dimensions of a PrimFunc buffer parameter."""
    shape = getattr(param, "shape", None) or []
    return [dim for dim in shape if isinstance(dim, tirx.Var)]
