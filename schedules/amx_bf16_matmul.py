"""A matmul of int8/int4 weights on Intel AMX-BF16 tiles (`tdpbf16ps`): prefill's projections on a CPU with AMX.

`ir_passes/quantize_weights.py` builds prefill's projections with it where the target has `amx-bf16`
(`Int8Dot.tiles == "bf16"`) and the weight has whole 32-row column pairs; the int8 AMX kernel (`amx_matmul.py`)
takes the others. Calls of fewer than `vnni_below` rows run the VNNI kernel's body, as the int8 AMX kernel's do.

The int8 AMX kernel (`amx_matmul.py`) pays for every 32-value group's own scale: each group's int32 tile sums are
stored and scaled in float32 by the vector units, which sets its pace. Here the scales are applied once, when a
parallel task dequantizes its weight rows to bfloat16, and the float32 sums stay in the C tiles across the whole K:

    x -> xa: bfloat16 (vcvtne2ps2bf16, round to nearest even), in A-tile order (a 16-row x 32-value tile is
             1 KiB contiguous), parallel over rows x 32-value chunks; rows padded to whole 32-row blocks with zeros
    parallel over tasks of `pairs` x 32 weight rows (each pair: 4 interleaved blocks, two 16-column B tiles):
      ldtilecfg
      per sweep of `block_chunks` 32-value chunks of K (all of K up to 2048):
        panel[pair, chunk, c, kpair, column] = the sweep's bf16 pairs of w * scale (+ min) (each weight value once
                                               per call; one sweep's panel, 512 KiB, stays in L2)
        per 32-row block, per pair:  C_rc = 0 (first sweep) or loaded from y;  per chunk:  A_0, A_1, B_0, B_1
                                     loaded, C_rc += A_r . B_c (4 products);  the 4 C tiles stored into y (a partial
                                     last block into a task buffer, copied to y at the end)
      tilerelease

Tiles (`TILE_CONFIG`): 0, 1 = A (16 rows x 32 bf16), 2, 3 = B (16 pairs x 16 columns x 2 bf16), 4 + 2r + c = C_rc
(16 x 16 float32): every tile 16 rows of 64 bytes. A chunk of 32 values is one group, so a B tile is one group of
16 weight rows: the dequantization reads each packed word once, two blocks (16 rows) per 512-bit vector, and writes
whole pair vectors (low half: the even value's bf16, high half: the odd one's).

Numerics: the weight is dequantized in float32 as the reference (`QuantFormat.dequantize`: one rounding of
v * scale + min, exact without a minimum) and rounded to bfloat16; x rounded to bfloat16; products exact, sums
float32. Against the int8 path (which rounds x to 8 bits per group), bfloat16's 8-bit mantissa keeps ~2^-9 relative
error per value on both operands.
It takes less time than the VNNI kernel from 32 rows on and than the int8 AMX kernel at prefill's row counts, and
is closer to float64 x . w than the VNNI kernel: bfloat16 rounds each value to 2^-9 of itself, Q8_0 to half a step
of its group's max / 127. Of where the time goes, streaming A (the row block's tiles, from L2) costs the most:
tiles are not renamed, so a load waits for the products reading the tile before. So a task takes up to
`MAX_PAIRS` column pairs, each block's A reused from L2 for each (4 pairs faster, 8 no better), and K is
dequantized a sweep at a time (all of K up front was slower: the panel out of L2). Tried, no gain: prefetching the
next block's A (to L1 or L2) or the A tiles 2-8 chunks ahead; each tile loaded just before its first product
(within noise); sweeps of 32 or 16 chunks (slower: C tiles reloaded from y). Measured in
docs/benchmarks.md#schedule-measurements.
Needs `n` a multiple of 32 (whole column pairs). Linux gives a process AMX state only when asked
(`ember.runtime.amx.request_amx_permission`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ember.ir.quant_formats import FORMATS, INTERLEAVED_ROWS, QuantFormat
from ember.ir.tvmscript import parsed_once
from ember.schedules import amx_matmul
from ember.schedules.amx_matmul import recorded_build, tile_config_byte, tile_intrinsics, tile_matmul_prim_func
from ember.schedules.int8_matmul import supports
from ember.targets.int8_dot import Int8Dot

TILE_ROWS = 16  # rows of every tile: A's activation rows, B's value pairs, C's activation rows
CHUNK = 32  # K values of one A tile row and of one B tile (16 pairs): one quantization group
COLUMNS = 16  # weight rows of a B tile and a C tile
TASK_ROWS = 2 * COLUMNS  # weight rows of a column pair: two B tiles
ROW_TILES = 2  # A tiles of one row block
BLOCK_ROWS = ROW_TILES * TILE_ROWS
TILE_BYTES = 64  # bytes of every tile row
TILE_CONFIG = [1] + [0] * 15 + [TILE_BYTES, 0] * 8 + [0] * 16 + [TILE_ROWS] * 8 + [0] * 8  # palette 1, tiles 0-7
MAX_PAIRS = 4  # column pairs (32 weight rows each) of a task: a row block's A tiles reloaded for each, from L2
MAX_BLOCK_CHUNKS = 64  # chunks of K per sweep: a row block's A tiles of one sweep, 128 KiB, stay in L2
BF16_KNOBS = ("pairs", "block_chunks", "vnni_below")  # as `ember tune` enumerates them (`knob_space`)
# Calls of fewer rows run the VNNI kernel's body: each call dequantizes the whole weight, which costs what a few
# dozen rows of VNNI products do: at 16 rows the tiles were slower, from 32 faster (measured in
# docs/benchmarks.md#schedule-measurements).
VNNI_BELOW_ROWS = 32
VNNI_BELOW_SPACE = (16, 32, 64)  # the thresholds `ember tune` tries
THRESHOLD_ROWS = (24, 48)  # rows between them, at which `ember tune` also times a kernel (`tuning.timed_rows`)
# On each kernel: {"format", "n", "k", "pairs", "block_chunks", "vnni_below"} (0: tiles for every row count).
BUILD_ATTR = "ember.amx_bf16_matmul"
# The `KERNEL_SOURCE_ATTR` of every kernel that multiplies a projection's quantized weight: on the int8 dot product,
# on int8 tiles or on these.
PROJECTION_KERNEL_SOURCES = (*amx_matmul.INT8_KERNEL_SOURCES, __name__)


def supports_bf16(fmt: QuantFormat, n: int, k: int) -> bool:
    """Whether this kernel computes an [n, k] weight in `fmt`."""
    return supports(fmt, n, k) and n % TASK_ROWS == 0


def _u32(value, lanes: int):
    """`value` (an int or a TIR integer) broadcast to `lanes` uint32."""
    return tirx.Broadcast(tirx.const(value, "uint32") if isinstance(value, int) else T.Cast("uint32", value), lanes)


def _to_bf16(low, high):
    """float32x16 `low` and `high` as their 32 bfloat16 (uint16 lanes: low's then high's), rounded to nearest even
    (`vcvtne2ps2bf16`, AVX512-BF16)."""
    return T.reinterpret("uint16x32", T.call_llvm_pure_intrin(
        "bfloat16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512", high, low))


def _pair(even, odd):
    """uint32x16 lanes of bfloat16 pairs: float32x16 `even`'s in the low halves, `odd`'s in the high ones."""
    return T.reinterpret("uint32x16", tirx.Shuffle([_to_bf16(even, odd)], [
        tirx.IntImm("int32", i // 2 + 16 * (i % 2)) for i in range(2 * COLUMNS)]))


def _dequantize_panel(fmt: QuantFormat, block_chunks: int):
    """The macro `dequantize(packed, scale, low, first_block, panel, u, sweep)`: groups sweep * block_chunks .. of the
    4 interleaved blocks from first_block as bfloat16 pairs in panel[u] [block_chunks, 2, 16 pairs, 16 columns]
    uint32, one B tile per (group, column tile)."""
    lanes = INTERLEAVED_ROWS
    wide = 2 * lanes
    words = fmt.group_size * fmt.bits // 32  # packed words of one row per group
    vec = tirx.Ramp(0, 1, lanes)
    floats = f"float32x{wide}"

    def joined(buffer, block, index):
        """buffer[block, index, 0:8] and buffer[block + 1, index, 0:8] as one 16-lane vector."""
        return tirx.Shuffle([buffer[block, index, vec], buffer[block + 1, index, vec]],
                            [tirx.IntImm("int32", i) for i in range(wide)])

    def field(word, shift: int, mask: int):
        """(word >> shift) & mask as float32."""
        return T.Cast(floats, T.reinterpret(f"int32x{wide}", tirx.bitwise_and(
            tirx.shift_right(word, _u32(shift, wide)), _u32(mask, wide))))

    def value(word, shift, mask, factor, bias):
        # stored * scale - offset * scale (+ min): the product and the offset's are exact, so one rounding, as
        # the reference's v * scale (+ min) has.
        return field(word, shift, mask) * factor[T.Ramp(0, 1, wide)] + bias[T.Ramp(0, 1, wide)]

    def bias_of(low, block, g, factor):
        """What each stored value's v * scale gets added: the group's minimums, or -offset * scale."""
        if fmt.zero_point:
            return T.Cast(floats, joined(low, block, g))
        return factor * T.Broadcast(T.float32(-fmt.stored_offset), wide)

    @T.macro
    def dequantize(packed, scale, low, first_block, panel, u, sweep):
        for i, c in T.grid(block_chunks, 2):
            with T.sblock("dequantize"):
                T.reads()
                T.writes()
                factor = T.sblock_alloc_buffer((wide,), "float32")  # < 1 KiB: registers
                bias = T.sblock_alloc_buffer((wide,), "float32")
                g = sweep * block_chunks + i
                factor[T.Ramp(0, 1, wide)] = T.Cast(floats, joined(scale, first_block + 2 * c, g))
                bias[T.Ramp(0, 1, wide)] = bias_of(low, first_block + 2 * c, g, factor[T.Ramp(0, 1, wide)])
                for w in T.unroll(words):
                    word: T.let[T.uint32x16] = joined(packed, first_block + 2 * c, g * words + w)
                    if fmt.bits == 8:  # bytes t of word w: values 4w + t
                        for h in T.unroll(2):
                            panel[u, i, c, 2 * w + h, T.Ramp(0, 1, wide)] = _pair(
                                value(word, 16 * h, 0xFF, factor, bias), value(word, 16 * h + 8, 0xFF, factor, bias))
                    else:  # byte t of word w: values 4w + t (low nibble) and 16 + 4w + t (high nibble)
                        for nibble, h in T.grid(2, 2):
                            panel[u, i, c, 8 * nibble + 2 * w + h, T.Ramp(0, 1, wide)] = _pair(
                                value(word, 16 * h + 4 * nibble, 0x0F, factor, bias),
                                value(word, 16 * h + 8 + 4 * nibble, 0x0F, factor, bias))

    return dequantize


def rule_knobs(n: int, k: int) -> tuple[int, int]:
    """(pairs, block_chunks): 32-row column pairs per parallel task, and 32-value chunks of K per sweep (a divisor of
    k / 32): the most of `MAX_PAIRS` and `MAX_BLOCK_CHUNKS` that the weight takes."""
    pairs = next(p for p in range(MAX_PAIRS, 0, -1) if (n // TASK_ROWS) % p == 0)
    chunks = k // CHUNK
    return pairs, next(c for c in range(min(chunks, MAX_BLOCK_CHUNKS), 0, -1) if chunks % c == 0)


def knob_space(n: int, k: int) -> list[list[int]]:
    """Every (pairs, block_chunks, vnni_below) an [n, k] weight's kernel takes, the rule's first: the rule's pairs
    and the smaller powers of two that divide the weight's pairs, the rule's sweep and half of it, each threshold."""
    rule_pairs, rule_chunks = rule_knobs(n, k)
    pairs = [rule_pairs, *(p for p in (2, 1) if p < rule_pairs and (n // TASK_ROWS) % p == 0)]
    chunks = [rule_chunks, *([rule_chunks // 2] if rule_chunks % 2 == 0 else [])]
    rule = [rule_pairs, rule_chunks, VNNI_BELOW_ROWS]
    space = [[p, c, below] for p in pairs for c in chunks for below in VNNI_BELOW_SPACE]
    return [rule, *(knobs for knobs in space if knobs != rule)]


def built_as(func: tirx.PrimFunc) -> dict[str, Any] | None:
    """What `func` computes and its knobs if `amx_bf16_matmul` built it (`BUILD_ATTR`, as plain values), else
    None."""
    return recorded_build(func, BUILD_ATTR, BF16_KNOBS)


def kernel_knob_space(func: tirx.PrimFunc) -> list[list[int]] | None:
    """`knob_space` of a kernel `amx_bf16_matmul` built with the VNNI body (None for any other PrimFunc)."""
    built = built_as(func)
    return None if built is None or not built["vnni_below"] else knob_space(built["n"], built["k"])


def rebuild(func: tirx.PrimFunc, vnni: Int8Dot, vector_bits: int, knobs: Sequence[int]) -> tirx.PrimFunc:
    """The kernel `func` (built by `amx_bf16_matmul` with `vnni`) built again with `knobs` (`BF16_KNOBS`), keeping
    `func`'s other attributes."""
    built = built_as(func)
    pairs, block_chunks, vnni_below = knobs
    kernel = amx_bf16_matmul(FORMATS[built["format"]], built["n"], built["k"], pairs, block_chunks, vnni,
                             vector_bits, vnni_below)
    return kernel.with_attrs({**dict(func.attrs), BUILD_ATTR: kernel.attrs[BUILD_ATTR]})


