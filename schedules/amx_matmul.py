"""ember's int8/int4 matmul on Intel AMX tiles (`amx-int8`), for many activation rows.

The VNNI kernel (`int8_matmul.py`) multiplies 8 weight rows by one activation row per
instruction; AMX's `tdpbssd` multiplies a 16-row x 64-byte tile of signed bytes by a tile of
signed bytes in VNNI layout into a 16 x 16 int32 tile. The weights need no new layout:
an `interleaved` block (`ir/quant_formats.py`) is, for one group, 8 words of K x 8 rows x 4
bytes, exactly a B tile of 8 rows of 32 bytes (8 int32 columns); so are int4's nibbles once
split into bytes. Each parallel task copies its blocks side by side once, for all its row
tiles, as signed bytes (stored `v + offset` less the offset: int8 xor 0x80, int4 nibble - 8),
so the integer sums are sum(q * v) with no bias to add (the VNNI kernel's `x_bias` gives the
same integers: sum(q * (v + offset)) - offset * sum(q)). The weights in memory are the same at
every level, and stay 4-bit. The activations are quantized as the VNNI path quantizes them
(`int8_matmul.quantize_rows`, the same macro), 16-row tile by tile, so an A tile is one contiguous load.

A group of 32 values is one `tdpbssd` of K = 32 (a tile's half depth): every group has its own
scales, so its int32 sums are stored (`tilestored64`) and scaled in float32, with the VNNI kernel's
expression (acc += float(sums) * (x_scale * scale)), group after group. That scaling is most of
the work; the tile unit does the products of pass j (`PASS_GROUPS` groups) while the vector units scale
pass j - 1's:

    per parallel block tile (`units` blocks of 8 weight rows):  ldtilecfg
      wide = the units' blocks side by side as signed bytes, once for all row blocks
      per `row_tiles` x 16 activation rows (the last block padded; its padded rows never stored):
        acc = 0
        per pass j:
          per group g of pass j:
            A_r = tileloadd(xq[rows r, g]), B_c = tileloadd(wide[g, c]), C_rc = A_r . B_c (tdpbssd)
            sums[j % 2, g] = C (tilestored, after all four products)
          per 8-vector part of acc:  part = acc;  per group g of pass j - 1:
            part += float(sums[(j - 1) % 2, g][rows]) * (x_scale[rows, g] * scale[c, g]);  acc = part
        y = acc
      tilerelease

Tiles (`tile_config`): 0, 1 = A (16 x 32 bytes) of 2 row tiles, 2, 3 = B (8 x 4 * 16 bytes) of 2 column
tiles of 16 weight rows (two blocks side by side fill a B tile's 64-byte rows), 4 + 2r + c = C_rc (16 x 16
int32). With 2 x 2 (32 rows x 32 weight rows, `units` 4 and `row_tiles` 2, the rule's), each tile load feeds
two products and four products are in flight at once; each C row is one 512-bit vector of the scaling.
The quantized activations are stored tile by tile (`quantize_rows`' `tile_rows`): an A tile is 512 contiguous bytes,
one stream, where row-major rows 2 * K apart were 16 streams of 32 bytes a line. Tried and slower: each group's
products issued between parts of the previous pass's scaling, parallel tasks over row chunks as well, each thread's
xq chunk in its L2, passes of 1 or 8 groups, and 16 accumulators in registers.
Where the time goes (timing variants with a part removed each): the 4 KiB of tile stores per group cost about as
much as the tile loads, zeroing and products together, and the scaling more than either. The scaling is three
vector instructions per 16 sums per group, as in the VNNI kernel: with a scale every 32 weights, it and the tile
stores set the pace, not the products, so the kernel gains far less over VNNI than the products alone do.
Measured in docs/benchmarks.md#schedule-measurements.
Built with the target's dot product (as `QuantizeWeights` builds it), the kernel also holds the VNNI
kernel's body (`int8_matmul.int8_dot_compute`) and runs it for calls of fewer than `VNNI_BELOW_ROWS` rows.
`ember tune` tunes that threshold with the tile blocking (`knob_space`; compile rebuilds a kernel, `rebuild`).
Linux gives a process AMX state only when asked (`ember.runtime.amx.request_amx_permission`);
without it the first tile instruction is SIGILL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ember.ir.quant_formats import FORMATS, INTERLEAVED_ROWS, QuantFormat
from ember.ir.tvmscript import parsed_once
from ember.schedules import int8_matmul
from ember.schedules.int8_matmul import int8_dot_compute, matmul_prim_func, quantize_rows, supports
from ember.targets.int8_dot import Int8Dot

TILE_ROWS = 16  # activation rows of an A and a C tile
PART_VECTORS = 8  # 16-lane accumulators a scaling pass keeps in registers (a buffer under TVM's 1 KiB stack limit)
PASS_GROUPS = 4  # groups whose sums are scaled in one pass over the accumulators
GROUP_BYTES = 32  # K bytes of one group: an A tile's row, a B tile's row (8 columns x 4 bytes)
PAIR = 2  # blocks side by side in one B tile's 64-byte rows
AMX_KNOBS = ("units", "row_tiles", "vnni_below")  # 8-row weight blocks per parallel task (4: two 16-row column
# tiles, 2: one, 1: one 8-row tile where blocks do not pair up), 16-row A tiles per row block (2 or 1), and the rows
# from which a call runs on tiles (below: the VNNI body), as `ember tune` enumerates them (`knob_space`)
ROW_TILE_SPACE = (2, 1)
# Calls of fewer rows run the VNNI kernel's body: with one 32-row block, copying a task's blocks side by side and
# padding the rows cost what the tiles gain; 48 rows (padded to 64) ran slower on tiles, 64 rows no slower and
# more rows faster (measured in docs/benchmarks.md#schedule-measurements).
VNNI_BELOW_ROWS = 64
VNNI_BELOW_SPACE = (32, 64, 128)  # the thresholds `ember tune` tries
# Row counts between those thresholds: `ember tune` times a kernel at them, beside its prefill rows, so that the
# threshold is chosen by what each side of it measures (`tuning.timed_rows`).
THRESHOLD_ROWS = (48, 96)
# On each kernel: {"format", "n", "k", "units", "row_tiles", "vnni_below"} (0: tiles for every row count).
BUILD_ATTR = "ember.amx_matmul"
# The `KERNEL_SOURCE_ATTR` of the kernels that multiply int8-quantized activations: the VNNI kernel and this one.
INT8_KERNEL_SOURCES = (int8_matmul.__name__, __name__)


def unit_space(n: int) -> list[int]:
    """The `units` knob values an [n, k] weight takes (blocks must split into whole tasks), the rule's first."""
    blocks = n // INTERLEAVED_ROWS
    return [units for units in (4, 2, 1) if blocks % units == 0]


