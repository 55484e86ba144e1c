"""Attach upper bounds of the symbolic sequence and batch sizes to functions and kernels.

Sets `tir_var_upper_bound` (and `tir_non_negative_var`) on every Relax function that
uses `seq_len`, `num_logits`, `batch_size` or `verify_len`, and `tir_var_upper_bound`
on every PrimFunc whose shapes they size. Why: `StaticPlanBlockMemory` can only plan a
buffer whose size it can bound. With `seq_len <= prefill_chunk` and `batch_size <=
max_batch` every intermediate gets a fixed-size slot allocated once, reused across
calls and shared between buffers with disjoint lifetimes, instead of a fresh
allocation per op per call. The schedules read the kernels' bounds to tell a decode
GEMV (a few rows) from a prefill GEMM. The same bounds are what the runtime must
respect (the manifest records them). Runs after legalization, so fused kernels carry
them too.

A kernel's bound is its callers': each symbolic dimension of its buffers takes the
bound of the size the call passes there. LegalizeOps and FuseTIR keep one kernel for
structurally equal computations, and an imported graph's prefill ([1, seq_len, h])
and decode ([1, batch_size, h]) are equal up to the size's name, as the hand-written
prefill and verify are: such a kernel is copied once per bound its callers give it,
so prefill gets a GEMM and decode a GEMV. This is the one rewrite the pass makes.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ember.ir.attributes import BATCH_SIZE, SEQ_LEN, VERIFY_LEN, VERIFY_TOKENS
from ember.ir.module_utils import replace_functions

Bounds = tuple[tuple[str, int], ...]  # a kernel's (symbolic dimension, bound) pairs, sorted


def attach_sequence_bounds(prefill_chunk: int, max_batch: int) -> tvm.transform.Pass:
    """A pass bounding `seq_len`/`num_logits` by `prefill_chunk`, `batch_size` by `max_batch` and
    `verify`'s length by VERIFY_TOKENS."""
    bounds = {SEQ_LEN: prefill_chunk, "num_logits": prefill_chunk, BATCH_SIZE: max_batch,
              VERIFY_LEN: VERIFY_TOKENS}

    @tvm.transform.module_pass(opt_level=0, name="AttachSequenceBounds")
    def _attach(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod, called = _kernel_per_bound(mod, bounds)
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
                # A kernel's bounds are its callers' (one set per kernel now); an uncalled one's, by its names.
                kernel_bounds = called[gv.name_hint] if gv.name_hint in called else _named_bounds(func, bounds)
                if kernel_bounds:
                    updates[gv.name_hint] = func.with_attr("tir_var_upper_bound", dict(kernel_bounds))
        return replace_functions(mod, updates)

    return _attach


def _kernel_per_bound(mod: tvm.IRModule, bounds: dict[str, int]) -> tuple[tvm.IRModule, dict[str, Bounds]]:
    """`mod` with each kernel its callers bound differently copied once per bound, the calls redirected; and the
    bounds of every called kernel, by name."""
    by_bounds: dict[tvm.ir.GlobalVar, dict[Bounds, list[relax.Call]]] = {}
    for call, kernel in _kernel_calls(mod):
        by_bounds.setdefault(kernel, {}).setdefault(_call_bounds(mod[kernel], call, bounds), []).append(call)
    called: dict[str, Bounds] = {}
    redirect: dict[relax.Call, tvm.ir.GlobalVar] = {}
    builder = relax.BlockBuilder(mod)
    for kernel, groups in by_bounds.items():
        (called[kernel.name_hint], _), *others = groups.items()
        for kernel_bounds, calls in others:
            # Bounded now, the copy differs from the kernel, which add_func would otherwise return instead.
            copy = builder.add_func(mod[kernel].with_attr("tir_var_upper_bound", dict(kernel_bounds)),
                                    kernel.name_hint)
            called[copy.name_hint] = kernel_bounds
            redirect.update({call: copy for call in calls})
    if not redirect:
        return mod, called
    copied = builder.get()
    updates = {gv.name_hint: _Redirect(copied, redirect).visit_expr(func) for gv, func in copied.functions_items()
               if isinstance(func, relax.Function)}
    return replace_functions(copied, updates), called


def _named_bounds(kernel: tirx.PrimFunc, bounds: dict[str, int]) -> Bounds:
    """The bounds of the sizes `kernel`'s symbolic dimensions are named after (for a kernel no entry calls)."""
    named = {var.name for param in kernel.params for var in _shape_vars(param)}
    return tuple(sorted((name, bound) for name, bound in bounds.items() if name in named))


def _kernel_calls(mod: tvm.IRModule) -> list[tuple[relax.Call, tvm.ir.GlobalVar]]:
    """Every call_tir of a PrimFunc in `mod`'s Relax functions."""
    calls = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            def visit(expr: relax.Expr) -> None:
                if (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_tir"
                        and isinstance(mod[expr.args[0]], tirx.PrimFunc)):
                    calls.append((expr, expr.args[0]))
            relax.analysis.post_order_visit(func, visit)
    return calls


def _call_bounds(kernel: tirx.PrimFunc, call: relax.Call, bounds: dict[str, int]) -> Bounds:
    """The bounds this call gives the kernel's symbolic dimensions: those of the sizes it passes there."""
    arguments = [arg.ty for arg in call.args[1].fields]
    outputs = call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]
    given: dict[str, int] = {}
    for param, passed in zip(kernel.params, [*arguments, *outputs]):
        dims, shape = getattr(param, "shape", None), getattr(passed, "shape", None)
        if dims is None or shape is None or len(shape) != len(dims):
            continue
        for dim, size in zip(dims, shape):
            if isinstance(dim, tirx.Var) and isinstance(size, tirx.Var) and size.name in bounds:
                given[dim.name] = bounds[size.name]
    return tuple(sorted(given.items()))


def _shape_vars(param: tirx.Var) -> list[tirx.Var]:
    """Symbolic dimensions of a PrimFunc buffer parameter."""
    shape = getattr(param, "shape", None) or []
    return [dim for dim in shape if isinstance(dim, tirx.Var)]


@relax.expr_functor.mutator
class _Redirect(relax.PyExprMutator):
    """Calls in `redirect` call the kernel given there instead."""

    def __init__(self, mod: tvm.IRModule, redirect: dict[relax.Call, tvm.ir.GlobalVar]) -> None:
        super().__init__(mod)
        self.redirect = redirect

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if call in self.redirect:
            return relax.Call(call.op, [self.redirect[call], *[self.visit_expr(a) for a in call.args[1:]]],
                              call.attrs, call.ty_args)
        return super().visit_call_(call)
