"""ember's mixture-of-experts kernels: routing, grouping pairs by expert, and the expert projections.

A sparse MoE block sends each token to `top_k` of `experts` FFNs. `ir_passes/lower_moe.py`
rewrites the block transformers traces into three kernels, each written here as loops
already scheduled for CPUs (their loop bounds are data: how many rows an expert got):

    moe_route(logits[T, E]) -> weights[T, k], ids[T, k]
        per token (parallel): the k largest logits, best first (ties to the lower expert),
        each weighted by the full softmax's probability (`softmax_first`: softmax -> top-k,
        Qwen-MoE, Mixtral) or by the softmax over the k chosen logits alone (top-k ->
        softmax, GraniteMoE), exactly as transformers computes each.

    moe_group(ids[P]) -> order[P], offsets[E + 1]
        a counting sort of the P = T * k (token, expert) pairs by expert: pairs
        order[offsets[e]:offsets[e + 1]] went to expert e, in pair order.

    moe_matmul(x[P, K], w[E * N, K], order, offsets) -> y[P, N]
        y[p] = w_e @ x[p] for p's expert e, the weights of expert e being rows
        e*N .. e*N + N - 1 of `w` (float, or the parts of a `--quant` format, rows layout):
        expert by expert (those some pair chose), parallel over tiles of N within one, each
        of the expert's pairs against its tile of rows: each thread streams one contiguous
        run of the expert's rows (parallel over tiles first, each thread interleaved k
        experts' short runs, and a decode step read its experts at half the speed). A weight
        row is read once per call and only for the experts some pair chose: a decode step
        streams the chosen experts' bytes, and a batch of sequences (or a prompt) reads each
        expert its tokens share once, from cache, not once per token.
        On CPUs with an int8 dot product (`TargetSpec.int8_dot`) a quantized expert weight is
        stored `interleaved` and its pairs' activations are quantized to int8, as a dense
        projection's are: the dense kernel's register tiles, expert by expert, over the pairs
        sorted by expert (`int8_matmul.int8_dot_experts`).
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from ember.ir.module_utils import is_op
from ember.ir.quant_formats import INTERLEAVED, ROWS, SCALE_DTYPE, QuantFormat
from ember.schedules.common import SCHEDULED_OPAQUE, float_lanes
from ember.schedules.int8_matmul import int8_dot_experts
from ember.targets.int8_dot import Int8Dot

# Attributes on the kernels, so passes find them: `moe_matmul`'s {"experts", "n", "k"} (an expert projection's
# weight), `moe_route`'s {"experts", "top_k"} (the router's logits).
MOE_MATMUL_ATTR, MOE_ROUTE_ATTR = "ember.moe_matmul", "ember.moe_route"
_NEG_INF = -3.4028234663852886e38


@functools.cache
def moe_route(experts: int, top_k: int, softmax_first: bool, index_dtype: str) -> tirx.PrimFunc:
    """Routing of [tokens, experts] float32 logits: the top-k experts' ids and weights (see the module docstring)."""

    @T.prim_func(s_tir=True, private=True)
    def route(logits_handle: T.handle, weights_handle: T.handle, ids_handle: T.handle):
        T.func_attr(SCHEDULED_OPAQUE)
        tokens = T.int64()
        logits = T.match_buffer(logits_handle, (tokens, experts), "float32")
        weights = T.match_buffer(weights_handle, (tokens, top_k), "float32")
        ids = T.match_buffer(ids_handle, (tokens, top_k), index_dtype)
        for t in T.parallel(tokens):
            with T.sblock("route"):
                T.reads()
                T.writes()
                taken = T.sblock_alloc_buffer((experts,), "int8")
                top = T.sblock_alloc_buffer((2,), "float32")  # the row's max, then the normalizer
                best = T.sblock_alloc_buffer((1,), "int32")
                top[0] = T.float32(_NEG_INF)
                for e in T.serial(experts):
                    taken[e] = T.int8(0)
                    top[0] = T.max(top[0], logits[t, e])
                top[1] = T.float32(0)
                if softmax_first:
                    for e in T.serial(experts):
                        top[1] = top[1] + T.exp(logits[t, e] - top[0])
                for j in T.serial(top_k):
                    best[0] = -1
                    for e in T.serial(experts):
                        if taken[e] == T.int8(0):
                            if best[0] < 0:
                                best[0] = T.Cast("int32", e)
                            elif logits[t, e] > logits[t, best[0]]:
                                best[0] = T.Cast("int32", e)
                    taken[best[0]] = T.int8(1)
                    ids[t, j] = T.Cast(index_dtype, best[0])
                    weights[t, j] = T.exp(logits[t, best[0]] - top[0])
                if not softmax_first:
                    for j in T.serial(top_k):
                        top[1] = top[1] + weights[t, j]
                for j in T.serial(top_k):
                    weights[t, j] = weights[t, j] / top[1]

    return route.with_attr(MOE_ROUTE_ATTR, {"experts": experts, "top_k": top_k})


