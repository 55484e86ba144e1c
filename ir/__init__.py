"""The IR vocabulary frontends, passes and schedules share, below all three.

- `attributes`: the attribute names and symbolic sizes ember marks IR with.
- `weight_recipes`: how each model parameter is computed from checkpoint tensors.
- `quant_formats`: the quantized weight formats (packing, scales, the numpy reference).
- `kv_cache`: the paged KV cache every model attends through, and the tag on its kernels.
- `module_utils`: small helpers to read and rebuild IRModules.
- `tvmscript`: TVMScript parsed without scanning `sys.modules` for every frame, and each kernel once.
"""
