"""ember's decode GEMV for int8/int4 weights on CPUs with an int8 dot-product instruction.

The float path (`matmul.py`) unpacks every weight value to float32 and multiplies it
with a float FMA: for 4-bit weights that is a shift, a mask, a convert and an FMA per
value, and decode becomes compute-bound well below the memory roofline. CPUs with
AVX512-VNNI or AVX-VNNI multiply bytes directly: `vpdpbusd` adds four products of an
unsigned and a signed byte into each int32 lane, 32 multiply-adds per instruction on
a 256-bit register. This kernel quantizes the activation row to int8 once per call
and does the dot products in integers, as llama.cpp does for Q4_0/Q8_0 weights:

    per row m of x (serial, once per call):
      per group of 32 values:  d = max|x| / 127,  q = round(x / d) in [-127, 127]
      xq[m, :] = q (int8), in the byte order the weight's packing needs
      x_scale, x_bias: per dot lane, the group's d and -offset * sum(q) / lanes per group
    parallel over weight rows n:
      for m:
        per chunk of the row (64 values for int4, 32 for int8), U chunks unrolled:
          dot = vpdpbusd(x_bias, w_bytes, xq)             # int32 x 8 lanes
          acc[u] += float(dot) * x_scale * w_scale         # float32 x 8
        y[m, n] = sum(acc)

Weights are stored unsigned the way the instruction wants them. int4 values are
stored as nibbles `v + 8` (quant_formats), so the low and the high nibbles of 32
packed bytes are two byte vectors of values 0..15; the activation bytes are stored
in the matching order (even positions of a 64-value chunk, then odd ones). int8
values flip their sign bit (`v ^ 0x80` is `v + 128`). The offset comes back out
through `x_bias`: sum((v + offset) * q) - offset * sum(q) = sum(v * q), exact in
integers. Each int32 lane covers values of one quantization group, so the weight
scales apply per lane (int4: lanes 0-3 are the chunk's first group, 4-7 its second).

Numerics: the weights are used exactly; the activations carry int8 rounding (at most
half a step of max|x| / 127 per value), the same rounding llama.cpp applies to Q4_0
and Q8_0 dot products. `ember compile --float-activations` keeps the float path.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ember.ir_passes.quant_formats import QuantFormat

# int32 lanes of one dot-product instruction (256-bit registers).
DOT_LANES = 8
DOT_BYTES = 4 * DOT_LANES
_GROUP = 32
_LEVELS = 127.0


def supports(fmt: QuantFormat, k: int) -> bool:
    """Whether this kernel computes `fmt` weights with `k` columns."""
    return (fmt.quantizes and not fmt.zero_point and fmt.dtype == "float32" and fmt.group_size == _GROUP
            and fmt.bits in (4, 8) and k % _chunk(fmt) == 0)


def int8_dot_gemv(fmt: QuantFormat, n: int, k: int, dot_intrinsic: str) -> tirx.PrimFunc:
    """The PrimFunc y[m, n] = x[m, :] . w(n, :) for an [n, k] weight in `fmt`.

    `dot_intrinsic` is the LLVM name of the target's u8 x s8 -> int32 dot product on
    256-bit vectors (`TargetSpec.int8_dot`). Parameters: x [M, k] float32, the weight's
    parts (packed, scale), y [M, n] float32."""
    if not supports(fmt, k):
        raise ValueError(f"the int8 dot-product GEMV does not compute {fmt.name} weights with k={k}")
    chunk = _chunk(fmt)
    chunks = k // chunk
    groups = chunk // _GROUP  # quantization groups per chunk
    lanes_per_group = DOT_LANES // groups
    offset = 2 ** (fmt.bits - 1)  # stored value = value + offset
    bias_per_lane = -offset // lanes_per_group
    unroll = next(u for u in (4, 2, 1) if chunks % u == 0)
    packed_shape, packed_dtype = fmt.part_shapes(n, k)["packed"]
    scale_shape, _ = fmt.part_shapes(n, k)["scale"]
    int4 = fmt.bits == 4

    def dot(acc, values, activations):
        return T.call_llvm_pure_intrin("int32x8", dot_intrinsic, acc, values, activations)

    def dot_chunk(packed, xq, bias, row, m, c):
        """int32 x 8: per lane, the sum of its values' products (exact, offset removed by `bias`)."""
        if int4:
            words = packed[row, tirx.Ramp(c * (chunk // 8), 1, chunk // 8)]
            mask = tirx.Broadcast(tirx.const(0x0F0F0F0F, "uint32"), chunk // 8)
            low = T.reinterpret("int8x32", tirx.bitwise_and(words, mask))
            high = T.reinterpret("int8x32", tirx.bitwise_and(
                tirx.shift_right(words, tirx.Broadcast(tirx.const(4, "uint32"), chunk // 8)), mask))
            first = dot(bias, low, xq[m, tirx.Ramp(c * chunk, 1, DOT_BYTES)])
            return dot(first, high, xq[m, tirx.Ramp(c * chunk + DOT_BYTES, 1, DOT_BYTES)])
        signed = T.reinterpret("uint32x8", packed[row, tirx.Ramp(c * chunk, 1, DOT_BYTES)])
        unsigned = T.reinterpret("int8x32", tirx.bitwise_xor(
            signed, tirx.Broadcast(tirx.const(0x80808080, "uint32"), DOT_LANES)))
        return dot(bias, unsigned, xq[m, tirx.Ramp(c * chunk, 1, DOT_BYTES)])

    def lane_scales(scale, row, c):
        """float32 x 8: each lane's weight scale."""
        if groups == 1:
            return tirx.Broadcast(scale[row, c], DOT_LANES)
        pair = scale[row, tirx.Ramp(c * groups, 1, groups)]
        # (Shuffle's output is at most as wide as its inputs together: repeat the pair.)
        return tirx.Shuffle([pair] * lanes_per_group, [i // lanes_per_group for i in range(DOT_LANES)])

    def byte_order(q):
        """The chunk's int32 values in the order the weight's bytes hold them, as int8."""
        if int4:  # low nibbles hold the even positions, high nibbles the odd ones
            return tirx.Shuffle([q], [2 * i for i in range(DOT_BYTES)] + [2 * i + 1 for i in range(DOT_BYTES)])
        return q

    @T.prim_func(s_tir=True)
    def int8_gemv(x_handle: T.handle, packed_handle: T.handle, scale_handle: T.handle, y_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})  # 8: opaque, never fused
        M = T.int64()
        x = T.match_buffer(x_handle, (M, k), "float32")
        packed = T.match_buffer(packed_handle, packed_shape, packed_dtype)
        scale = T.match_buffer(scale_handle, scale_shape, "float32")
        y = T.match_buffer(y_handle, (M, n), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            xq = T.sblock_alloc_buffer((M, k), "int8")
            x_scale = T.sblock_alloc_buffer((M, chunks, DOT_LANES), "float32")
            x_bias = T.sblock_alloc_buffer((M, chunks, DOT_LANES), "int32")
            q = T.sblock_alloc_buffer((chunk,), "int32")
            group_scale = T.sblock_alloc_buffer((groups,), "float32")
            group_sum = T.sblock_alloc_buffer((groups,), "int32")
            for m, c in T.grid(M, chunks):
                for g in T.serial(groups):
                    top: T.let[T.float32] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fmax",
                        T.fabs(x[m, T.Ramp(c * chunk + g * _GROUP, 1, _GROUP)]))
                    group_scale[g] = top / T.float32(_LEVELS)
                    inverse: T.let[T.float32] = T.if_then_else(top > T.float32(0), T.float32(_LEVELS) / top,
                                                               T.float32(0))
                    q[T.Ramp(g * _GROUP, 1, _GROUP)] = T.Cast("int32x32", T.nearbyint(
                        x[m, T.Ramp(c * chunk + g * _GROUP, 1, _GROUP)] * T.Broadcast(inverse, _GROUP)))
                    group_sum[g] = T.call_llvm_pure_intrin(
                        "int32", "llvm.vector.reduce.add", q[T.Ramp(g * _GROUP, 1, _GROUP)])
                xq[m, T.Ramp(c * chunk, 1, chunk)] = T.Cast(f"int8x{chunk}", byte_order(q[T.Ramp(0, 1, chunk)]))
                for lane in T.vectorized(DOT_LANES):
                    x_scale[m, c, lane] = group_scale[lane // lanes_per_group]
                    x_bias[m, c, lane] = group_sum[lane // lanes_per_group] * bias_per_lane
            # One activation row at a time: the row loop is then all a core runs, and LLVM keeps the
            # accumulators in registers. (A batch re-reads the weight once per sequence.)
            for m in T.serial(M):
                for row in T.parallel(n):
                    with T.sblock("row"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((unroll, DOT_LANES), "float32")  # independent FMA chains
                        for u, lane in T.grid(unroll, DOT_LANES):
                            acc[u, lane] = T.float32(0)
                        for c_outer in T.serial(chunks // unroll):
                            for u in T.unroll(unroll):
                                acc[u, T.Ramp(0, 1, DOT_LANES)] = acc[u, T.Ramp(0, 1, DOT_LANES)] + T.Cast(
                                    "float32x8",
                                    dot_chunk(packed, xq, x_bias[m, c_outer * unroll + u, T.Ramp(0, 1, DOT_LANES)],
                                              row, m, c_outer * unroll + u),
                                ) * x_scale[m, c_outer * unroll + u, T.Ramp(0, 1, DOT_LANES)] * lane_scales(
                                    scale, row, c_outer * unroll + u)
                        for u in T.serial(1, unroll):
                            for lane in T.vectorized(DOT_LANES):
                                acc[0, lane] = acc[0, lane] + acc[u, lane]
                        y[m, row] = T.float32(0)
                        for lane in T.serial(DOT_LANES):
                            y[m, row] = y[m, row] + acc[0, lane]

    return int8_gemv


def _chunk(fmt: QuantFormat) -> int:
    """Values of one weight row consumed per dot step: 32 packed bytes."""
    return DOT_BYTES * 8 // fmt.bits
