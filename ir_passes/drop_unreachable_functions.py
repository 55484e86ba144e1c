"""Functions no entry reaches are removed.

The entries are the exported Relax functions (those with a `global_symbol`); a PrimFunc
stays only where a Relax function reaches it, directly or through other functions, even
if it carries a `global_symbol` of its own (the paged KV cache's kernels do). Two passes
leave functions behind that `DeadCodeElimination` keeps:

- `FuseTransposeMatmul` (TVM 0.27) can leave a `transpose_matmul_fuse` composite
  function that no function calls (seen with a tied LM head in graphs from
  `torch.export`, whose decode and verify projections have the same structure). Lowered,
  it becomes kernels no rule schedules and no one runs.
- `drop_unused_kv_kernels` and `quantize_kv_cache` take kernels out of the KV cache's
  create call; TVM's kernels stay in the module, exported, unless removed here.
"""

from __future__ import annotations

import tvm
from tvm import relax


@tvm.transform.module_pass(opt_level=0, name="DropUnreachableFunctions")
def drop_unreachable_functions(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` without the functions its exported functions never reach."""
    by_name = {gv.name_hint: func for gv, func in mod.functions_items()}
    stack = [name for name, func in by_name.items()
             if isinstance(func, relax.Function) and (func.attrs or {}).get("global_symbol") is not None]
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
