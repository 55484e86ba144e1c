"""CPU schedule for injective kernels: copies, concats, activations, gathers, RoPE.

Matches a PrimFunc whose blocks are all spatial. Producers are inlined into their
consumers so each output element is computed in one pass; each remaining block's
innermost axis is split by the SIMD width and vectorized when its extent is a
constant multiple of it. Outer axes stay serial on purpose: these kernels move a
few KB per token, less than the cost of waking the thread pool, so parallelism
would make them slower (measured in docs/benchmarks.md#schedule-measurements).
"""

from __future__ import annotations

from tvm import s_tir
from tvm.runtime import DataType
from tvm.s_tir.dlight.analysis import SBlockInfo

from ember.schedules.common import CPURule, const_extent, inline_all_but


class Elementwise(CPURule):
    """Inline producers, vectorize the inner axis."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], _bounds: dict[str, int]) -> s_tir.Schedule | None:
        if not all(info.is_injective() for info in infos):
            return None
        inline_all_but(sch, [infos[-1].block_rv])
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            self._schedule_block(sch, block)
        return sch

    def _schedule_block(self, sch: s_tir.Schedule, block: s_tir.SBlockRV) -> None:
        loops = sch.get_loops(block)
        if not loops:
            return
        inner = loops[-1]
        extent = const_extent(sch, inner)
        dtype = str(sch.get(block).writes[0].source.dtype)
        lanes = max(self.vector_bits // DataType(dtype).bits, 1)
        if extent is not None and extent >= lanes and extent % lanes == 0:
            sch.vectorize(sch.split(inner, [None, lanes])[1])
        elif extent is not None and extent <= 4 * lanes:
            sch.vectorize(inner)
