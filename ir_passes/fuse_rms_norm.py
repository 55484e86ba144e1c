"""RMSNorm written out as elementwise operators becomes one `rms_norm` operator.

Matches, in every Relax function, the way an imported graph (torch.export of
transformers' `LlamaRMSNorm` and its copies in other families) spells RMSNorm:

    y = multiply(w, multiply(x, rsqrt(add(mean(power(x, 2), axis=[-1], keepdims=True), eps))))

(either operand order of both multiplies) and rewrites it into

    y = rms_norm(x, w, axes=[-1], epsilon=eps)

Why: written out, the square is a kernel of its own that writes x^2 to memory, and
the mean's keepdims axis keeps the row reduction rule (`schedules/reduction.py`)
from matching the rest; as one operator it legalizes into the one row kernel the
hand-written frontend's `nn.RMSNorm` gets. Anything else (another exponent, a mean
over other axes, a norm without a weight) is left as it is.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ember.ir.module_utils import bindings, is_op, replace_functions, scalar_constant


@tvm.transform.module_pass(opt_level=0, name="FuseRMSNorm")
def fuse_rms_norm(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every written-out RMSNorm of `mod`'s Relax functions as one `rms_norm`."""
    updates = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and (norms := _find_norms(func)):
            updates[gv.name_hint] = _Rewriter(mod, norms).visit_expr(func)
    if not updates:
        return mod
    entries = [gv.name_hint for gv, func in mod.functions_items() if isinstance(func, relax.Function)]
    return relax.transform.DeadCodeElimination(entries)(replace_functions(mod, updates))


def _find_norms(func: relax.Function) -> dict[relax.Var, tuple[relax.Expr, relax.Expr, float]]:
    """output variable -> (x, weight, eps) for each RMSNorm of `func`."""
    values = {b.var: b.value for b in bindings(func)}
    found = {}
    for var, value in values.items():
        if not is_op(value, "relax.multiply"):
            continue
        for weight, normed in (value.args, value.args[::-1]):
            if len(getattr(weight.ty, "shape", None) or []) != 1:
                continue
            match = _normalized(values.get(normed), values)
            if match is not None:
                found[var] = (match[0], weight, match[1])
                break
    return found


def _normalized(value: relax.Expr | None, values: dict) -> tuple[relax.Expr, float] | None:
    """(x, eps) if `value` is multiply(x, rsqrt(mean(x^2, axis=-1, keepdims) + eps)), in either order."""
    if not is_op(value, "relax.multiply"):
        return None
    for x, scale in (value.args, value.args[::-1]):
        rsqrt = values.get(scale)
        if not is_op(rsqrt, "relax.rsqrt"):
            continue
        add = values.get(rsqrt.args[0])
        if not is_op(add, "relax.add"):
            continue
        mean, eps = values.get(add.args[0]), scalar_constant(add.args[1])
        if eps is None or not is_op(mean, "relax.mean") or not mean.attrs.keepdims:
            continue
        ndim = len(x.ty.shape)
        if [int(a) % ndim for a in mean.attrs.axis] != [ndim - 1]:
            continue
        square = values.get(mean.args[0])
        if is_op(square, "relax.power") and square.args[0].same_as(x) and scalar_constant(square.args[1]) == 2.0:
            return x, eps
    return None


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, norms: dict) -> None:
        super().__init__(mod)
        self.norms = norms

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.norms:
            super().visit_var_binding_(binding)
            return
        x, weight, eps = self.norms[binding.var]
        normed = relax.op.nn.rms_norm(self.visit_expr(x), self.visit_expr(weight), axes=[-1], epsilon=eps)
        if isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, self.builder_.emit(normed))
        else:
            self.set_var_remap(binding.var, self.builder_.emit_output(normed))