def knob_space(n: int) -> list[list[int]]:
    """Every (units, row_tiles, vnni_below) an [n, k] weight's kernel takes, the rule's first."""
    rule = [unit_space(n)[0], ROW_TILE_SPACE[0], VNNI_BELOW_ROWS]
    space = [[units, row_tiles, below] for units in unit_space(n) for row_tiles in ROW_TILE_SPACE
             for below in VNNI_BELOW_SPACE]
    return [rule, *(knobs for knobs in space if knobs != rule)]


def built_as(func: tirx.PrimFunc) -> dict[str, Any] | None:
    """What `func` computes and its knobs if `amx_int8_matmul` built it (`BUILD_ATTR`, as plain values), else None."""
    return recorded_build(func, BUILD_ATTR, AMX_KNOBS)


def recorded_build(func: tirx.PrimFunc, build_attr: str, knobs: Sequence[str]) -> dict[str, Any] | None:
    """`func`'s `build_attr` as a tile kernel builder wrote it (`tile_matmul_prim_func`), as plain values: the format,
    n, k and `knobs`; None if `func` has none."""
    built = (func.attrs or {}).get(build_attr)
    if built is None:
        return None
    return {"format": str(built["format"]), **{name: int(built[name]) for name in ("n", "k", *knobs)}}


def kernel_knob_space(func: tirx.PrimFunc) -> list[list[int]] | None:
    """`knob_space` of a kernel `amx_int8_matmul` built with the VNNI body (None for any other PrimFunc)."""
    built = built_as(func)
    return None if built is None or not built["vnni_below"] else knob_space(built["n"])


