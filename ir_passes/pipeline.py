"""The compilation pipeline, as phases chosen by the target.

Read top to bottom, this is everything that happens to a model between the
frontend and `tvm.compile`'s code generation:

0. imported graphs: the `forward` an importer traced (torch.export, ONNX) loses a
   tracer's habits and becomes ember's entries over the paged KV cache; a module a
   frontend built with its entries passes through.
1. graph passes: model-level rewrites that may change parameters (their weight
   recipes change with them): projection fusion, weight quantization.
2. legalization: Relax operators become TIR PrimFuncs; neighbours are fused;
   functions and kernels get the bounds of their symbolic sizes.
3. scheduling: every PrimFunc gets a schedule for the target (`schedules/`), from
   a tuning database where one has a checked record, else from the rules; then, on
   CPUs, exp and sigmoid become polynomials that vectorize, and kernels scheduled to
   the same code become one.
4. dataflow lowering and memory planning: static buffers sized by the bounds;
   on CUDA, decode's kernel runs captured as CUDA graphs.
5. finalization: VM-level lowering; on CPUs every kernel marked `noalias` (TVM's LLVM
   code generation reads it from one function for the whole module).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tvm
from tvm import relax

from ember.ir.quant_formats import FORMATS, QuantFormat
from ember.ir_passes.add_lora_slots import LoraSlots, add_lora_slots
from ember.ir_passes.attach_sequence_bounds import attach_sequence_bounds
from ember.ir_passes.capture_cuda_graphs import capture_cuda_graphs
from ember.ir_passes.drop_unreachable_functions import drop_unreachable_functions
from ember.ir_passes.drop_unused_kv_kernels import drop_unused_kv_kernels
from ember.ir_passes.fold_permute_chains import fold_permute_chains
from ember.ir_passes.fold_split_concat import fold_split_concat
from ember.ir_passes.fuse_parallel_projections import fuse_parallel_projections
from ember.ir_passes.fuse_rms_norm import fuse_rms_norm
from ember.ir_passes.lower_moe import lower_moe
from ember.ir_passes.merge_equal_kernels import merge_equal_kernels
from ember.ir_passes.noalias_kernels import noalias_kernels
from ember.ir_passes.pack_float_panels import pack_float_panels
from ember.ir_passes.polynomial_exp import polynomial_exp
from ember.ir_passes.quantize_kv_cache import quantize_kv_cache
from ember.ir_passes.quantize_weights import quantize_weights
from ember.ir_passes.specialize_attention import specialize_attention
from ember.ir_passes.specialize_cpu_attention import specialize_cpu_attention
from ember.ir_passes.specialize_cpu_rope import specialize_cpu_rope
from ember.ir_passes.tidy_traced_graph import tidy_traced_graph
from ember.schedules import schedule_passes
from ember.schedules.tuning_db import TuningDatabase
from ember.targets.registry import TargetSpec


@dataclass(frozen=True)
class LowerOptions:
    """What the graph passes need to know beyond the target."""

    quantization: QuantFormat
    prefill_chunk: int
    max_batch: int
    keep_embedding: bool = False  # leave the embedding table in the compute dtype
    keep_lm_head: bool = False  # leave the output projection in the compute dtype
    tuning: TuningDatabase | None = None  # records from `ember tune` on this machine
    int8_activations: bool = True  # projections multiply int8 activations where the target has an int8 dot
    # Checkpoint tensor -> the name of its own format, in place of `quantization` (a GGUF file's per-tensor types).
    tensor_formats: Mapping[str, str] = field(default_factory=dict)
    # "q8"/"f16": the KV cache stores int8/float16 rows (`quantize_kv_cache`); None: the model's dtype.
    kv_quant: str | None = None
    lora: LoraSlots | None = None  # room for LoRA adapters chosen at serve time


def imported_graph_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """An imported full-sequence `forward` becomes the `prefill` / `decode` / `verify` entries."""
    return [
        # Views traced once per reader become one; empty slices (full-width partial rotary) go.
        tidy_traced_graph,
        # Mixture-of-experts blocks (router, gathered expert projections) become ember's MoE kernels.
        lower_moe(target.vector_bits),
        # Causal attention found in the graph is handed to the paged KV cache, built here for the target.
        specialize_attention(target.target),
    ]


def graph_passes(target: TargetSpec, options: LowerOptions) -> list[tvm.transform.Pass]:
    """Model-level rewrites on Relax operators, before any lowering."""
    tensor_formats = {name: FORMATS[fmt] for name, fmt in options.tensor_formats.items()}
    return [
        # The KV cache is handed no kernels for token trees, MLA, or sliding-window layers the model does not have.
        drop_unused_kv_kernels,
        # Transposes that cancel (an imported graph's head layouts meeting the cache's) go.
        fold_permute_chains,
        # An imported graph's RMSNorm, written out as elementwise operators, becomes one operator.
        fuse_rms_norm,
        # q/k/v and gate/up become one projection each: fewer, wider GEMVs.
        fuse_parallel_projections(tensor_formats),
        # With --lora-rank, each targeted projection (fused or not) adds its tokens' adapter terms in one kernel.
        *([add_lora_slots(options.lora, target.vector_bits)] if options.lora else []),
        # The fused q/k/v output, split and concatenated again for the KV cache: a reshape;
        # then chains of reshapes (heads views around attention) become one each.
        fold_split_concat,
        # With --kv-quant, the cache is created with ember's kernels for its rows and attention hands it q/k/v as words.
        *([quantize_kv_cache(target, options.kv_quant)] if options.kv_quant else []),
        relax.transform.RemoveRedundantReshape(),
        # After fusion, so a fused projection is packed as one weight.
        quantize_weights(options.quantization, options.keep_embedding, options.keep_lm_head,
                         target.int8_dot if options.int8_activations else None, target.vector_bits,
                         tensor_formats),
        # On CPUs, the weights left in float are stored as panels for the GEMM's outer-product tile.
        *([] if target.is_gpu else [pack_float_panels(target.vector_bits)]),
    ]


def legalize_passes(target: TargetSpec, options: LowerOptions) -> list[tvm.transform.Pass]:
    """Relax operators to TIR, then operator fusion; kernels learn their size bounds."""
    return [
        # matmul(x, permute_dims(W)) -> one NT_matmul reading W row-major: no transpose
        # kernel, and the GEMV's reduction runs along contiguous memory.
        relax.transform.FuseTransposeMatmul(),
        drop_unreachable_functions,  # what FuseTransposeMatmul and the KV cache passes leave behind
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        # Elementwise producers/consumers (norm scaling, SiLU*up, residual adds) fuse
        # into their neighbours so each activation is written once.
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
        # Bounds for memory planning, and for the schedules to tell GEMV from GEMM.
        attach_sequence_bounds(options.prefill_chunk, options.max_batch),
        # The KV cache's kernels are TVM's; on CPUs, its attention and rotary embedding become ember's.
        *([] if target.is_gpu else [specialize_cpu_attention(target), specialize_cpu_rope]),
    ]


def kernel_math_passes(target: TargetSpec) -> list[tvm.transform.Pass]:
    """On CPUs, exp and sigmoid (SiLU) become polynomials that vectorize instead of a libm call per element; then
    kernels whose schedules came out as the same code (copies made for different bounds) become one.

    After scheduling, so that `ember tune` and `ember analyze` (which read `to_kernels`) see
    the operators as the model wrote them, and the schedules match either way."""
    return ([] if target.is_gpu else [polynomial_exp]) + [merge_equal_kernels]


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
    ] + ([] if target.is_gpu else [noalias_kernels])  # after VMShapeLower, which adds shape functions


def with_entries(mod: tvm.IRModule, target: TargetSpec) -> tvm.IRModule:
    """Only the first phase: an imported graph's entries and KV cache, whose shape the compiler reads before
    lowering (`KV_CACHE_ATTR`); a module built with its entries is returned as it is."""
    with target.target:
        return tvm.transform.Sequential(imported_graph_passes(target))(mod)


def to_kernels(mod: tvm.IRModule, target: TargetSpec, options: LowerOptions) -> tvm.IRModule:
    """Only the graph and legalization phases: the unscheduled kernels, as `ember tune` sees them."""
    with target.target:
        return tvm.transform.Sequential(imported_graph_passes(target) + graph_passes(target, options)
                                        + legalize_passes(target, options))(mod)


def phases(target: TargetSpec, options: LowerOptions) -> list[tuple[str, list[tvm.transform.Pass]]]:
    """Every phase, in order: (name, passes)."""
    return [
        ("imported-graph", imported_graph_passes(target)),
        ("graph", graph_passes(target, options)),
        ("legalize", legalize_passes(target, options)),
        ("schedule", schedule_passes(target, options.tuning)),
        ("kernel-math", kernel_math_passes(target)),
        ("dataflow-lower", dataflow_lower_passes(target)),
        ("memory-planning", memory_planning_passes(target)),
        ("finalize", finalize_passes(target)),
    ]


def lower(mod: tvm.IRModule, target: TargetSpec, options: LowerOptions, dump_dir: Path | None = None) -> tvm.IRModule:
    """Run every phase; the result goes to `tvm.compile(..., relax_pipeline=None)`. With `dump_dir`, the module
    as TVMScript is written there before the first phase (`00-imported.py`) and after each (`01-<phase>.py`...)."""
    passes = [] if dump_dir is None else [dump_script(dump_dir, 0, "imported")]
    for number, (name, phase) in enumerate(phases(target, options), start=1):
        passes += phase
        if dump_dir is not None:
            passes.append(dump_script(dump_dir, number, name))
    with target.target:
        return tvm.transform.Sequential(passes, name="ember")(mod)


def dump_script(dump_dir: Path, number: int, phase: str) -> tvm.transform.Pass:
    """A pass that writes the module as TVMScript to `dump_dir`/NN-`phase`.py and leaves it unchanged."""
    @tvm.transform.module_pass(opt_level=0, name=f"dump_{phase.replace('-', '_')}")
    def dump(mod: tvm.IRModule, _context: tvm.transform.PassContext) -> tvm.IRModule:
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / f"{number:02d}-{phase}.py").write_text(mod.script(), encoding="utf-8")
        return mod

    return dump
