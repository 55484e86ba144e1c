"""ember's matmul for int8/int4 weights on CPUs with an int8 dot-product instruction.

The float path (`matmul.py`) unpacks every weight value to float32 and multiplies it
with a float FMA: a shift, a mask, a convert and an FMA per value, so decode is
compute-bound below the memory roofline and prefill runs at float GEMM speed at best.
CPUs with AVX512-VNNI or AVX-VNNI multiply bytes directly: `vpdpbusd` adds four
products of an unsigned and a signed byte into each int32 lane, 32 multiply-adds per
instruction on a 256-bit register. This kernel quantizes the activation rows to int8
once per call (llama.cpp's Q8_0 rounding) and does the dot products in integers.

Weights are stored `interleaved` (see `ir_passes/quant_formats.py`): one 256-bit load
holds 4 bytes of each of 8 weight rows. Broadcasting 4 activation bytes against it
makes each int32 lane one row's partial dot product, so a quantization group of 32
values is 8 (int8) or 4 x 2 (int4 nibbles) instructions into one int32 vector with no
shuffles, then one convert and one FMA with the 8 rows' scales, loaded as a vector:

    per activation row m, per group g (parallel over m x g in prefill, serial in decode):
      d = max|x| / 127,  q = round(x / d)
      xq[m, 8g:8g+8] = q as 8 words of 4 bytes;  x_scale[m, g] = d;  x_bias[m, g] = -offset * sum(q)
    parallel over blocks of `row_blocks` x 8 weight rows:
      for each tile of `tokens` activation rows:
        acc[tokens, row_blocks] = 0                           # float32 x 8, one lane per weight row
        for g:
          dot[t, b] = broadcast(x_bias[m_t, g])               # int32 x 8
          for each weight word w of the group:
            dot[t, b] = vpdpbusd(dot[t, b], packed[b, w, 0:8], broadcast(xq[m_t, w]))
          acc[t, b] += float(dot[t, b]) * x_scale[m_t, g] * scale[b, g, 0:8]
        y[m_t, 8b:8b+8] = acc[t, b]                           # one vector store

The register tile reuses each weight load for `tokens` activation rows and each
activation broadcast for `row_blocks` weight loads: prefill's tile (4 x 2 blocks on
AVX-512's 32 registers) makes the kernel compute-bound at ~4x the float GEMM's speed;
decode's (1 x 1) streams the weight once, linearly. Values are stored unsigned
(`v + offset`); `x_bias` takes the offset back out: sum((v + offset) * q) - offset *
sum(q) = sum(v * q), exact in integers. A partial last tile of activation rows
recomputes the last row instead of branching (the stores write the same values).

Numerics: the weights are used exactly; the activations carry int8 rounding (at most
half a step of max|x| / 127 per value), the same rounding llama.cpp applies to Q4_0
and Q8_0 dot products. `ember compile --float-activations` keeps the float path.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ember.ir_passes.quant_formats import INTERLEAVED, INTERLEAVED_ROWS, QuantFormat

# Bytes of one dot-product operand (256-bit registers): 4 per weight row of a block.
DOT_BYTES = 4 * INTERLEAVED_ROWS
_LEVELS = 127.0


def supports(fmt: QuantFormat, n: int, k: int) -> bool:
    """Whether this kernel computes an [n, k] weight in `fmt`."""
    return fmt.quantizes and fmt.dtype == "float32" and fmt.interleaves(n, k)


def register_tile(vector_bits: int, many_tokens: bool) -> tuple[int, int]:
    """(activation rows, weight row blocks) of one register tile.

    Prefill: 4 x 2 needs 16 accumulator registers, which AVX-512's 32 hold (measured on
    Zen 4, 128 tokens: 1.3x the speed of 2 x 2, 1.7x of 1 x 1); AVX-VNNI has 16, so 2 x 2.
    Decode: one row block, streamed once."""
    if not many_tokens:
        return 1, 1
    return (4, 2) if vector_bits >= 512 else (2, 2)


def int8_dot_matmul(fmt: QuantFormat, n: int, k: int, dot_intrinsic: str, many_tokens: bool,
                    vector_bits: int) -> tirx.PrimFunc:
    """The PrimFunc y[m, n] = x[m, :] . w(n, :) for an [n, k] weight in `fmt`, stored `interleaved`.

    `dot_intrinsic` is the LLVM name of the target's u8 x s8 -> int32 dot product on
    256-bit vectors (`TargetSpec.int8_dot`). `many_tokens`: prefill (rows quantized in
    parallel, a register tile over several rows) rather than decode (one token per
    sequence). Parameters: x [batch, seq, k] float32, the weight's parts (packed, scale), y [batch, seq, n]."""
    if not supports(fmt, n, k):
        raise ValueError(f"the int8 dot-product matmul does not compute a [{n}, {k}] {fmt.name} weight")
    lanes = INTERLEAVED_ROWS
    groups = k // fmt.group_size
    words = fmt.group_size * fmt.bits // 32  # packed words of one row per group
    offset = 2 ** (fmt.bits - 1)  # stored value = value + offset
    tokens, row_blocks = register_tile(vector_bits, many_tokens)
    if (n // lanes) % row_blocks:
        row_blocks = 1
    parts = fmt.part_shapes(n, k, INTERLEAVED)
    packed_shape, scale_shape = parts["packed"][0], parts["scale"][0]
    int4 = fmt.bits == 4
    quantize_loop = T.parallel if many_tokens else T.serial
    vec = tirx.Ramp(0, 1, lanes)

    def dot(acc, weight_bytes, xq_word):
        activations = T.reinterpret("int8x32", tirx.Broadcast(xq_word, lanes))
        return T.call_llvm_pure_intrin("int32x8", dot_intrinsic, acc, T.reinterpret("int8x32", weight_bytes), activations)

    def group_dot(acc, packed, xq, block, m, g):
        """int32 x 8: the group's dot product for each of the block's 8 weight rows, plus `acc`."""
        for w in range(words):
            word = packed[block, g * words + w, vec]
            if not int4:
                acc = dot(acc, word, xq[m, g * 8 + w])
                continue
            nibbles = tirx.Broadcast(tirx.const(0x0F0F0F0F, "uint32"), lanes)
            high = tirx.shift_right(word, tirx.Broadcast(tirx.const(4, "uint32"), lanes))
            acc = dot(acc, tirx.bitwise_and(word, nibbles), xq[m, g * 8 + w])  # values 4w..4w+3
            acc = dot(acc, tirx.bitwise_and(high, nibbles), xq[m, g * 8 + 4 + w])  # values 16+4w..
        return acc

    @T.prim_func(s_tir=True)
    def int8_matmul(x_handle: T.handle, packed: T.Buffer(packed_shape, "uint32"),
                    scale: T.Buffer(scale_shape, "float32"), y_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})  # 8: opaque, never fused
        batch = T.int64()
        seq = T.int64()
        x = T.match_buffer(x_handle, (batch, seq, k), "float32")
        y = T.match_buffer(y_handle, (batch, seq, n), "float32")
        with T.sblock("root"):
            T.reads()
            T.writes()
            xq = T.sblock_alloc_buffer((batch * seq, k // 4), "int32")  # 4 int8 activations per word
            x_scale = T.sblock_alloc_buffer((batch * seq, groups), "float32")
            x_bias = T.sblock_alloc_buffer((batch * seq, groups), "int32")
            for mg in quantize_loop(batch * seq * groups):
                with T.sblock("quantize"):
                    T.reads()
                    T.writes()
                    q = T.sblock_alloc_buffer((32,), "int32")
                    m: T.let[T.int64] = mg // groups
                    g: T.let[T.int64] = mg % groups
                    top: T.let[T.float32] = T.call_llvm_pure_intrin(
                        "float32", "llvm.vector.reduce.fmax", T.fabs(x[m // seq, m % seq, T.Ramp(g * 32, 1, 32)]))
                    inverse: T.let[T.float32] = T.if_then_else(top > T.float32(0), T.float32(_LEVELS) / top,
                                                               T.float32(0))
                    q[T.Ramp(0, 1, 32)] = T.Cast("int32x32", T.nearbyint(
                        x[m // seq, m % seq, T.Ramp(g * 32, 1, 32)] * T.Broadcast(inverse, 32)))
                    x_scale[m, g] = top / T.float32(_LEVELS)
                    x_bias[m, g] = T.call_llvm_pure_intrin("int32", "llvm.vector.reduce.add",
                                                           q[T.Ramp(0, 1, 32)]) * (-offset)
                    xq[m, T.Ramp(g * 8, 1, 8)] = T.reinterpret("int32x8", T.Cast("int8x32", q[T.Ramp(0, 1, 32)]))
            for tile_n in T.parallel(n // (lanes * row_blocks)):
                with T.sblock("tile"):
                    T.reads()
                    T.writes()
                    dots = T.sblock_alloc_buffer((tokens, row_blocks, lanes), "int32")
                    acc = T.sblock_alloc_buffer((tokens, row_blocks, lanes), "float32")
                    for tile_m in T.serial((batch * seq + tokens - 1) // tokens):
                        for t, b in T.grid(tokens, row_blocks):
                            acc[t, b, vec] = T.Broadcast(T.float32(0), lanes)
                        for g in T.serial(groups):
                            for t in T.unroll(tokens):
                                for b in T.unroll(row_blocks):
                                    dots[t, b, vec] = group_dot(
                                        T.Broadcast(x_bias[T.min(tile_m * tokens + t, batch * seq - 1), g], lanes), packed, xq,
                                        tile_n * row_blocks + b, T.min(tile_m * tokens + t, batch * seq - 1), g)
                            for t in T.unroll(tokens):
                                for b in T.unroll(row_blocks):
                                    acc[t, b, vec] = acc[t, b, vec] + T.Cast("float32x8", dots[t, b, vec]) * (
                                        T.Broadcast(x_scale[T.min(tile_m * tokens + t, batch * seq - 1), g], lanes)
                                        * scale[tile_n * row_blocks + b, g, vec])
                        for t, b in T.grid(tokens, row_blocks):
                            m: T.let[T.int64] = T.min(tile_m * tokens + t, batch * seq - 1)
                            y[m // seq, m % seq, T.Ramp((tile_n * row_blocks + b) * lanes, 1, lanes)] = acc[t, b, vec]

    return int8_matmul
