"""What a target is.

- `registry`: a compilation target — the TVM target plus the facts ember's passes
  and schedules choose by (device kind, SIMD width, cores; a GPU's architecture and
  the preset it is sized by). `resolve_target("cpu")` detects the host; a JSON TVM
  target dict (inline or a file) selects another CPU; `cuda:sm_90a` a CUDA GPU,
  compiled for without one; backends that cannot be built here are refused with
  what is missing.
- `hardware`: hardware descriptions (peak FLOP/s per dtype, bandwidth, memory) for
  `ember analyze`, as JSON presets or measured on the host.

Submodules are imported explicitly, so reading a hardware preset does not load TVM.
"""
