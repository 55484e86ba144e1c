"""Small helpers for reading and rebuilding IRModules, shared by ember's stages."""

from __future__ import annotations

from collections.abc import Container, Iterator

import tvm
from tvm import relax, tirx

from ember.ir.attributes import KERNEL_SOURCE_ATTR


def replace_functions(mod: tvm.IRModule, updates: dict[str, tvm.ir.BaseFunc]) -> tvm.IRModule:
    """A new IRModule with the functions named in `updates` replaced; `mod` is untouched."""
    return tvm.IRModule(
        {gv: updates.get(gv.name_hint, func) for gv, func in mod.functions_items()},
        attrs=mod.attrs,
        global_infos=mod.global_infos,
    )


def schedulable_kernels(mod: tvm.IRModule) -> Iterator[tuple[tvm.ir.GlobalVar, tirx.PrimFunc]]:
    """The PrimFuncs of `mod` that come from operators, which ember's schedules and kernel
    passes own: every one but those tagged `KERNEL_SOURCE_ATTR` (written as explicit loops)."""
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and KERNEL_SOURCE_ATTR not in (func.attrs or {}):
            yield gv, func


def upper_bounds(func: tirx.PrimFunc) -> dict[str, int]:
    """The upper bound of each bounded symbolic size of `func` (its `tir_var_upper_bound`), by name."""
    return {str(name): int(bound) for name, bound in dict((func.attrs or {}).get("tir_var_upper_bound", {})).items()}


def is_op(expr: relax.Expr, name: str) -> bool:
    """Whether `expr` calls the Relax operator `name` (e.g. "relax.matmul")."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def calls_packed(value: relax.Expr, name: str, op: str = "relax.call_pure_packed") -> bool:
    """Whether `value` calls the packed function `name` through `op`."""
    return (is_op(value, op) and isinstance(value.args[0], relax.ExternFunc)
            and str(value.args[0].global_symbol) == name)


def bindings(func: relax.Function) -> Iterator[relax.Binding]:
    """Every binding of a Relax function's body, block by block."""
    for block in func.body.blocks:
        yield from block.bindings


def is_weight_transpose(expr: relax.Expr, weights: Container[relax.Var]) -> bool:
    """Whether `expr` is `permute_dims(W)` swapping the two axes of a 2-D `W` in `weights`."""
    if not is_op(expr, "relax.permute_dims") or expr.args[0] not in weights:
        return False
    axes = expr.attrs.axes
    return len(expr.args[0].ty.shape) == 2 and (axes is None or [int(a) for a in axes] == [1, 0])


def permute_axes(permute: relax.Call) -> list[int]:
    """The axes of a `permute_dims` call (None means reversed)."""
    rank = len(permute.args[0].ty.shape)
    return [int(a) for a in permute.attrs.axes] if permute.attrs.axes is not None else list(range(rank))[::-1]


def scalar_constant(expr: relax.Expr) -> float | None:
    """The value of `expr` if it is a constant holding one number (`R.const(0.5)`), else None."""
    if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy())
    return None
