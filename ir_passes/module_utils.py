"""Small IRModule helpers and attribute names shared by ember's stages."""

from __future__ import annotations

from collections.abc import Container, Iterator

import tvm
from tvm import relax, tirx

# Set by the frontend on PrimFuncs written by hand in TVM's LLM library (paged KV cache).
KERNEL_SOURCE_ATTR = "ember.kernel_source"
# Set by the quantization pass on weight-unpacking blocks: how many consecutive values
# along K are unpacked from one packed element and one scale (the widest useful vector).
VECTOR_RUN_ATTR = "ember.vector_run"
# Set by the frontend on the IRModule: the rotary embedding the KV cache applies,
# {"theta": float, "scaling": dict (config's rope_scaling, {} for plain RoPE), "rotary_dim": int,
#  "sliding_window": bool (TVM's runtime then rotates cached keys inside the prefill kernels)}.
ROPE_ATTR = "ember.rope"
# The symbolic length of the `verify` entry's input (speculative decoding's pending token and guesses)
# and its bound: as many rows as a decode batch (`schedules/matmul.py`'s FEW_ROWS), so its kernels are
# scheduled as decode's, a few rows reusing each weight load.
VERIFY_LEN, VERIFY_TOKENS = "verify_len", 8


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


def is_op(expr: relax.Expr, name: str) -> bool:
    """Whether `expr` calls the Relax operator `name` (e.g. "relax.matmul")."""
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


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


def scalar_constant(expr: relax.Expr) -> float | None:
    """The value of `expr` if it is a constant holding one number (`R.const(0.5)`), else None."""
    if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy())
    return None
