"""Fail compilation if any kernel would run unscheduled.

Runs after the rules. A PrimFunc passes if a rule scheduled it (`tirx.is_scheduled`)
or if it was written as explicit loops by TVM's paged-KV-cache library (tagged
`ember.kernel_source` by the frontend). Anything else is a kernel no rule matched: an error naming it, so a
new operator shows up as a compile failure instead of a silent serial loop.
"""

from __future__ import annotations

import tvm

from ember.ir.module_utils import schedulable_kernels


@tvm.transform.module_pass(opt_level=0, name="CheckAllScheduled")
def check_all_scheduled(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Raise if a PrimFunc is neither scheduled nor library-written."""
    unscheduled = [gv.name_hint for gv, func in schedulable_kernels(mod)
                   if int((func.attrs or {}).get("tirx.is_scheduled", 0)) != 1]
    if unscheduled:
        raise RuntimeError(
            f"no ember schedule rule matched kernels {sorted(unscheduled)}; "
            "add a rule in schedules/ (or report this model to ember's issue tracker)"
        )
    return mod

