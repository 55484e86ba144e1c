"""An imported `forward` loses habits of tracers that ember's later passes would trip on.

Matches only the `forward` function an importer writes (`frontend/torch_export.py`,
`frontend/onnx.py`: one whole sequence in, logits out); a module a frontend built with
its entries already is left as it is.

1. **One view per reader.** A tracer records `x.view(...)` or `x.reshape(...)` again for
   each consumer: q, k and v each reshape the normed hidden states. Common
   subexpression elimination makes them one binding, so the projections read one
   variable and `fuse_parallel_projections` can fuse them.
2. **Empty tensors.** Partial-rotary code splits a head into `x[..., :rotary_dim]` and
   `x[..., rotary_dim:]` and concatenates them again; where the rotary dim is the whole
   head (Phi-3), the second part has no elements. A kernel over a zero extent cannot be
   vectorized (TVM fails to compile it), and it computes nothing: each empty operand
   of a `concat` is dropped (the concat itself where one operand is left), and the
   slices that made them die with it.
3. **A reciprocal square root in two operators.** ONNX has no rsqrt: RMSNorm's
   `1 / sqrt(mean + eps)` is exported as Sqrt and Reciprocal; it becomes `rsqrt`, the
   spelling `fuse_rms_norm` matches.
4. **Cubes.** GELU's tanh form computes `pow(x, 3)`: as `x * x * x` it vectorizes
   (a power is a libm call per element) and is exact for negative `x`, which TVM's code
   generation warns a power of 3 or more may not be.
5. **Projections of flattened rows.** torch's linear layer on [1, seq, in] traces as
   `reshape(matmul(reshape(x, [seq, in]), W), [1, seq, out])` (with `+ bias` before the
   outer reshape where it is an addmm); as `matmul(x, W)` (+ bias) on the 3-D
   activations (the form ember's own definitions have), FuseOps can fuse the projection
   with its neighbours: the residual add, the activation, the split of a fused projection.
6. **Indices from the end.** `x[..., [-2], :]` (Falcon splits its multi-query heads so)
   becomes `take(x, [-2], axis)` in TVM's importer, whose `fast` mode reads before the
   tensor's start: constant indices are counted from the start of the (static) axis.
7. **A softmax's input less its own maximum.** `softmax(x - max(x))` over the same axis
   (gpt-oss writes it so before its attention sinks; torch's `max(dim, keepdim=True)`
   traces as a top-1 `topk`) is `softmax(x)`: a softmax subtracts the maximum itself.
   The top-1 would otherwise be a reduction over the tokens that no later pass knows
   (`lower_moe` would refuse it as a router it does not know).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from ember.ir.attributes import FORWARD
from ember.ir.module_utils import bindings, is_op, replace_functions, scalar_constant


@tvm.transform.module_pass(opt_level=0, name="TidyTracedGraph")
def tidy_traced_graph(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` with its imported `forward` tidied (see the module docstring)."""
    if FORWARD not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod
    forward = relax.transform.EliminateCommonSubexpr()(tvm.IRModule({FORWARD: mod[FORWARD]}))[FORWARD]
    forward = _Tidy(forward).visit_expr(forward)
    cleaned = relax.transform.DeadCodeElimination([FORWARD])(tvm.IRModule({FORWARD: forward}))[FORWARD]
    return replace_functions(mod, {FORWARD: cleaned})


def _is_empty(expr: relax.Expr) -> bool:
    """Whether `expr` is a tensor with a dimension known to be 0."""
    shape = getattr(expr.ty, "shape", None)
    return shape is not None and any(isinstance(d, tirx.IntImm) and int(d) == 0 for d in shape)


def _indices_from_start(take: relax.Call) -> relax.Call:
    """`take` with negative constant indices counted from the start of its static axis."""
    x, indices = take.args
    if not isinstance(indices, tvm.ir.expr.Constant):
        return take
    values = indices.value.numpy()
    axis = int(take.attrs.axis) % len(x.ty.shape)
    extent = x.ty.shape[axis]
    if not (values < 0).any() or not isinstance(extent, tirx.IntImm):
        return take
    counted = relax.const(values % int(extent), str(values.dtype))
    return relax.op.take(x, counted, axis=take.attrs.axis, mode=take.attrs.mode)


