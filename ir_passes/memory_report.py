"""Compile-time memory report: weights, KV cache per token, planned workspace.

An analysis, not a rewrite: it reads a module after `StaticPlanBlockMemory` and
sums the fixed-size storages each entry function allocates (every intermediate
tensor lives in one of them). Together with the weight and KV-cache sizes this
tells, before anything runs, how long a context fits in a memory budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import tvm
from tvm import relax

from ember.ir.weight_recipes import weight_params


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a deployment needs, by kind."""

    weight_bytes: int
    kv_bytes_per_token: int
    workspace_bytes: dict[str, int]
    context_window: int

    @property
    def peak_workspace_bytes(self) -> int:
        """The largest planned workspace of any entry function."""
        return max(self.workspace_bytes.values(), default=0)

    def max_context(self, budget_bytes: int) -> int:
        """The longest total context (tokens in the KV cache) that fits `budget_bytes`."""
        free = budget_bytes - self.weight_bytes - self.peak_workspace_bytes
        return max(0, min(free // self.kv_bytes_per_token, self.context_window))

    def kv_capacity(self, budget_bytes: int, max_batch: int) -> int:
        """Tokens the KV cache holds over all sequences: `max_batch` full contexts, or what fits the budget."""
        free = budget_bytes - self.weight_bytes - self.peak_workspace_bytes
        return max(0, min(free // self.kv_bytes_per_token, max_batch * self.context_window))

    def to_json(self) -> dict:
        """Plain data for the manifest."""
        return {**asdict(self), "peak_workspace_bytes": self.peak_workspace_bytes}


def planned_workspace(mod: tvm.IRModule) -> dict[str, int]:
    """Bytes of static storage each Relax function allocates."""
    totals: dict[str, int] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            sizes = _storage_sizes(func)
            if sizes:
                totals[gv.name_hint] = sum(sizes)
    return totals


def _storage_sizes(func: relax.Function) -> list[int]:
    """Bytes of each static storage `func` allocates."""
    sizes: list[int] = []
    relax.analysis.post_order_visit(func.body, lambda e: _collect_storage(e, sizes))
    return sizes


def memory_report(lowered: tvm.IRModule, kv_bytes_per_token: int, context_window: int) -> MemoryReport:
    """The report for a module lowered through memory planning."""
    weights = weight_params(lowered["decode"])
    weight_bytes = sum(
        int(np.prod([int(d) for d in p.ty.shape])) * np.dtype(str(p.ty.dtype)).itemsize for p in weights
    )
    return MemoryReport(weight_bytes, kv_bytes_per_token, planned_workspace(lowered), context_window)


def _collect_storage(expr: relax.Expr, sizes: list[int]) -> None:
    if (
        isinstance(expr, relax.Call)
        and isinstance(expr.op, tvm.ir.Op)
        and expr.op.name in ("relax.vm.alloc_storage", "relax.memory.alloc_storage")
        and isinstance(expr.args[0], relax.ShapeExpr)
    ):
        dims = expr.args[0].values
        if all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            sizes.append(int(np.prod([int(d) for d in dims])))