@functools.cache
def moe_group(experts: int, index_dtype: str) -> tirx.PrimFunc:
    """The counting sort of (token, expert) pairs by expert: order[P] and offsets[experts + 1], int32."""

    @T.prim_func(s_tir=True, private=True)
    def group(ids_handle: T.handle, order_handle: T.handle, offsets_handle: T.handle):
        T.func_attr(SCHEDULED_OPAQUE)
        pairs = T.int64()
        ids = T.match_buffer(ids_handle, (pairs,), index_dtype)
        order = T.match_buffer(order_handle, (pairs,), "int32")
        offsets = T.match_buffer(offsets_handle, (experts + 1,), "int32")
        with T.sblock("group"):
            T.reads()
            T.writes()
            cursor = T.sblock_alloc_buffer((experts,), "int32")
            for e in T.serial(experts + 1):
                offsets[e] = 0
            for p in T.serial(pairs):
                offsets[ids[p] + 1] = offsets[ids[p] + 1] + 1
            for e in T.serial(experts):
                offsets[e + 1] = offsets[e + 1] + offsets[e]
                cursor[e] = offsets[e]
            for p in T.serial(pairs):
                order[cursor[ids[p]]] = T.Cast("int32", p)
                cursor[ids[p]] = cursor[ids[p]] + 1

    return group


def _tile_rows(n: int) -> int:
    """Weight rows one task computes per pair: 4 accumulators in flight where N allows."""
    return next(rows for rows in (4, 2, 1) if n % rows == 0)


