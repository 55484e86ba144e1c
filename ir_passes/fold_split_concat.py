"""A split whose pieces are reshaped and concatenated back in order becomes one reshape.

Matches, inside one dataflow block,

    parts = split(y, ..., axis=-1)                 # y [..., N], pieces [..., N_i]
    p_i   = reshape(parts[i], [..., N_i / D, D])   # every piece, with the same D
    c     = concat([p_0, ..., p_n-1], axis=-2)     # [..., N / D, D]

and rewrites `c = reshape(y, [..., N / D, D])`: the pieces lie in `y` contiguously and
in order, so the concatenation is `y`'s bytes unchanged.

Why: `fuse_parallel_projections` turns q/k/v into one projection and splits its output;
the model then views q, k and v as heads and concatenates them for the KV cache's
fused-qkv attention. Without this pass every layer copies the projection twice (split,
concat) and the VM runs five reshapes, to produce the tensor it started with.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.sym.analyzer import Analyzer

from ember.ir.module_utils import bindings, is_op, replace_functions


@tvm.transform.module_pass(opt_level=0, name="FoldSplitConcat")
def fold_split_concat(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Fold the pattern in every Relax function."""
    updates = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            folded = _fold(func)
            if folded is not None:
                updates[gv.name_hint] = folded
    return replace_functions(mod, updates) if updates else mod


def _fold(func: relax.Function) -> relax.Function | None:
    values = {binding.var: binding.value for binding in bindings(func)}
    sources = {}
    for binding in bindings(func):
        source = _concatenated_split_source(binding.value, values)
        if source is not None:
            sources[binding.var] = source
    if not sources:
        return None
    rewritten = _ConcatToReshape(sources).visit_expr(func)
    return relax.analysis.remove_all_unused(rewritten)


def _concatenated_split_source(value: relax.Expr, values: dict[relax.Var, relax.Expr]) -> relax.Var | None:
    """`y` if `value` is concat(reshape(split(y)[0]), ..., reshape(split(y)[n-1])) as in the docstring."""
    if not is_op(value, "relax.concat") or not isinstance(value.args[0], relax.Tuple):
        return None
    pieces = list(value.args[0].fields)
    rank = len(value.ty.shape)
    if value.attrs.axis is None or int(value.attrs.axis) % rank != rank - 2:
        return None
    split, heads_dims = None, set()
    for index, piece in enumerate(pieces):
        reshape = values.get(piece)
        if not is_op(reshape, "relax.reshape"):
            return None
        item = values.get(reshape.args[0])
        if not isinstance(item, relax.TupleGetItem) or item.index != index:
            return None
        if split is None:
            split = item.tuple_value
        elif not item.tuple_value.same_as(split):
            return None
        source_shape, piece_shape = list(reshape.args[0].ty.shape), list(piece.ty.shape)
        if len(piece_shape) != rank or not _equal(piece_shape[:-2], source_shape[:-1]):
            return None
        if not isinstance(piece_shape[-1], tvm.tirx.IntImm):
            return None
        heads_dims.add(int(piece_shape[-1]))
    call = values.get(split)
    if not is_op(call, "relax.split") or len(split.ty.fields) != len(pieces):
        return None
    y = call.args[0]
    if int(call.attrs.axis) % len(y.ty.shape) != len(y.ty.shape) - 1 or len(heads_dims) != 1:
        return None
    return y


def _equal(a: list, b: list) -> bool:
    analyzer = Analyzer()
    return len(a) == len(b) and all(analyzer.can_prove_equal(x, y) for x, y in zip(a, b))


@relax.expr_functor.mutator
class _ConcatToReshape(relax.PyExprMutator):
    def __init__(self, sources: dict[relax.Var, relax.Var]) -> None:
        super().__init__()
        self.sources = sources

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        source = self.sources.get(binding.var)
        if source is None:
            super().visit_var_binding_(binding)
            return
        reshaped = relax.op.reshape(self.visit_expr(source), binding.var.ty.shape)
        self.set_var_remap(binding.var, self.builder_.emit(reshaped))
