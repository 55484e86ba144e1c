"""CPU schedule for `NT` matmuls: C[m, n] = sum_k A[m, k] * W[n, k], with epilogues.

Matches a PrimFunc with exactly one reduction block whose two inputs are both
indexed last by the reduction variable (a row-major weight read along its rows,
as `FuseTransposeMatmul` produces for every projection), any number of leading
spatial axes folded into m (batch x sequence), and optional elementwise epilogues
(bias, residual add). Decode (m = batch) makes it a GEMV, prefill (m = tokens) a GEMM.

A GEMV (m bounded by FEW_ROWS: decode), per block of `rows` weight rows (1 by default):

    parallel n_o                    # weight row blocks across cores
      for m                         # every sequence of the batch reuses the rows from L1
        acc[rows, lanes] = 0        # rfactor of k by `lanes`: register tile
        for k_o
          unroll n_i in rows
            unroll vectors in lanes   # `lanes` may span several vectors: independent chains
              vector k_i:           acc[n_i, k_i] += A[m, k] * W[n, k]   (FMA)
        C[m, n] = tree_sum(acc[n_i, :])   # halving vector adds, then the epilogue, in cache

Why: the weight is the large operand and streams from memory exactly once per call;
the inner loop is contiguous vector loads and FMAs on independent accumulators, which
hides FMA latency. Reading one row at a time, each core streams one linear range of
memory: interleaving reads from several rows halves the achieved DRAM bandwidth on a
98 MB lm_head. Quantized weights arrive as an unpacking block (the prologue, see
`ir_passes/quantize_weights.py`), inlined into the FMA loop: each value is unpacked in
registers and used once, with vectors no wider than the values sharing a packed word.

A GEMM (prefill) as outer products, per tile of `rows` weight rows (two vectors' worth):

    parallel n_o
      Wt[k, n_i] = W[n, k]          # the tile's rows, transposed (unpacked, if quantized)
      for m_o                       # m_tile activation rows at a time
        C_tile[m_tile, rows] = 0    # in registers
        for k
          unroll m_i, vector n_i:   C_tile[m_i, n_i] += A[m, k] * Wt[k, n_i]   (broadcast x FMA)
        C[m, n] = C_tile            # then the epilogue

Why: each FMA's operands are one broadcast activation and one contiguous weight vector,
m_tile x rows/lanes independent accumulators stay in registers for the whole k loop, and
the weight tile (unpacked once) is reused by every activation row from L1/L2.

The sizes are knobs (`GEMV_KNOBS`, `GEMM_KNOBS`): `rows` (weight rows per block or
tile), `lanes` (a GEMV's k split, up to four vectors) and `m_tile` (a GEMM's activation
rows per register tile). The rule picks defaults; tuning (`schedules/tuning.py`) samples them with
meta_schedule and replays the best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import s_tir, tirx
from tvm.runtime import DataType
from tvm.s_tir.dlight.analysis import SBlockInfo
from tvm.s_tir.schedule import ExprRV

from ember.ir_passes.module_utils import VECTOR_RUN_ATTR
from ember.schedules.common import CPURule, const_extent, extent_bound, reduction_lanes, schedule_halving, tree_sum, vector_accumulator

# Activations with at most this many rows (decode batches) count as a GEMV.
FEW_ROWS = 8


# A knob's value: a Python int (rules, replayed records) or a sampled variable (tuning).
Knob = int | ExprRV
# Chooses a knob: (name, candidates, default) -> value, called in the order of GEMV_KNOBS or GEMM_KNOBS.
KnobChooser = Callable[[str, Sequence[int], int], Knob]
GEMV_KNOBS = ("rows", "lanes")
GEMM_KNOBS = ("rows", "m_tile")


def default_knobs(_name: str, _candidates: Sequence[int], default: int) -> Knob:
    """The rule's own choice for every knob."""
    return default