@functools.cache
def moe_matmul(fmt: QuantFormat | None, experts: int, n: int, k: int, vector_bits: int,
               int8_dot: Int8Dot | None = None, many_tokens: bool = False) -> tirx.PrimFunc:
    """The expert projection y[p] = w_e @ x[p] (see the module docstring) for a [experts * n, k] weight, float32
    (`fmt` None) or stored in `fmt`'s rows layout; with `int8_dot` (the target's dot product), stored `interleaved`
    and computed in integer dot products (`int8_matmul.int8_dot_experts`: `many_tokens` for prefill's register
    tiles, else decode's). Parameters: x [P, k] float32, the weight (or its parts), order, offsets, y [P, n]
    float32."""
    rows, lanes = _tile_rows(n), float_lanes((k,), vector_bits)
    layout = ROWS
    if int8_dot is not None and fmt is not None:
        body, layout = int8_dot_experts(fmt, experts, n, k, int8_dot, many_tokens, vector_bits), INTERLEAVED
    elif fmt is not None and k % fmt.group_size == 0 and fmt.group_size % lanes == 0:
        body = _float_loops(experts, n, rows, lanes, _by_group(fmt, k, rows, lanes))
    else:
        body = _float_loops(experts, n, rows, lanes, _by_weight(fmt, k, rows, lanes))
    project = _over_pairs(experts, n, k, body)
    attrs = {MOE_MATMUL_ATTR: {"experts": experts, "n": n, "k": k}}
    if fmt is None:
        @T.prim_func(s_tir=True, private=True)
        def float_weights(x_handle: T.handle, weight: T.Buffer((experts * n, k), "float32"),
                          order_handle: T.handle, offsets_handle: T.handle, y_handle: T.handle):
            T.func_attr(SCHEDULED_OPAQUE)
            project(x_handle, weight, None, None, order_handle, offsets_handle, y_handle)

        return float_weights.with_attrs(attrs)

    shapes = fmt.part_shapes(experts * n, k, layout)
    packed_shape, packed_dtype = shapes["packed"]
    scale_shape = shapes["scale"][0]
    if fmt.zero_point:
        @T.prim_func(s_tir=True, private=True)
        def with_minimums(x_handle: T.handle, packed: T.Buffer(packed_shape, packed_dtype),
                          scale: T.Buffer(scale_shape, SCALE_DTYPE), low: T.Buffer(scale_shape, SCALE_DTYPE),
                          order_handle: T.handle, offsets_handle: T.handle, y_handle: T.handle):
            T.func_attr(SCHEDULED_OPAQUE)
            project(x_handle, packed, scale, low, order_handle, offsets_handle, y_handle)

        return with_minimums.with_attrs(attrs)

    @T.prim_func(s_tir=True, private=True)
    def without_minimums(x_handle: T.handle, packed: T.Buffer(packed_shape, packed_dtype),
                         scale: T.Buffer(scale_shape, SCALE_DTYPE), order_handle: T.handle,
                         offsets_handle: T.handle, y_handle: T.handle):
        T.func_attr(SCHEDULED_OPAQUE)
        project(x_handle, packed, scale, None, order_handle, offsets_handle, y_handle)

    return without_minimums.with_attrs(attrs)


def expert_projection(mod: tvm.IRModule, value: relax.Expr) -> int | None:
    """The number of experts if `value` calls a `moe_matmul` kernel of `mod` (args: x, weight, order, offsets), else
    None."""
    info = _kernel_attr(mod, value, MOE_MATMUL_ATTR)
    return int(info["experts"]) if info is not None else None


def is_routing(mod: tvm.IRModule, value: relax.Expr) -> bool:
    """Whether `value` calls a `moe_route` kernel of `mod` (its argument: the router's logits)."""
    return _kernel_attr(mod, value, MOE_ROUTE_ATTR) is not None


def _kernel_attr(mod: tvm.IRModule, value: relax.Expr, attr: str):
    """`attr` of the PrimFunc of `mod` that `value` calls through call_tir, else None."""
    if not is_op(value, "relax.call_tir"):
        return None
    callee = value.args[0]
    func = mod[callee] if callee in mod.get_global_vars() else None
    return (func.attrs or {}).get(attr) if isinstance(func, tirx.PrimFunc) else None


def _over_pairs(experts: int, n: int, k: int, body):
    """The macro `project(x_handle, weight, scale, low, order_handle, offsets_handle, y_handle)` of every expert
    projection's PrimFunc: x [P, k], y [P, n] and the grouping matched to their shapes, then the macro
    `body(pairs, x, weight, scale, low, order, offsets, y)`."""

    @T.macro
    def project(x_handle, weight, scale, low, order_handle, offsets_handle, y_handle):
        pairs = T.int64()
        x = T.match_buffer(x_handle, (pairs, k), "float32")
        y = T.match_buffer(y_handle, (pairs, n), "float32")
        order = T.match_buffer(order_handle, (pairs,), "int32")
        offsets = T.match_buffer(offsets_handle, (experts + 1,), "int32")
        body(pairs, x, weight, scale, low, order, offsets, y)

    return project


