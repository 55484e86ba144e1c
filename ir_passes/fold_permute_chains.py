"""Chains of axis permutations become one permutation, or none.

Matches, in every Relax function, `permute_dims(permute_dims(x, a), b)` (to any depth) and
rewrites it into `permute_dims(x, a∘b)`, or into `x` itself where the composition is
the identity.

Why: an imported graph moves attention's heads around in its own layout ([1, heads,
seq, dim] for a batched matmul, [seq, 1, heads, dim] in the sdpa decomposition), and
`specialize_attention` hands the cache [1, seq, heads, dim]: the chains of transposes
that meet there cancel out, but FuseOps would fuse them into a kernel that copies the
attention output once per layer and step. The inner permutations stay in place for
other readers; dead ones are removed.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ember.ir.module_utils import bindings, is_op, permute_axes, replace_functions


@tvm.transform.module_pass(opt_level=0, name="FoldPermuteChains")
def fold_permute_chains(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` with every chain of permute_dims composed into one (see the module docstring)."""
    updates = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and _has_chain(func):
            updates[gv.name_hint] = _Folder(mod).visit_expr(func)
    if not updates:
        return mod
    entries = [gv.name_hint for gv, func in mod.functions_items() if isinstance(func, relax.Function)]
    return relax.transform.DeadCodeElimination(entries)(replace_functions(mod, updates))


def _has_chain(func: relax.Function) -> bool:
    permuted = {b.var for b in bindings(func) if is_op(b.value, "relax.permute_dims")}
    return any(is_op(b.value, "relax.permute_dims") and b.value.args[0] in permuted for b in bindings(func))


@relax.expr_functor.mutator
class _Folder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.permuted: dict[relax.Var, tuple[relax.Expr, list[int]]] = {}  # new variable -> (base, axes)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if not is_op(value, "relax.permute_dims"):
            super().visit_var_binding_(binding)
            return
        x, axes = self.visit_expr(value.args[0]), permute_axes(value)
        if x in self.permuted:
            base, inner = self.permuted[x]
            x, axes = base, [inner[a] for a in axes]
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        if axes == list(range(len(axes))):
            folded = x if isinstance(binding.var, relax.DataflowVar) else emit(x)
        else:
            folded = emit(relax.op.permute_dims(x, axes))
            self.permuted[folded] = (x, axes)
        self.set_var_remap(binding.var, folded)
