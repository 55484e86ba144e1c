"""Mark every PrimFunc of a CPU module `tirx.noalias`, so that LLVM may keep register tiles in registers.

Matches the PrimFuncs that lack `tirx.noalias` (TVM's paged KV cache kernels that ember
does not replace: page copies, state merging, the sliding-window variants where a model
has a window; and the VM's shape functions) and sets it; rewrites nothing else.

Why: TVM 0.27's LLVM code generator applies one function's `tirx.noalias` to the whole
module: observed, every kernel of a module is compiled as the function whose name sorts
last says (with `NT_matmul7` and a page-copy kernel without the attribute, the matmul
loses `noalias` when the copy is named `zz_copy`, keeps it when named `AA_copy`). In a
model that function is one of the KV cache's kernels, which have none (it was
`tree_attn_paged_kv_cpu` when it was measured), so every kernel lost it: its
`<name>_compute_` function (pointer arguments `noalias`) is inlined into the packed
wrapper and all buffers share one alias class, so LLVM must assume that the
matmul's accumulator tile (a workspace buffer) may alias the activations it reads. It
stores all eight accumulators after every FMA and reloads the activation vector for
each: a float32 1B Llama's 128-token prefill ran its GEMMs at 60 GF/s instead of the
115 GF/s the same kernels reach compiled alone (Zen 3, 2 threads).

The invariant kept: none of these kernels is called with two overlapping buffers where
one is written. Their written buffers are the cache's pages (each kernel takes the page
array once) or output and merge-state arrays the cache allocates apart from its inputs;
the shape functions take one heap. GPU modules are left alone (not measured there).
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ember.ir.module_utils import replace_functions

NOALIAS_ATTR = "tirx.noalias"


@tvm.transform.module_pass(opt_level=0, name="NoaliasKernels")
def noalias_kernels(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every PrimFunc of `mod` with `tirx.noalias` set."""
    updates = {
        gv.name_hint: func.with_attr(NOALIAS_ATTR, True)
        for gv, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get(NOALIAS_ATTR))
    }
    return replace_functions(mod, updates) if updates else mod
