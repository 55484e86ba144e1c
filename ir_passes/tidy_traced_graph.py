"""An imported `forward` loses two habits of tracers that ember's later passes would trip on.

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
3. **Indices from the end.** `x[..., [-2], :]` (Falcon splits its multi-query heads so)
   becomes `take(x, [-2], axis)` in TVM's importer, whose `fast` mode reads before the
   tensor's start: constant indices are counted from the start of the (static) axis.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ember.ir.attributes import FORWARD
from ember.ir.module_utils import replace_functions


@tvm.transform.module_pass(opt_level=0, name="TidyTracedGraph")
def tidy_traced_graph(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` with its imported `forward` deduplicated, free of empty tensors and of indices from the end."""
    if FORWARD not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod
    forward = relax.transform.EliminateCommonSubexpr()(tvm.IRModule({FORWARD: mod[FORWARD]}))[FORWARD]
    forward = _Tidy().visit_expr(forward)
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
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.take":
            return _indices_from_start(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.concat"
                and isinstance(call.args[0], relax.Tuple)):
            return call
        fields = call.args[0].fields
        kept = [field for field in fields if not _is_empty(field)]
        if len(kept) == len(fields) or not kept:
            return call
        return kept[0] if len(kept) == 1 else relax.op.concat(kept, axis=call.attrs.axis)
