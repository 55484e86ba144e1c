"""What a target is.

- `registry`: a compilation target — the TVM target plus the facts ember's passes
  and schedules choose by (device kind, SIMD width, cores). `resolve_target("cpu")`
  detects the host; a JSON TVM target dict (inline or a file) selects another CPU;
  backends that are not built yet are refused with the reason.
- `hardware`: hardware descriptions (peak FLOP/s per dtype, bandwidth, memory) for
  `ember analyze`, as JSON presets or measured on the host.

Submodules are imported explicitly, so reading a hardware preset does not load TVM.
"""
