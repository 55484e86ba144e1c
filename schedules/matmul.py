"""CPU schedule for `NT` matmuls: C[m, n] = sum_k A[m, k] * W[n, k], with epilogues.

Matches a PrimFunc with exactly one reduction block whose two inputs are both
indexed last by the reduction variable (a row-major weight read along its rows,
as `FuseTransposeMatmul` produces for every projection), any number of leading
spatial axes folded into m (batch x sequence), and optional elementwise epilogues
(bias, residual add). Decode (m = batch, at most FEW_ROWS) makes it a GEMV, prefill
(m = tokens) a GEMM.

GEMM, per block of `rows` weight rows (two vectors' worth):

    parallel n_o                        # weight row blocks across cores
      Wt[k, n_i] = W[n, k]              # the block transposed once (k-major, in L1/L2)
      for m_o                           # every tile of m_tile tokens reuses it
        acc[m_tile, rows] = 0           # registers
        for k
          unroll m_i in m_tile
            vectors n_i in rows:        acc[m_i, n_i] += broadcast(A[m, k]) * Wt[k, n_i]   (FMA)
        C[m, n] = acc (+ epilogue)      # whole vectors along n, once per tile

Why: both inputs are contiguous along k, so a tile that vectorizes n needs the weight
transposed; done per row block inside the kernel (once per block, reused by all m
tokens, about 1/m of the FMA work), it turns the inner loop into one vector load per
`lanes` outputs, m_tile broadcasts and m_tile x rows/lanes independent FMAs, with no
horizontal sums (1.35-1.5x the former k-vectorized tile on Zen 3 at m = 128).

GEMV, per block of `rows` weight rows (and a GEMM whose n fills no vector):

    parallel n_o
      for m                             # every sequence reuses the rows from L1
        acc[rows, lanes] = 0            # rfactor of k by `lanes`: register tile
        for k_o
          unroll n_i in rows
            unroll vectors in lanes     # `lanes` may span several vectors: independent chains
              vector k_i:               acc[n_i, k_i] += A[m, k] * W[n, k]   (FMA)
        C[m, n] = tree_sum(acc[n_i, :]) # halving vector adds, then the epilogue, in cache

Why: the weight is the large operand and streams from memory exactly once per call
(the rows stay in L1 while all m reuse them); the inner loop is contiguous vector
loads and FMAs on independent accumulators, which hides FMA latency.

Quantized weights arrive as an unpacking block (the prologue) that computes W from
packed integers (see `ir_passes/quantize_weights.py`). In a GEMV it is inlined into
the FMA loop: each value is unpacked in registers and used once, with vectors as
wide as the values sharing a packed word (8 for int4: one broadcast word, eight
shifts). In a GEMM it is computed `rows` rows at a time into a local tile under n_o
(then transposed), so unpacking is paid once, not once per token.

Three sizes are knobs (`MATMUL_KNOBS`): `rows` (weight rows per register tile),
`lanes` (the vector: along k in a GEMV, where up to four vectors split k; along n,
one vector, in a GEMM) and `m_tile` (activation rows per register tile in a GEMM).
The rule picks defaults; tuning (`schedules/tuning.py`) samples them with
meta_schedule and replays the best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import s_tir, tirx
from tvm.tirx import IndexMap
from tvm.runtime import DataType
from tvm.s_tir.dlight.analysis import SBlockInfo
from tvm.s_tir.schedule import ExprRV

from ember.ir_passes.module_utils import VECTOR_RUN_ATTR
from ember.schedules.common import CPURule, const_extent, extent_bound, reduction_lanes, schedule_halving, tree_sum, vector_accumulator

# Activations with at most this many rows (decode batches) count as a GEMV.
FEW_ROWS = 8


# A knob's value: a Python int (rules, replayed records) or a sampled variable (tuning).
Knob = int | ExprRV
# Chooses a knob: (name, candidates, default) -> value. Names come in the order of MATMUL_KNOBS.
KnobChooser = Callable[[str, Sequence[int], int], Knob]
MATMUL_KNOBS = ("rows", "lanes", "m_tile")


def default_knobs(_name: str, _candidates: Sequence[int], default: int) -> Knob:
    """The rule's own choice for every knob."""
    return default


