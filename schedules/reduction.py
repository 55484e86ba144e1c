"""CPU schedule for row reductions with an elementwise consumer (RMSNorm, LayerNorm and kin).

Matches a PrimFunc with one or more reduction blocks over the innermost axis of
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
    """Vectorized per-row reductions + elementwise epilogue."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], _bounds: dict[str, int]) -> s_tir.Schedule | None:
        reductions = [info for info in infos if not info.is_injective()]
        if not reductions or not infos[-1].is_injective():
            return None
        if not all(info.dom_kind().endswith("SR") for info in reductions):
            return None
        reduce_blocks, output = [info.block_rv for info in reductions], infos[-1].block_rv
        inline_all_but(sch, [*reduce_blocks, output])
        if len(sch.get_child_blocks(sch.get_sblock("root"))) != len(reduce_blocks) + 1:
            return None
        return self._schedule_row(sch, reduce_blocks, output)

    def _schedule_row(self, sch: s_tir.Schedule, reduce_blocks, output) -> s_tir.Schedule | None:
        """Per row: each reduction (RMSNorm has one; LayerNorm two, the mean and then the variance
        around it) with vector accumulators, in order, then the output sweep."""
        *out_rows, h = sch.get_loops(output)
        out_lanes = reduction_lanes(const_extent(sch, h), self.vector_bits, str(sch.get(output).writes[0].source.dtype))
        if out_lanes is None or not out_rows:
            return None
        lanes = []
        for block in reduce_blocks:
            *_, k = sch.get_loops(block)
            dtype = str(sch.get(block).writes[0].source.dtype)
            lanes.append(reduction_lanes(const_extent(sch, k), self.vector_bits, dtype))
        if None in lanes:
            return None
        row = sch.fuse(*out_rows) if len(out_rows) > 1 else out_rows[0]
        h_o, h_i = sch.split(h, [None, out_lanes])
        sch.vectorize(h_i)
        # The last reduction first: compute_at puts each producer ahead of its consumers in the row.
        for reduce_block, width in reversed(list(zip(reduce_blocks, lanes))):
            *_, k = sch.get_loops(reduce_block)
            k_o, k_i = sch.split(k, [None, width])
            # Lanes as the last axis of the accumulator: contiguous vector registers.
            accumulate = vector_accumulator(sch, reduce_block, k_i)
            sch.compute_at(reduce_block, row)
            sch.compute_at(accumulate, row)
            *_, rf_k_i, rf_k_o = sch.get_loops(accumulate)
            sch.reorder(rf_k_o, rf_k_i)
            sch.vectorize(rf_k_i)
            sch.decompose_reduction(accumulate, rf_k_o)
        return sch