def rebuild(func: tirx.PrimFunc, vnni: Int8Dot, vector_bits: int, knobs: Sequence[int]) -> tirx.PrimFunc:
    """The kernel `func` (built by `amx_int8_matmul` with `vnni`) built again with `knobs` (`AMX_KNOBS`), keeping
    `func`'s other attributes."""
    built = built_as(func)
    units, row_tiles, vnni_below = knobs
    kernel = amx_int8_matmul(FORMATS[built["format"]], built["n"], built["k"], units, vnni, vector_bits, vnni_below,
                             row_tiles)
    return kernel.with_attrs({**dict(func.attrs), BUILD_ATTR: kernel.attrs[BUILD_ATTR]})


def column_tiles(units: int) -> tuple[int, int]:
    """(C tiles side by side, weight rows of each) of a task of `units` blocks."""
    return max(units // PAIR, 1), min(units, PAIR) * INTERLEAVED_ROWS


def tile_config(units: int, row_tiles: int = 2) -> list[int]:
    """The 64-byte `ldtilecfg` operand: palette 1, then each tile's bytes per row (uint16) and rows (uint8)."""
    config = [0] * 64
    config[0] = 1
    col_tiles, col_rows = column_tiles(units)
    shapes = {r: (TILE_ROWS, GROUP_BYTES) for r in range(row_tiles)}
    shapes.update({2 + c: (GROUP_BYTES // 4, 4 * col_rows) for c in range(col_tiles)})
    shapes.update({4 + 2 * r + c: (TILE_ROWS, 4 * col_rows) for r in range(row_tiles) for c in range(col_tiles)})
    for tile, (rows, row_bytes) in shapes.items():
        config[16 + 2 * tile] = row_bytes
        config[48 + tile] = rows
    return config


def tile_matmul_prim_func(name: str, fmt: QuantFormat, n: int, k: int, tiles, vnni: Int8Dot | None,
                          vector_bits: int, vnni_below: int, build_attr: str, knobs: dict[str, int]) -> tirx.PrimFunc:
    """The PrimFunc `name` of an AMX matmul whose body is the macro `tiles(batch, seq, x, packed, scale, low, y)`;
    with `vnni` (the target's dot product), calls of fewer than `vnni_below` rows run the VNNI kernel's body
    (`vector_bits` wide) instead. `build_attr` records what it computes, its `knobs` and `vnni_below` (0 without
    `vnni`), for `recorded_build`."""
    vector = None if vnni is None else int8_dot_compute(fmt, n, k, vnni, True, vector_bits)

    @T.macro
    def compute(batch, seq, x, packed, scale, low, y):
        if vnni is None:
            tiles(batch, seq, x, packed, scale, low, y)
        elif batch * seq < vnni_below:
            vector(batch, seq, x, packed, scale, low, y)
        else:
            tiles(batch, seq, x, packed, scale, low, y)

    kernel = matmul_prim_func(name, fmt, n, k, compute)
    return kernel.with_attr(build_attr, {"format": fmt.name, "n": n, "k": k, **knobs,
                                         "vnni_below": vnni_below if vnni is not None else 0})


def tile_config_byte(config: list[int], i):
    """Byte i of the `ldtilecfg` operand `config`, for i a loop variable unrolled to a constant."""
    byte = tirx.const(0, "uint8")
    for index, value in enumerate(config):
        if value:
            byte = tirx.Select(i == index, tirx.const(value, "uint8"), byte)
    return byte


def tile_intrinsics(product: str = "llvm.x86.tdpbssd"):
    """The register-numbered AMX intrinsics (void calls: TIR has no x86_amx type for the `.internal` ones): tile
    load, store, zero, and `product` (int8's `tdpbssd`, or bf16's `tdpbf16ps`) C += A . B."""
    def load(tile, address, stride):
        return T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(tile), address, T.int64(stride))

    def store(tile, address, stride):
        return T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(tile), address, T.int64(stride))

    def zero(tile):
        return T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(tile))

    def dot(dst, a, b):
        return T.call_llvm_intrin("void", product, T.int8(dst), T.int8(a), T.int8(b))

    return load, store, zero, dot


def _check_knobs(n: int, units: int | None, row_tiles: int | None) -> tuple[int, int]:
    """(units, row_tiles): the rule's where None, else the given ones if the weight takes them."""
    space = unit_space(n)
    units = space[0] if units is None else int(units)
    if units not in space:
        raise ValueError(f"AMX matmul units {units} are not among {space} for {n} weight rows")
    row_tiles = ROW_TILE_SPACE[0] if row_tiles is None else int(row_tiles)
    if row_tiles not in ROW_TILE_SPACE:
        raise ValueError(f"AMX matmul row_tiles {row_tiles} are not among {list(ROW_TILE_SPACE)}")
    return units, row_tiles


def _signed_wide_copy(fmt: QuantFormat, k: int, units: int):
    """The macro `copy(packed, first_block, wide)`: the task's blocks side by side in wide [k / 4, 8 * units], as
    signed bytes (v, the stored value less the offset); int4's nibbles as bytes, in the interleaved word order of a
    group: values 4w.. in the low nibbles, 16 + 4w.. in the high ones."""
    lanes = INTERLEAVED_ROWS
    groups = k // fmt.group_size
    words = fmt.group_size * fmt.bits // 32  # packed words of one row per group
    offset = fmt.stored_offset
    vec = tirx.Ramp(0, 1, lanes)

    def u32(value):
        return tirx.Broadcast(tirx.const(value, "uint32"), lanes)

    def signed(nibbles):
        """Bytes 0..15 less the offset (int4's 8: -8..7), byte by byte."""
        if not offset:
            return nibbles
        return T.reinterpret("uint32x8", T.reinterpret("int8x32", nibbles) - tirx.Broadcast(T.int8(offset), 32))

    @T.macro
    def copy(packed, first_block, wide):
        for u, g, w in T.grid(units, groups, words):
            if fmt.bits == 4:
                wide[g * 8 + w, T.Ramp(u * lanes, 1, lanes)] = signed(tirx.bitwise_and(
                    packed[first_block + u, g * words + w, vec], u32(0x0F0F0F0F)))
                wide[g * 8 + words + w, T.Ramp(u * lanes, 1, lanes)] = signed(tirx.bitwise_and(
                    tirx.shift_right(packed[first_block + u, g * words + w, vec], u32(4)), u32(0x0F0F0F0F)))
            else:  # stored v + 128: xor 0x80 is v
                wide[g * 8 + w, T.Ramp(u * lanes, 1, lanes)] = tirx.bitwise_xor(
                    packed[first_block + u, g * words + w, vec], u32(0x80808080))

    return copy


@parsed_once
def amx_int8_matmul(fmt: QuantFormat, n: int, k: int, units: int | None = None, vnni: Int8Dot | None = None,
                    vector_bits: int = 512, vnni_below: int = VNNI_BELOW_ROWS,
                    row_tiles: int | None = None) -> tirx.PrimFunc:
    """The PrimFunc y[m, n] = x[m, :] . w(n, :) for an [n, k] weight in `fmt`, stored `interleaved`, on AMX tiles.

    Same parameters as `int8_matmul.int8_dot_matmul`'s kernel: x [batch, seq, k] float32, the weight's parts,
    y [batch, seq, n]; the same numbers as the VNNI kernel (integer sums equal, scaled with the same expression).
    `units`, `row_tiles`, `vnni_below`: the knobs (`AMX_KNOBS`), the rule's where None (or defaulted).
    With `vnni` (the target's dot product), calls of fewer than `vnni_below` rows run the VNNI kernel's body."""
    if not supports(fmt, n, k):
        raise ValueError(f"the AMX int8 matmul does not compute a [{n}, {k}] {fmt.name} weight")
    units, row_tiles = _check_knobs(n, units, row_tiles)
    lanes = INTERLEAVED_ROWS
    groups = k // fmt.group_size
    zero_point = fmt.zero_point
    config = tile_config(units, row_tiles)
    col_tiles, col_rows = column_tiles(units)
    block_rows = row_tiles * TILE_ROWS  # activation rows of one row block
    passes = (groups + PASS_GROUPS - 1) // PASS_GROUPS
    part_rows = PART_VECTORS // col_tiles  # rows of the accumulators a pass keeps in registers

    load, store, zero, dot = tile_intrinsics()
    vec = tirx.Ramp(0, 1, lanes)
    width = units * lanes  # the task's weight rows
    col = tirx.Ramp(0, 1, col_rows)
    floats = f"float32x{col_rows}"

    def joined(buffer, first_block, g):
        """Group g's values of `col_rows // 8` blocks from first_block in an interleaved [blocks, groups, 8] buffer,
        as one float32 vector."""
        vectors = [buffer[first_block + u, g, vec] for u in range(col_rows // lanes)]
        joined = vectors[0] if len(vectors) == 1 else tirx.Shuffle(
            vectors, [tirx.IntImm("int32", i) for i in range(col_rows)])
        return T.Cast(floats, joined)

    def padded(rows):
        """`rows` rounded up to whole row blocks, which the A tile loads read."""
        return (rows + block_rows - 1) // block_rows * block_rows

    # Signed weights: no bias. Each A tile's 16 rows x 32 bytes contiguous: its group's load reads 8 whole cache lines,
    # one stream (row-major, 16 rows 2 * K apart, 32 bytes of each line and 16 streams the prefetchers lost).
    quantize = quantize_rows(groups, None, zero_point, TILE_ROWS)
    copy = _signed_wide_copy(fmt, k, units)

    @T.macro
    def products(g, slot, first, xq, wide, sums):
        # Group g's int32 sums of the row block from `first` and the task's weight rows, into sums[slot]. The tile
        # unit runs in order: each C tile is stored after all the products, so no store waits on the product just
        # issued (stored each after its own product, the four latencies added up).
        for r in T.unroll(row_tiles):
            T.evaluate(load(r, T.address_of(xq[((first // TILE_ROWS + r) * groups + g) * TILE_ROWS, 0]), GROUP_BYTES))
            for c in T.unroll(col_tiles):
                if r == 0:
                    T.evaluate(load(2 + c, T.address_of(wide[g * 8, c * col_rows]), 4 * width))
                T.evaluate(zero(4 + 2 * r + c))
                T.evaluate(dot(4 + 2 * r + c, r, 2 + c))
        for r in T.unroll(row_tiles):
            for c in T.unroll(col_tiles):
                T.evaluate(store(4 + 2 * r + c, T.address_of(sums[slot, r, c, 0, 0]), 4 * col_rows))

    @T.macro
    def scale_rows(g, slot, row, r, first_block, scale, low, x_scale, x_sum, sums, part):
        # part (`part_rows` rows of the task's weight rows, in registers) += group g's sums of those rows scaled,
        # with the VNNI kernel's expression; each row's scale broadcast once for its column tiles.
        for h in T.unroll(part_rows):
            for c in T.unroll(col_tiles):
                part[c, h, col] = part[c, h, col] + T.Cast(floats, sums[slot, r, c, row % TILE_ROWS + h, col]) * (
                    T.Broadcast(x_scale[row + h, g], col_rows) * joined(scale, first_block + c * PAIR, g))
                if zero_point:
                    part[c, h, col] = part[c, h, col] + T.Broadcast(x_sum[row + h, g], col_rows) * joined(
                        low, first_block + c * PAIR, g)

    @T.macro
    def scale_pass(j, first, first_block, scale, low, x_scale, x_sum, sums, acc, part):
        # acc += pass j's groups' sums scaled: `part_rows` rows at a time, their accumulators loaded into registers
        # once for the pass's groups, not once a group.
        for r in T.unroll(row_tiles):
            for quarter in T.unroll(TILE_ROWS // part_rows):
                for c in T.unroll(col_tiles):
                    for h in T.unroll(part_rows):
                        part[c, h, col] = acc[r * TILE_ROWS + quarter * part_rows + h, T.Ramp(c * col_rows, 1,
                                                                                                col_rows)]
                for i in T.unroll(PASS_GROUPS):
                    if j * PASS_GROUPS + i < groups:
                        scale_rows(j * PASS_GROUPS + i, j % 2 * PASS_GROUPS + i,
                                   first + r * TILE_ROWS + quarter * part_rows, r, first_block, scale, low,
                                   x_scale, x_sum, sums, part)
                for c in T.unroll(col_tiles):
                    for h in T.unroll(part_rows):
                        acc[r * TILE_ROWS + quarter * part_rows + h, T.Ramp(c * col_rows, 1, col_rows)] = part[
                            c, h, col]

    @T.macro
    def row_block(first, rows, first_block, seq, scale, low, xq, x_scale, x_sum, y, wide, sums, acc, part):
        # y for activation rows first .. first + block_rows - 1 (those below `rows`) and the task's weight rows.
        for t in T.serial(block_rows):
            acc[t, T.Ramp(0, 1, width)] = T.Broadcast(T.float32(0), width)
        # Software-pipelined by passes of PASS_GROUPS groups: a pass's tile products are issued before the previous
        # pass's sums are scaled, so the tile unit and the vector units work at once (`sums` holds two passes).
        for j in T.serial(passes + 1):
            if j < passes:
                for i in T.unroll(PASS_GROUPS):
                    if j * PASS_GROUPS + i < groups:
                        products(j * PASS_GROUPS + i, j % 2 * PASS_GROUPS + i, first, xq, wide, sums)
            if j > 0:
                scale_pass(j - 1, first, first_block, scale, low, x_scale, x_sum, sums, acc, part)
        for t in T.serial(block_rows):
            if first + t < rows:
                y[(first + t) // seq, (first + t) % seq, T.Ramp(first_block * lanes, 1, width)] = acc[
                    t, T.Ramp(0, 1, width)]

    @T.macro
    def tiles(batch, seq, x, packed, scale, low, y):
        with T.sblock("amx"):
            T.reads()
            T.writes()
            xq = T.sblock_alloc_buffer((padded(batch * seq) * groups, 8), "int32")  # tiles (`quantize_rows`)
            x_scale = T.sblock_alloc_buffer((padded(batch * seq), groups), "float32")
            x_sum = T.sblock_alloc_buffer((padded(batch * seq), groups) if zero_point else (1, 1), "float32")
            for mg in T.parallel(batch * seq * groups):
                quantize(mg, seq, x, xq, x_scale, None, x_sum)
            # The last A tiles load whole 16 rows. Writing their rows past the batch keeps them in xq: TVM sizes a
            # buffer by the elements loads and stores touch, and a tile load (an address) touches one, so without
            # this write xq ends at the batch and the load reads up to 31 rows of K past it (a fault at K = 16384).
            # Their scales are zeros too: left as whatever memory held, they made denormals in the padded rows'
            # sums, and each one a slow microcode assist (a 4-row call took many times the VNNI kernel's time).
            for pad, g in T.grid(padded(batch * seq) - batch * seq, groups):
                xq[((batch * seq + pad) // TILE_ROWS * groups + g) * TILE_ROWS + (batch * seq + pad) % TILE_ROWS,
                   T.Ramp(0, 1, 8)] = T.Broadcast(T.int32(0), 8)
                x_scale[batch * seq + pad, g] = T.float32(0)
                if zero_point:
                    x_sum[batch * seq + pad, g] = T.float32(0)
            for task in T.parallel(n // width):
                with T.sblock("task"):
                    T.reads()
                    T.writes()
                    tile_config_bytes = T.sblock_alloc_buffer((64,), "uint8")
                    wide = T.sblock_alloc_buffer((k // 4, width), "uint32")
                    sums = T.sblock_alloc_buffer((2 * PASS_GROUPS, row_tiles, col_tiles, TILE_ROWS, col_rows),
                                                 "int32")
                    acc = T.sblock_alloc_buffer((block_rows, width), "float32")
                    part = T.sblock_alloc_buffer((col_tiles, part_rows, col_rows), "float32")  # < 1 KiB: registers
                    for i in T.unroll(64):  # tile state is per thread: each task configures its own
                        tile_config_bytes[i] = tile_config_byte(config, i)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(tile_config_bytes[0])))
                    copy(packed, task * units, wide)
                    for block in T.serial(padded(batch * seq) // block_rows):
                        row_block(block * block_rows, batch * seq, task * units, seq, scale, low, xq, x_scale,
                                  x_sum, y, wide, sums, acc, part)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return tile_matmul_prim_func("amx_matmul", fmt, n, k, tiles, vnni, vector_bits, vnni_below, BUILD_ATTR,
                                 {"units": units, "row_tiles": row_tiles})
