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
from tvm import relax, tirx

from ember.ir.weight_recipes import weight_params
from ember.schedules.moe import MOE_MATMUL_ATTR, MOE_ROUTE_ATTR

# Operators that only view a tensor under another shape (the weights they see are their first argument's).
_VIEWS = ("relax.reshape", "relax.memory.view", "relax.ensure_zero_offset")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a deployment needs, by kind."""

    weight_bytes: int
    kv_bytes_per_token: int
    workspace_bytes: dict[str, int]
    context_window: int
    # Of the weights, the routed experts' (read only by the expert projections), and the bytes of weights a decoded
    # token reads: every other weight whole, and top_k of each layer's experts.
    expert_weight_bytes: int = 0
    active_weight_bytes: int = 0

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
    weight_bytes = sum(_bytes(p) for p in weights)
    experts, share = _expert_weights(lowered, set(weights))
    expert_bytes = sum(_bytes(p) for p in experts)
    return MemoryReport(weight_bytes, kv_bytes_per_token, planned_workspace(lowered), context_window, expert_bytes,
                        round(weight_bytes - expert_bytes * (1 - share)))


def _bytes(param: relax.Var) -> int:
    return int(np.prod([int(d) for d in param.ty.shape])) * np.dtype(str(param.ty.dtype)).itemsize


def _expert_weights(lowered: tvm.IRModule, weights: set[relax.Var]) -> tuple[list[relax.Var], float]:
    """The weights decode's expert projections read (`schedules/moe.moe_matmul`), and the share of them one token
    reads (top_k of the experts, from the router's kernel)."""
    kernels = {gv: func.attrs for gv, func in lowered.functions_items()
               if isinstance(func, tirx.PrimFunc) and func.attrs is not None}
    projections = {gv for gv, attrs in kernels.items() if MOE_MATMUL_ATTR in attrs}
    route = next((attrs[MOE_ROUTE_ATTR] for attrs in kernels.values() if MOE_ROUTE_ATTR in attrs), None)
    if not projections or route is None:
        return [], 1.0
    bound: dict[relax.Var, relax.Expr] = {}
    found: dict[relax.Var, None] = {}

    def source(expr: relax.Expr) -> relax.Expr:  # through the views and reshapes memory planning leaves
        while isinstance(expr, relax.Var) and expr in bound:
            value = bound[expr]
            if not (isinstance(value, relax.Call) and value.args and isinstance(value.op, tvm.ir.Op)
                    and value.op.name in _VIEWS):
                break
            expr = value.args[0]
        return expr

    for block in lowered["decode"].body.blocks:  # normalized: every call is a binding's value
        for binding in block.bindings:
            bound[binding.var] = call = binding.value
            if not isinstance(call, relax.Call):
                continue
            callee, args = call.op, list(call.args)
            if isinstance(callee, tvm.ir.Op) and callee.name == "relax.call_tir":
                callee, args = args[0], list(args[1].fields) if isinstance(args[1], relax.Tuple) else [args[1]]
            if callee in projections:
                found.update({arg: None for arg in map(source, args) if arg in weights})
    return list(found), int(route["top_k"]) / int(route["experts"])


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
