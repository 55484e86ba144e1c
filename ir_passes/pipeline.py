"""The compilation pipeline, as phases chosen by the target.

Read top to bottom, this is everything that happens to a model between the
frontend and `tvm.compile`'s code generation:

1. graph passes: model-level rewrites that may change parameters (their weight
   recipes change with them) and bounds for memory planning.
2. legalization: Relax operators become TIR PrimFuncs; neighbours are fused.
3. scheduling: every PrimFunc gets a schedule for the target (`schedules/`).
4. dataflow lowering and memory planning: static buffers sized by the bounds;
   on CUDA, decode's kernel runs captured as CUDA graphs.
5. finalization: VM-level lowering.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ember.ir_passes.attach_sequence_bounds import attach_sequence_bounds
from ember.ir_passes.capture_cuda_graphs import capture_cuda_graphs
from ember.ir_passes.fuse_parallel_projections import fuse_parallel_projections
from ember.schedules import schedule_passes
from ember.targets.registry import TargetSpec


def graph_passes(target: TargetSpec, prefill_chunk: int, max_batch: int) -> list[tvm.transform.Pass]:
    """Model-level rewrites on Relax operators, before any lowering."""
    return [
        # q/k/v and gate/up become one projection each: fewer, wider GEMVs.
        fuse_parallel_projections,
        attach_sequence_bounds(prefill_chunk, max_batch),
    ]


def legalize_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """Relax operators to TIR, then operator fusion."""
    return [
        # matmul(x, permute_dims(W)) -> one NT_matmul reading W row-major: no transpose
        # kernel, and the GEMV's reduction runs along contiguous memory.
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        # Elementwise producers/consumers (norm scaling, SiLU*up, residual adds) fuse
        # into their neighbours so each activation is written once.
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]


def dataflow_lower_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """Leave the dataflow form; calls become destination-passing."""
    return [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
    ]


def memory_planning_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """Static memory planning within the bounds attached by the graph passes."""
    return [relax.transform.StaticPlanBlockMemory()] + cuda_graph_passes(target)


def cuda_graph_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """On CUDA, decode's kernels replayed from graphs captured per batch size (needs static storage)."""
    return [capture_cuda_graphs] if target.cuda_graph else []


def finalize_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """Lower to what the Relax VM executes."""
    return [
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def lower(mod: tvm.IRModule, target: TargetSpec, prefill_chunk: int, max_batch: int) -> tvm.IRModule:
    """Run every phase; the result goes to `tvm.compile(..., relax_pipeline=None)`."""
    passes = (
        graph_passes(target, prefill_chunk, max_batch)
        + legalize_passes(target)
        + schedule_passes(target)
        + dataflow_lower_passes(target)
        + memory_planning_passes(target)
        + finalize_passes(target)
    )
    with target.target:
        return tvm.transform.Sequential(passes, name="ember")(mod)
