"""ember's matmul for int8/int4 weights in integer dot products (x86 from AVX2, aarch64 with dotprod).

The float path (`matmul.py`) unpacks every weight value to float32 and multiplies it
with a float FMA: a shift, a mask, a convert and an FMA per value, so decode is
compute-bound below the memory roofline and prefill runs at float GEMM speed at best.
x86 CPUs multiply bytes directly, 32 multiply-adds per 256-bit register. This kernel
quantizes the activation rows to int8 once per call (llama.cpp's Q8_0 rounding) and
does the dot products in integers, with the target's instructions (`TargetSpec.int8_dot`,
the one place a level is chosen):

    avx512vnni, avxvnni   vpdpbusd adds four u8 x s8 products into each int32 lane
    avx512, avx2          vpmaddubsw adds two u8 x s8 products into a saturating int16
                          lane, vpmaddwd with ones sums pairs of those into int32
                          (AVX-512 without VNNI runs the AVX2 sequence, with a larger tile)

    i8mm (aarch64)        usdot: vpdpbusd's u8 x s8 into int32, on 128-bit registers
    dotprod (aarch64)     sdot: s8 x s8 into int32 (int8 weights made signed again: v = stored xor 0x80)

On aarch64 a block's 8 rows are two 128-bit registers of 4 rows (`Int8Dot.lanes`): the
same weight bytes as x86, two loads and two dot products where x86 has one. AVX512-VNNI's
prefill goes the other way: one 512-bit vpdpbusd multiplies two blocks (16 rows), whose
words are two 256-bit loads joined, and the convert, FMA and store of a group are 16 lanes
wide (`kernel_dot`); so does int4 decode's whole tile of 8 sequences (`wide_decode_tiles`).
The stored weights are the same at every level.
SSE4.2-only CPUs and aarch64 without dotprod have no int8 path: the float path computes
their projections.

Weights are stored `interleaved` (see `ir/quant_formats.py`): one 256-bit load
holds 4 bytes of each of 8 weight rows. Broadcasting 4 activation bytes against it
makes each int32 lane one row's partial dot product, so a quantization group of 32
values is 8 (int8) or 4 x 2 (int4 nibbles) instructions into one int32 vector with no
shuffles, then one convert and one FMA with the 8 rows' scales, loaded as a vector (of
float16, widened to float32 as it is loaded: `vcvtph2ps`, NEON's `fcvtl`):

    per activation row m, per group g (parallel over m x g, serially for a decode of 1-3 sequences):
      d = max|x| / 127,  q = round(x / d)
      xq[m, 8g:8g+8] = q as 8 words of 4 bytes;  x_scale[m, g] = d;  x_bias[m, g] = -offset * sum(q)
    parallel over blocks of `row_blocks` x 8 weight rows:
      for each tile of `tokens` activation rows, then the last rows in tiles of tokens/2, tokens/4, .., 1:
        acc[tokens, row_blocks] = 0                           # float32 x 8, one lane per weight row
        for g:
          prefetch(packed[b, g + 4 KiB])                      # decode only: `prefetch_distance`, and for a
                                                              # tile of several blocks `tile_prefetch_distance`
          dot[t, b] = broadcast(x_bias[m_t, g])               # int32 x 8
          for each weight word w of the group:
            dot[t, b] = vpdpbusd(dot[t, b], packed[b, w, 0:8], broadcast(xq[m_t, w]))  # VNNI; see below
          acc[t, b] += float(dot[t, b]) * x_scale[m_t, g] * scale[b, g, 0:8]
          acc[t, b] += x_sum[m_t, g] * min[b, g, 0:8]           # zero-point formats only
        y[m_t, 8b:8b+8] = acc[t, b]                           # one vector store

The register tile reuses each weight load for `tokens` activation rows and each
activation broadcast for `row_blocks` weight loads: prefill's tile (4 x 2 blocks on
AVX-512's 32 registers) makes the kernel compute-bound, well above the float GEMM's speed;
decode's (8 sequences x 1 block with VNNI or AVX-512, 2 on AVX2; int4 on AVX512-VNNI 8 x 2
blocks) streams the weight once, linearly, and transforms each word once for all the tile's
sequences. Values are stored unsigned (`v + offset`); `x_bias` takes the offset back out:
sum((v + offset) * q) - offset * sum(q) = sum(v * q), exact in integers.
A zero-point format (q4f32_zp, llama.cpp's Q4_1) stores levels 0..15 with no offset and a
minimum per group: sum(x * (scale * v + min)) = x_scale * (scale * sum(q * v) + min * sum(q)),
so the quantize step also keeps x_sum = x_scale * sum(q) (llama.cpp's Q8_1 `s`) and each group
adds one FMA with the 8 rows' minimums.
Rows past the last whole tile (the only row of a 1-sequence decode) take smaller tiles, each a
copy of the loop nest: 7 rows past the 8-row tiles take one of 4, one of 2 and one of 1, so each
row is computed once, whatever the batch. Decode's tails of 8-row tiles past a few rows instead
take one more whole tile over padded activations, storing only the batch's rows (`padded_tail_rows`).

Knobs (`INT8_KNOBS`): `tokens`, `row_blocks` and `unroll` (the word loop unrolled, or a
loop). The best tuple depends on the level, the CPU and the shape: the rule's is close to
the best of AVX512-VNNI code on Zen 4, and AVX2's rule (`register_tile`) is the tile that
does not spill on Zen 3 (measured in docs/benchmarks.md#schedule-measurements, as are the
rule's other choices).
The kernel is a whole PrimFunc built from its knobs, not a schedule of a generic one, so
`knob_space` lists every tuple it takes (tiles within a quarter of the level's vector
registers, as each tile entry holds an int32 and a float32 accumulator and, for int4
without VNNI, an int16 one), the rule's (`rule_knobs`) first. `ember tune` measures
them one by one and `compile --tuning-db` rebuilds the kernel with the best
(`schedules/tuning.py`); `BUILD_ATTR` records what the kernel computes, knobs aside.

Without VNNI, nothing may saturate vpmaddubsw's int16 pair sums (|q| <= 127: q8 rounds
to +-127), and the stored weights are the same as for VNNI, so an artifact's weights do
not depend on the ISA level:
  int4: nibbles v + 8 in 0..15 times q: a pair is at most 2 * 15 * 127 = 3810, and the
    8 steps of a group add 16 products per int16 lane, at most 30480 <= 32767, so a
    group sums in int16 (vpaddw) and widens once: 8 vpmaddubsw + 1 vpmaddwd per group.
  int8: v + 128 in 0..255 times q would reach 2 * 255 * 127 = 64770 and saturate. As in
    llama.cpp, the unsigned operand is |v| (v = stored xor 0x80, then vpabsb) and the
    signed one q with v's sign (vpsignb): a pair is at most 2 * 128 * 127 = 32512 <= 32767
    (v >= -127 after rounding; -128 would still fit). Each step widens at once, and the
    offset is not subtracted (`x_bias` is 0).

Numerics: the weights are used exactly; the activations carry int8 rounding (at most
half a step of max|x| / 127 per value), the same rounding llama.cpp applies to Q4_0,
Q4_1 and Q8_0 dot products. `ember compile --float-activations` keeps the float path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ember.ir.quant_formats import FORMATS, INTERLEAVED, INTERLEAVED_ROWS, SCALE_DTYPE, QuantFormat
from ember.ir.tvmscript import parsed_once
from ember.schedules.common import prefetch
from ember.targets.int8_dot import Int8Dot

_LEVELS = 127.0
INT8_KNOBS = ("tokens", "row_blocks", "unroll")
# On each kernel: {"format", "n", "k", "many_tokens"}, the arguments of `int8_dot_matmul` but the target's and
# the knobs.
BUILD_ATTR = "ember.int8_matmul"
DECODE_TOKENS = 2  # sequences in AVX2's and NEON's decode register tile (`register_tile`)
# How far ahead of its loads decode prefetches the weight stream (`prefetch_distance`), and the line it fetches.
PREFETCH_BYTES = 4096
CACHE_LINE_BYTES = 64
# Decode quantizes its activation rows in parallel from this many sequences: at 8 sequences the serial
# loop had the other thread wait, at 2 the parallel launch cost more than it saved, at 4 it was even
# (measured in docs/benchmarks.md#schedule-measurements).
PARALLEL_QUANTIZE_ROWS = 4


def tile_entries(vector_bits: int) -> int:
    """Entries a register tile may have: a quarter of the level's vector registers, as each entry
    holds an int32 and a float32 accumulator and, for int4 without VNNI, an int16 one."""
    return (32 if vector_bits >= 512 else 16) // 4


def supports(fmt: QuantFormat, n: int, k: int) -> bool:
    """Whether this kernel computes an [n, k] weight in `fmt`."""
    return fmt.quantizes and fmt.dtype == "float32" and fmt.interleaves(n, k)


def kernel_dot(dot: Int8Dot, n: int, many_tokens: bool) -> Int8Dot:
    """The multiply the kernel of an [n, k] weight uses: the target's, but 256-bit for decode and
    for weights whose rows are not whole 512-bit multiplies.

    Decode streams the weight from memory. A 512-bit multiply reads two interleaved blocks at
    once, two streams 2k bytes apart, which the CPU's prefetchers follow worse than the one
    linear stream of the 256-bit form: with it a one-sequence decode step took longer, and at 8
    sequences, where the 512-bit tile computes faster from cache, the step gained less than it
    lost at 1 to 3 sequences (measured in docs/benchmarks.md#schedule-measurements). Only whole
    tiles of sequences take it (`wide_decode_tiles`)."""
    if not many_tokens and dot.narrow is not None:
        return dot.narrow
    return dot.for_rows(n)


def wide_decode_tiles(n: int, dot: Int8Dot, many_tokens: bool, bits: int) -> bool:
    """Whether decode's whole tiles of sequences multiply pairs of blocks on 512-bit registers.

    One sequence streams the weight best as one linear stream of 256-bit multiplies
    (`kernel_dot`), but a whole tile of sequences (8 with AVX512-VNNI) computes from cache
    between its loads, and there a 512-bit multiply does the work of two: the rule then takes
    tiles of 8 sequences x 2 blocks, one 512-bit multiply each (`wide_decode_tile`), and the
    sequences past the whole tiles take 256-bit tiles, one block and then the next, so a
    1-sequence step reads one linear stream as before. Int4 only: its nibble masks, shifts and
    dot products all halve, and the steps with whole tiles got faster while those of fewer
    sequences stayed the same; int8's 512-bit tile was as often slower as faster, so it is not
    taken. The two blocks' 256-bit tiles are a loop, not unrolled: unrolled, the 1-sequence step
    took longer. Measured in docs/benchmarks.md#schedule-measurements."""
    return not many_tokens and bits == 4 and dot.narrow is not None and dot.for_rows(n) is dot


def wide_decode_tile(vector_bits: int) -> tuple[int, int]:
    """(sequences, row blocks) of `wide_decode_tiles`' tile: a full tile, one 512-bit multiply's 2 blocks."""
    return tile_entries(vector_bits), 2


def padded_tail_rows(tokens: int, wide_tiles: bool, many_tokens: bool) -> int | None:
    """The fewest rows past the whole tiles of `tokens` rows that take one more whole tile, whose
    missing rows read padding and store nothing; None: tails always take the halving tiles (4, 2, 1).

    Each halving tile reads its weight block again and transforms each word again, for fewer
    sequences: past a few rows, one whole tile that wastes some rows costs less. Padding paid from
    5 sequences on `wide_decode_tiles` (q4f32; at 4 it was slower) and from 7 with 256-bit 8-row
    tiles (q8f32; at 6 it was slower); batches that take no padded tile were unchanged, and
    compute-bound skylake-avx512 code neither gained nor lost (measured in
    docs/benchmarks.md#schedule-measurements). Each row's arithmetic is the same in every tile,
    so the logits are the same to the bit. Prefill's tails, a few rows of many, and tiles of fewer
    rows keep the halving tiles."""
    if many_tokens or tokens != 8:
        return None
    return 5 if wide_tiles else 7


def prefetch_distance(many_tokens: bool) -> int:
    """Packed words (one block's 8 rows x 4 bytes each) between decode's weight loads and its prefetches; 0: none.

    Decode reads each weight once, as one stream per thread. The hardware prefetchers keep up
    while a cache line feeds a few instructions (one sequence), not when it feeds a tile of
    sequences, and not across the two streams of a 512-bit multiply: the loads then wait on
    memory. A software prefetch `PREFETCH_BYTES` ahead, the group's lines once per group,
    keeps the stream in flight: decode got faster with it on avx512vnni and on AVX2 code, most
    at 8 sequences, and 2 KiB and 8 KiB ahead did no better than 4 KiB (measured in
    docs/benchmarks.md#schedule-measurements). Prefill reuses each weight line for many rows from
    cache and has nothing to gain. (NEON's speed cannot be measured here: aarch64 gets the same
    prefetch, unmeasured.)"""
    return 0 if many_tokens else PREFETCH_BYTES // (4 * INTERLEAVED_ROWS)


def tile_prefetch_distance(distance: int, blocks: int, block_words: int) -> int:
    """`prefetch_distance` for a register tile of `blocks` row blocks of `block_words` packed words each: the
    same, or for a tile of several blocks, at least one tile ahead (the same group of the next tile's blocks).

    A tile of several blocks (AVX512-VNNI int4 decode's 8 sequences x 2 blocks, `wide_decode_tiles`) reads
    one stream per block, a block apart. A distance inside a block sends the first block's prefetches into
    the second, already being read, and none reaches the next tile's second block, which its tile then
    starts from memory. A tile ahead made the 8- and 16-sequence steps faster and left the one-block tiles
    of 1 and 4 sequences as they were (measured in docs/benchmarks.md#schedule-measurements)."""
    if distance == 0 or blocks == 1:
        return distance
    return max(distance, blocks * block_words)


def register_tile(vector_bits: int, many_tokens: bool, dot: Int8Dot, bits: int) -> tuple[int, int]:
    """(activation rows, weight row blocks) of one register tile.

    Prefill, 512-bit multiplies (AVX512-VNNI, 16 rows each, `kernel_dot`): 4 x 4 blocks, 8 int32
    and 8 float32 accumulators, faster than the 256-bit and the 512-bit 4 x 2 tiles.
    Prefill, 256-bit: 4 x 2 needs 16 accumulator registers, which AVX-512's 32 hold (faster than
    2 x 2 and 1 x 1 on Zen 4); AVX-VNNI has 16, so 2 x 2.
    AVX2's steps hold more temporaries (the sign trick's |v| and signed q, int4's masked
    nibbles and int16 sums): its 2 x 2 tile spilled (haswell and znver3 code: 84 stack
    references in the q8 inner loop, 54 in q4's), so int8 takes 2 x 1 (5) and int4 1 x 4
    (3, the masked nibbles shared by 4 blocks), both faster than 2 x 2 on Zen 3.
    Decode, 256-bit: one row block, streamed once, and the sequences of a batch in tiles: each
    weight word is loaded and transformed (int4's nibbles, AVX2's sign trick) once for the tile's
    sequences; the last ones take tiles of 4, 2 and 1. With VNNI or AVX-512's 32 registers, the tile
    holds as many sequences as the register budget has entries (`tile_entries`: 8 on AVX-512, 4 on
    AVX-VNNI): each sequence's products are one dependent chain of vpdpbusd, which a 2-sequence tile
    runs two at a time, and each weight word serves 8 sequences, not 2. At 8 sequences the full
    tile beat 2 x 1 on avx512vnni, skylake-avx512 and AVX-VNNI code (all but one q8f32 projection),
    and the decode step got faster; at 1 sequence, which only the 1-row tile computes, the speed is
    the same. (Splitting each sequence's chain in two, int4's low and high nibbles apart, then
    gained nothing.) AVX2 keeps pairs: on Zen 3, 2 x 1 beat 1 x 1 at 2 to 8 sequences; 4 x 1
    spilled registers and was slower than 2 x 1 at every batch, 2 x 2 no faster than 1 x 1. (The
    dot products themselves, per sequence, are most of AVX2's work: wider tiles cannot halve it.)
    NEON (4-row multiplies) keeps pairs too. Measured in docs/benchmarks.md#schedule-measurements."""
    if not many_tokens:
        if dot.lanes >= INTERLEAVED_ROWS and (dot.accumulates or vector_bits >= 512):
            return tile_entries(vector_bits), 1
        return DECODE_TOKENS, 1
    if dot.lanes > INTERLEAVED_ROWS:
        return 4, 4
    if vector_bits >= 512:
        return 4, 2
    if dot.accumulates:
        return 2, 2
    return (2, 1) if bits == 8 else (1, 4)


def rule_knobs(n: int, dot: Int8Dot, many_tokens: bool, vector_bits: int, bits: int) -> list[int]:
    """The knobs (`INT8_KNOBS`) for `bits`-bit weights the rule picks: `register_tile`, with
    the row blocks halved until they divide the weight's, and the word loop unrolled on VNNI only."""
    if wide_decode_tiles(n, dot, many_tokens, bits):
        return [*wide_decode_tile(vector_bits), 1]
    dot = kernel_dot(dot, n, many_tokens)
    tokens, row_blocks = register_tile(vector_bits, many_tokens, dot, bits)
    while (n // INTERLEAVED_ROWS) % row_blocks:
        row_blocks //= 2
    return [tokens, row_blocks, int(dot.accumulates)]


def knob_space(n: int, dot: Int8Dot, many_tokens: bool, vector_bits: int, bits: int) -> list[list[int]]:
    """Every knob tuple the kernel of an [n, k] weight of `bits`-bit values takes, the rule's first.

    Row blocks come in whole multiplies (two blocks for a 512-bit one). Decode is tuned with one
    sequence, which only the 1-row tile computes: its row blocks and word loop are searched, and
    its token tile is the rule's, or the largest beside the row blocks that the register budget holds.
    With `wide_decode_tiles`, the rule's 512-bit tile of 2 blocks reads one block at a time at one
    sequence, as 1 block does; its word loop is searched too."""
    rule = rule_knobs(n, dot, many_tokens, vector_bits, bits)
    wide = wide_decode_tiles(n, dot, many_tokens, bits)
    dot = kernel_dot(dot, n, many_tokens)
    # Tile entries: a row block per token, or a 512-bit multiply's two blocks.
    budget = tile_entries(vector_bits)
    per_entry = max(dot.lanes // INTERLEAVED_ROWS, 1)  # row blocks of one entry
    row_blocks = [blocks for blocks in (1, 2, 4, 8)
                  if blocks % per_entry == 0 and (n // INTERLEAVED_ROWS) % blocks == 0 and blocks // per_entry <= 4]
    if many_tokens:
        tiles = [(tokens, blocks) for tokens in (1, 2, 4) for blocks in row_blocks
                 if tokens * blocks // per_entry <= budget]
    else:
        tiles = [(min(rule[0], budget * per_entry // blocks), blocks) for blocks in row_blocks]
        if wide:  # the rule's 512-bit tile, its word loop unrolled or not
            tiles.insert(0, (rule[0], rule[1]))
    space = [[tokens, blocks, unroll] for tokens, blocks in tiles for unroll in (0, 1)]
    return [rule, *(knobs for knobs in space if knobs != rule)]


def built_as(func: tirx.PrimFunc) -> dict[str, Any] | None:
    """What `func` computes if `int8_dot_matmul` built it (`BUILD_ATTR`, as plain values), else None."""
    built = (func.attrs or {}).get(BUILD_ATTR)
    if built is None:
        return None
    return {"format": str(built["format"]), "n": int(built["n"]), "k": int(built["k"]),
            "many_tokens": bool(built["many_tokens"])}


def kernel_knob_space(func: tirx.PrimFunc, dot: Int8Dot, vector_bits: int) -> list[list[int]] | None:
    """`knob_space` of a kernel `int8_dot_matmul` built (None for any other PrimFunc)."""
    built = built_as(func)
    return None if built is None else knob_space(built["n"], dot, built["many_tokens"], vector_bits,
                                                FORMATS[built["format"]].bits)


def rebuild(func: tirx.PrimFunc, dot: Int8Dot, vector_bits: int, knobs: Sequence[int]) -> tirx.PrimFunc:
    """The kernel `func` (built by `int8_dot_matmul`) built again with `knobs`, keeping `func`'s attributes."""
    built = built_as(func)
    kernel = int8_dot_matmul(FORMATS[built["format"]], built["n"], built["k"], dot, built["many_tokens"],
                             vector_bits, knobs)
    return kernel.with_attrs(dict(func.attrs))


@parsed_once
def int8_dot_matmul(fmt: QuantFormat, n: int, k: int, dot: Int8Dot, many_tokens: bool,
                    vector_bits: int, knobs: Sequence[int] | None = None) -> tirx.PrimFunc:
    """The PrimFunc y[m, n] = x[m, :] . w(n, :) for an [n, k] weight in `fmt`, stored `interleaved`.

    See `int8_dot_compute` for the arguments; parameters: x [batch, seq, k] float32, the weight's parts, y."""
    compute = int8_dot_compute(fmt, n, k, dot, many_tokens, vector_bits, knobs)
    kernel = matmul_prim_func("int8_matmul", fmt, n, k, compute)
    return kernel.with_attr(BUILD_ATTR, {"format": fmt.name, "n": n, "k": k, "many_tokens": many_tokens})


def matmul_prim_func(name: str, fmt: QuantFormat, n: int, k: int, compute) -> tirx.PrimFunc:
    """The PrimFunc `name` (`name`_with_minimums with a zero point) over x [batch, seq, k] float32, an [n, k] weight's
    interleaved parts in `fmt` and y [batch, seq, n], its body the macro `compute(batch, seq, x, packed, scale, low,
    y)` (low: None without a zero point)."""
    parts = fmt.part_shapes(n, k, INTERLEAVED)
    packed_shape, scale_shape = parts["packed"][0], parts["scale"][0]

    @T.macro
    def matmul(x_handle, packed, scale, low, y_handle):
        batch = T.int64()
        seq = T.int64()
        x = T.match_buffer(x_handle, (batch, seq, k), "float32")
        y = T.match_buffer(y_handle, (batch, seq, n), "float32")
        compute(batch, seq, x, packed, scale, low, y)

    if fmt.zero_point:
        @T.prim_func(s_tir=True)
        def with_minimums(x_handle: T.handle, packed: T.Buffer(packed_shape, "uint32"),
                          scale: T.Buffer(scale_shape, SCALE_DTYPE), low: T.Buffer(scale_shape, SCALE_DTYPE),
                          y_handle: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})  # 8: opaque, never fused
            matmul(x_handle, packed, scale, low, y_handle)

        return with_minimums.with_attr("global_symbol", f"{name}_with_minimums")

    @T.prim_func(s_tir=True)
    def without_minimums(x_handle: T.handle, packed: T.Buffer(packed_shape, "uint32"),
                         scale: T.Buffer(scale_shape, SCALE_DTYPE), y_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})  # 8: opaque, never fused
        matmul(x_handle, packed, scale, None, y_handle)

    return without_minimums.with_attr("global_symbol", name)


def dense_rows(seq, m) -> list:
    """A projection's activation row m as indices of its [batch, seq, ...] activations and results."""
    return [m // seq, m % seq]


def pair_rows(order, m) -> list:
    """An expert projection's row m, its pairs sorted by expert, as the index of its [pairs, ...] activations and
    results: pair order[m] (`schedules/moe.py`)."""
    return [order[m]]


def _row(buffer, rows_of, where, m, ramp):
    """`buffer`'s vector `ramp` of activation row m, the row indexed by `rows_of` (`dense_rows`, `pair_rows`)."""
    return tirx.BufferLoad(buffer, _row_index(rows_of, where, m, ramp))


def _row_index(rows_of, where, m, ramp) -> list:
    """The indices of vector `ramp` of activation row m, the row indexed by `rows_of`."""
    return [*rows_of(where, m), ramp]


def quantize_rows(groups: int, offset: int | None, zero_point: bool, tile_rows: int = 0, rows_of=dense_rows):
    """The macro `quantize(mg, where, x, xq, x_scale, x_bias, x_sum)`: group mg % groups of activation row mg // groups
    (x's row `rows_of(where, m)`) quantized (llama.cpp's Q8_0 rounding) into xq's 8 words, its scale, its bias
    (-offset * sum(q); none written where offset is None) and, with a zero point, x_scale * sum(q). The int8 and
    the AMX kernels both call it, so their q are the same to the bit. xq is [rows, groups * 8] words, or with
    `tile_rows`, tiles of that many rows' group, each contiguous: row m's group g at
    xq[(m // tile_rows * groups + g) * tile_rows + m % tile_rows, 0:8]."""
    @T.macro
    def quantize(mg, where, x, xq, x_scale, x_bias, x_sum):
        with T.sblock("quantize"):
            T.reads()
            T.writes()
            q = T.sblock_alloc_buffer((32,), "int32")
            m: T.let[T.int64] = mg // groups
            g: T.let[T.int64] = mg % groups
            top: T.let[T.float32] = T.call_llvm_pure_intrin(
                "float32", "llvm.vector.reduce.fmax", T.fabs(_row(x, rows_of, where, m, T.Ramp(g * 32, 1, 32))))
            inverse: T.let[T.float32] = T.if_then_else(top > T.float32(0), T.float32(_LEVELS) / top,
                                                       T.float32(0))
            q[T.Ramp(0, 1, 32)] = T.Cast("int32x32", T.nearbyint(
                _row(x, rows_of, where, m, T.Ramp(g * 32, 1, 32)) * T.Broadcast(inverse, 32)))
            total: T.let[T.int32] = T.call_llvm_pure_intrin("int32", "llvm.vector.reduce.add",
                                                            q[T.Ramp(0, 1, 32)])
            x_scale[m, g] = top / T.float32(_LEVELS)
            if offset is not None:
                x_bias[m, g] = total * (-offset)
            if zero_point:
                x_sum[m, g] = T.Cast("float32", total) * (top / T.float32(_LEVELS))
            if tile_rows > 0:
                xq[(m // tile_rows * groups + g) * tile_rows + m % tile_rows, T.Ramp(0, 1, 8)] = T.reinterpret(
                    "int32x8", T.Cast("int8x32", q[T.Ramp(0, 1, 32)]))
            else:
                xq[m, T.Ramp(g * 8, 1, 8)] = T.reinterpret("int32x8", T.Cast("int8x32", q[T.Ramp(0, 1, 32)]))

    return quantize


def int8_dot_compute(fmt: QuantFormat, n: int, k: int, dot: Int8Dot, many_tokens: bool,
                     vector_bits: int, knobs: Sequence[int] | None = None):
    """The macro `compute(batch, seq, x, packed, scale, low, y)` of the int8 matmul's body (x, y: buffers).

    `dot` is the target's u8 x s8 dot product on 256-bit vectors (`TargetSpec.int8_dot`).
    `many_tokens`: prefill (rows quantized in parallel, a register tile over several rows)
    rather than decode (one token per sequence). `knobs`: one of `knob_space` (default: the
    rule's). x [batch, seq, k] float32, the weight's parts (packed, scale, low: None without a zero point),
    y [batch, seq, n] float32."""
    if not supports(fmt, n, k):
        raise ValueError(f"the int8 dot-product matmul does not compute a [{n}, {k}] {fmt.name} weight")
    plan = _tiles(fmt, n, k, dot, many_tokens, vector_bits, knobs, n, dense_rows)
    tokens, row_blocks, groups, zero_point = plan.tokens, plan.row_blocks, plan.groups, fmt.zero_point
    whole, halving_tails, quantize_all = plan.whole, plan.halving_tails, plan.quantize_all
    whole_tiles, halving_tail, tiled_rows = plan.whole_tiles, plan.halving_tail, plan.tiled_rows
    lanes = INTERLEAVED_ROWS

    @T.macro
    def compute(batch, seq, x, packed, scale, low, y):
        with T.sblock("root"):
            T.reads()
            T.writes()
            # The rows the tiles read: a padded tail's missing ones too (`padded_tail_rows`).
            xq = T.sblock_alloc_buffer((tiled_rows(batch * seq), k // 4), "int32")  # 4 int8 activations per word
            x_scale = T.sblock_alloc_buffer((tiled_rows(batch * seq), groups), "float32")
            x_bias = T.sblock_alloc_buffer((tiled_rows(batch * seq), groups), "int32")
            # With a zero point: x_scale * sum(q), what the group's minimum multiplies (llama.cpp's Q8_1 `s`).
            x_sum = T.sblock_alloc_buffer((tiled_rows(batch * seq), groups) if zero_point else (1, 1), "float32")
            quantize_all(batch * seq, tiled_rows(batch * seq), seq, x, xq, x_scale, x_bias, x_sum)
            for tile_n in T.parallel(n // (lanes * row_blocks)):
                for tile_m in T.serial(whole_tiles(batch * seq)):
                    whole(tile_m * tokens, tokens, batch * seq - 1, 0, tile_n * row_blocks, seq, packed, scale, low,
                          xq, x_scale, x_bias, x_sum, y)
                if halving_tail(batch * seq):
                    halving_tails(0, batch * seq, tile_n * row_blocks, seq, packed, scale, low, xq, x_scale, x_bias,
                                  x_sum, y)

    return compute


def int8_dot_experts(fmt: QuantFormat, experts: int, n: int, k: int, dot: Int8Dot, many_tokens: bool,
                     vector_bits: int):
    """The macro `project(pairs, x, packed, scale, low, order, offsets, y)` of a mixture of experts' projection
    (`schedules/moe.py`'s `moe_matmul`) in integer dot products: y[p] = w_e @ x[p] for each (token, expert) pair p,
    x [pairs, k] and y [pairs, n] float32 (buffers), the [experts * n, k] weight's parts stored `interleaved` (expert
    e's rows are its n / 8 blocks from block e * n / 8).

    The pairs' activation rows are quantized in the order `order` sorts them by expert, so that expert e's are the
    rows offsets[e] .. offsets[e + 1] - 1 of the quantized activations: the projection of the dense kernel's
    register tiles (`int8_dot_compute`, the rule's knobs for an [n, k] weight), expert by expert (those some pair
    chose), parallel over its row tiles, its rows' tiles each storing to its pair's row. A decode step's single
    pair per expert streams the expert's blocks as one prefetched run, as a dense decode streams its weight."""
    if not supports(fmt, n, k):
        raise ValueError(f"the int8 dot-product matmul does not compute experts of [{n}, {k}] {fmt.name} weights")
    plan = _tiles(fmt, n, k, dot, many_tokens, vector_bits, None, experts * n, pair_rows)
    tokens, row_blocks, groups, zero_point = plan.tokens, plan.row_blocks, plan.groups, fmt.zero_point
    whole, halving_tails, quantize_all = plan.whole, plan.halving_tails, plan.quantize_all
    whole_tiles, halving_tail = plan.whole_tiles, plan.halving_tail
    lanes = INTERLEAVED_ROWS
    # A padded tile of an expert's last rows reads up to `tokens` rows past all pairs' (`padded_tail_rows`).
    past = 0 if plan.pad_from is None else tokens

    @T.macro
    def project(pairs, x, packed, scale, low, order, offsets, y):
        with T.sblock("root"):
            T.reads()
            T.writes()
            xq = T.sblock_alloc_buffer((pairs + past, k // 4), "int32")
            x_scale = T.sblock_alloc_buffer((pairs + past, groups), "float32")
            x_bias = T.sblock_alloc_buffer((pairs + past, groups), "int32")
            x_sum = T.sblock_alloc_buffer((pairs + past, groups) if zero_point else (1, 1), "float32")
            quantize_all(pairs, pairs + past, order, x, xq, x_scale, x_bias, x_sum)
            for e in T.serial(experts):
                if offsets[e + 1] > offsets[e]:
                    for tile_n in T.parallel(n // (lanes * row_blocks)):
                        for tile_m in T.serial(whole_tiles(offsets[e + 1] - offsets[e])):
                            whole(offsets[e] + tile_m * tokens, tokens, offsets[e + 1] - 1, offsets[e],
                                  e * (n // lanes) + tile_n * row_blocks, order, packed, scale, low, xq, x_scale,
                                  x_bias, x_sum, y)
                        if halving_tail(offsets[e + 1] - offsets[e]):
                            halving_tails(offsets[e], offsets[e + 1] - offsets[e],
                                          e * (n // lanes) + tile_n * row_blocks, order, packed, scale, low, xq,
                                          x_scale, x_bias, x_sum, y)

    return project


@dataclass(frozen=True)
class _Tiles:
    """The register tiles of an int8 matmul, as macros over its quantized activations (`_tiles`):

    whole(first, count, last, base, first_block, where, packed, scale, low, xq, x_scale, x_bias, x_sum, y)
        a tile of `count` activation rows from `first` (with `pad_from`, storing none past `last`) against
        `row_blocks` weight row blocks from `first_block`; `base`: the first row of the tiles of these blocks
        (the first tile prefetches their weight);
    halving_tails(base, total, first_block, where, ...)
        the rows of `total` from `base` past the whole tiles, in tiles of 4, 2, 1;
    quantize_all(rows, padded, where, x, xq, x_scale, x_bias, x_sum)
        `rows` activation rows quantized (`quantize_rows`), in parallel for prefill or a few sequences; with
        `pad_from`, rows `rows` .. `padded` - 1, which padded tiles read and never store, given scales of 0."""

    tokens: int
    row_blocks: int
    groups: int
    pad_from: int | None  # `padded_tail_rows`
    whole: Any
    halving_tails: Any
    quantize_all: Any

    def whole_tiles(self, rows):
        """Whole tiles of `rows` activation rows: with `pad_from`, a tail of pad_from rows or more is one. (An
        expression inline in the loop: bound to a TIR name, it made the 8- and 16-sequence steps slower.)"""
        if self.pad_from is None:
            return rows // self.tokens
        return (rows + self.tokens - self.pad_from) // self.tokens

    def halving_tail(self, rows):
        """Whether the rows past `rows`' whole tiles take the halving tiles: always, or below pad_from rows."""
        return True if self.pad_from is None else rows % self.tokens < self.pad_from

    def tiled_rows(self, rows):
        """`rows` activation rows, or with `pad_from` rounded up to whole tiles."""
        return rows if self.pad_from is None else (rows + self.tokens - 1) // self.tokens * self.tokens


def _tiles(fmt: QuantFormat, n: int, k: int, dot: Int8Dot, many_tokens: bool, vector_bits: int,
           knobs: Sequence[int] | None, weight_rows: int, rows_of) -> _Tiles:
    """The register tiles of the int8 matmul of an [n, k] weight (see `int8_dot_compute` for the arguments), its
    activation and result rows indexed by `rows_of(where, m)` (`dense_rows`, `pair_rows`), its weight buffer holding
    `weight_rows` rows (the [n, k] weight, or every expert's: a result's columns are then its rows' modulo n)."""
    target_dot, dot = dot, kernel_dot(dot, n, many_tokens)
    space = knob_space(n, target_dot, many_tokens, vector_bits, fmt.bits)
    knobs = space[0] if knobs is None else [int(knob) for knob in knobs]
    if knobs not in space:
        raise ValueError(f"int8 matmul knobs {dict(zip(INT8_KNOBS, knobs))} are not among {space}")
    tokens, row_blocks, unroll = knobs
    lanes = INTERLEAVED_ROWS
    groups = k // fmt.group_size
    words = fmt.group_size * fmt.bits // 32  # packed words of one row per group
    block_words = groups * words  # packed words of one block
    line_words = CACHE_LINE_BYTES // (4 * lanes)  # a block's packed words in one cache line
    int4 = fmt.bits == 4
    # int8 weights on vpmaddubsw (the sign trick below) and on sdot are made signed again: no offset to take out.
    offset = 0 if fmt.bits == 8 and (dot.signed_weights or not dot.accumulates) else fmt.stored_offset
    zero_point = fmt.zero_point
    word_loop = T.unroll if unroll else T.serial
    wide = tirx.Ramp(0, 1, 2 * lanes)  # int16 pairs
    # int4 on vpmaddubsw: a group's products add up in int16 (`sums`), widened once per group.
    int16_sums = int4 and not dot.accumulates

    def column(block):
        """The result column of weight row block `block`'s first row."""
        return block * lanes if weight_rows == n else block * lanes % n

    def tile_of(dot: Int8Dot, blocks: int, guarded: bool = False):
        """The register tile macro of `blocks` weight row blocks multiplied with `dot`; `guarded`, it stores no
        row past `last` (`padded_tail_rows`)."""
        # One multiply covers `dot.lanes` weight rows (a "unit"): half of an 8-row block on NEON, a block
        # on 256-bit x86 registers, two blocks joined on 512-bit ones.
        rows = dot.lanes
        units = blocks * lanes // rows
        vec = tirx.Ramp(0, 1, rows)
        ahead = tile_prefetch_distance(prefetch_distance(many_tokens), blocks, block_words)
        int32s, bytes_, floats = f"int32x{rows}", f"int8x{4 * rows}", f"float32x{rows}"

        def unit_rows(buffer, first_row, index):
            """The `rows` values at `index` of weight rows first_row.. (a multiple of `rows`) in an interleaved
            [blocks, index, 8] buffer: part of one block's vector, or whole blocks' vectors joined."""
            if rows <= lanes:
                return buffer[first_row // lanes, index, tirx.Ramp(first_row % lanes, 1, rows)]
            vectors = [buffer[first_row // lanes + b, index, tirx.Ramp(0, 1, lanes)] for b in range(rows // lanes)]
            return tirx.Shuffle(vectors, [tirx.IntImm("int32", i) for i in range(rows)])

        def u32(value):
            return tirx.Broadcast(tirx.const(value, "uint32"), rows)

        def activations(xq_word):
            return T.reinterpret(bytes_, tirx.Broadcast(xq_word, rows))

        def pairs(unsigned, signed):
            """int16 x 16: sums of two u8 x s8 products (vpmaddubsw)."""
            return T.call_llvm_pure_intrin("int16x16", dot.multiply, unsigned, signed)

        def widen(acc, sums):
            """acc + the int16 pairs summed into int32 (vpmaddwd with ones)."""
            return acc + T.call_llvm_pure_intrin("int32x8", dot.widen, sums, tirx.Broadcast(T.int16(1), 2 * lanes))

        def word_dot(acc, packed, xq, first_row, m, g, w):
            """`acc` plus the products of the group's weight word w for the `rows` weight rows from
            first_row: int32 x `rows`, or int16 x 16 pairs where `int16_sums`."""
            word = unit_rows(packed, first_row, g * words + w)
            steps = [(word, xq[m, g * 8 + w])]  # (weight bytes, activation word): 4 products per row
            if int4:
                steps = [(tirx.bitwise_and(word, u32(0x0F0F0F0F)), xq[m, g * 8 + w]),  # values 4w..4w+3
                         (tirx.bitwise_and(tirx.shift_right(word, u32(4)), u32(0x0F0F0F0F)), xq[m, g * 8 + 4 + w])]
            for weight, xq_word in steps:
                if dot.accumulates:
                    if dot.signed_weights and not int4:  # stored v + 128, xor 0x80: v
                        weight = tirx.bitwise_xor(weight, u32(0x80808080))
                    acc = T.call_llvm_pure_intrin(int32s, dot.multiply, acc, T.reinterpret(bytes_, weight),
                                                  activations(xq_word))
                elif int4:
                    # Nibbles 0..15 times |q| <= 127: each int16 lane sums 16 products a group, at most
                    # 16 * 15 * 127 = 30480 <= 32767 in magnitude.
                    acc = acc + pairs(T.reinterpret("int8x32", weight), activations(xq_word))
                else:
                    # Stored v + 128, xor 0x80 gives v back. |v| as the unsigned operand and q with v's sign
                    # as the signed one: each product is |v| * |q| <= 128 * 127, a pair at most 32512 <= 32767.
                    # (v + 128 times q would reach 2 * 255 * 127 = 64770 and saturate.) A pair per int16 lane:
                    # widened at once. abs(-128) stays -128, whose byte read unsigned is 128.
                    signed_weight = T.reinterpret("int8x32", tirx.bitwise_xor(weight, u32(0x80808080)))
                    signed_x = T.call_llvm_pure_intrin("int8x32", dot.sign, activations(xq_word), signed_weight)
                    acc = widen(acc, pairs(T.abs(signed_weight), signed_x))
            return acc

        @T.macro
        def tile(first, count, last, base, first_block, where, packed, scale, low, xq, x_scale, x_bias, x_sum, y):
            # y for activation rows first .. first + count - 1 and the weight rows of `blocks` blocks from first_block
            # (the tiles of these blocks start at row `base`).
            with T.sblock("tile"):
                T.reads()
                T.writes()
                dots = T.sblock_alloc_buffer((count, units, rows), "int32")
                sums = T.sblock_alloc_buffer((count, units, 2 * lanes), "int16")  # if int16_sums
                acc = T.sblock_alloc_buffer((count, units, rows), "float32")
                for t, u in T.grid(count, units):
                    acc[t, u, vec] = T.Broadcast(T.float32(0), rows)
                for g in T.serial(groups):
                    # The lines `ahead` words past the group's, in each block (the last block of the weight: its own
                    # end), by the block's first tile only: the tiles after it read the same words.
                    if ahead > 0:
                        if first == base:
                            packed_flat = T.decl_buffer((weight_rows * block_words,), "uint32", data=packed.data)
                            for b in T.unroll(blocks):
                                for line in T.unroll(max(words // line_words, 1)):
                                    # (The index inline: bound to a name first, it made the 4-sequence step
                                    # slower.)
                                    T.evaluate(prefetch(T.address_of(packed_flat[
                                        T.min((first_block + b) * block_words + g * words + line * line_words + ahead,
                                              weight_rows // lanes * block_words - 1) * lanes])))
                    for t in T.unroll(count):
                        for u in T.unroll(units):
                            dots[t, u, vec] = T.Broadcast(x_bias[first + t, g], rows)
                            if int16_sums:
                                sums[t, u, wide] = T.Broadcast(T.int16(0), 2 * lanes)
                    # Word by word over the tile: each weight word is loaded (and transformed) once per
                    # tile. Without VNNI a step is several instructions, and a group unrolled spilled
                    # registers and ran far slower (haswell code on Zen 4), so the rule unrolls only on VNNI.
                    for w in word_loop(words):
                        for t in T.unroll(count):
                            for u in T.unroll(units):
                                if int16_sums:
                                    sums[t, u, wide] = word_dot(sums[t, u, wide], packed, xq,
                                                                first_block * lanes + u * rows, first + t, g, w)
                                else:
                                    dots[t, u, vec] = word_dot(dots[t, u, vec], packed, xq,
                                                               first_block * lanes + u * rows, first + t, g, w)
                    for t in T.unroll(count):
                        for u in T.unroll(units):
                            if int16_sums:
                                dots[t, u, vec] = widen(dots[t, u, vec], sums[t, u, wide])
                            acc[t, u, vec] = acc[t, u, vec] + T.Cast(floats, dots[t, u, vec]) * (
                                T.Broadcast(x_scale[first + t, g], rows)
                                * T.Cast(floats, unit_rows(scale, first_block * lanes + u * rows, g)))
                            if zero_point:  # + the group's minimum times its activations' sum
                                acc[t, u, vec] = acc[t, u, vec] + T.Broadcast(x_sum[first + t, g], rows) * T.Cast(
                                    floats, unit_rows(low, first_block * lanes + u * rows, g))
                if guarded:
                    for t in T.unroll(count):
                        if first + t <= last:
                            for u in T.unroll(units):
                                T.buffer_store(y, acc[t, u, vec], _row_index(
                                    rows_of, where, first + t, T.Ramp(column(first_block) + u * rows, 1, rows)))
                else:
                    for t, u in T.grid(count, units):
                        T.buffer_store(y, acc[t, u, vec], _row_index(
                            rows_of, where, first + t, T.Ramp(column(first_block) + u * rows, 1, rows)))

        return tile

    # Whole tiles and the last rows' tiles: the same tile, but see `wide_decode_tiles`.
    wide_tiles = wide_decode_tiles(n, target_dot, many_tokens, fmt.bits) and (
        tokens, row_blocks) == wide_decode_tile(vector_bits)
    rest_blocks = 1 if wide_tiles else row_blocks
    pad_from = padded_tail_rows(tokens, wide_tiles, many_tokens)
    rest = tile_of(dot, rest_blocks)
    if wide_tiles or pad_from is not None:
        whole = tile_of(target_dot if wide_tiles else dot, row_blocks, guarded=pad_from is not None)
    else:
        whole = rest  # the same tile

    @T.macro
    def last_rows(size, base, total, first_block, where, packed, scale, low, xq, x_scale, x_bias, x_sum, y):
        # A tile of `size` rows where the `total` rows from `base` end `size` or more past a multiple of 2 * size,
        # for tiles of more than `size` rows. Sizes 4, 2 and 1 in turn cover every tile `knob_space` takes (at most
        # 8 rows).
        if tokens > size:
            if total % (2 * size) >= size:
                rest(base + total // (2 * size) * (2 * size), size, base + total - 1, base, first_block, where,
                     packed, scale, low, xq, x_scale, x_bias, x_sum, y)

    @T.macro
    def halving_tails(base, total, first_block, where, packed, scale, low, xq, x_scale, x_bias, x_sum, y):
        # The last rows, fewer than a tile, in tiles of halving sizes: of 8 tokens, 7 rows take 4, 2 and 1
        # (with `wide_decode_tiles`, for one block and then the next).
        for part in T.serial(row_blocks // rest_blocks):
            last_rows(4, base, total, first_block + part * rest_blocks, where, packed, scale, low, xq, x_scale,
                      x_bias, x_sum, y)
            last_rows(2, base, total, first_block + part * rest_blocks, where, packed, scale, low, xq, x_scale,
                      x_bias, x_sum, y)
            last_rows(1, base, total, first_block + part * rest_blocks, where, packed, scale, low, xq, x_scale,
                      x_bias, x_sum, y)

    quantize = quantize_rows(groups, offset, zero_point, rows_of=rows_of)

    @T.macro
    def quantize_all(rows, padded, where, x, xq, x_scale, x_bias, x_sum):
        if many_tokens or rows >= PARALLEL_QUANTIZE_ROWS:
            for mg in T.parallel(rows * groups):
                quantize(mg, where, x, xq, x_scale, x_bias, x_sum)
        else:
            for mg in T.serial(rows * groups):
                quantize(mg, where, x, xq, x_scale, x_bias, x_sum)
        if pad_from is not None:  # the missing rows' products, never stored, start from scales of 0
            for m, g in T.grid(padded - rows, groups):
                x_scale[rows + m, g] = T.float32(0)
                if zero_point:
                    x_sum[rows + m, g] = T.float32(0)

    return _Tiles(tokens, row_blocks, groups, pad_from, whole, halving_tails, quantize_all)
