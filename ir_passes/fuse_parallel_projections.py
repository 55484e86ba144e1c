"""Horizontal fusion of projections that read the same activation.

Matches, inside one dataflow block, two or more bindings

    y_i = matmul(x, permute_dims(W_i))        W_i an [N_i, K] weight parameter

that share the activation `x` (q/k/v of attention; gate/up of a SwiGLU MLP) and
rewrites them into

    y   = matmul(x, permute_dims(W_fused))    W_fused = concat(W_1 .. W_n, axis=0)
    y_i = split(y, [N_1, N_1 + N_2, ...], axis=-1)[i]

(`W_fused`'s recipe records each member's rows, N_1 .. N_n.)

Why: decode reads the activation once and runs one GEMV with N_1 + ... + N_n rows
to divide among cores instead of n small ones; prefill gets one wider GEMM. The
model definition keeps Hugging Face's separate projections; only the graph changes.

Invariant: every entry function takes the same weights in the same order. A group
is fused only if it occurs in every function that takes weights; `W_fused` takes
the place of `W_1` and its recipe concatenates the members' recipes, so weight
conversion produces exactly the tensor the graph expects. A fused weight is stored in
one format, so weights that `tensor_formats` stores differently (a GGUF file's v
projection in Q6_K beside q and k in Q4_K) are not fused together: q and k still are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import tvm
from tvm import relax

from ember.ir.module_utils import bindings, is_op, is_weight_transpose, replace_functions
from ember.ir.weight_recipes import (
    entry_functions_with_weights,
    get_recipes,
    recipe_sources,
    set_recipes,
    weight_params,
)


def fuse_parallel_projections(tensor_formats: Mapping[str, Any] | None = None) -> tvm.transform.Pass:
    """The pass fusing same-input projections in every weight-taking entry function, keeping apart
    weights whose checkpoint tensors `tensor_formats` gives different formats."""

    @tvm.transform.module_pass(opt_level=0, name="FuseParallelProjections")
    def transform(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = entry_functions_with_weights(mod)
        if not names:
            return mod
        recipes = get_recipes(mod)
        formats = {name: tuple((tensor_formats or {}).get(source) for source in recipe_sources(recipe))
                   for name, recipe in recipes.items()}
        first, *others = [_find_groups(mod[name], formats) for name in names]
        groups = [g for g in first if all(g in found for found in others)]
        return _fuse(mod, names, recipes, groups) if groups else mod

    return transform


def _fuse(mod: tvm.IRModule, names: list[str], recipes: dict, groups: list[tuple[str, ...]]) -> tvm.IRModule:
    """`mod` with each group's weights one parameter (and recipe) in the functions `names`."""
    fused_name = {group: _fused_param_name(group) for group in groups}
    rows = {p.name: int(p.ty.shape[0]) for p in weight_params(mod[names[0]])}
    new_recipes = {}
    for name, recipe in recipes.items():
        group = next((g for g in groups if name in g), None)
        if group is None:
            new_recipes[name] = recipe
        elif name == group[0]:
            # `rows`: each member's, so later passes know which rows (output features) are whose.
            new_recipes[fused_name[group]] = {"op": "concat", "axis": 0, "inputs": [recipes[m] for m in group],
                                              "rows": [rows[m] for m in group]}
    rewritten = {name: _rewrite_function(mod[name], groups, fused_name) for name in names}
    return set_recipes(replace_functions(mod, rewritten), new_recipes)


def _find_groups(func: relax.Function, formats: dict[str, tuple]) -> list[tuple[str, ...]]:
    """Tuples of weight-parameter names whose projections share one input and whose weights `formats`
    (parameter name -> its tensors' formats) stores alike."""
    weights = {p: p.name for p in weight_params(func)}
    transposed: dict[relax.Var, relax.Var] = {}
    by_input: dict[relax.Expr, list[relax.Var]] = {}
    for binding in bindings(func):
        value = binding.value
        if is_weight_transpose(value, weights):
            transposed[binding.var] = value.args[0]
        elif is_op(value, "relax.matmul") and value.args[1] in transposed:
            weight = transposed[value.args[1]]
            out_dtype = value.attrs.out_dtype
            if out_dtype is None or str(out_dtype) == str(weight.ty.dtype):
                by_input.setdefault((value.args[0], formats[weights[weight]]), []).append(weight)
    groups = []
    for members in by_input.values():
        k_dims = {int(m.ty.shape[1]) for m in members}
        dtypes = {m.ty.dtype for m in members}
        if len(members) >= 2 and len(k_dims) == 1 and len(dtypes) == 1 and len(set(members)) == len(members):
            groups.append(tuple(weights[m] for m in members))
    return groups


