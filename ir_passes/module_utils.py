"""Small IRModule helpers and attribute names shared by ember's stages."""

from __future__ import annotations

import tvm

# Set by the frontend on PrimFuncs written by hand in TVM's LLM library (paged KV cache).
KERNEL_SOURCE_ATTR = "ember.kernel_source"
# Set by the quantization pass on weight-unpacking blocks: how many consecutive values
# along K are unpacked from one packed element and one scale (the widest useful vector).
VECTOR_RUN_ATTR = "ember.vector_run"


def replace_functions(mod: tvm.IRModule, updates: dict[str, tvm.ir.BaseFunc]) -> tvm.IRModule:
    """A new IRModule with the functions named in `updates` replaced; `mod` is untouched."""
    return tvm.IRModule(
        {gv: updates.get(gv.name_hint, func) for gv, func in mod.functions_items()},
        attrs=mod.attrs,
        global_infos=mod.global_infos,
    )