@parsed_once
def amx_bf16_matmul(fmt: QuantFormat, n: int, k: int, pairs: int | None = None, block_chunks: int | None = None,
                    vnni: Int8Dot | None = None, vector_bits: int = 512,
                    vnni_below: int = VNNI_BELOW_ROWS) -> tirx.PrimFunc:
    """The PrimFunc y[m, n] = x[m, :] . w(n, :) for an [n, k] weight in `fmt`, stored `interleaved`, on AMX-BF16
    tiles: x and the dequantized weight rounded to bfloat16, float32 sums. Same parameters as
    `int8_matmul.int8_dot_matmul`'s kernel: x [batch, seq, k] float32, the weight's parts, y [batch, seq, n].
    `pairs`, `block_chunks`: the blocking (`rule_knobs` where None). With `vnni` (the target's dot product), calls
    of fewer than `vnni_below` rows run the VNNI kernel's body (`vector_bits` wide)."""
    if not supports_bf16(fmt, n, k):
        raise ValueError(f"the AMX-BF16 matmul does not compute a [{n}, {k}] {fmt.name} weight")
    rule = rule_knobs(n, k)
    pairs = rule[0] if pairs is None else pairs
    block_chunks = rule[1] if block_chunks is None else block_chunks
    chunks = k // CHUNK
    if (n // TASK_ROWS) % pairs or chunks % block_chunks:
        raise ValueError(f"AMX-BF16 blocking ({pairs}, {block_chunks}) does not divide a [{n}, {k}] weight")
    sweeps = chunks // block_chunks
    width = pairs * TASK_ROWS  # weight rows of a task
    load, store, zero, dot = tile_intrinsics("llvm.x86.tdpbf16ps")
    dequantize = _dequantize_panel(fmt, block_chunks)
    blocks_per_pair = TASK_ROWS // INTERLEAVED_ROWS

    def padded(rows):
        """`rows` rounded up to whole row blocks, which the A tile loads read."""
        return (rows + BLOCK_ROWS - 1) // BLOCK_ROWS * BLOCK_ROWS

    def a_row(m, chunk):
        """xa's row of activation row m's chunk: each tile's 16 rows x 32 values contiguous."""
        return (m // TILE_ROWS * chunks + chunk) * TILE_ROWS + m % TILE_ROWS

    @T.macro
    def to_bf16(mc, seq, x, xa):
        m: T.let[T.int64] = mc // chunks
        chunk: T.let[T.int64] = mc % chunks
        xa[a_row(m, chunk), T.Ramp(0, 1, CHUNK)] = _to_bf16(x[m // seq, m % seq, T.Ramp(chunk * CHUNK, 1, 16)],
                                                            x[m // seq, m % seq, T.Ramp(chunk * CHUNK + 16, 1, 16)])

    @T.macro
    def products(first, sweep, u, xa, panel):
        # C_rc += the sweep's chunks of activation rows first .. first + 31 times column pair u.
        for i in T.serial(block_chunks):
            for r in T.unroll(ROW_TILES):
                T.evaluate(load(r, T.address_of(xa[a_row(first + r * TILE_ROWS, sweep * block_chunks + i), 0]),
                                TILE_BYTES))
            for c in T.unroll(2):
                T.evaluate(load(2 + c, T.address_of(panel[u, i, c, 0, 0]), TILE_BYTES))
            for r in T.unroll(ROW_TILES):
                for c in T.unroll(2):
                    T.evaluate(dot(4 + 2 * r + c, r, 2 + c))

    def home_columns(home):
        """Columns of `home`'s rows (its row stride)."""
        return home.shape[-1]

    def home_address(home, row, column, seq):
        """The address of (row, column) in `home`: y [batch, seq, n] or a task's partial block [32, width]."""
        if len(home.shape) == 3:
            return T.address_of(home[row // seq, row % seq, column])
        return T.address_of(home[row % BLOCK_ROWS, column])

    @T.macro
    def sweep_pair(first, sweep, u, column, seq, xa, panel, home):
        # The C tiles of rows first .. first + 31 and pair u live in `home` (y, whose rows are n apart, or a task's
        # [32, width] buffer) between sweeps: zero before the first, loaded before the others, stored after each.
        for r in T.unroll(ROW_TILES):
            for c in T.unroll(2):
                if sweep == 0:
                    T.evaluate(zero(4 + 2 * r + c))
                else:
                    T.evaluate(load(4 + 2 * r + c, home_address(home, first + r * TILE_ROWS, column + c * COLUMNS,
                                                                 seq), 4 * home_columns(home)))
        products(first, sweep, u, xa, panel)
        for r in T.unroll(ROW_TILES):
            for c in T.unroll(2):
                T.evaluate(store(4 + 2 * r + c, home_address(home, first + r * TILE_ROWS, column + c * COLUMNS, seq),
                                 4 * home_columns(home)))

    @T.macro
    def task_body(task, rows, seq, packed, scale, low, xa, panel, partial, y):
        # y's columns task * width .., every row: per sweep of K, per 32-row block, per column pair; a partial last
        # block's sums through `partial` (its padded rows never stored into y).
        for sweep in T.serial(sweeps):
            # the sweep's panel dequantized just before its products: one sweep's, not all of K, stays in L2
            for u in T.serial(pairs):
                dequantize(packed, scale, low, (task * pairs + u) * blocks_per_pair, panel, u, sweep)
            for block in T.serial(padded(rows) // BLOCK_ROWS):
                for u in T.serial(pairs):
                    if block * BLOCK_ROWS + BLOCK_ROWS <= rows:
                        sweep_pair(block * BLOCK_ROWS, sweep, u, task * width + u * TASK_ROWS, seq, xa, panel, y)
                    else:
                        sweep_pair(block * BLOCK_ROWS, sweep, u, u * TASK_ROWS, seq, xa, panel, partial)
        if rows % BLOCK_ROWS != 0:
            for t, part in T.grid(rows % BLOCK_ROWS, width // COLUMNS):
                y[(rows - rows % BLOCK_ROWS + t) // seq, (rows - rows % BLOCK_ROWS + t) % seq,
                  T.Ramp(task * width + part * COLUMNS, 1, COLUMNS)] = partial[t, T.Ramp(part * COLUMNS, 1, COLUMNS)]

    @T.macro
    def tiles(batch, seq, x, packed, scale, low, y):
        with T.sblock("amx_bf16"):
            T.reads()
            T.writes()
            xa = T.sblock_alloc_buffer((padded(batch * seq) * chunks, CHUNK), "uint16")
            for mc in T.parallel(batch * seq * chunks):
                to_bf16(mc, seq, x, xa)
            # The last A tiles load whole 16 rows: written zeros keep them in xa (TVM sizes a buffer by what its
            # loads and stores touch; a tile load touches one element) and keep denormals out of padded sums.
            for pad, chunk in T.grid(padded(batch * seq) - batch * seq, chunks):
                xa[a_row(batch * seq + pad, chunk), T.Ramp(0, 1, CHUNK)] = T.Broadcast(T.uint16(0), CHUNK)
            for task in T.parallel(n // width):
                with T.sblock("task"):
                    T.reads()
                    T.writes()
                    tile_config_bytes = T.sblock_alloc_buffer((64,), "uint8")
                    panel = T.sblock_alloc_buffer((pairs, block_chunks, 2, TILE_ROWS, COLUMNS), "uint32")
                    partial = T.sblock_alloc_buffer((BLOCK_ROWS, width), "float32")
                    for i in T.unroll(64):  # tile state is per thread: each task configures its own
                        tile_config_bytes[i] = tile_config_byte(TILE_CONFIG, i)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(tile_config_bytes[0])))
                    # All written: TVM sizes a buffer by what its loads and stores touch, and a tile store (an
                    # address) touches one element, so the copy's rows alone left the tiles' rows 16-31 past its end.
                    for t in T.serial(BLOCK_ROWS):
                        partial[t, T.Ramp(0, 1, width)] = T.Broadcast(T.float32(0), width)
                    task_body(task, batch * seq, seq, packed, scale, low, xa, panel, partial, y)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return tile_matmul_prim_func("amx_bf16_matmul", fmt, n, k, tiles, vnni, vector_bits, vnni_below, BUILD_ATTR,
                                 {"pairs": pairs, "block_chunks": block_chunks})