class NTMatmul(CPURule):
    """GEMV/GEMM with a row-major [N, K] weight, vectorized along K."""

    def __init__(self, vector_bits: int, rows: int = 4, choose: KnobChooser = default_knobs) -> None:
        super().__init__(vector_bits)
        self.rows = rows
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
        unpack_inline = bool(prologues) and gemv
        if unpack_inline:
            # A GEMV: unpack each weight value right where it is multiplied (in registers),
            # with vectors no wider than the runs the packed layout reads with one load.
            run = min(int(sch.get(p).annotations.get(VECTOR_RUN_ATTR, k_extent or 1)) for p in prologues)
            vector_bits = min(vector_bits, run * DataType(dtype).bits)
            for prologue in prologues:
                sch.compute_inline(prologue)
            prologues = []
        if n_extent is None:
            return None
        n_vector = reduction_lanes(n_extent, vector_bits, dtype)
        if not gemv and n_vector is not None and n_vector >= 4:
            return self._schedule_gemm(sch, block, prologues, epilogues, m_loops, n, n_extent, n_vector)
        vector = reduction_lanes(k_extent, vector_bits, dtype)
        if vector is None:
            return None
        # Float weights in a GEMV: 8 rows x one vector of k, eight independent FMA chains that
        # share each activation load, so a batch (m = 2..8) is bound by FMAs rather than by
        # loads and FMA latency (Zen 3: 1.5-1.9x at m = 8, 1.1x at m = 1 on a 98 MB lm_head).
        # Weights unpacked in registers stream one row at a time: on Zen 4, interleaving
        # several rows' reads ran at about half the DRAM bandwidth.
        tile = (1, 2) if unpack_inline else (8, 1) if gemv else (4, 1)
        rows = self.choose("rows", [r for r in (1, 2, 4, 8) if n_extent % r == 0],
                           next(r for r in (tile[0], 4, 2, 1) if n_extent % r == 0))
        # The k split: one or more vectors per row, each its own accumulator (hides FMA latency).
        widths = [w for w in (vector // 2, vector, 2 * vector, 4 * vector) if w >= 4 and k_extent % w == 0] or [vector]
        lanes = self.choose("lanes", widths, tile[1] * vector if tile[1] * vector in widths else vector)
        # A GEMM whose n fills no vector (an odd vocabulary): m_tile activation rows share each weight load.
        m_tile = self.choose("m_tile", [1] if gemv else [1, 2, 4, 8], 1)

        m = _fused(sch, block, m_loops)
        n_o, n_i = sch.split(n, [None, rows])
        k_o, k_i = sch.split(k, [None, lanes])
        sch.reorder(n_o, m, k_o, n_i, k_i)
        # Lanes as the last axis of the accumulator: contiguous vector registers.
        accumulate = vector_accumulator(sch, block, k_i)
        # A sampled `lanes` (tuning) must not change how many blocks the trace creates: the
        # tree's depth depends on it, so tuning times plain sums and replays add the tree.
        halvings = tree_sum(sch, block) if isinstance(lanes, int) else []
        rf_n_o, rf_m, rf_k_o, rf_n_i, rf_k_i = sch.get_loops(accumulate)
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

    def _schedule_gemm(self, sch: s_tir.Schedule, block: s_tir.SBlockRV, prologues: list[s_tir.SBlockRV],
                       epilogues: list[s_tir.SBlockRV], m_loops: list[s_tir.LoopRV], n: s_tir.LoopRV,
                       n_extent: int, vector: int) -> s_tir.Schedule:
        """Many activation rows: an m_tile x (rows weight rows) outer-product tile over a transposed
        copy of each block of weight rows (see the module docstring); `vector` divides n."""
        widths = [vector * v for v in (1, 2, 3, 4) if n_extent % (vector * v) == 0]
        rows = self.choose("rows", widths, 2 * vector if 2 * vector in widths else widths[-1])
        lanes = self.choose("lanes", [vector], vector)  # one candidate, so it equals `vector` when sampled
        m_tile = self.choose("m_tile", [2, 3, 4, 5, 6, 8], 4)
        weight = _weight_read(sch, block)
        m = _fused(sch, block, m_loops)
        *_, k = sch.get_loops(block)
        n_o, n_i = sch.split(n, [None, rows])
        m_o, m_i = sch.split(m, [None, m_tile])
        sch.reorder(n_o, m_o, k, m_i, n_i)
        # The block of weight rows, k-major: a vector load reads `vector` rows' values at one k.
        packed = sch.cache_read(block, weight, "global")
        sch.compute_at(packed, n_o)
        ndim = len(sch.get(packed).writes[0].region)
        sch.transform_layout(packed, ("write", 0), IndexMap.from_func(
            lambda *index: (*index[:-2], index[-1], index[-2]), ndim=ndim))
        for prologue in prologues:
            self._unpack_rows(sch, prologue, n_o)
        # The m_tile x rows sums stay in registers through the k loop; written back once.
        accumulator = sch.cache_write(block, 0, "global")
        # With a symbolic m, the last tile is partial: LoopPartition peels it off, so the full
        # tiles run without a bounds check around every FMA.
        sch.annotate(m_o, "pragma_loop_partition_hint", 1)
        sch.parallel(n_o)
        for consumer in (accumulator, *epilogues):
            sch.reverse_compute_at(consumer, m_o)
            _vectorize_inner(sch, consumer, vector)
        n_a, n_v = sch.split(n_i, [None, lanes])
        sch.vectorize(n_v)
        sch.unroll(n_a)
        sch.unroll(m_i)
        init = sch.decompose_reduction(block, k)
        _vectorize_inner(sch, init, vector)
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


def _fused(sch: s_tir.Schedule, block: s_tir.SBlockRV, m_loops: list[s_tir.LoopRV]) -> s_tir.LoopRV:
    """The activation rows as one loop (batch x sequence), a unit loop if there are none."""
    return sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0] if m_loops else sch.add_unit_loop(block)


def _weight_read(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> int:
    """Index among the block's reads of the weight: the input indexed by the output's last axis (n)."""
    stmt = sch.get(block)
    n_var = stmt.iter_vars[-2].var
    return next(i for i, region in enumerate(stmt.reads)
                if len(region.region) >= 2 and isinstance(region.region[-2].min, tirx.Var)
                and region.region[-2].min.same_as(n_var))


def _vectorize_inner(sch: s_tir.Schedule, block: s_tir.SBlockRV, lanes: int) -> None:
    """Vectorize the block's innermost loop in vectors of `lanes` (unrolled if longer)."""
    inner = sch.get_loops(block)[-1]
    extent = const_extent(sch, inner)
    if extent is None or extent % lanes:
        return
    outer, inner = sch.split(inner, [None, lanes])
    sch.vectorize(inner)
    sch.unroll(outer)


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
