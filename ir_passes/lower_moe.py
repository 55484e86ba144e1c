"""Sparse mixture-of-experts blocks in an imported graph become ember's MoE kernels.

Input: the traced `forward` of a model whose experts transformers ran as `batched_mm`
(`frontend/torch_export.py`): per block, a router and the experts as

    logits = x @ W_router^T                                         [T, E]
    softmax -> topk(k) (-> / sum)     or     topk(k) -> softmax        the routing
    ids = reshape(top-k indices, [T * k])
    h = squeeze(take(W_gate_up, ids) @ expand_dims(rows, -1))        [T * k, N] per (token, expert) pair
      or squeeze(expand_dims(rows, 1) @ take(W_gate_up, ids), 1)      W stored [E, K, N] (gpt-oss)
    ... (a gathered bias), activation, the down projection the same way, weights, sum over k

Output: the routing as one `moe_route` kernel (softmax and top-k fused, nothing left
for `specialize_attention` to mistake for attention), and each gathered projection as
`moe_matmul` over the expert weight seen as [E * N, K] rows, with the pairs grouped by
expert once per block (`moe_group`); see `schedules/moe.py`. What is around them (the
activation, a renormalisation, the routing weights, the sum over k, shared experts)
stays as traced, as does the gather of each pair's expert bias (a row per pair). An expert
weight stored [E, K, N] is transposed as it is loaded (its recipe). The gathered form reads
every pair's whole expert weight into a [T * k, N, K] tensor; the kernels read each chosen
expert's rows once.

Refused in one line naming the operator: a top-k that is not a router's (smallest, on
another axis, not fed by a softmax nor feeding one), an expert weight read any other way,
and a top-k left over, which no kernel computes.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ember.core.errors import ModelError
from ember.ir.attributes import FORWARD, KERNEL_SOURCE_ATTR
from ember.ir.module_utils import bindings, is_op
from ember.ir.weight_recipes import Recipe, get_recipes, set_recipes, weight_params
from ember.schedules import moe


def lower_moe(vector_bits: int) -> tvm.transform.Pass:
    """The pass rewriting `forward`'s MoE blocks (a module without any passes through)."""

    @tvm.transform.module_pass(opt_level=0, name="LowerMoE")
    def transform(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if FORWARD not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        func = mod[FORWARD]
        if not any(is_op(b.value, "relax.topk") for b in bindings(func)):
            return mod
        rewriter = _Rewriter(mod, func, vector_bits)
        rewriter.builder_.update_func(mod.get_global_var(FORWARD), rewriter.rewrite())
        recipes = get_recipes(mod)
        for name, (experts, transposed) in rewriter.flattened.items():
            recipes[name] = _flattened(recipes[name], experts, transposed)
        return set_recipes(rewriter.builder_.get(), recipes)

    return transform


def _flattened(recipe: Recipe, shape: list[int], transposed: bool) -> Recipe:
    """`recipe` of a stacked [E, N, K] expert weight (stored [E, K, N] if `transposed`) giving it as [E * N, K]
    rows."""
    rows = [shape[0] * shape[1], shape[2]]
    if transposed:
        return {"op": "reshape", "shape": rows, "input": {"op": "transpose", "input": recipe}}
    if recipe["op"] == "reshape":
        return {**recipe, "shape": rows}
    return {"op": "reshape", "shape": rows, "input": recipe}


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function, vector_bits: int) -> None:
        super().__init__(mod)
        self.func = func
        self.vector_bits = vector_bits
        self.values = {binding.var: binding.value for binding in bindings(func)}
        self.readers: dict[relax.Var, list[relax.Var]] = {}
        for var, value in self.values.items():
            for read in relax.analysis.free_vars(value):
                self.readers.setdefault(read, []).append(var)
        weights = weight_params(func)
        self.stacked = {p for p in weights if len(p.ty.shape) == 3}  # [E, N, K] (or [E, K, N]) expert weights
        self.layouts: dict[relax.Var, bool] = {}  # stacked weight -> whether stored [E, K, N] (gpt-oss)
        self.flattened: dict[str, tuple[list[int], bool]] = {}  # name -> the [E, N, K] shape it had, transposed?
        self.routers: dict[relax.Var, tuple[relax.Var, int, tvm.tirx.PrimFunc]] = {}  # topk -> (logits, k, kernel)
        self.routed: dict[relax.Var, tuple[relax.Var, int]] = {}  # a routing result -> (its topk, field of the route)
        self.projections: dict[relax.Var, tuple[relax.Var, relax.Var, relax.Var]] = {}  # squeeze var -> (x, W, ids)
        self.skipped: set[relax.Var] = set()
        self.groups: dict[relax.Var, relax.Var] = {}  # ids var -> its (order, offsets)
        self.kernels: dict[str, relax.GlobalVar] = {}
        self._match()
        self.transposed = {weight for weight, transposed in self.layouts.items() if transposed}
        self.rows_of = {p: relax.Var(p.name, relax.TensorType(_rows(p, p in self.transposed), p.ty.dtype))
                        for p in self.stacked}

    def rewrite(self) -> relax.Function:
        params = [self.rows_of.get(p, p) for p in self.func.params]
        body = self.visit_expr(self.func.body)
        rewritten = relax.Function(params, body, self.func.ret_ty, self.func.is_pure, self.func.attrs,
                                   self.func.span)
        rewritten = relax.analysis.remove_all_unused(rewritten)
        self._check_nothing_left(rewritten)
        return rewritten

    # -- matching -------------------------------------------------------------------------------------------

    def _match(self) -> None:
        for var, value in self.values.items():
            if is_op(value, "relax.topk"):
                self._match_router(var, value)
            elif is_op(value, "relax.take") and value.args[0] in self.stacked:
                self._match_projection(var, value)

    def _match_router(self, var: relax.Var, topk: relax.Call) -> None:
        attrs = topk.attrs
        scores = topk.args[0]
        where = f"{FORWARD}: {var.name} = topk"
        if (not bool(attrs.largest) or str(attrs.ret_type) != "both" or scores.ty.ndim != 2
                or int(attrs.axis) not in (-1, 1)):
            raise ModelError(f"{where}: not a router's top-k (the k largest over the last axis of [tokens, experts] "
                             "scores, values and indices)")
        fields = {int(self.values[r].index): r for r in self.readers.get(var, [])
                  if isinstance(self.values[r], relax.TupleGetItem)}
        if set(fields) != {0, 1} or len(self.readers[var]) != 2:
            raise ModelError(f"{where}: its values and indices are read in a way ember's router does not know")
        producer = self.values.get(scores)
        if is_op(producer, "relax.nn.softmax") and _last_axis(producer) and len(self.readers[scores]) == 1:
            logits, softmax_first, weights_var = producer.args[0], True, fields[0]
            self.skipped.add(scores)
        else:
            consumers = self.readers.get(fields[0], [])
            weights_var = consumers[0] if len(consumers) == 1 else None
            if weights_var is None or not is_op(self.values[weights_var], "relax.nn.softmax") or not _last_axis(
                    self.values[weights_var]):
                raise ModelError(f"{where}: a router ember does not know: neither softmax then top-k nor top-k then "
                                 "softmax over the chosen experts")
            logits, softmax_first = scores, False
            self.skipped.add(fields[0])
        if str(logits.ty.dtype) != "float32":
            raise ModelError(f"{where}: router logits in {logits.ty.dtype}; ember routes float32 logits")
        experts, top_k = int(logits.ty.shape[1]), int(attrs.k)
        if not 0 < top_k <= experts:
            raise ModelError(f"{where}: top-{top_k} of {experts} experts")
        self.routers[var] = (logits, top_k, moe.moe_route(experts, top_k, softmax_first,
                                                          str(topk.ty.fields[1].dtype)))
        self.routed[weights_var] = (var, 0)
        self.routed[fields[1]] = (var, 1)

    def _match_projection(self, var: relax.Var, take: relax.Call) -> None:
        """squeeze(take(W, ids) @ expand_dims(x, -1)) with W [E, N, K], or squeeze(expand_dims(x, 1) @ take(W, ids),
        1) with W [E, K, N] (gpt-oss stores its experts so): each pair's row of x times its expert's matrix."""
        weight, ids = take.args
        where = f"{FORWARD}: {var.name} = take({weight.name})"
        readers = self.readers.get(var, [])
        product = readers[0] if len(readers) == 1 else None
        value = self.values.get(product)
        row, transposed = None, False
        if is_op(value, "relax.matmul"):
            transposed = value.args[1].same_as(var)
            row = self.values.get(value.args[0] if transposed else value.args[1])
        squeeze = self.readers.get(product, [None])[0] if row is not None else None
        if (int(take.attrs.axis) != 0 or ids.ty.ndim != 1 or not is_op(row, "relax.expand_dims")
                or [int(a) for a in row.attrs.axis] not in (([1], [-2]) if transposed else ([-1], [2]))
                or len(self.readers[product]) != 1 or not is_op(self.values.get(squeeze), "relax.squeeze")
                or self.layouts.get(weight, transposed) != transposed):
            raise ModelError(f"{where}: an expert weight read other than as the gathered projection "
                             "squeeze(take(W, ids) @ expand_dims(x, -1)) or squeeze(expand_dims(x, 1) @ take(W, ids)) "
                             "ember knows")
        self.layouts[weight] = transposed
        self.skipped |= {var, product}
        self.projections[squeeze] = (row.args[0], weight, ids)

    # -- rewriting ------------------------------------------------------------------------------------------

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var = binding.var
        if var in self.skipped:
            return
        if var in self.routers:
            logits, top_k, kernel = self.routers[var]
            tokens = logits.ty.shape[0]
            call = relax.call_tir(self._kernel(kernel, "moe_route"), [self.visit_expr(logits)],
                                  [relax.TensorType([tokens, top_k], "float32"),
                                   relax.TensorType([tokens, top_k], str(binding.value.ty.fields[1].dtype))])
            self.set_var_remap(var, self.builder_.emit(call))
            return
        if var in self.routed:
            router, field = self.routed[var]
            self._emit_as(var, relax.TupleGetItem(self.get_var_remap(router), field))
            return
        if var in self.projections:
            x, weight, ids = self.projections[var]
            (rows, k), experts = _rows(weight, weight in self.transposed), int(weight.ty.shape[0])
            n = rows // experts
            self.flattened[weight.name] = ([experts, n, k], weight in self.transposed)
            order, offsets = self._grouped(self.visit_expr(ids), experts)
            kernel = self._kernel(moe.moe_matmul(None, experts, n, k, self.vector_bits), "moe_matmul")
            pairs = x.ty.shape[0]
            self._emit_as(var, relax.call_tir(kernel, [self.visit_expr(x), self.rows_of[weight], order, offsets],
                                              relax.TensorType([pairs, n], "float32")))
            return
        super().visit_var_binding_(binding)

    def _grouped(self, ids: relax.Var, experts: int) -> tuple[relax.Expr, relax.Expr]:
        """(order, offsets) of `ids`'s pairs by expert, computed once per block."""
        if ids not in self.groups:
            kernel = self._kernel(moe.moe_group(experts, str(ids.ty.dtype)), "moe_group")
            self.groups[ids] = self.builder_.emit(relax.call_tir(
                kernel, [ids], [relax.TensorType([ids.ty.shape[0]], "int32"),
                                relax.TensorType([experts + 1], "int32")]))
        group = self.groups[ids]
        return self.builder_.emit(relax.TupleGetItem(group, 0)), self.builder_.emit(relax.TupleGetItem(group, 1))

    def _kernel(self, kernel: tvm.tirx.PrimFunc, name: str) -> relax.GlobalVar:
        key = str(tvm_ffi.structural_hash(kernel))
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(kernel.with_attr(KERNEL_SOURCE_ATTR, moe.__name__), name)
        return self.kernels[key]

    def _emit_as(self, old: relax.Var, new: relax.Expr) -> None:
        if isinstance(old, relax.DataflowVar):
            self.set_var_remap(old, self.builder_.emit(new))
        else:
            self.set_var_remap(old, self.builder_.emit_output(new))

    def _check_nothing_left(self, func: relax.Function) -> None:
        for binding in bindings(func):
            if is_op(binding.value, "relax.topk"):
                raise ModelError(f"{FORWARD}: {binding.var.name} = topk outside a router ember knows")
        stacked = [p.name for p in func.params if len(p.ty.shape) == 3 and p.name not in self.flattened]
        if stacked:
            raise ModelError(f"{FORWARD}: expert weight {stacked[0]} is read other than by a gathered projection")


def _rows(weight: relax.Var, transposed: bool) -> list[int]:
    """[E * N, K]: the rows the expert kernels read a stacked [E, N, K] weight (stored [E, K, N] if `transposed`) as."""
    experts, n, k = (int(d) for d in weight.ty.shape)
    if transposed:
        n, k = k, n
    return [experts * n, k]


def _last_axis(softmax: relax.Call) -> bool:
    return int(softmax.attrs.axis) in (-1, softmax.args[0].ty.ndim - 1)
