"""The paged KV cache is handed no kernels for what ember's runtime never asks of it.

TVM's `TIRPagedKVCache` builds a kernel for every request its runtime could serve and
hands all of them to `create_paged_kv_cache`: attention over token trees (two kernels),
sliding-window prefill and decode, and MLA's append. ember's runtime decodes chains
(speculation verifies a chain of drafted tokens, never a tree), calls the sliding-window
kernels only where some layers have a window and others none (`CacheShape.window_pages`,
as recorded on the module), and builds no MLA model. This pass empties those slots of the
create call (an empty tuple, or null for MLA's append, as `quantize_kv_cache` hands its
packed cache); the runtime refuses a request that needs a missing kernel. The kernels, no
longer referenced, are then dropped by `drop_unreachable_functions`.

Why: they were compiled into every artifact, a fifth of the demo model's library.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ember.ir.kv_cache import (
    CREATE_FUNCTION,
    NEVER_CALLED_ATTENTION,
    SLIDING_WINDOW_ATTENTION,
    CreateArg,
    cache_window,
)
from ember.ir.module_utils import calls_packed


@tvm.transform.module_pass(opt_level=0, name="DropUnusedKVKernels")
def drop_unused_kv_kernels(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """The pass: the slots of kernels no request will need are emptied."""
    _window, sliding_slots = cache_window(mod)
    emptied = NEVER_CALLED_ATTENTION if sliding_slots else (*NEVER_CALLED_ATTENTION, *SLIDING_WINDOW_ATTENTION)
    rewriter = _EmptySlots(mod, emptied)
    updates = {gv: rewriter.visit_expr(func) for gv, func in mod.functions_items() if isinstance(func, relax.Function)}
    if not rewriter.rewritten:
        return mod
    return tvm.IRModule({gv: updates.get(gv, func) for gv, func in mod.functions_items()},
                        attrs=mod.attrs, global_infos=mod.global_infos)


@relax.expr_functor.mutator
class _EmptySlots(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, emptied: tuple[CreateArg, ...]) -> None:
        super().__init__(mod)
        self.emptied = emptied
        self.rewritten = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not calls_packed(call, CREATE_FUNCTION):
            return call
        args = list(call.args[1:])
        for index in self.emptied:
            args[index] = relax.Tuple([])
        args[CreateArg.APPEND_MLA] = relax.op.null_value()
        self.rewritten = True
        return relax.call_pure_packed(CREATE_FUNCTION, *args, ty_args=list(call.ty_args))
