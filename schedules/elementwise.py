"""CPU schedule for injective kernels: copies, concats, activations, gathers, RoPE.

Matches a PrimFunc whose blocks are all spatial. Producers are inlined into their
consumers so each output element is computed in one pass; each remaining block's
innermost axis is split by the SIMD width and vectorized when its extent is a
constant multiple of it, and all outer axes are fused into one parallel loop.
Why: unscheduled, these are serial scalar loops; most are small, but in prefill
(tokens x hidden) they add up, and every one of them would otherwise run on one core.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.runtime import DataType
from tvm.target import Target

from ember.schedules.common import const_extent, inline_all_but


class Elementwise(ScheduleRule):
    """Inline, vectorize the inner axis, parallelize the rest."""

    def __init__(self, vector_bits: int) -> None:
        self.vector_bits = vector_bits

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(info.is_injective() for info in infos):
            return None
        try:
            inline_all_but(sch, [infos[-1].block_rv])
            for block in sch.get_child_blocks(sch.get_sblock("root")):
                self._schedule_block(sch, block)
        except s_tir.ScheduleError:
            return None
        return sch

    def _schedule_block(self, sch: s_tir.Schedule, block: s_tir.SBlockRV) -> None:
        loops = sch.get_loops(block)
        if not loops:
            return
        inner = loops[-1]
        extent = const_extent(sch, inner)
        dtype = str(sch.get(block).writes[0].source.dtype)
        lanes = max(self.vector_bits // DataType(dtype).bits, 1)
        outer = list(loops[:-1])
        if extent is not None and extent >= lanes and extent % lanes == 0:
            inner_o, inner_i = sch.split(inner, [None, lanes])
            sch.vectorize(inner_i)
            outer.append(inner_o)
        elif extent is not None and extent <= 4 * lanes:
            sch.vectorize(inner)
        else:
            outer.append(inner)
        if outer:
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
