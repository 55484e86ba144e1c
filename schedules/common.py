"""The base of ember's CPU schedule rules and the helpers they share."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.runtime import DataType
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.script import tirx as T
from tvm.target import Target

from ember.ir.module_utils import upper_bounds

# The attributes of a kernel written as loops already scheduled for CPUs (`moe.py`, `lora.py`): no rule touches it,
# and operator fusion leaves it alone (8: TVM's opaque pattern).
SCHEDULED_OPAQUE = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8}


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
        try:
            return self.schedule(sch, infos, upper_bounds(sch.mod["main"]))
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


def float_lanes(sizes: tuple[int, ...], vector_bits: int) -> int:
    """float32 lanes of a hand-written kernel's rows: the target's vector width where every size is whole vectors
    of it."""
    lanes = vector_bits // 32
    while any(size % lanes for size in sizes):
        lanes //= 2
    return lanes


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


def vector_accumulator(sch: s_tir.Schedule, block: s_tir.SBlockRV, lanes_loop: s_tir.LoopRV) -> s_tir.SBlockRV:
    """rfactor `block` over `lanes_loop`: partial sums, one per lane, in a contiguous buffer.

    The buffer keeps the default "global" scope: TVM puts small constant-size global
    buffers on the stack, while a "local" one costs a TVMBackendAllocWorkspace call
    per parallel iteration on CPU (more than a short GEMV row takes to compute).
    """
    return sch.rfactor(lanes_loop, factor_axis=len(sch.get(block).writes[0].region))


def tree_sum(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> list[s_tir.SBlockRV]:
    """Turn `block`'s sum over the lanes of a vector accumulator into a tree of halvings.

    TVM adds the lanes one after another: a chain of dependent scalar adds as long as
    the accumulator, per output element. Instead, each level adds the upper half of the
    partial sums onto the lower half (an rfactor of the reduction): log2(lanes) - 1
    levels of vector adds, and `block` adds the last two. Returns the levels' blocks,
    first to last; call it before moving `block`, then `schedule_halving` each level
    where it lands.
    """
    levels = []
    width = const_extent(sch, _reduction_loop(sch, block))
    while width is not None and width > 2 and width % 2 == 0:
        width //= 2
        _, lanes = sch.split(_reduction_loop(sch, block), [2, width])
        levels.append(vector_accumulator(sch, block, lanes))
    return levels


def schedule_halving(sch: s_tir.Schedule, level: s_tir.SBlockRV, vector: int, depth: int) -> None:
    """One level of `tree_sum`, below its first `depth` loops: for each output element, the
    two halves one after the other (unrolled), each as vector adds over the lanes."""
    loops = sch.get_loops(level)[depth:]
    stmt = sch.get(level)
    lanes = _loop_of(sch, level, stmt.writes[0].region[-1].min)
    halves = _loop_of(sch, level, _reduction_var(stmt))
    others = [loop for loop in loops if not any(sch.get(loop).same_as(sch.get(x)) for x in (lanes, halves))]
    sch.reorder(*others, halves, lanes)
    width = const_extent(sch, lanes)
    if width is not None and width > vector:
        outer, lanes = sch.split(lanes, [None, vector])
        sch.unroll(outer)
    if width is not None and width >= 4:
        sch.vectorize(lanes)
    sch.unroll(halves)
    sch.decompose_reduction(level, halves)


def _loop_of(sch: s_tir.Schedule, block: s_tir.SBlockRV, var: tirx.Var) -> s_tir.LoopRV:
    """The loop bound to `block`'s iteration variable `var`."""
    stmt = sch.get(block)
    values = get_sblockrealize(sch, block).iter_values
    (bound,) = [value for iv, value in zip(stmt.iter_vars, values) if iv.var.same_as(var)]
    return next(loop for loop in sch.get_loops(block) if sch.get(loop).loop_var.same_as(bound))


def _reduction_var(stmt: s_tir.stmt.SBlock) -> tirx.Var:
    """The block's only reduction iteration variable."""
    (reduced,) = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    return reduced


def _reduction_loop(sch: s_tir.Schedule, block: s_tir.SBlockRV) -> s_tir.LoopRV:
    """The loop bound to `block`'s only reduction variable, moved innermost."""
    reduced = sch.get(_loop_of(sch, block, _reduction_var(sch.get(block))))
    loops = sch.get_loops(block)
    position = next(i for i, loop in enumerate(loops) if sch.get(loop).same_as(reduced))
    if position != len(loops) - 1:
        sch.reorder(*loops[position + 1:], loops[position])
    return loops[position]


def prefetch(address: tirx.PrimExpr) -> tirx.PrimExpr:
    """A software prefetch of the cache line at `address`: a read (0), kept in all caches (3), of data (1)."""
    return T.call_llvm_intrin("void", "llvm.prefetch", address, 0, 3, 1)
