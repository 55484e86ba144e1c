"""Functions no entry reaches are removed.

`FuseTransposeMatmul` (TVM 0.27) can leave a `transpose_matmul_fuse` composite
function behind that no function calls (seen with a tied LM head in graphs from
`torch.export`, whose decode and verify projections have the same structure), and
`DeadCodeElimination` keeps it. Lowered, it becomes kernels no rule schedules and
no one runs. This pass keeps the exported functions (those with a `global_symbol`)
and everything they reach, directly or through other functions, and drops the rest.
"""

from __future__ import annotations

import tvm
from tvm import relax


@tvm.transform.module_pass(opt_level=0, name="DropUnreachableFunctions")
def drop_unreachable_functions(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` without the functions its exported functions never reach."""
    by_name = {gv.name_hint: func for gv, func in mod.functions_items()}
    stack = [name for name, func in by_name.items() if (func.attrs or {}).get("global_symbol") is not None]
    reached: set[str] = set()
    while stack:
        name = stack.pop()
        if name in reached:
            continue
        reached.add(name)
        func = by_name[name]
        if isinstance(func, relax.Function):
            stack.extend(gv.name_hint for gv in relax.analysis.all_global_vars(func))
    if len(reached) == len(by_name):
        return mod
    return tvm.IRModule({gv: func for gv, func in mod.functions_items() if gv.name_hint in reached},
                        attrs=mod.attrs, global_infos=mod.global_infos)
