"""Tag the PrimFuncs a module has before legalization: TVM's paged-KV-cache kernels."""

from __future__ import annotations

import tvm

from ember.ir_passes.module_utils import KERNEL_SOURCE_ATTR, replace_functions


def tag_library_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """Mark every PrimFunc of `mod` as written by hand in `tvm.relax.frontend.nn.llm`.

    The model itself is Relax operators at this point, so every PrimFunc here is one
    of the KV cache's kernels; the schedule check accepts them as they are.
    """
    updates = {
        gv.name_hint: func.with_attr(KERNEL_SOURCE_ATTR, "tvm.relax.frontend.nn.llm.kv_cache")
        for gv, func in mod.functions_items()
        if isinstance(func, tvm.tirx.PrimFunc)
    }
    return replace_functions(mod, updates)