@relax.expr_functor.mutator
class _Tidy(relax.PyExprMutator):
    def __init__(self, func: relax.Function) -> None:
        super().__init__()
        self.values = {binding.var: binding.value for binding in bindings(func)}
        self.readers: dict[relax.Var, int] = {}
        for value in self.values.values():
            for var in relax.analysis.free_vars(value):
                self.readers[var] = self.readers.get(var, 0) + 1

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        root = self.values.get(call.args[1]) if len(call.args) > 1 else None
        if is_op(call, "relax.divide") and scalar_constant(call.args[0]) == 1.0 and is_op(root, "relax.sqrt"):
            return relax.op.rsqrt(self.visit_expr(root.args[0]))
        if is_op(call, "relax.nn.softmax") and (shifted := self._less_own_max(call)) is not None:
            return relax.op.nn.softmax(self.visit_expr(shifted), call.attrs.axis)
        if is_op(call, "relax.reshape") and (rows := self._projected_rows(call)) is not None:
            x, weight, product, bias = rows
            projected = relax.op.matmul(self.visit_expr(x), self.visit_expr(weight), product.attrs.out_dtype)
            return projected if bias is None else relax.op.add(projected, self.visit_expr(bias))
        call = super().visit_call_(call)
        if is_op(call, "relax.power") and scalar_constant(call.args[1]) == 3.0:
            x = call.args[0]
            return relax.op.multiply(relax.op.multiply(x, x), x)
        if is_op(call, "relax.take"):
            return _indices_from_start(call)
        if is_op(call, "relax.concat") and isinstance(call.args[0], relax.Tuple):
            return _without_empty_operands(call)
        return call

    def _less_own_max(self, softmax: relax.Call) -> relax.Expr | None:
        """x where `softmax` is softmax(x - m) with m the values of a top-1 topk of x over the softmax's axis (torch's
        `max(dim, keepdim=True)`, through the tuples it traces as); None otherwise."""
        difference = self.values.get(softmax.args[0])
        if not is_op(difference, "relax.subtract"):
            return None
        x, m = difference.args
        value = self.values.get(m)
        while isinstance(value, relax.TupleGetItem) and int(value.index) == 0:
            source = self.values.get(value.tuple_value)
            value = self.values.get(source.fields[0]) if isinstance(source, relax.Tuple) else source
        if not is_op(value, "relax.topk"):
            return None
        rank, attrs = x.ty.ndim, value.attrs
        same = (value.args[0].same_as(x) and int(attrs.k) == 1 and bool(attrs.largest)
                and int(attrs.axis) % rank == int(softmax.attrs.axis) % rank)
        return x if same else None

    def _projected_rows(
        self, reshape: relax.Call,
    ) -> tuple[relax.Expr, relax.Expr, relax.Call, relax.Expr | None] | None:
        """(x, W, the matmul, the bias or None) if `reshape` is reshape(matmul(reshape(x, [rows, in]), W) [+ bias],
        x's leading dims + [out]) (torch's addmm adds a bias so), the matmul read by this reshape alone."""
        product_var, bias = reshape.args[0], None
        biased = self.values.get(product_var)
        if is_op(biased, "relax.add"):
            if self.readers.get(product_var) != 1:
                return None
            product_var, bias = next(((term, other) for term, other in (biased.args, biased.args[::-1])
                                      if is_op(self.values.get(term), "relax.matmul")
                                      and isinstance(other.ty, relax.TensorType) and other.ty.ndim == 1),
                                     (None, None))
        product = self.values.get(product_var)
        if not is_op(product, "relax.matmul") or self.readers.get(product_var) != 1:
            return None
        flattened = self.values.get(product.args[0])
        if not is_op(flattened, "relax.reshape") or len(product.args[1].ty.shape) != 2:
            return None
        x = flattened.args[0]
        leading, wanted = list(x.ty.shape)[:-1], list(reshape.ty.shape)
        same = len(wanted) == len(leading) + 1 and all(tvm_ffi.structural_equal(a, b) for a, b in zip(leading, wanted))
        return (x, product.args[1], product, bias) if same and len(product.ty.shape) == 2 else None


def _without_empty_operands(concat: relax.Call) -> relax.Expr:
    fields = concat.args[0].fields
    kept = [field for field in fields if not _is_empty(field)]
    if len(kept) == len(fields) or not kept:
        return concat
    return kept[0] if len(kept) == 1 else relax.op.concat(kept, axis=concat.attrs.axis)
