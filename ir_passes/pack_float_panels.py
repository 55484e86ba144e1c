"""Float projection weights stored as panels of rows, for an outer-product GEMM tile.

Matches, in every entry function that takes weights, a float weight parameter `W`
[N, K] whose every use is a projection

    y = matmul(x, permute_dims(W))

and stores it as panels of P rows, each panel k-major (`P` = two SIMD vectors of the
weight's dtype: 16 float32 on AVX2, 32 on AVX-512):

    W.panels[N / P, K, P]      W.panels[p, k, i] = W[p * P + i, k]
    y[..., n] = sum_k x[..., k] * W.panels[n // P, k, n % P]

Why: a prefill GEMM over the row-major weight (`schedules/matmul.py`) multiplies a
row of x by a row of W, so every output needs a horizontal sum of vector lanes, and
its register tile reached about 60 GFLOP/s per Zen 3 core. Over panels, one k step
loads P weights of P outputs (contiguous), broadcasts one activation per token, and
accumulates m_tile x P outputs in registers with plain FMAs: the tile BLAS libraries
and llama.cpp's tinyBLAS use, about 95 GFLOP/s per core. Decode reads each panel
front to back once, contiguous like a row, so it streams at the same bandwidth.

The parameter keeps its name (its recipe gains a `panels` step, so weight conversion
writes the panels); weights read any other way (a tied embedding's gather, norm
scales), weights the quantization pass packed, and N not a multiple of P keep their
layout. CPU targets only: GPU schedules expect the row-major weight.
"""

from __future__ import annotations

import tvm
from tvm import relax, te
from tvm.runtime import DataType

from ember.ir.module_utils import bindings, is_op, is_weight_transpose
from ember.ir.weight_recipes import entry_functions_with_weights, get_recipes, set_recipes, weight_params

PANEL_OP = "panels"


def panel_rows(vector_bits: int, dtype: str) -> int:
    """Rows per panel: two SIMD vectors of `dtype` (the tile's width in outputs)."""
    return 2 * vector_bits // DataType(dtype).bits


def to_panels(weight, rows: int):
    """numpy: [N, K] -> [N / rows, K, rows] (what a `panels` recipe step computes)."""
    n, k = weight.shape
    return weight.reshape(n // rows, rows, k).transpose(0, 2, 1)


def pack_float_panels(vector_bits: int) -> tvm.transform.Pass:
    """The pass storing every float projection-only weight as panels sized for `vector_bits` SIMD."""

    @tvm.transform.module_pass(opt_level=0, name="PackFloatPanels")
    def transform(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = entry_functions_with_weights(mod)
        if not names:
            return mod
        chosen: set[str] | None = None
        for name in names:
            found = _projection_only_weights(mod[name], vector_bits)
            chosen = found if chosen is None else chosen & found
        if not chosen:
            return mod
        rewriter = _Rewriter(mod, chosen, vector_bits)
        for name in names:
            rewriter.builder_.update_func(mod.get_global_var(name), rewriter.rewrite_function(mod[name]))
        recipes = {name: {"op": PANEL_OP, "rows": rewriter.rows[name], "input": recipe} if name in chosen else recipe
                   for name, recipe in get_recipes(mod).items()}
        return set_recipes(rewriter.builder_.get(), recipes)

    return transform


def _projection_only_weights(func: relax.Function, vector_bits: int) -> set[str]:
    """Names of the 2-D float weights `func` reads only through projections, N a multiple of the panel."""
    weights = {p: p.name for p in weight_params(func)
               if len(p.ty.shape) == 2 and DataType(p.ty.dtype).is_float
               and all(isinstance(d, tvm.tirx.IntImm) for d in p.ty.shape)
               and int(p.ty.shape[0]) % panel_rows(vector_bits, p.ty.dtype) == 0}
    transposed: dict[relax.Var, relax.Var] = {}
    projected: set[str] = set()
    other_uses: set[str] = set()
    for binding in bindings(func):
        value = binding.value
        if is_weight_transpose(value, weights):
            transposed[binding.var] = value.args[0]
            continue
        if is_op(value, "relax.matmul") and value.args[1] in transposed:
            projected.add(weights[transposed[value.args[1]]])
            reads = [value.args[0]]
        else:
            reads = [value]
        for var in relax.analysis.free_vars(relax.Tuple(reads)):
            if var in weights:
                other_uses.add(weights[var])
            elif var in transposed:
                other_uses.add(weights[transposed[var]])
    for var in relax.analysis.free_vars(func.body.body):
        if var in weights:
            other_uses.add(weights[var])
    return projected - other_uses


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Replaces the chosen weights by their panels and their projections by panel matmuls."""

    def __init__(self, mod: tvm.IRModule, chosen: set[str], vector_bits: int) -> None:
        super().__init__(mod)
        self.chosen = chosen
        self.vector_bits = vector_bits
        self.rows: dict[str, int] = {}  # weight name -> rows per panel
        self.panels_of: dict[relax.Var, relax.Var] = {}
        self.transposed: dict[relax.Var, relax.Var] = {}

    def rewrite_function(self, func: relax.Function) -> relax.Function:
        new_params = []
        for param in func.params:
            if param.name not in self.chosen:
                new_params.append(param)
                continue
            n, k = (int(d) for d in param.ty.shape)
            rows = self.rows.setdefault(param.name, panel_rows(self.vector_bits, param.ty.dtype))
            panels = relax.Var(param.name, relax.TensorType((n // rows, k, rows), param.ty.dtype))
            self.panels_of[param] = panels
            new_params.append(panels)
        body = self.visit_expr(func.body)
        return relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs, func.span)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.permute_dims") and value.args[0] in self.panels_of:
            self.transposed[binding.var] = value.args[0]  # consumed by the matmul below; no binding left
            return
        if is_op(value, "relax.matmul") and value.args[1] in self.transposed:
            panels = self.panels_of[self.transposed[value.args[1]]]
            x = self.visit_expr(value.args[0])
            y = self.builder_.emit_te(_panel_matmul(str(binding.var.ty.dtype)), x, panels,
                                      primfunc_name_hint="panel_matmul")
            if isinstance(binding.var, relax.DataflowVar):
                self.set_var_remap(binding.var, y)
            else:  # an output of the dataflow block keeps being one
                self.set_var_remap(binding.var, self.builder_.emit_output(y))
            return
        super().visit_var_binding_(binding)


def _panel_matmul(out_dtype: str):
    """TE: y[..., n] = sum_k x[..., k] * panels[n // P, k, n % P]."""

    def compute(x: te.Tensor, panels: te.Tensor) -> te.Tensor:
        count, k, rows = (int(d) for d in panels.shape)
        reduce = te.reduce_axis((0, k), name="k")
        return te.compute(
            (*x.shape[:-1], count * rows),
            lambda *idx: te.sum(x[(*idx[:-1], reduce)].astype(out_dtype)
                                * panels[idx[-1] // rows, reduce, idx[-1] % rows].astype(out_dtype), axis=reduce),
            name="matmul",
        )

    return compute
