"""ember's int8/int4 matmul on Intel AMX tiles (`amx-int8`), for many activation rows.

The VNNI kernel (`int8_matmul.py`) multiplies 8 weight rows by one activation row per
instruction; AMX's `tdpbsud` multiplies a 16-row x 64-byte tile of signed bytes by a tile of
unsigned bytes in VNNI layout into a 16 x 16 int32 tile. The weights need no new layout:
an `interleaved` block (`ir/quant_formats.py`) is, for one group, 8 words of K x 8 rows x 4
bytes, exactly a B tile of 8 rows of 32 bytes (8 int32 columns); so are int4's nibbles once
split into bytes (once per parallel task, for all its row tiles; the weights stay 4-bit in memory).
The activations are quantized as the VNNI path quantizes them (llama.cpp's Q8_0 rounding,
the same expression), row-major, so a 16-row A tile is one strided load of them.

Why `tdpbsud` (s8 activations x u8 weights): stored weights are unsigned (`v + offset`, or
int4 levels 0..15) and the activations signed, the operand order AMX's signed-by-unsigned
form takes with the activations as the row-major A tile. The integer sums are VNNI's:
sum(q * (v + offset)) - offset * sum(q) (`x_bias`), exact in int32.

A group of 32 values is one `tdpbsud` of K = 32 (a tile's half depth): every group has its
own scales, so its int32 sums are stored (`tilestored64`) and scaled in float32 with the
same expression and order as the VNNI kernel, group after group:

    per parallel block tile (units of 8 weight rows, `AMX_KNOBS`):  ldtilecfg
      wide = the units' blocks side by side (int4: as bytes), once for all row tiles
      per 16 activation rows (the last tile padded; its padded rows never stored):
        per group g:  A = tileloadd(xq[rows, g]), B = tileloadd(wide[g]), C = 0, C += A . B (tdpbsud)
          acc[t] += float(C[t] + x_bias[t, g]) * x_scale[t, g] * scale[g]
        y = acc
      tilerelease

Tiles: 0 = A (16 x 32 bytes), 1 = B (8 x 4 * width bytes), 2 = C (16 x width int32), width = 8 * units
weight rows. Two blocks side by side fill a B tile's 64-byte rows: one `tdpbsud` gives 16 x 16 sums, twice
what a block alone gives, and one C tile row is one 512-bit vector of the epilogue. The accumulators are
two 8-row buffers, each under TVM's 1 KiB stack limit: on the stack LLVM keeps them in registers (a 1 KiB
buffer is heap memory, loaded and stored in every group).
Built with the target's dot product (as `QuantizeWeights` builds it), the kernel also holds the VNNI
kernel's body (`int8_matmul.int8_dot_compute`) and runs it for calls of fewer than `VNNI_BELOW_ROWS` rows.
Linux gives a process AMX state only when asked (`ember.runtime.amx.request_amx_permission`);
without it the first tile instruction is SIGILL.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ember.ir.quant_formats import INTERLEAVED, INTERLEAVED_ROWS, SCALE_DTYPE, QuantFormat
from ember.schedules.int8_matmul import int8_dot_compute, supports
from ember.targets.int8_dot import Int8Dot

_LEVELS = 127.0
TILE_ROWS = 16  # activation rows of an A and a C tile
HALF_ROWS = TILE_ROWS // 2  # rows of one accumulator buffer
GROUP_BYTES = 32  # K bytes of one group: an A tile's row, a B tile's row (8 columns x 4 bytes)
AMX_KNOBS = ("units",)  # 8-row weight blocks per parallel task, side by side in its B and C tiles: 2 (16 rows,
# 64-byte tile rows) where the blocks pair up, else 1
# Calls of fewer rows run the VNNI kernel's body: with one or two 16-row tiles, copying a task's blocks side by
# side and padding the rows cost more than the tiles gain ([2048, 2048] q4f32: 4 rows 0.45 ms against VNNI's 0.11,
# 16 rows 0.49 against 0.39; 40 rows 1.09 against 1.68; loaded 2-vCPU host, 1 thread).
VNNI_BELOW_ROWS = 32
# On each kernel: {"format", "n", "k", "units", "vnni_below"} (0: tiles for every row count).
BUILD_ATTR = "ember.amx_matmul"


def unit_space(n: int) -> list[int]:
    """The `units` knob values an [n, k] weight takes (blocks must split into whole tasks), the rule's first."""
    blocks = n // INTERLEAVED_ROWS
    return [units for units in (2, 1) if blocks % units == 0]


