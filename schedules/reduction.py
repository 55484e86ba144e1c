"""CPU schedule for row reductions with an elementwise consumer (RMSNorm and kin).

Matches a PrimFunc with exactly one reduction block over the innermost axis of
rows (`sum_k f(x[r, k])`) whose result feeds an elementwise output over the same
rows; every other block must inline. Emits, per row (serial: a row is a few KB,
cheaper than waking the thread pool):

    acc[lanes] = 0; for k_o: acc[:] += f(x[r, k_o*lanes : (k_o+1)*lanes])   (vector)
    s = sum(acc)                                                              (16 adds)
    for h_o: out[r, h_o*lanes : ...] = g(x, s, weight)                        (vector)

Why: dlight's CPU reduction rule parallelises over the hidden axis and recomputes
the row sum under it, O(H^2) work for a decode RMSNorm; here the sum is computed
once per row with vector accumulators and the output pass is one vector sweep.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.dlight.analysis import SBlockInfo

from ember.schedules.common import CPURule, const_extent, inline_all_but, reduction_lanes, vector_accumulator


class RowReduction(CPURule):
    """Vectorized per-row reduction + elementwise epilogue."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], _bounds: dict[str, int]) -> s_tir.Schedule | None:
        reductions = [info for info in infos if not info.is_injective()]
        if len(reductions) != 1 or not infos[-1].is_injective():
            return None
        reduce_block, output = reductions[0].block_rv, infos[-1].block_rv
        if not reductions[0].dom_kind().endswith("SR"):
            return None
        inline_all_but(sch, [reduce_block, output])
        if len(sch.get_child_blocks(sch.get_sblock("root"))) != 2:
            return None
        return self._schedule_row(sch, reduce_block, output)

    def _schedule_row(self, sch: s_tir.Schedule, reduce_block, output) -> s_tir.Schedule | None:
        *row_loops, k = sch.get_loops(reduce_block)
        *out_rows, h = sch.get_loops(output)
        dtype = str(sch.get(reduce_block).writes[0].source.dtype)
        lanes = reduction_lanes(const_extent(sch, k), self.vector_bits, dtype)
        out_lanes = reduction_lanes(const_extent(sch, h), self.vector_bits, str(sch.get(output).writes[0].source.dtype))
        if lanes is None or out_lanes is None or not out_rows:
            return None
        row = sch.fuse(*out_rows) if len(out_rows) > 1 else out_rows[0]
        h_o, h_i = sch.split(h, [None, out_lanes])
        sch.vectorize(h_i)
        k_o, k_i = sch.split(k, [None, lanes])
        # Lanes as the last axis of the accumulator: contiguous vector registers.
        accumulate = vector_accumulator(sch, reduce_block, k_i)
        sch.compute_at(reduce_block, row)
        sch.compute_at(accumulate, row)
        *_, rf_k_i, rf_k_o = sch.get_loops(accumulate)
        sch.reorder(rf_k_o, rf_k_i)
        sch.vectorize(rf_k_i)
        sch.decompose_reduction(accumulate, rf_k_o)
        return sch