def _rewrite_function(func: relax.Function, groups: list[tuple[str, ...]], fused_name: dict) -> relax.Function:
    params_by_name = {p.name: p for p in func.params}
    fused_params = {}
    for group in groups:
        first = params_by_name[group[0]]
        rows = sum(int(params_by_name[m].ty.shape[0]) for m in group)
        shape = [rows, first.ty.shape[1]]
        fused_params[group] = relax.Var(fused_name[group], relax.TensorType(shape, first.ty.dtype))
    new_params = []
    for param in func.params:
        group = next((g for g in groups if param.name in g), None)
        if group is None:
            new_params.append(param)
        elif param.name == group[0]:
            new_params.append(fused_params[group])
    rewriter = _ProjectionRewriter(groups, fused_params, params_by_name)
    body = rewriter.visit_expr(func.body)
    return relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


@relax.expr_functor.mutator
class _ProjectionRewriter(relax.PyExprMutator):
    """Emits one fused matmul + split at the first projection of each group."""

    def __init__(self, groups, fused_params, params_by_name) -> None:
        super().__init__()
        self.member_to_group = {params_by_name[m]: g for g in groups for m in g}
        self.fused_params = fused_params
        self.params_by_name = params_by_name
        self.transposed: dict[relax.Var, relax.Var] = {}
        self.pending: dict[tuple, list] = {}
        self.done: set[relax.Var] = set()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.permute_dims") and value.args[0] in self.member_to_group:
            self.transposed[binding.var] = value.args[0]
            return
        if is_op(value, "relax.matmul") and value.args[1] in self.transposed:
            self._emit_member(binding, self.transposed[value.args[1]])
            return
        super().visit_var_binding_(binding)

    def _emit_member(self, binding: relax.VarBinding, weight: relax.Var) -> None:
        if binding.var in self.done:
            return
        group = self.member_to_group[weight]
        members = [self.params_by_name[m] for m in group]
        x = self.visit_expr(binding.value.args[0])
        fused_t = self.builder_.emit(relax.op.permute_dims(self.fused_params[group]))
        fused_y = self.builder_.emit(relax.op.matmul(x, fused_t))
        bounds, total = [], 0
        for member in members[:-1]:
            total += int(member.ty.shape[0])
            bounds.append(total)
        parts = self.builder_.emit(relax.op.split(fused_y, bounds, axis=-1))
        for index, var in enumerate(self.pending[group]):
            self.set_var_remap(var, self.builder_.emit(relax.TupleGetItem(parts, index)))
            self.done.add(var)

    def index_block(self, block: relax.BindingBlock) -> None:
        """Record, per group, which matmul binding produces each member's projection."""
        transposed = {}
        for binding in block.bindings:
            value = binding.value
            if is_op(value, "relax.permute_dims") and value.args[0] in self.member_to_group:
                transposed[binding.var] = value.args[0]
            elif is_op(value, "relax.matmul") and value.args[1] in transposed:
                weight = transposed[value.args[1]]
                group = self.member_to_group[weight]
                slots = self.pending.setdefault(group, [None] * len(group))
                slots[group.index(weight.name)] = binding.var

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self.index_block(block)
        return super().visit_dataflow_block_(block)



def _fused_param_name(group: tuple[str, ...]) -> str:
    """`a.q_proj.w`, `a.k_proj.w` -> `a.q_k_proj.w`: shared prefix, member parts, shared suffix."""
    tokens = [re.split(r"([._])", name) for name in group]
    head = len(os.path.commonprefix(tokens))
    while head and tokens[0][head - 1] not in "._":
        head -= 1
    tail = len(os.path.commonprefix([t[head:][::-1] for t in tokens]))
    while tail and tokens[0][len(tokens[0]) - tail] not in "._":
        tail -= 1
    middles = ["".join(t[head: len(t) - tail]) for t in tokens]
    return "".join(tokens[0][:head]) + "_".join(middles) + "".join(tokens[0][len(tokens[0]) - tail:])
