"""Kernels scheduled to the same code become one.

`attach_sequence_bounds` copies a kernel once per bound its callers give it, so that the
schedules can tell a decode GEMV from a prefill GEMM. Where the copies' schedules come out
the same anyway, the library carried the same code twice: `verify`'s 8 rows and decode's
8 sequences take one GEMV, and `verify`'s norms and reshapes are prefill's. On the demo
model (q4f32, this host's target) 13 of the 53 kernels were such copies, among them five
int8 matmuls.

This pass keeps the first kernel by name of each group that is structurally equal but for its
`tir_var_upper_bound`, gives it the group's bounds (the larger for each size: every
caller's sizes stay within them) and redirects the other kernels' calls to it. Kernels
a Relax function hands over as values (the KV cache's, given to its runtime) are left
alone. Runs after scheduling and the kernel-math rewrites, before the dataflow is lowered:
what is compared is the code the kernels will be.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from ember.ir.module_utils import upper_bounds

_BOUNDS = "tir_var_upper_bound"


@tvm.transform.module_pass(opt_level=0, name="MergeEqualKernels")
def merge_equal_kernels(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` with each group of kernels equal but for their bounds merged into the group's first."""
    handed_over = _handed_over(mod)
    groups: dict[tuple, list[list[tuple[tvm.ir.GlobalVar, tirx.PrimFunc, tirx.PrimFunc]]]] = {}
    for gv, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint):  # the same kept every run
        if isinstance(func, tirx.PrimFunc) and gv.name_hint not in handed_over:
            code = _code(func)
            key = (tvm_ffi.structural_hash(code, map_free_vars=True), _size_names(func))
            candidates = groups.setdefault(key, [])
            for members in candidates:
                if tvm_ffi.structural_equal(members[0][2], code, map_free_vars=True):
                    members.append((gv, func, code))
                    break
            else:
                candidates.append([(gv, func, code)])
    merged = [members for candidates in groups.values() for members in candidates if len(members) > 1]
    if not merged:
        return mod
    redirect, kept = {}, {}
    for (first_gv, first, _), *others in merged:
        bounds = upper_bounds(first)
        for gv, func, _ in others:
            redirect[gv.name_hint] = first_gv
            for name, bound in upper_bounds(func).items():
                bounds[name] = max(bound, bounds.get(name, 0))
        kept[first_gv.name_hint] = first.with_attr(_BOUNDS, bounds) if bounds else first
    redirector, functions = _Redirect(mod, redirect), {}
    for gv, func in mod.functions_items():
        if gv.name_hint in redirect:
            continue
        if isinstance(func, relax.Function):
            func = redirector.visit_expr(func)
        functions[gv] = kept.get(gv.name_hint, func)
    return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)


def equal_but_for_bounds(first: tirx.PrimFunc, second: tirx.PrimFunc) -> bool:
    """Whether two kernels are the same code: structurally equal but for their bounds and exported symbols, with
    their sizes named alike."""
    return _size_names(first) == _size_names(second) and tvm_ffi.structural_equal(_code(first), _code(second),
                                                                                   map_free_vars=True)


def _code(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` without the attributes that do not change its code: its bounds and exported symbol."""
    for name in (_BOUNDS, "global_symbol"):
        if name in (func.attrs or {}):
            func = func.without_attr(name)
    return func


def _handed_over(mod: tvm.IRModule) -> set[str]:
    """Kernels a Relax function hands over as values rather than calls (the KV cache's, given to its runtime)."""
    referenced, called = set(), set()

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name.startswith(
                "relax.call_tir") and isinstance(expr.args[0], tvm.ir.GlobalVar):
            called.add(expr.args[0].name_hint)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
            referenced |= {gv.name_hint for gv in relax.analysis.all_global_vars(func)}
    return referenced - called


def _size_names(func: tirx.PrimFunc) -> tuple[str, ...]:
    """The names of the symbolic sizes of `func`'s buffers, in parameter order: bounds are keyed by them, so kernels
    merge only where the same names stand in the same places."""
    return tuple(dim.name for param in func.params for dim in (getattr(param, "shape", None) or [])
                 if isinstance(dim, tirx.Var))


@relax.expr_functor.mutator
class _Redirect(relax.PyExprMutator):
    """Calls of a kernel in `redirect` (by name) call the kernel given there instead."""

    def __init__(self, mod: tvm.IRModule, redirect: dict[str, tvm.ir.GlobalVar]) -> None:
        super().__init__(mod)
        self.redirect = redirect

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.args and isinstance(call.args[0], tvm.ir.GlobalVar) and call.args[0].name_hint in self.redirect:
            return relax.Call(call.op, [self.redirect[call.args[0].name_hint], *call.args[1:]], call.attrs,
                              call.ty_args)
        return call
