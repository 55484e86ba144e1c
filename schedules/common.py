"""The base of ember's CPU schedule rules and the helpers they share."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.runtime import DataType
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.target import Target


class CPURule(ScheduleRule):
    """A rule for llvm targets; `schedule` sees a normalized PrimFunc's blocks and its size bounds."""

    def __init__(self, vector_bits: int) -> None:
        self.vector_bits = vector_bits

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        return self.apply_to(s_tir.Schedule(func))

    def apply_to(self, sch: s_tir.Schedule) -> s_tir.Schedule | None:
        """Schedule the `main` PrimFunc of `sch` in place (meta_schedule hands its own schedules here)."""
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        attrs = sch.mod["main"].attrs or {}
        bounds = {str(name): int(bound) for name, bound in dict(attrs.get("tir_var_upper_bound", {})).items()}
        try:
            return self.schedule(sch, infos, bounds)
        except s_tir.ScheduleError:
            return None

    def schedule(
        self, sch: s_tir.Schedule, infos: list[SBlockInfo], bounds: dict[str, int]
    ) -> s_tir.Schedule | None:
        """Schedule the function's blocks, or return None if the rule does not match.

        `bounds` maps symbolic sizes (`seq_len`, `batch_size`) to their upper bounds.
        """
        raise NotImplementedError


def extent_bound(sch: s_tir.Schedule, loops: list[s_tir.LoopRV], bounds: dict[str, int]) -> int | None:
    """Upper bound of the product of the loops' extents, if each is a constant or a bounded size."""
    total = 1
    for loop in loops:
        extent = sch.get(loop).extent
        if isinstance(extent, tirx.IntImm):
            total *= int(extent)
        elif isinstance(extent, tirx.Var) and extent.name in bounds:
            total *= bounds[extent.name]
        else:
            return None
    return total


def const_extent(sch: s_tir.Schedule, loop: s_tir.LoopRV) -> int | None:
    """The loop's extent if it is a compile-time constant."""
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def reduction_lanes(extent: int | None, vector_bits: int, dtype: str) -> int | None:
    """The widest power-of-two vector width (at most one register) that divides `extent`."""
    if extent is None:
        return None
    lanes = max(vector_bits // DataType(dtype).bits, 1)
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes if lanes >= 4 or extent < 4 else None


def inline_all_but(sch: s_tir.Schedule, keep: list[s_tir.SBlockRV]) -> None:
    """Inline every block except `keep` into its consumers (or producers, if it is a sink)."""
    kept = [sch.get(block) for block in keep]
    progress = True
    while progress:
        progress = False
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if any(sch.get(block).same_as(stmt) for stmt in kept):
                continue
            for inline in (sch.compute_inline, sch.reverse_compute_inline):
                try:
                    inline(block)
                    progress = True
                    break
                except s_tir.ScheduleError:
                    continue
