"""CPU schedule for `NT` matmuls: C[m, n] = sum_k A[m, k] * W[n, k], with epilogues.

Matches a PrimFunc with exactly one reduction block whose two inputs are both
indexed last by the reduction variable (a row-major weight read along its rows,
as `FuseTransposeMatmul` produces for every projection), any number of leading
spatial axes folded into m (batch x sequence), and optional elementwise epilogues
(bias, residual add). Decode (m = batch) makes it a GEMV, prefill (m = tokens) a GEMM.

Schedule, per block of `rows` weight rows (8, or 4 where 8 rows overflow L1; 1 for
weights unpacked in a GEMV):

    parallel n_o                    # weight row blocks across cores
      for m                         # every token/sequence reuses the rows from L1
        acc[rows, lanes] = 0        # rfactor of k by `lanes`: register tile
        for k_o
          unroll n_i in rows
            unroll vectors in lanes   # `lanes` may span several vectors: independent chains
              vector k_i:           acc[n_i, k_i] += A[m, k] * W[n, k]   (FMA)
        C[m, n] = tree_sum(acc[n_i, :])   # halving vector adds, then the epilogue, in cache

Why: the weight is the large operand and streams from memory exactly once per call
(the rows stay in L1 while all m reuse them); the inner loop is contiguous vector
loads and FMAs on independent accumulators, which hides FMA latency. The tile aims
at CHAINS (8) such chains that share every activation load: 8 rows x one vector,
or 4 rows x two vectors of k (GEMV) / two activation rows (GEMM, `m_tile`). That
makes a decode batch (m = 2..8) and a prefill FMA-bound instead of load- and
latency-bound. Float weights, which `ir_passes/pack_float_panels.py` stores as
panels of rows transposed at compile time, take an outer-product tile instead
(`_schedule_panels`: no horizontal sums; faster than this tile's GEMM on Zen 3); this
tile remains for weights unpacked from integers and for weights read any other way.

Quantized weights arrive as an unpacking block (the prologue) that computes W from
packed integers (see `ir_passes/quantize_weights.py`). In a GEMV (m bounded by
FEW_ROWS) it is inlined into the FMA loop: each value is unpacked in registers
and used once, with vectors as wide as the values sharing a packed word (8 for
int4: one broadcast word, eight shifts). In a GEMM it is computed `rows` rows at
a time into a local tile under n_o, so unpacking is paid once, not once per token.

Three sizes are knobs (`MATMUL_KNOBS`): `rows` (weight rows per register tile),
`lanes` (the k split, up to four vectors) and `m_tile` (activation rows sharing each
weight load in a GEMM: the register tile becomes m_tile x rows accumulators, which
turns prefill from load-bound into FMA-bound). Over panels, `rows` counts outputs per
tile (whole panels) and `lanes` the k steps a GEMV accumulates apart. The rule picks defaults; tuning
(`schedules/tuning.py`) samples them with meta_schedule and replays the best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import s_tir, tirx
from tvm.runtime import DataType
from tvm.s_tir.dlight.analysis import SBlockInfo
from tvm.s_tir.schedule import ExprRV

from ember.ir.attributes import VECTOR_RUN_ATTR
from ember.schedules.common import (
    CPURule,
    const_extent,
    extent_bound,
    reduction_lanes,
    schedule_halving,
    tree_sum,
    vector_accumulator,
)

# Activations with at most this many rows (decode batches) count as a GEMV.
FEW_ROWS = 8
# Independent FMA chains a register tile aims for: FMA latency (4 cycles) x 2 FMA units.
CHAINS = 8
# Weight rows of a tile stay in L1 while every activation row reuses them (32 KiB on x86 cores).
L1_BYTES = 32 * 1024


# A knob's value: a Python int (rules, replayed records) or a sampled variable (tuning).
Knob = int | ExprRV
# Chooses a knob: (name, candidates, default) -> value. Names come in the order of MATMUL_KNOBS.
KnobChooser = Callable[[str, Sequence[int], int], Knob]
MATMUL_KNOBS = ("rows", "lanes", "m_tile")


def default_knobs(_name: str, _candidates: Sequence[int], default: int) -> Knob:
    """The rule's own choice for every knob."""
    return default


