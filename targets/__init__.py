"""What a compilation target is: a TVM target plus the facts ember's passes and
schedules choose by (device kind, SIMD width, core count).

`resolve_target("cpu")` detects the host; a JSON object (inline or a file path) with
a TVM target dict selects another CPU. Targets whose backend is not built yet are
refused here, with the reason, rather than failing deep inside TVM.
"""

from ember.targets.registry import TargetSpec, resolve_target

__all__ = ["TargetSpec", "resolve_target"]
