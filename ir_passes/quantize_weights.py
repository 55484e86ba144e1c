"""Weight-only quantization: float weights become packed integers, unpacked inside the kernels.

Every weight gets the `--quant` format, or its own where `tensor_formats` names one for
the checkpoint tensors it is computed from (a GGUF file's per-tensor types: a Q4_K_M
file's Q6_K output head stays in 8 bits while its Q4_K projections take 4); a weight
whose format does not quantize stays in float.

Matches, in every entry function that takes weights, the two ways a model reads a
2-D weight parameter `W` [N, K]:

    y = matmul(x, permute_dims(W))      a projection (x [..., K] -> y [..., N])
    e = take(W, ids, axis=0)            an embedding gather

    y = moe_matmul(x, W, order, offsets)  an expert projection (`ir_passes/lower_moe.py`),
                                        W [experts * N, K] the experts' rows

and, when every use of `W` is one of these, replaces the parameter by its stored
parts (`W.packed`, `W.scale` and, for `_zp` formats, `W.min`; see `quant_formats`)
and each use by one kernel that reads the parts directly:

    y = dequantize_matmul(x, W.packed, W.scale)   # y[.., n] = sum_k x[.., k] * w(n, k)
    e = dequantize_take(W.packed, W.scale, ids)   # e[.., k] = w(ids[..], k)

where `w(n, k)` is the format's unpacking expression. On CPUs with an int8 dot product
(AVX2 and up: `TargetSpec.int8_dot`), projections instead call `schedules/int8_matmul.py`'s kernel, which
quantizes the activations to int8 and multiplies in integers, as llama.cpp does
(`--float-activations` turns this off); their weights are stored in the layout that
kernel reads (`interleaved`, blocks of 8 rows side by side), and a gather of such a
weight (tied embeddings) reads that layout too. Each kernel is one PrimFunc:
the graph never holds a floating-point copy of a weight, and the schedules decide
how much of a weight is unpacked at a time (a few rows, in cache). Every token
streams `bits_per_weight / 32` of the bytes of the float32 model: decode is
memory-bound, so that is the speed-up to expect.

The recipe of each part wraps the weight's own recipe in a `quantize` step, so
weight conversion packs exactly what the graph reads. Weights read any other way
(norm scales, biases, anything unexpected) keep the compute dtype. A weight used
both as embedding and as output projection (tied) is quantized for both or for
neither: `keep_embedding` / `keep_lm_head` keep it in float if either asks. The
LM head is recognised by dataflow, not by name: the projection whose result the
function returns (through casts and reshapes only). A mixture of experts' router
(the projection whose logits `moe_route` reads) keeps its weight and its
activations in float.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping

import tvm
from tvm import relax, te, tirx

from ember.ir.attributes import BATCH_SIZE, KERNEL_SOURCE_ATTR, VECTOR_RUN_ATTR, VERIFY_LEN
from ember.ir.module_utils import bindings, is_op, is_weight_transpose
from ember.ir.quant_formats import INTERLEAVED, ROWS, QuantFormat
from ember.ir.weight_recipes import (
    Recipe,
    entry_functions_with_weights,
    get_recipes,
    recipe_sources,
    set_recipes,
    weight_params,
)
from ember.schedules import amx_bf16_matmul, amx_matmul, int8_matmul, moe
from ember.schedules.moe import expert_projection, is_routing
from ember.targets.int8_dot import Int8Dot

_PASS_THROUGH = ("relax.astype", "relax.reshape")


def quantize_weights(fmt: QuantFormat, keep_embedding: bool = False, keep_lm_head: bool = False,
                     int8_dot: Int8Dot | None = None, vector_bits: int = 256,
                     tensor_formats: Mapping[str, QuantFormat] | None = None) -> tvm.transform.Pass:
    """The pass quantizing every matmul and embedding weight to `fmt`, or to the format `tensor_formats`
    gives the checkpoint tensors it is computed from.

    With `int8_dot` (the target's dot product, `TargetSpec.int8_dot`), projections
    quantize their activations to int8 and multiply in integers (`schedules/int8_matmul.py`,
    register tiles sized by the target's `vector_bits`), where the format and shape allow it; on a target
    with AMX (`Int8Dot.tiles`) prefill's on AMX tiles from the kernel's `VNNI_BELOW_ROWS` rows of a call up (a knob
    of `ember tune`), its shorter calls on the vector dot product: bfloat16 tiles on dequantized weights
    (`schedules/amx_bf16_matmul.py`) where the target has AMX-BF16 and the weight whole 32-row column pairs, else
    int8 tiles (`schedules/amx_matmul.py`).
    """

    @tvm.transform.module_pass(opt_level=0, name="QuantizeWeights")
    def transform(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = entry_functions_with_weights(mod)
        if not names:
            return mod
        recipes = get_recipes(mod)
        formats = {name: _format_of(recipe, fmt, tensor_formats or {}) for name, recipe in recipes.items()}
        chosen: set[str] | None = None
        projected: set[str] = set()
        routers: set[str] = set()
        experts: dict[str, int] = {}
        for name in names:
            uses = _WeightUses(mod, mod[name])
            projected |= uses.projected
            routers |= uses.routers
            experts |= uses.experts
            # A router's weight stays in float, as llama.cpp keeps `ffn_gate_inp` in F32 in every quantized file:
            # E x K values a layer (under 1% of its experts'), and rounded to 4 bits (8.6% RMS error) it chooses
            # other experts than the model's own where two are close, a different answer rather than noise.
            keep = set(uses.routers)
            if keep_embedding:
                keep |= uses.embeddings
            if keep_lm_head:
                keep |= uses.lm_heads
            found = {name for name in uses.quantizable - keep if formats[name].quantizes}
            chosen = found if chosen is None else chosen & found
        if not chosen:
            return mod
        interleaved = (projected - routers) | set(experts) if int8_dot is not None else set()
        rewriter = _Rewriter(mod, {name: formats[name] for name in chosen}, int8_dot, vector_bits, experts)
        for name in names:
            rewriter.builder_.update_func(mod.get_global_var(name),
                                          rewriter.rewrite_function(mod[name], interleaved))
        new_recipes = {}
        for name, recipe in recipes.items():
            if name not in chosen:
                new_recipes[name] = recipe
                continue
            for part in formats[name].parts:
                new_recipes[f"{name}.{part}"] = {"op": "quantize", "format": formats[name].name, "part": part,
                                                 "layout": rewriter.layouts[name], "input": recipe}
        return set_recipes(rewriter.builder_.get(), new_recipes)

    return transform


def _few_tokens(rows: tirx.PrimExpr) -> bool:
    """Whether a projection's `rows` (its activations' last leading dimension, or an expert projection's pairs)
    are decode's or a verify step's few: one token per sequence (1 or the batch size, times the experts a token
    chooses), or the few tokens a verify step checks; not a prompt's."""
    if isinstance(rows, tirx.IntImm):
        return int(rows) == 1
    return any(var.name in (BATCH_SIZE, VERIFY_LEN) for var in tirx.analysis.undefined_vars(rows))


def _format_of(recipe: Recipe, fmt: QuantFormat, tensor_formats: Mapping[str, QuantFormat]) -> QuantFormat:
    """The format of the weight `recipe` computes: its checkpoint tensors' own (the finest, should they
    differ; `fuse_parallel_projections` fuses only weights of one format), else `fmt`."""
    own = [tensor_formats[name] for name in recipe_sources(recipe) if name in tensor_formats]
    return max(own, key=lambda f: f.bits_per_weight) if own else fmt


class _WeightUses:
    """How one function reads its weights."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function) -> None:
        weights = {p: p.name for p in weight_params(func)}
        transposed: dict[relax.Var, relax.Var] = {}
        self.embeddings: set[str] = set()
        self.routers: set[str] = set()  # weights projecting a MoE router's logits
        self.experts: dict[str, int] = {}  # expert weights, by name: how many experts
        projections: dict[relax.Var, str] = {}
        readable: dict[str, bool] = {name: True for name in weights.values()}
        for binding in bindings(func):
            value = binding.value
            if is_weight_transpose(value, weights):
                transposed[binding.var] = value.args[0]
                continue
            if is_op(value, "relax.matmul") and value.args[1] in transposed:
                projections[binding.var] = weights[transposed[value.args[1]]]
                others = [value.args[0]]
            elif is_op(value, "relax.take") and value.args[0] in weights and _is_row_gather(value):
                self.embeddings.add(weights[value.args[0]])
                others = list(value.args[1:])
            elif (count := expert_projection(mod, value)) is not None:
                x, weight, *grouping = value.args[1].fields
                if weight in weights:
                    self.experts[weights[weight]] = count
                others = [x, *grouping]
            elif is_routing(mod, value):
                self.routers |= {projections[var] for var in value.args[1].fields if var in projections}
                others = [value]
            else:
                others = [value]
            for var in _free_vars(others):
                if var in weights:
                    readable[weights[var]] = False
                elif var in transposed:
                    readable[weights[transposed[var]]] = False
        for var in _free_vars([func.body.body]):
            if var in weights:
                readable[weights[var]] = False
        self.quantizable = {name for name, ok in readable.items() if ok and _is_2d(func, name)}
        self.projected = set(projections.values())
        self.lm_heads = {projections[var] for var in _returned_through_casts(func) if var in projections}


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Replaces projections and gathers of chosen weights by dequantizing kernels."""

    def __init__(self, mod: tvm.IRModule, formats: dict[str, QuantFormat], int8_dot: Int8Dot | None,
                 vector_bits: int, experts: Mapping[str, int]) -> None:
        super().__init__(mod)
        self.mod = mod
        self.experts = experts  # expert weights ([experts * N, K]), by name: how many experts
        self.formats = formats  # the chosen weights' formats, by parameter name
        self.int8_dot = int8_dot
        self.vector_bits = vector_bits
        self.int8_kernels: dict[tuple[str, int, int, bool], relax.GlobalVar] = {}
        self._moe_kernels: dict[tuple[str, int, int, int, str, bool], relax.GlobalVar] = {}
        self.parts_of: dict[relax.Var, tuple[QuantFormat, dict[str, relax.Var], int, str]] = {}
        self.transposed: dict[relax.Var, relax.Var] = {}
        self.layouts: dict[str, str] = {}  # weight name -> the layout its parts are stored in

    def rewrite_function(self, func: relax.Function, interleaved: set[str]) -> relax.Function:
        """`func` taking the parts of the chosen weights instead of the weights; those in
        `interleaved` are stored for the int8 dot-product kernel where it computes them."""
        new_params = []
        for param in func.params:
            fmt = self.formats.get(param.name)
            if fmt is None:
                new_params.append(param)
                continue
            n, k = (int(d) for d in param.ty.shape)
            # An expert weight's rows are each expert's [N, K] weight in turn: the kernel takes each as a weight.
            int8 = param.name in interleaved and int8_matmul.supports(fmt, n // self.experts.get(param.name, 1), k)
            layout = self.layouts.setdefault(param.name, INTERLEAVED if int8 else ROWS)
            parts = {
                part: relax.Var(f"{param.name}.{part}", relax.TensorType(shape, dtype))
                for part, (shape, dtype) in fmt.part_shapes(n, k, layout).items()
            }
            self.parts_of[param] = (fmt, parts, k, layout)
            new_params.extend(parts.values())
        body = self.visit_expr(func.body)
        return relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs, func.span)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.permute_dims") and value.args[0] in self.parts_of:
            self.transposed[binding.var] = value.args[0]  # consumed by the matmul below; no binding left
            return
        if is_op(value, "relax.matmul") and value.args[1] in self.transposed:
            fmt, parts, k, layout = self.parts_of[self.transposed[value.args[1]]]
            x = self.visit_expr(value.args[0])
            out_dtype = str(binding.var.ty.dtype)
            if layout == INTERLEAVED:
                self._emit_as(binding.var, self._int8_dot_matmul(fmt, x, parts, k, int(binding.var.ty.shape[-1])))
                return
            self._emit_as(binding.var, self.builder_.emit_te(
                _dequantize_matmul(fmt, k, out_dtype), x, *parts.values(),
                primfunc_name_hint="dequantize_matmul"))
            return
        if (experts := expert_projection(self.mod, value)) is not None and (
                value.args[1].fields[1] in self.parts_of):
            x, weight, order, offsets = (self.visit_expr(arg) for arg in value.args[1].fields)
            fmt, parts, k, layout = self.parts_of[value.args[1].fields[1]]
            n = int(binding.var.ty.shape[-1])
            int8_dot = self.int8_dot if layout == INTERLEAVED else None
            many_tokens = int8_dot is not None and not _few_tokens(binding.var.ty.shape[0])
            key = (fmt.name, experts, n, k, layout, many_tokens)
            if key not in self._moe_kernels:
                kernel = moe.moe_matmul(fmt, experts, n, k, self.vector_bits, int8_dot, many_tokens)
                self._moe_kernels[key] = self.builder_.add_func(kernel.with_attr(KERNEL_SOURCE_ATTR, moe.__name__),
                                                                "moe_matmul")
            kernel = self._moe_kernels[key]
            self._emit_as(binding.var, self.builder_.emit(
                relax.call_tir(kernel, [x, *parts.values(), order, offsets], binding.var.ty)))
            return
        if is_op(value, "relax.take") and value.args[0] in self.parts_of:
            fmt, parts, k, layout = self.parts_of[value.args[0]]
            ids = self.visit_expr(value.args[1])
            self._emit_as(binding.var, self.builder_.emit_te(
                _dequantize_take(fmt, k, layout), ids, *parts.values(), primfunc_name_hint="dequantize_take"))
            return
        super().visit_var_binding_(binding)

    def _int8_dot_matmul(self, fmt: QuantFormat, x: relax.Expr, parts: dict[str, relax.Var], k: int,
                         n: int) -> relax.Expr:
        """y = x @ w(n, :)^T by `int8_matmul`'s kernel, which takes x as [batch, seq, k].

        Decode (one token per sequence: x is [batch, 1, k], or [1, batch, k] in an imported graph) and
        prefill get their own variants; a verify step (x is [1, verify_len, k], a few rows) takes decode's.
        A model's activations are [batch, seq, k] already: no reshape (each one a VM call)."""
        *lead, _ = x.ty.shape
        many_tokens = not (lead and _few_tokens(lead[-1]))
        key = (fmt.name, n, k, many_tokens)
        if key not in self.int8_kernels:
            tiles = self.int8_dot.tiles if many_tokens else ""  # prefill on AMX tiles; decode on the vector dot
            if tiles == "bf16" and amx_bf16_matmul.supports_bf16(fmt, n, k):
                kernel = amx_bf16_matmul.amx_bf16_matmul(fmt, n, k, vnni=self.int8_dot, vector_bits=self.vector_bits)
                source, name = amx_bf16_matmul.__name__, "amx_bf16_matmul"
            elif tiles:
                kernel = amx_matmul.amx_int8_matmul(fmt, n, k, vnni=self.int8_dot, vector_bits=self.vector_bits)
                source, name = amx_matmul.__name__, "amx_int8_matmul"
            else:
                kernel = int8_matmul.int8_dot_matmul(fmt, n, k, self.int8_dot, many_tokens, self.vector_bits)
                source, name = int8_matmul.__name__, "int8_dot_matmul"
            self.int8_kernels[key] = self.builder_.add_func(kernel.with_attr(KERNEL_SOURCE_ATTR, source), name)
        kernel = self.int8_kernels[key]
        if len(lead) == 2:
            return self.builder_.emit(relax.call_tir(kernel, [x, *parts.values()],
                                                     relax.TensorType((*lead, n), "float32")))
        rows = functools.reduce(operator.mul, lead, 1)
        flat = self.builder_.emit(relax.op.reshape(x, (1, rows, k)))
        y = self.builder_.emit(
            relax.call_tir(kernel, [flat, *parts.values()], relax.TensorType((1, rows, n), "float32")))
        return self.builder_.emit(relax.op.reshape(y, (*lead, n)))

    def _emit_as(self, old: relax.Var, new: relax.Expr) -> None:
        if isinstance(old, relax.DataflowVar):
            self.set_var_remap(old, new)
        else:  # an output of the dataflow block keeps being one
            self.set_var_remap(old, self.builder_.emit_output(new))


def _dequantize_matmul(fmt: QuantFormat, k: int, out_dtype: str):
    """TE: y[..., n] = sum_k x[..., k] * w(n, k), accumulated in `out_dtype`."""

    def compute(x: te.Tensor, *tensors: te.Tensor) -> te.Tensor:
        parts = dict(zip(fmt.parts, tensors))
        n = int(parts["scale"].shape[0])
        weight = te.compute((n, k), lambda i, j: fmt.dequantize_expr(parts, i, j), name="dequantize",
                            attrs={VECTOR_RUN_ATTR: fmt.vector_run})
        reduce = te.reduce_axis((0, k), name="k")
        return te.compute(
            (*x.shape[:-1], n),
            lambda *idx: te.sum(
                x[(*idx[:-1], reduce)].astype(out_dtype) * weight[idx[-1], reduce].astype(out_dtype), axis=reduce
            ),
            name="matmul",
        )

    return compute


def _dequantize_take(fmt: QuantFormat, k: int, layout: str):
    """TE: e[..., j] = w(ids[...], j), from parts stored in `layout`."""

    def compute(ids: te.Tensor, *tensors: te.Tensor) -> te.Tensor:
        parts = dict(zip(fmt.parts, tensors))
        return te.compute(
            (*ids.shape, k), lambda *idx: fmt.dequantize_expr(parts, ids[idx[:-1]], idx[-1], layout), name="take"
        )

    return compute


def _returned_through_casts(func: relax.Function) -> set[relax.Var]:
    """Variables whose value the function returns, possibly cast, reshaped or in a tuple."""
    values = {b.var: b.value for b in bindings(func)}
    found, stack = set(), [func.body.body]
    while stack:
        expr = stack.pop()
        if isinstance(expr, relax.Tuple):
            stack.extend(expr.fields)
        elif isinstance(expr, relax.Var) and expr not in found:
            found.add(expr)
            value = values.get(expr)
            if isinstance(value, (relax.Var, relax.Tuple)):
                stack.append(value)
            elif value is not None and any(is_op(value, op) for op in _PASS_THROUGH):
                stack.append(value.args[0])
    return found


def _free_vars(exprs: list[relax.Expr]) -> set[relax.Var]:
    found = set()
    for expr in exprs:
        if isinstance(expr, relax.Var):
            found.add(expr)
        elif isinstance(expr, relax.Expr):
            found.update(relax.analysis.free_vars(expr))
    return found


def _is_2d(func: relax.Function, name: str) -> bool:
    param = next(p for p in func.params if p.name == name)
    return len(param.ty.shape) == 2 and all(isinstance(d, tirx.IntImm) for d in param.ty.shape)


def _is_row_gather(expr: relax.Call) -> bool:
    return int(expr.attrs.axis) == 0
