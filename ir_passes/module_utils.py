"""Small IRModule helpers shared by ember's passes."""

from __future__ import annotations

import tvm


def replace_functions(mod: tvm.IRModule, updates: dict[str, tvm.ir.BaseFunc]) -> tvm.IRModule:
    """A new IRModule with the functions named in `updates` replaced; `mod` is untouched."""
    return tvm.IRModule(
        {gv: updates.get(gv.name_hint, func) for gv, func in mod.functions_items()},
        attrs=mod.attrs,
        global_infos=mod.global_infos,
    )