def tile_config(units: int) -> list[int]:
    """The 64-byte `ldtilecfg` operand: palette 1, then each tile's bytes per row (uint16) and rows (uint8)."""
    config = [0] * 64
    config[0] = 1
    row_bytes = units * INTERLEAVED_ROWS * 4
    shapes = [(TILE_ROWS, GROUP_BYTES), (GROUP_BYTES // 4, row_bytes), (TILE_ROWS, row_bytes)]
    for tile, (rows, row_bytes) in enumerate(shapes):
        config[16 + 2 * tile] = row_bytes
        config[48 + tile] = rows
    return config


def _tile_intrinsics():
    """The register-numbered AMX intrinsics (void calls: TIR has no x86_amx type for the `.internal` ones)."""
    def load(tile, address, stride):
        return T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(tile), address, T.int64(stride))

    def store(tile, address, stride):
        return T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(tile), address, T.int64(stride))

    def zero(tile):
        return T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(tile))

    def dot(dst, a, b):
        return T.call_llvm_intrin("void", "llvm.x86.tdpbsud", T.int8(dst), T.int8(a), T.int8(b))

    return load, store, zero, dot


def amx_int8_matmul(fmt: QuantFormat, n: int, k: int, units: int | None = None, vnni: Int8Dot | None = None,
                    vector_bits: int = 512, vnni_below: int = VNNI_BELOW_ROWS) -> tirx.PrimFunc:
    """The PrimFunc y[m, n] = x[m, :] . w(n, :) for an [n, k] weight in `fmt`, stored `interleaved`, on AMX tiles.

    Same parameters as `int8_matmul.int8_dot_matmul`'s kernel: x [batch, seq, k] float32, the weight's parts,
    y [batch, seq, n]; the same numbers as the VNNI kernel (integer sums equal, scaled in the same order).
    With `vnni` (the target's dot product), calls of fewer than `vnni_below` rows run the VNNI kernel's body."""
    if not supports(fmt, n, k):
        raise ValueError(f"the AMX int8 matmul does not compute a [{n}, {k}] {fmt.name} weight")
    space = unit_space(n)
    units = space[0] if units is None else int(units)
    if units not in space:
        raise ValueError(f"AMX matmul units {units} are not among {space} for {n} weight rows")
    lanes = INTERLEAVED_ROWS
    groups = k // fmt.group_size
    words = fmt.group_size * fmt.bits // 32  # packed words of one row per group
    int4 = fmt.bits == 4
    offset = fmt.stored_offset
    zero_point = fmt.zero_point
    parts = fmt.part_shapes(n, k, INTERLEAVED)
    packed_shape, scale_shape = parts["packed"][0], parts["scale"][0]
    config = tile_config(units)

    def config_byte(i):
        """Byte i of `config` (i unrolled to a constant)."""
        byte = tirx.const(0, "uint8")
        for index, value in enumerate(config):
            if value:
                byte = tirx.Select(i == index, tirx.const(value, "uint8"), byte)
        return byte
    load, store, zero, dot = _tile_intrinsics()
    vec = tirx.Ramp(0, 1, lanes)
    width = units * lanes  # the task's weight rows: one vector of the epilogue
    row = tirx.Ramp(0, 1, width)
    floats = f"float32x{width}"

    def joined(buffer, first_block, g):
        """Group g's values of the task's `units` blocks in an interleaved [blocks, groups, 8] buffer, as one vector."""
        vectors = [buffer[first_block + u, g, vec] for u in range(units)]
        return vectors[0] if units == 1 else tirx.Shuffle(vectors, [tirx.IntImm("int32", i) for i in range(width)])
    nibbles = tirx.Broadcast(tirx.const(0x0F0F0F0F, "uint32"), lanes)
    four = tirx.Broadcast(tirx.const(4, "uint32"), lanes)

    def padded(rows):
        """`rows` rounded up to whole 16-row tiles, which the A tile loads read."""
        return (rows + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS

    @T.macro
    def quantize(mg, seq, x, xq, x_scale, x_bias, x_sum):
        # The VNNI kernel's quantize step (int8_matmul.py), the same expression: the same q to the bit.
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
            total: T.let[T.int32] = T.call_llvm_pure_intrin("int32", "llvm.vector.reduce.add",
                                                            q[T.Ramp(0, 1, 32)])
            x_scale[m, g] = top / T.float32(_LEVELS)
            x_bias[m, g] = total * (-offset)
            if zero_point:
                x_sum[m, g] = T.Cast("float32", total) * (top / T.float32(_LEVELS))
            xq[m, T.Ramp(g * 8, 1, 8)] = T.reinterpret("int32x8", T.Cast("int8x32", q[T.Ramp(0, 1, 32)]))

    @T.macro
    def products(g, first, xq, wide, sums):
        # Group g's int32 sums of the 16 activation rows from `first` and the task's weight rows, into sums[g % 2].
        T.evaluate(load(0, T.address_of(xq[first, g * 8]), k))
        T.evaluate(load(1, T.address_of(wide[g * 8, 0]), 4 * width))
        T.evaluate(zero(2))
        T.evaluate(dot(2, 0, 1))
        T.evaluate(store(2, T.address_of(sums[g % 2, 0, 0]), 4 * width))

    @T.macro
    def scale_sums(g, first, first_block, scale, low, x_scale, x_bias, x_sum, sums, acc, half):
        # acc += group g's sums of rows half * 8 .. half * 8 + 7 scaled, as the VNNI kernel scales them.
        for h in T.unroll(HALF_ROWS):
            t = half * HALF_ROWS + h
            acc[h, row] = acc[h, row] + T.Cast(floats, sums[g % 2, t, row] + T.Broadcast(
                x_bias[first + t, g], width)) * (T.Broadcast(x_scale[first + t, g], width) * T.Cast(
                    floats, joined(scale, first_block, g)))
            if zero_point:
                acc[h, row] = acc[h, row] + T.Broadcast(x_sum[first + t, g], width) * T.Cast(
                    floats, joined(low, first_block, g))

    @T.macro
    def row_tile(first, rows, first_block, seq, scale, low, xq, x_scale, x_bias, x_sum, y, wide, sums, top, bottom):
        # y for activation rows first .. first + 15 (those below `rows`) and `units` blocks from first_block.
        for h in T.unroll(HALF_ROWS):
            top[h, row] = T.Broadcast(T.float32(0), width)
            bottom[h, row] = T.Broadcast(T.float32(0), width)
        # Software-pipelined: group g's tile products are issued before group g - 1's sums are scaled, so the
        # tile unit and the vector units work at once (`sums` holds two groups).
        for g in T.serial(groups + 1):
            if g < groups:
                products(g, first, xq, wide, sums)
            if g > 0:
                scale_sums(g - 1, first, first_block, scale, low, x_scale, x_bias, x_sum, sums, top, 0)
                scale_sums(g - 1, first, first_block, scale, low, x_scale, x_bias, x_sum, sums, bottom, 1)
        for h in T.unroll(HALF_ROWS):
            if first + h < rows:
                y[(first + h) // seq, (first + h) % seq, T.Ramp(first_block * lanes, 1, width)] = top[h, row]
            if first + HALF_ROWS + h < rows:
                y[(first + HALF_ROWS + h) // seq, (first + HALF_ROWS + h) % seq,
                  T.Ramp(first_block * lanes, 1, width)] = bottom[h, row]

    vector = None if vnni is None else int8_dot_compute(fmt, n, k, vnni, True, vector_bits)

    @T.macro
    def tiles(batch, seq, x, packed, scale, low, y):
        with T.sblock("amx"):
            T.reads()
            T.writes()
            xq = T.sblock_alloc_buffer((padded(batch * seq), k // 4), "int32")
            x_scale = T.sblock_alloc_buffer((padded(batch * seq), groups), "float32")
            x_bias = T.sblock_alloc_buffer((padded(batch * seq), groups), "int32")
            x_sum = T.sblock_alloc_buffer((padded(batch * seq), groups) if zero_point else (1, 1), "float32")
            for mg in T.parallel(batch * seq * groups):
                quantize(mg, seq, x, xq, x_scale, x_bias, x_sum)
            # The last A tile loads whole 16 rows. Writing its rows past the batch keeps them in xq: TVM sizes a
            # buffer by the elements loads and stores touch, and a tile load (an address) touches one, so without
            # this write xq ends at the batch and the load reads up to 15 rows of K past it (a fault at K = 16384).
            # Their scales are zeros too: left as whatever memory held, they made denormals in the padded rows'
            # sums, and each one a slow microcode assist (4 rows of a [2048, 2048] weight: 3.2 ms, VNNI 0.1 ms).
            for pad, g in T.grid(padded(batch * seq) - batch * seq, groups):
                xq[batch * seq + pad, T.Ramp(g * 8, 1, 8)] = T.Broadcast(T.int32(0), 8)
                x_scale[batch * seq + pad, g] = T.float32(0)
                x_bias[batch * seq + pad, g] = 0
                if zero_point:
                    x_sum[batch * seq + pad, g] = T.float32(0)
            for task in T.parallel(n // (lanes * units)):
                with T.sblock("task"):
                    T.reads()
                    T.writes()
                    tile_config_bytes = T.sblock_alloc_buffer((64,), "uint8")
                    wide = T.sblock_alloc_buffer((k // 4, width), "uint32")
                    sums = T.sblock_alloc_buffer((2, TILE_ROWS, width), "int32")
                    top = T.sblock_alloc_buffer((HALF_ROWS, width), "float32")
                    bottom = T.sblock_alloc_buffer((HALF_ROWS, width), "float32")
                    for i in T.unroll(64):  # tile state is per thread: each task configures its own
                        tile_config_bytes[i] = config_byte(i)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(tile_config_bytes[0])))
                    # The task's blocks side by side, once for all its row tiles; int4's nibbles as bytes, in the
                    # interleaved word order of a group: values 4w.. in the low nibbles, 16 + 4w.. in the high ones.
                    for u, g, w in T.grid(units, groups, words):
                        if int4:
                            wide[g * 8 + w, T.Ramp(u * lanes, 1, lanes)] = tirx.bitwise_and(
                                packed[task * units + u, g * words + w, vec], nibbles)
                            wide[g * 8 + words + w, T.Ramp(u * lanes, 1, lanes)] = tirx.bitwise_and(
                                tirx.shift_right(packed[task * units + u, g * words + w, vec], four), nibbles)
                        else:
                            wide[g * 8 + w, T.Ramp(u * lanes, 1, lanes)] = packed[task * units + u, g * words + w, vec]
                    for tile_m in T.serial(padded(batch * seq) // TILE_ROWS):
                        row_tile(tile_m * TILE_ROWS, batch * seq, task * units, seq, scale, low, xq, x_scale, x_bias,
                                 x_sum, y, wide, sums, top, bottom)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    @T.macro
    def matmul(x_handle, packed, scale, low, y_handle):
        batch = T.int64()
        seq = T.int64()
        x = T.match_buffer(x_handle, (batch, seq, k), "float32")
        y = T.match_buffer(y_handle, (batch, seq, n), "float32")
        if vnni is None:
            tiles(batch, seq, x, packed, scale, low, y)
        elif batch * seq < vnni_below:
            vector(batch, seq, x, packed, scale, low, y)
        else:
            tiles(batch, seq, x, packed, scale, low, y)

    if zero_point:
        @T.prim_func(s_tir=True)
        def amx_matmul_with_minimums(x_handle: T.handle, packed: T.Buffer(packed_shape, "uint32"),
                                     scale: T.Buffer(scale_shape, SCALE_DTYPE),
                                     low: T.Buffer(scale_shape, SCALE_DTYPE), y_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})  # 8: opaque, never fused
            matmul(x_handle, packed, scale, low, y_handle)

        kernel = amx_matmul_with_minimums
    else:
        @T.prim_func(s_tir=True)
        def amx_matmul(x_handle: T.handle, packed: T.Buffer(packed_shape, "uint32"),
                       scale: T.Buffer(scale_shape, SCALE_DTYPE), y_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})  # 8: opaque, never fused
            matmul(x_handle, packed, scale, None, y_handle)

        kernel = amx_matmul
    return kernel.with_attr(BUILD_ATTR, {"format": fmt.name, "n": n, "k": k, "units": units,
                                         "vnni_below": vnni_below if vnni is not None else 0})