class NTMatmul(CPURule):
    """GEMV/GEMM with a row-major [N, K] weight, vectorized along K."""

    def __init__(self, vector_bits: int, choose: KnobChooser = default_knobs) -> None:
        super().__init__(vector_bits)
        self.choose = choose

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], bounds: dict[str, int]) -> s_tir.Schedule | None:
        reductions = [index for index, info in enumerate(infos) if not info.is_injective()]
        if len(reductions) != 1:
            return None
        main = infos[reductions[0]]
        prologues = [info.block_rv for info in infos[: reductions[0]]]
        epilogues = [info.block_rv for info in infos[reductions[0] + 1:]]
        kinds = main.dom_kind()
        if len(kinds) < 2 or kinds[-1] != "R" or kinds[:-1] != "S" * (len(kinds) - 1):
            return None
        block = main.block_rv
        if not _is_nt_access(sch, block):
            return None
        *m_loops, n, k = sch.get_loops(block)
        n_extent, k_extent = const_extent(sch, n), const_extent(sch, k)
        dtype = str(sch.get(block).writes[0].source.dtype)
        vector_bits = self.vector_bits
        m_bound = extent_bound(sch, m_loops, bounds)
        gemv = m_bound is not None and m_bound <= FEW_ROWS
        if n_extent is None:
            return None
        if not gemv:
            return self._schedule_gemm(sch, block, m_loops, n, k, prologues, epilogues, n_extent, dtype)
        if prologues:
            # Unpack each weight value right where it is multiplied (in registers), with
            # vectors no wider than the runs the packed layout reads with one load.
            run = min(int(sch.get(p).annotations.get(VECTOR_RUN_ATTR, k_extent or 1)) for p in prologues)
            vector_bits = min(vector_bits, run * DataType(dtype).bits)
            for prologue in prologues:
                sch.compute_inline(prologue)
        vector = reduction_lanes(k_extent, vector_bits, dtype)
        if vector is None:
            return None
        # A GEMV streams one weight row at a time: a single linear read per core keeps the
        # hardware prefetcher ahead, where interleaving several rows' reads runs at about
        # half the DRAM bandwidth (float and int8 weights alike; measured on a 98 MB lm_head).
        rows = self.choose("rows", [r for r in (1, 2, 4, 8) if n_extent % r == 0], 1)
        # The k split: one or more vectors per row, each its own accumulator (hides FMA latency).
        widths = [w for w in (vector // 2, vector, 2 * vector, 4 * vector) if w >= 4 and k_extent % w == 0] or [vector]
        lanes = self.choose("lanes", widths, 2 * vector if 2 * vector in widths else vector)

        m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0] if m_loops else sch.add_unit_loop(block)
        n_o, n_i = sch.split(n, [None, rows])
        k_o, k_i = sch.split(k, [None, lanes])
        sch.reorder(n_o, m, k_o, n_i, k_i)
        # Lanes as the last axis of the accumulator: contiguous vector registers.
        accumulate = vector_accumulator(sch, block, k_i)
        halvings = tree_sum(sch, block)
        rf_n_o, rf_m, rf_k_o, rf_n_i, rf_k_i = sch.get_loops(accumulate)
        sch.parallel(rf_n_o)
        for consumer in (*halvings, block, *epilogues):
            sch.reverse_compute_at(consumer, rf_m)
        for level in halvings:
            schedule_halving(sch, level, vector, depth=2)
        # k split wider than one vector: unrolled vectors, each an independent accumulator.
        rf_k_a, rf_k_i = sch.split(rf_k_i, [None, vector])
        sch.vectorize(rf_k_i)
        sch.unroll(rf_k_a)
        sch.unroll(rf_n_i)
        sch.decompose_reduction(accumulate, rf_k_o)
        return sch

    def _schedule_gemm(self, sch, block, m_loops, n, k, prologues, epilogues, n_extent, dtype):
        """A GEMM as outer products: an m_tile x n_tile register tile of C, updated for each k
        from m_tile broadcast activations and n_tile contiguous weights (a transposed copy
        of the weight rows, made once per n tile and reused by every activation row)."""
        vector = max(self.vector_bits // DataType(dtype).bits, 1)
        tiles = [t for t in (vector, 2 * vector, 4 * vector) if n_extent % t == 0]
        if not tiles:
            return None
        n_tile = self.choose("rows", tiles, 2 * vector if 2 * vector in tiles else tiles[0])
        m_tile = self.choose("m_tile", [1, 2, 4, 6, 8], 4)
        m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0] if m_loops else sch.add_unit_loop(block)
        n_o, n_i = sch.split(n, [None, n_tile])
        m_o, m_i = sch.split(m, [None, m_tile])
        sch.reorder(n_o, m_o, k, m_i, n_i)
        sch.parallel(n_o)
        # With a symbolic m, the last tile is partial: LoopPartition peels it off, so the full
        # tiles run without a bounds check around every FMA.
        sch.annotate(m_o, "pragma_loop_partition_hint", 1)
        # The weight tile, transposed to [k, n]: each k reads n_tile contiguous values.
        if prologues:
            (tile,) = prologues
            sch.compute_at(tile, n_o)
        else:
            tile = sch.cache_read(block, 1, "global")
            sch.compute_at(tile, n_o)
        sch.transform_layout(tile, ("write", 0), lambda row, col: (col, row))
        tile_row, tile_col = sch.get_loops(tile)[-2:]
        sch.reorder(tile_col, tile_row)
        sch.vectorize(tile_row)
        # C's tile in registers for the whole k loop (written out, with the epilogue, after it).
        output = sch.cache_write(block, 0, "global") if not epilogues else None
        for consumer in [output] if output is not None else epilogues:
            sch.reverse_compute_at(consumer, m_o)
        vectors, lanes = sch.split(n_i, [None, vector])
        sch.vectorize(lanes)
        sch.unroll(vectors)
        sch.unroll(m_i)
        sch.decompose_reduction(block, k)
        return sch


def _is_nt_access(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> bool:
    """Both inputs are indexed last by the reduction variable (contiguous along k)."""
    stmt = sch.get(block)
    reduce_vars = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if len(reduce_vars) != 1:
        return False
    output = stmt.writes[0].source
    inputs = [region for region in stmt.reads if not region.source.same_as(output)]
    if len(inputs) != 2:
        return False
    for region in inputs:
        last = region.region[-1]
        if not (isinstance(last.min, tirx.Var) and last.min.same_as(reduce_vars[0])):
            return False
    return True