class NTMatmul(CPURule):
    """GEMV/GEMM with a row-major [N, K] weight, vectorized along K, or with a weight stored as panels."""

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
        prologues, epilogues = _inline_side_inputs(sch, block, prologues, epilogues)
        panel = _panel_rows(sch, block)
        if panel is not None:
            return self._schedule_panels(sch, block, epilogues, panel, bounds) if not prologues else None
        if not _is_nt_access(sch, block):
            return None
        *m_loops, n, k = sch.get_loops(block)
        n_extent, k_extent = const_extent(sch, n), const_extent(sch, k)
        dtype = str(sch.get(block).writes[0].source.dtype)
        vector_bits = self.vector_bits
        m_bound = extent_bound(sch, m_loops, bounds)
        gemv = m_bound is not None and m_bound <= FEW_ROWS
        unpack_inline = bool(prologues) and gemv
        if unpack_inline:
            # A GEMV: unpack each weight value right where it is multiplied (in registers),
            # with vectors no wider than the runs the packed layout reads with one load.
            run = min(int(sch.get(p).annotations.get(VECTOR_RUN_ATTR, k_extent or 1)) for p in prologues)
            vector_bits = min(vector_bits, run * DataType(dtype).bits)
            for prologue in prologues:
                sch.compute_inline(prologue)
            prologues = []
        vector = reduction_lanes(k_extent, vector_bits, dtype)
        if n_extent is None or vector is None:
            return None
        # Float weights: CHAINS independent FMA chains sharing each activation load (see the
        # module docstring). Rows longer than L1 holds eight of (k = 2048) take four, and two
        # vectors of k (GEMV) or two activation rows per weight load (GEMM) for the other four.
        # Weights unpacked in registers (a quantized GEMV) stream one row at a time: on Zen 4,
        # interleaving rows' reads left DRAM bandwidth unused (docs/benchmarks.md#schedule-measurements).
        fits_l1 = [r for r in (8, 4) if r * k_extent * DataType(dtype).bits // 8 <= L1_BYTES] or [4]
        rows = 1 if unpack_inline else fits_l1[0]
        rows = self.choose("rows", [r for r in (1, 2, 4, 8) if n_extent % r == 0],
                           next(r for r in (rows, 4, 2, 1) if n_extent % r == 0))
        chains = 2 if unpack_inline else max(1, CHAINS // rows) if isinstance(rows, int) else 1
        # The k split: one or more vectors per row, each its own accumulator (hides FMA latency).
        widths = [w for w in (vector // 2, vector, 2 * vector, 4 * vector) if w >= 4 and k_extent % w == 0] or [vector]
        vectors = chains if gemv else 1
        lanes = self.choose("lanes", widths, vectors * vector if vectors * vector in widths else vector)
        m_tile = self.choose("m_tile", [1] if gemv else [1, 2, 4, 8], 1 if gemv else chains)

        m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0] if m_loops else sch.add_unit_loop(block)
        n_o, n_i = sch.split(n, [None, rows])
        k_o, k_i = sch.split(k, [None, lanes])
        sch.reorder(n_o, m, k_o, n_i, k_i)
        # Lanes as the last axis of the accumulator: contiguous vector registers.
        accumulate = vector_accumulator(sch, block, k_i)
        # A sampled `lanes` (tuning) must not change how many blocks the trace creates: the
        # tree's depth depends on it, so tuning times plain sums and replays add the tree.
        halvings = tree_sum(sch, block) if isinstance(lanes, int) else []
        rf_n_o, rf_m, rf_k_o, rf_n_i, rf_k_i = sch.get_loops(accumulate)
        # m_tile activation rows share each weight vector load (m_tile = 1: the loop is a unit loop).
        rf_m, rf_m_i = sch.split(rf_m, [None, m_tile])
        sch.reorder(rf_m, rf_k_o, rf_m_i, rf_n_i, rf_k_i)
        # With a symbolic m, the last tile is partial: LoopPartition peels it off, so the full
        # tiles run without a bounds check around every FMA.
        sch.annotate(rf_m, "pragma_loop_partition_hint", 1)
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
        sch.unroll(rf_m_i)
        sch.decompose_reduction(accumulate, rf_k_o)
        for prologue in prologues:
            self._unpack_rows(sch, prologue, rf_n_o)
        return sch

    def _schedule_panels(self, sch: s_tir.Schedule, block: s_tir.SBlockRV, epilogues: list[s_tir.SBlockRV],
                         panel: int, bounds: dict[str, int]) -> s_tir.Schedule | None:
        """A matmul over a weight stored as panels (`ir_passes/pack_float_panels.py`).

        A tile is `rows` outputs (one or more panels). GEMM: m_tile x rows accumulators; each
        k step loads the tile's weights once, broadcasts one activation per row and issues
        m_tile x rows / vector FMAs into independent accumulators: no horizontal sums.

            parallel n_o                      # tiles of panels across cores; a panel stays in L2
              for m_o                         # tiles of m_tile activation rows
                acc[m_tile, rows] = 0         # registers
                for k
                  unroll m_i, panel j: vector n_i: acc[m_i, j, n_i] += A[m, k] * W[n_o + j, k, n_i]
                C[m, n] = acc (+ epilogue)

        GEMV (at most FEW_ROWS rows: decode, verify): per row, the tile's panels stream front to
        back side by side; `lanes` consecutive k steps go to separate accumulators (FMA latency),
        added at the end.
        """
        *m_loops, n, k = sch.get_loops(block)
        n_extent, k_extent = const_extent(sch, n), const_extent(sch, k)
        if n_extent is None or k_extent is None or n_extent % panel:
            return None
        dtype = str(sch.get(block).writes[0].source.dtype)
        vector = reduction_lanes(panel, self.vector_bits, dtype)
        if vector is None:
            return None
        m_bound = extent_bound(sch, m_loops, bounds)
        gemv = m_bound is not None and m_bound <= FEW_ROWS
        rows = self.choose("rows", [r * panel for r in (1, 2, 4) if n_extent % (r * panel) == 0],
                           2 * panel if gemv and n_extent % (2 * panel) == 0 else panel)
        lanes = self.choose("lanes", [k for k in (1, 2, 4) if k_extent % k == 0] if gemv else [1], 2 if gemv else 1)
        m_tile = self.choose("m_tile", [1] if gemv else [1, 2, 3, 4, 6, 8], 1 if gemv else 6)
        m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0] if m_loops else sch.add_unit_loop(block)
        n_o, n_i = sch.split(n, [None, rows])
        # Every knob splits a loop on both paths (a unit loop where it is 1), so that a tuning trace
        # keeps all three decisions.
        m_o, m_i = sch.split(m, [None, m_tile])
        k_o, k_i = sch.split(k, [None, lanes])
        if gemv:
            sch.reorder(n_o, m_o, m_i, k_o, k_i, n_i)
            accumulate = sch.rfactor(k_i, factor_axis=0)  # acc[k_i, m, n]: one accumulator per k step
            sch.set_scope(accumulate, 0, "local")
            n_o, _, rows_loop, rf_k_o, rf_k_i, rf_n_i = sch.get_loops(accumulate)  # rfactor's own loop nest
            consumers = (block, *epilogues)
            sch.unroll(rf_k_i)
        else:
            sch.reorder(n_o, m_o, k_o, k_i, m_i, n_i)
            # With a symbolic m, the last tile is partial: peeled off, so full tiles run unguarded.
            sch.annotate(m_o, "pragma_loop_partition_hint", 1)
            accumulate, rows_loop = block, m_o
            consumers = (sch.cache_write(block, 0, "local"), *epilogues)
            _, _, rf_k_o, _, rf_m_i, rf_n_i = sch.get_loops(accumulate)
            sch.unroll(rf_m_i)
        sch.parallel(n_o)
        for consumer in consumers:
            sch.reverse_compute_at(consumer, rows_loop)
            inner = sch.get_loops(consumer)[-1]
            if const_extent(sch, inner) == rows:
                sch.vectorize(sch.split(inner, [None, vector])[1])
        vectors, rf_n_i = sch.split(rf_n_i, [None, vector])
        sch.vectorize(rf_n_i)
        sch.unroll(vectors)
        sch.decompose_reduction(accumulate, rf_k_o)
        return sch

    def _unpack_rows(self, sch: s_tir.Schedule, prologue: s_tir.SBlockRV, n_o: s_tir.LoopRV) -> None:
        """A GEMM's weight computed in the kernel (unpacked from integers): `rows` rows at a time,
        into cache, then reused by every row of the activation."""
        sch.compute_at(prologue, n_o)
        sch.set_scope(prologue, 0, "local")
        inner = sch.get_loops(prologue)[-1]
        extent = const_extent(sch, inner)
        dtype = str(sch.get(prologue).writes[0].source.dtype)
        lanes = reduction_lanes(extent, self.vector_bits, dtype)
        if lanes is not None and lanes > 1:
            sch.vectorize(sch.split(inner, [None, lanes])[1])


def _inline_side_inputs(sch: s_tir.Schedule, block: s_tir.SBlockRV, prologues: list[s_tir.SBlockRV],
                        epilogues: list[s_tir.SBlockRV]) -> tuple[list[s_tir.SBlockRV], list[s_tir.SBlockRV]]:
    """The prologues the matmul reads and the epilogues that read its result (each directly or through the
    others); every other block, computed from the kernel's inputs alone, inlined into the blocks that read it.

    Such a block (sigmoid(G) of a [rows, 1] gate that scales the product, as Qwen2-MoE's shared expert has it)
    covers no tile of the output: placed at a tile's loop it spans every row, and then so do the epilogues
    that read it, each tile writing all rows from sums other tiles have not finished. Inlined, its value is
    computed where each output element is."""
    feeding = [region.source for region in sch.get(block).reads]
    kept_prologues = []
    for prologue in reversed(prologues):
        stmt = sch.get(prologue)
        if _touches(stmt.writes, feeding):
            feeding.extend(region.source for region in stmt.reads)
            kept_prologues.insert(0, prologue)
        else:
            sch.compute_inline(prologue)
    derived = [sch.get(block).writes[0].source]
    kept_epilogues = []
    for epilogue in epilogues:
        stmt = sch.get(epilogue)
        if _touches(stmt.reads, derived):
            derived.extend(region.source for region in stmt.writes)
            kept_epilogues.append(epilogue)
        else:
            sch.compute_inline(epilogue)
    return kept_prologues, kept_epilogues


def _touches(regions, buffers) -> bool:
    """Whether any of the buffer regions is of one of `buffers`."""
    return any(region.source.same_as(buffer) for region in regions for buffer in buffers)


def _panel_rows(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> int | None:
    """P, if one input is a weight stored as panels, read as W[n // P, k, n % P], and the other is
    read along k last (`ir_passes/pack_float_panels.py`)."""
    stmt = sch.get(block)
    reduce_vars = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    output = stmt.writes[0].source
    inputs = [region for region in stmt.reads if not region.source.same_as(output)]
    if len(reduce_vars) != 1 or len(inputs) != 2:
        return None
    weights = [r for r in inputs if len(r.region) == 3 and isinstance(r.source.shape[2], tirx.IntImm)
               and isinstance(r.region[1].min, tirx.Var) and r.region[1].min.same_as(reduce_vars[0])]
    others = [r for r in inputs if isinstance(r.region[-1].min, tirx.Var) and r.region[-1].min.same_as(reduce_vars[0])]
    if len(weights) != 1 or len(others) != 1 or weights[0] is others[0]:
        return None
    return int(weights[0].source.shape[2])


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
