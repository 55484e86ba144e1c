"""Weights of an imported graph in the layout ember's projection passes match.

A traced graph multiplies some weights as `x @ W` with `W` stored [in, out]:
transformers' Conv1D (GPT-2) keeps its weights so, and ONNX exporters store every
linear layer's weight pre-transposed. ember's passes (projection fusion,
quantization, float panels) match projections as `x @ permute_dims(W)` with `W`
stored [out, in], as a checkpoint's linear layers are. Each such weight is taken
as [out, in] and read transposed; its recipe transposes the stored tensor once, at
compile time.
"""

from __future__ import annotations

from tvm import relax

from ember.ir.module_utils import bindings, is_op
from ember.ir.weight_recipes import Recipe


def read_weights_transposed(func: relax.Function,
                            recipes: dict[str, Recipe]) -> tuple[relax.Function, dict[str, Recipe]]:
    """`func` with each 2-D weight it only multiplies as x @ W read as x @ permute_dims(W) of W stored [out, in],
    and the recipes with those weights transposed."""
    func, transposed = _transposed_reads(func)
    return func, {name: {"op": "transpose", "input": recipe} if name in transposed else recipe
                  for name, recipe in recipes.items()}


def _transposed_reads(func: relax.Function) -> tuple[relax.Function, list[str]]:
    """`func` with each 2-D weight it only multiplies as x @ W taken as [out, in] and read as
    x @ permute_dims(W), and the names of those weights."""
    num_input = int(func.attrs["num_input"])
    weights = set(func.params[num_input:])
    right_operands, other_uses = set(), set()
    for binding in bindings(func):
        value = binding.value
        if is_op(value, "relax.matmul") and value.args[1] in weights and len(value.args[1].ty.shape) == 2:
            right_operands.add(value.args[1])
            reads = [value.args[0]]
        else:
            reads = [value]
        other_uses |= {var for var in relax.analysis.free_vars(relax.Tuple(reads)) if var in weights}
    chosen = right_operands - other_uses
    if not chosen:
        return func, []
    stored = {w: relax.Var(w.name, relax.TensorType(list(w.ty.shape)[::-1], w.ty.dtype)) for w in chosen}
    body = _ReadTransposed(stored).visit_expr(func.body)
    params = [stored.get(p, p) for p in func.params]
    return relax.Function(params, body, None, func.is_pure, func.attrs), [w.name for w in chosen]


@relax.expr_functor.mutator
class _ReadTransposed(relax.PyExprMutator):
    def __init__(self, stored: dict[relax.Var, relax.Var]) -> None:
        super().__init__()
        self.stored = stored

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.matmul") and value.args[1] in self.stored:
            weight = self.builder_.emit(relax.op.permute_dims(self.stored[value.args[1]]))
            product = relax.op.matmul(self.visit_expr(value.args[0]), weight, value.attrs.out_dtype)
            emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
            self.set_var_remap(binding.var, emit(product))
            return
        super().visit_var_binding_(binding)
