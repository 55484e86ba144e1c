"""`ember compile`: a model into an artifact directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from ember.cli.options import (
    EXAMPLES,
    add_graph_arguments,
    checkpoint_dir,
    mib,
    name_list,
    parse_bytes,
)
from ember.core.errors import EmberError
from ember.core.manifest import KV_QUANTIZATIONS

COMPILE_DETAILS = """
A GGUF file's tensors keep their types: Q8_0/Q4_0/Q4_1 weights as stored, K-quants
re-quantized to the closest format with at least their bits and the error printed. An ONNX
file's forward takes input_ids and returns the logits of every position.

TARGET is `cpu` (this machine, the default); an aarch64 Linux board (raspberry-pi-5,
rk3588, jetson-orin-cpu, graviton3, or `aarch64` for any ARMv8.2-A CPU with dotprod;
cross-linked with aarch64-linux-gnu-g++); a TVM target JSON object or file for another CPU,
e.g. '{"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 8}'; `cuda:ARCH` (cuda:sm_80,
cuda:sm_90a, ...; compiles without a GPU); `cuda:DEVICE` (a GPU preset such as cuda:h100,
cuda:l4); `cuda` (this machine's GPU); or `opencl`.
"""

COMPILE_CACHES = """
Parsed kernels, built libraries and torch.export's traces are kept in ~/.cache/ember/
(kernels/, libraries/ up to 2 GiB, traced/): compiling a model of the same architecture,
quantization, sizes and target again, with these or other weights, copies its library
instead of generating code, and another --quant of a --frontend torch-export checkpoint
takes the graph traced before. EMBER_KERNEL_CACHE=0, EMBER_LIBRARY_CACHE=0 and
EMBER_TRACE_CACHE=0 turn them off.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember compile` and its options."""
    from ember.ir.quant_formats import FORMATS  # numpy: once main has started

    parser = subparsers.add_parser(
        "compile", help="compile a model into an artifact directory",
        description="Compile a Hugging Face checkpoint, a GGUF file (llama.cpp's format) or an ONNX file into a "
                    "deployable artifact.",
        epilog=EXAMPLES + COMPILE_DETAILS + COMPILE_CACHES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint directory, a .gguf file, an .onnx file (see --tokenizer) or `demo` "
                                      "for the bundled demo model (see MODEL below)")
    parser.add_argument("-o", "--output", required=True, type=Path, help="artifact directory to write")
    parser.add_argument("--target", default="cpu",
                        help="`cpu` (this machine, default), an aarch64 board such as raspberry-pi-5, a TVM target "
                             "JSON object or file, `cuda:ARCH`, `cuda:DEVICE`, `cuda` or `opencl` (see TARGET below)")
    parser.add_argument("--quant", default=None, metavar="FORMAT",
                        help="weight format of every weight (default: a GGUF file's own per tensor, else q0f32 "
                             "on CPUs, q0f16 on GPUs), with its bits per weight: "
                             + ", ".join(f"{fmt.name} ({fmt.bits_per_weight:g})" for fmt in FORMATS.values()))
    add_graph_arguments(parser)
    _add_weight_arguments(parser)
    _add_cache_arguments(parser)
    _add_lora_arguments(parser)
    parser.add_argument("--tuning-db", type=Path, metavar="DIR",
                        help="apply the records `ember tune` wrote on this machine; the rules schedule the rest")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--dump-ir", type=Path, metavar="DIR",
                        help="write the module as TVMScript before the pipeline (00-imported.py) and after each of "
                             "its phases (01-imported-graph.py ... 08-finalize.py) to DIR, a new or empty directory")
    return parser


def _add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-embedding", action="store_true",
                        help="leave the token embedding in the compute dtype (quantized formats only)")
    parser.add_argument("--keep-lm-head", action="store_true",
                        help="leave the output projection in the compute dtype (quantized formats only); "
                             "a tied embedding is kept if either flag is given")
    parser.add_argument("--float-activations", action="store_true",
                        help="q8f32/q4f32: keep the projections' activations in float. By default, on CPUs with "
                             "an int8 dot product (AVX2 and up, ARM dotprod), they are rounded to int8 per group of "
                             "32, as llama.cpp does, and multiplied in integers, which is faster")


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-rank", type=int, default=None, metavar="R",
                        help="leave room for LoRA adapters of rank up to R, which `ember serve --lora` loads and "
                             "each request picks (float32 compute: --quant q0f32, q8f32 or q4f32; CPU targets)")
    parser.add_argument("--lora-slots", type=int, default=4, metavar="N",
                        help="with --lora-rank: adapters loaded at once (default 4)")
    parser.add_argument("--lora-targets", type=name_list, default=None, metavar="NAMES",
                        help="with --lora-rank: the projections adapters may change, by module name as PEFT's "
                             "target_modules (default q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")


def _add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-quant", choices=KV_QUANTIZATIONS, default=None,
                        help="float32 models on CPU targets: store the KV cache packed, for longer contexts in the "
                             "same memory: q8 (int8, scaled per token and head: ~0.27x the bytes) or f16 (0.5x, "
                             "closer to float32's logits than q8). Default: the model's dtype")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="largest number of prompt tokens per prefill call (default 256)")
    parser.add_argument("--embeddings", action="store_true",
                        help="also compile the embed function, which `ember serve` answers /v1/embeddings with "
                             "(Llama-family checkpoint directories; it shares prefill's kernels: little compile time)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="most sequences decoded together (default 8)")
    parser.add_argument("--pipeline-stages", type=int, default=None, metavar="K",
                        help="split the model by layers into K artifacts, OUT/stage-i, each with only its layers' "
                             "weights and KV cache, for `ember serve --ray` to run one per machine (docs/cluster.md); "
                             "K at most the layer count; not with --embeddings or --kv-quant")
    parser.add_argument("--memory-budget", type=parse_bytes,
                        help="memory for weights + workspace + KV cache, e.g. 4GB; sets the longest context "
                             "the artifact allows and the KV cache's size (default on GPUs: 90%% of its memory)")


def run(args: argparse.Namespace) -> int:
    """Compile MODEL into -o's directory and print what it holds."""
    from ember.core.writable import check_apart, check_writable
    from ember.driver.artifact_dir import check_output_dir

    model_dir = checkpoint_dir(args.model)
    check_output_dir(args.output)
    if args.dump_ir is not None:
        check_apart(args.output, "-o", args.dump_ir, "--dump-ir")
        _check_dump_dir(args.dump_ir)
        check_writable(args.dump_ir, "--dump-ir")
    if args.tuning_db is not None:
        check_apart(args.output, "-o", args.tuning_db, "--tuning-db")
    # The compiler takes seconds to import: only now that the paths are known good.
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.schedules.tuning import describe_schedule_sources

    options = CompileOptions(
        lora=_lora_slots(args),
        target=args.target,
        quantization=args.quant,
        keep_embedding=args.keep_embedding,
        keep_lm_head=args.keep_lm_head,
        frontend=args.frontend,
        tokenizer_dir=args.tokenizer,
        float_activations=args.float_activations,
        kv_quant=args.kv_quant,
        embeddings=args.embeddings,
        pipeline_stages=args.pipeline_stages,
        prefill_chunk=args.prefill_chunk,
        max_batch=args.max_batch,
        memory_budget=args.memory_budget,
        tuning_db=args.tuning_db,
        show_progress=not args.no_progress,
    )
    result = compile_model(model_dir, args.output, options, dump_ir=args.dump_ir)
    memory = result.memory
    print(f"compiled {model_dir} -> {result.output_dir} in {result.seconds:.1f} s")
    pipeline = result.manifest.pipeline
    if pipeline is not None:
        print("  stages: " + ", ".join(f"{name} (layers {begin}..{end - 1})"
                                       for name, (begin, end) in zip(pipeline["stages"], pipeline["layers"])))
        print(f"  {args.output}/stage-0 alone:")
    if args.tuning_db is not None:
        print(f"  {describe_schedule_sources(result.schedules)}")
    print(f"  weights {mib(memory.weight_bytes)}, KV cache {memory.kv_bytes_per_token / 1024:.1f} KiB/token, "
          f"planned workspace {mib(memory.peak_workspace_bytes)}")
    if memory.expert_weight_bytes:
        print(f"  experts {mib(memory.expert_weight_bytes)} of the weights; a decoded token reads "
              f"{mib(memory.active_weight_bytes)} of weights")
    kv = result.manifest.kv_cache
    if kv["memory_budget"]:
        print(f"  in a memory budget of {mib(kv['memory_budget'])}: KV cache of {kv['max_total_tokens']} tokens, "
              f"longest context {kv['max_context']} tokens")
    if args.dump_ir is not None:
        print(f"  the module after each phase of the pipeline: {args.dump_ir}")
    return 0


def _lora_slots(args: argparse.Namespace):
    """The adapter slots --lora-rank, --lora-slots and --lora-targets ask for, or None."""
    if args.lora_rank is None:
        if args.lora_targets is not None or args.lora_slots != 4:
            raise EmberError(f"{'--lora-targets' if args.lora_targets is not None else '--lora-slots'}: applies only "
                             "with --lora-rank R")
        return None
    from ember.ir_passes.add_lora_slots import DEFAULT_TARGETS, LoraSlots

    return LoraSlots(args.lora_rank, args.lora_slots, tuple(args.lora_targets or DEFAULT_TARGETS))


def _check_dump_dir(path: Path) -> None:
    """--dump-ir's DIR: new, or an empty directory (dumps of different builds are never mixed)."""
    if path.is_dir():
        if any(path.iterdir()):
            raise EmberError(f"--dump-ir {path}: the directory is not empty; give a new or empty one")
    elif path.exists() or path.is_symlink():
        raise EmberError(f"--dump-ir {path}: exists and is not a directory; give a new or empty one")
