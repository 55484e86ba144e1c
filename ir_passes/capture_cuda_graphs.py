"""Replay decode's kernel launches from CUDA graphs, one graph set per batch size.

Matches the `decode` entry function of a module after static memory planning.
Marks its `batch_size` as a symbolic variable that graphs may be captured for
(`relax.rewrite_cuda_graph.capture_symbolic_vars`), then runs TVM's
`RewriteCUDAGraph` with `relax.backend.use_cuda_graph` on. That rewrite emits:

- `cuda_graph_alloc`: the planned static storages, allocated once on the first
  call and reused by every later one (of any entry function);
- `decode_cuda_graph_captureN`: each maximal run of kernels between two calls
  into the KV cache (attention is a packed runtime call, not capturable), called
  through `vm.builtin.cuda_graph.run_or_capture`, which captures the run the
  first time it sees a batch size and replays the graph after that.

Why: a decode step of a 1B-class model is some 130 kernels of a few to tens of
microseconds each; launching them one by one from the VM adds microseconds per
kernel, a large share of the step on a fast GPU. A graph replay is one launch per run.

Invariant: a captured run only reads weights (the same tensors every call) and
buffers in static storage, so replaying it with new contents is exact; inputs
that change address per call (the token ids) stay outside the graphs. Prefill is
not marked: its `seq_len` takes too many values to capture each.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ember.ir.attributes import BATCH_SIZE
from ember.ir.module_utils import replace_functions

CAPTURED_FUNCTION = "decode"
CAPTURED_VARS = [BATCH_SIZE]


@tvm.transform.module_pass(opt_level=0, name="CaptureCUDAGraphs")
def capture_cuda_graphs(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Mark decode's batch size capturable and lift its kernel runs into CUDA graphs."""
    decode = mod[CAPTURED_FUNCTION].with_attr("relax.rewrite_cuda_graph.capture_symbolic_vars", CAPTURED_VARS)
    mod = replace_functions(mod, {CAPTURED_FUNCTION: decode})
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        return relax.transform.RewriteCUDAGraph()(mod)