def _float_loops(experts: int, n: int, rows: int, lanes: int, accumulate):
    """`moe_matmul`'s loops in float32 (see the module docstring): each pair against a tile of `rows` weight rows
    into float32 x `lanes` accumulators, `accumulate(acc, x, p, weight, scale, low, first)` adding the products of
    pair p's row and the rows from `first`, then each row's lanes summed."""

    @T.macro
    def loops(pairs, x, weight, scale, low, order, offsets, y):
        for e in T.serial(experts):
            if offsets[e + 1] > offsets[e]:
                for tile in T.parallel(n // rows):
                    for r in T.serial(offsets[e + 1] - offsets[e]):
                        with T.sblock("project"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((rows, lanes), "float32")
                            p: T.let[T.int32] = order[offsets[e] + r]
                            first: T.let[T.int64] = T.Cast("int64", e) * n + tile * rows
                            for j in T.unroll(rows):
                                for v in T.vectorized(lanes):
                                    acc[j, v] = T.float32(0)
                            accumulate(acc, x, p, weight, scale, low, first)
                            for j in T.unroll(rows):
                                for v in T.serial(lanes - 1):
                                    acc[j, 0] = acc[j, 0] + acc[j, v + 1]
                                y[p, tile * rows + j] = acc[j, 0]

    return loops


def _by_weight(fmt: QuantFormat | None, k: int, rows: int, lanes: int):
    """`_float_loops`' products for a float weight (or a quantized one whose K is not whole groups of whole vectors):
    each weight unpacked to its float value and multiplied."""

    @T.macro
    def accumulate(acc, x, p, weight, scale, low, first):
        for c in T.serial(k // lanes):
            for j in T.unroll(rows):
                for v in T.vectorized(lanes):
                    acc[j, v] = acc[j, v] + x[p, c * lanes + v] * _weight(fmt, weight, scale, low, first + j,
                                                                          c * lanes + v)

    return accumulate


def _by_group(fmt: QuantFormat, k: int, rows: int, lanes: int):
    """`_float_loops`' products for a quantized weight, a quantization group at a time: the group's integer levels
    are multiplied with the activations unscaled, and the sums scaled once a group,

        y[p, row] = sum_g scale[row, g] * sum_{c in g} x[p, c] * level[row, c]  (+ min[row, g] * sum_{c in g} x[p, c])

    so a weight costs a widening, a convert and an FMA; unpacking each weight to its float value took a scale load,
    a convert and a multiply more, and kept the expert projections compute-bound below the host's bandwidth."""
    group = fmt.group_size

    @T.macro
    def accumulate(acc, x, p, weight, scale, low, first):
        part = T.sblock_alloc_buffer((rows, lanes), "float32")
        xsum = T.sblock_alloc_buffer((lanes,), "float32")
        for g in T.serial(k // group):
            for j in T.unroll(rows):
                for v in T.vectorized(lanes):
                    part[j, v] = T.float32(0)
            for v in T.vectorized(lanes):
                xsum[v] = T.float32(0)
            for c in T.serial(group // lanes):
                for v in T.vectorized(lanes):
                    xsum[v] = xsum[v] + x[p, g * group + c * lanes + v]
                for j in T.unroll(rows):
                    for v in T.vectorized(lanes):
                        part[j, v] = part[j, v] + x[p, g * group + c * lanes + v] * T.Cast(
                            "float32", fmt.level_expr(weight, first + j, g * group + c * lanes + v))
            for j in T.unroll(rows):
                for v in T.vectorized(lanes):
                    acc[j, v] = acc[j, v] + part[j, v] * T.Cast("float32", scale[first + j, g]) + \
                        _group_minimum(low, first + j, g) * xsum[v]

    return accumulate


def _group_minimum(low, row, group):
    """A zero-point format's minimum of `row`'s quantization group, 0 for a format without minimums (whose activation
    sums then drop out when LLVM folds the product)."""
    return T.float32(0) if low is None else T.Cast("float32", low[row, group])


def _weight(fmt: QuantFormat | None, weight, scale, low, row, col):
    """Element [row, col] of the expert weight: the float, or `fmt`'s unpacking of its parts."""
    if fmt is None:
        return weight[row, col]
    parts = {"packed": weight, "scale": scale, **({"min": low} if low is not None else {})}
    return fmt.dequantize_expr(parts, row, col).astype("float32")
