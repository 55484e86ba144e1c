"""The compile driver: model directory in, artifact directory out.

Wires the stages together and owns nothing else: frontend (import), ir_passes
(lower, with schedules), `tvm.compile` (codegen), weight conversion, manifest.
The artifact is assembled in a staging directory beside OUT and renamed into place
only when complete, so a failure or Ctrl-C never leaves a half artifact at OUT, and
OUT is replaced only if it is empty or an ember artifact (`ember.driver.artifact_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

import ember
from ember.core.errors import EmberError
from ember.core.machine import memory_limits
from ember.core.manifest import (
    FORMAT_VERSION,
    KV_QUANTIZATIONS,
    LIBRARY_NAME,
    PARAMS_DIR,
    PROMPT_END_INPUT,
    EntryArg,
    EntryFunction,
    LoraModule,
    LoraRecord,
    Manifest,
    object_arg,
    tensor_arg,
    write_manifest,
)
from ember.driver.artifact_dir import check_output_dir, replace_dir, staging_dir
from ember.driver.codegen import build_library, cross_linker
from ember.driver.convert import quantized_sources, write_params
from ember.driver.tvm_log import tvm_warnings_hidden
from ember.frontend import source as model_source
from ember.frontend.config import ModelConfig
from ember.frontend.gguf import conversion_summary
from ember.frontend.records import source_record
from ember.ir.attributes import KERNEL_SOURCE_ATTR, KV_CACHE_ATTR, ROPE_ATTR, VERIFY_TOKENS
from ember.ir.kv_cache import CREATE_ARGUMENTS, KV_ROWS, recorded_layer_windows
from ember.ir.quant_formats import FORMATS, QuantFormat
from ember.ir.tvmscript import stacks_from_linecache
from ember.ir.weight_recipes import get_recipes, weight_params
from ember.ir_passes import pipeline
from ember.ir_passes.add_lora_slots import ADAPTER_OP, SCALES_INPUT, SLOTS_INPUT, LoraSlots
from ember.ir_passes.memory_report import MemoryReport, memory_report
from ember.ir_passes.split_pipeline_stages import split_pipeline_stage, stage_layers
from ember.runtime.artifact import BUILT_FOR_FUNCTION, CONTEXT_FIELD, PARAM_TYPES_FUNCTION, built_for
from ember.schedules import amx_matmul
from ember.schedules.tuning import ScheduleSources, schedule_sources
from ember.schedules.tuning_db import TuningDatabase
from ember.targets.hardware import host_memory_bytes
from ember.targets.registry import TargetSpec, resolve_target

log = logging.getLogger("ember")

PAGE_SIZE = 16
# Bounds on the KV cache's shape options: TVM's paged cache keeps per-sequence tables of
# `max_batch` entries, and a prefill chunk sizes the planned workspace.
MAX_BATCH = 1024
MAX_PREFILL_CHUNK = 65536


@dataclass
class CompileOptions:
    """What to build; the defaults suit a laptop-class CPU."""

    target: str = "cpu"
    quantization: str | None = None  # None: the target's default (q0f16 on GPUs, q0f32 on CPUs)
    keep_embedding: bool = False
    keep_lm_head: bool = False
    float_activations: bool = False  # decode keeps float activations even where the CPU has an int8 dot
    prefill_chunk: int = 256
    max_batch: int = 8
    memory_budget: int | None = None  # None: most of a GPU target's memory; on CPUs see `_memory_budget`
    tuning_db: Path | None = None  # a directory written by `ember tune` on this machine
    frontend: str = "builtin"  # a checkpoint directory's importer: "builtin" (hand-written) or "torch-export"
    tokenizer_dir: Path | None = None  # an ONNX file's tokenizer and config.json (default: the file's directory)
    # "q8"/"f16": int8/float16 keys and values in the KV cache (CPU targets); None: the model's dtype
    kv_quant: str | None = None
    embeddings: bool = False  # the `embed` entry, for `ember serve`'s /v1/embeddings (Llama family, builtin frontend)
    pipeline_stages: int | None = None  # split the layers into this many stage artifacts (OUT/stage-i)
    lora: LoraSlots | None = None  # room for LoRA adapters that `ember serve --lora` loads
    show_progress: bool = True


@dataclass
class CompileResult:
    """What `compile_model` produced."""

    output_dir: Path
    manifest: Manifest
    memory: MemoryReport
    seconds: float
    schedules: ScheduleSources  # how many kernels were scheduled from tuning records, by the rules
    # The weights' conversion: [(parameter, dtype)] in graph order and each one's recipe, which
    # `convert.write_params` replays from the checkpoint (on a device without the compiler too).
    params: list[tuple[str, str]] = field(default_factory=list)
    recipes: dict[str, dict] = field(default_factory=dict)


def check_sizes(prefill_chunk: int, max_batch: int) -> None:
    """Refuse a --prefill-chunk or --max-batch outside what the kernels are built for (compile's and tune's)."""
    if not 1 <= prefill_chunk <= MAX_PREFILL_CHUNK:
        raise EmberError(f"--prefill-chunk {prefill_chunk}: must be between 1 and {MAX_PREFILL_CHUNK}")
    if not 1 <= max_batch <= MAX_BATCH:
        raise EmberError(f"--max-batch {max_batch}: must be between 1 and {MAX_BATCH}")


@stacks_from_linecache()
def compile_model(model_dir: Path, output_dir: Path, options: CompileOptions,
                  dump_ir: Path | None = None) -> CompileResult:
    """Compile `model_dir`, a Hugging Face checkpoint directory or a GGUF file, into an artifact at `output_dir`;
    with `dump_ir`, the module as TVMScript before and after each phase of the pipeline goes there."""
    start = time.perf_counter()
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    target = resolve_target(options.target)
    types_as_stored = options.quantization is None  # a GGUF file's weights keep their own types
    options = _with_defaults(options, target, model_dir)
    cross_linker(target)  # a missing cross toolchain is refused before any work
    if options.quantization not in FORMATS:
        raise EmberError(f"--quant {options.quantization!r} is not supported; choose one of {', '.join(FORMATS)}")
    check_sizes(options.prefill_chunk, options.max_batch)
    _check_kv_quant(options, target)
    _check_lora(options, target)
    check_pipeline_options(options)
    check_output_dir(output_dir)
    tuning = TuningDatabase.for_compiling(options.tuning_db) if options.tuning_db is not None else None
    quantization = FORMATS[options.quantization]
    model_dtype = quantization.dtype

    with staging_dir(output_dir) as staging:
        stage = _stage_printer(options.show_progress, start)
        stage(f"importing {model_dir}")
        imported = model_source.import_model(model_dir, target.target, model_dtype, frontend=options.frontend,
                                             tokenizer_dir=options.tokenizer_dir, embeddings=options.embeddings)
        mod = pipeline.with_entries(imported.mod, target)
        build = _Build(imported, target, options, model_dir, types_as_stored, tuning, quantization, stage)
        if options.pipeline_stages is None:
            built = build.artifact(mod, staging, dump_ir)
        else:
            built = _build_pipeline(build, mod, staging, dump_ir)
        replace_dir(staging, output_dir)
    manifest, memory, schedules, params, recipes = built
    return CompileResult(output_dir, manifest, memory, time.perf_counter() - start, schedules, params, recipes)


@dataclass
class _Build:
    """What building one artifact from an imported module needs beyond the module (one per compile)."""

    imported: Any
    target: TargetSpec
    options: CompileOptions
    model_dir: Path
    types_as_stored: bool
    tuning: TuningDatabase | None
    quantization: QuantFormat
    stage: Callable[..., None]

    def artifact(self, mod: tvm.IRModule, staging: Path, dump_ir: Path | None,
                 pipeline_stage: dict[str, Any] | None = None) -> tuple:
        """Lower, build and convert `mod` into the artifact directory `staging`; (manifest, memory, schedules,
        params, recipes)."""
        imported, target, options, model_dir, stage = self.imported, self.target, self.options, self.model_dir, \
            self.stage
        model_dtype = self.quantization.dtype
        config = _attention_as_built(mod, imported.config)
        # A prefill chunk's new tokens attend to each other causally, windowed layers or not (TVM's runtime has one
        # kernel for them): no longer than the window, none of them falls out of another's.
        prefill_chunk = min(options.prefill_chunk, config.context_window, config.sliding_window or MAX_PREFILL_CHUNK)
        tensor_formats = model_source.stored_formats(imported) if self.types_as_stored else {}

        stage(f"lowering and scheduling for {target.describe()}")
        lower_options = pipeline.LowerOptions(self.quantization, prefill_chunk, options.max_batch,
                                              options.keep_embedding, options.keep_lm_head, self.tuning,
                                              int8_activations=not options.float_activations,
                                              tensor_formats=tensor_formats, kv_quant=options.kv_quant,
                                              lora=options.lora)
        with tvm_warnings_hidden():
            lowered = pipeline.lower(mod, target, lower_options, dump_ir)
        schedules = schedule_sources(lowered)
        recipes = get_recipes(lowered)
        quantized = quantized_sources(recipes)
        source = source_record(imported, quantized)
        for line in conversion_summary(source.get("conversion", {})):  # shown even with --no-progress
            (stage if options.show_progress else log.warning)(f"GGUF weights: {line}")
        kv_bytes_per_token = _kv_bytes_per_token(config, model_dtype, options.kv_quant)
        memory = memory_report(lowered, kv_bytes_per_token, config.context_window)
        budget = _memory_budget(options, target, memory)
        if budget is not None and memory.max_context(budget) < 1:
            whose = ("--memory-budget" if options.memory_budget else
                     "half of this machine's memory (the default where the whole KV cache does not fit it)")
            raise EmberError(
                f"{whose}, {budget} bytes, does not hold the weights ({memory.weight_bytes} bytes) and workspace "
                f"({memory.peak_workspace_bytes} bytes); give a larger --memory-budget or a smaller --quant"
            )
        options = dataclasses.replace(options, memory_budget=budget)

        stage("generating code")
        weights = weight_params(lowered["decode"])
        params = [(p.name, str(p.ty.dtype)) for p in weights]
        manifest = _manifest(imported, config, target, options, prefill_chunk, params, memory, model_dir, source,
                             activations(lowered), _long_factors_above(lowered))
        manifest.param_types = {p.name: {"shape": [int(n) for n in p.ty.shape], "dtype": str(p.ty.dtype)}
                                for p in weights}
        manifest.lora = _lora_record(options.lora, recipes, manifest.param_types)
        _add_json_function(lowered, PARAM_TYPES_FUNCTION, manifest.param_types)
        _add_json_function(lowered, BUILT_FOR_FUNCTION, {**built_for(manifest), CONTEXT_FIELD: config.context_window})
        staging.mkdir(exist_ok=True)
        if build_library(lowered, target, staging / LIBRARY_NAME):
            stage("copied the library built before from an equal module (EMBER_LIBRARY_CACHE=0 builds it anew)",
                  detail=True)
        stage(f"converting weights to {_formats_used(quantized, options.quantization)}")
        # Adapter slots are the runtime's to allocate (`manifest.lora`): no bytes of theirs in the shards.
        stored = [(name, dtype) for name, dtype in params if recipes[name]["op"] != ADAPTER_OP]
        write_params(stored, recipes, imported.weights, staging / PARAMS_DIR, options.show_progress)
        for path in imported.tokenizer_files:
            shutil.copyfile(path, staging / path.name)
        if pipeline_stage is not None:
            manifest.pipeline_stage = pipeline_stage
            manifest.entry_functions = _stage_entries(manifest.entry_functions, pipeline_stage)
        write_manifest(staging, manifest)
        return manifest, memory, schedules, params, recipes


def _build_pipeline(build: _Build, mod: tvm.IRModule, staging: Path, dump_ir: Path | None) -> tuple:
    """Each stage of `mod` (`--pipeline-stages`) as an artifact in `staging`/stage-i, then the pipeline's manifest
    naming them, which seals every stage's files; the first stage's (manifest, memory, schedules, params, recipes)."""
    count = build.options.pipeline_stages
    config = _attention_as_built(mod, build.imported.config)
    _check_pipeline_stages(count, config, _long_factors_above(mod))
    hidden = config.hidden_size
    ranges = stage_layers(config.num_hidden_layers, count)
    names = [f"stage-{index}" for index in range(count)]
    results = []
    for index, (name, layers) in enumerate(zip(names, ranges)):
        build.stage(f"stage {index + 1} of {count}: layers {layers[0]}..{layers[1] - 1}")
        stage_mod = split_pipeline_stage(mod, layers, hidden)
        description = {"index": index, "count": count, "layers": list(layers),
                       "input": "token_ids" if index == 0 else "hidden",
                       "output": "logits" if index == count - 1 else "hidden", "hidden_size": hidden}
        results.append(build.artifact(stage_mod, staging / name, dump_ir and dump_ir / name, description))
    manifests = [result[0] for result in results]
    whole = dataclasses.replace(
        manifests[-1], model=config.to_json(), entry_functions={}, params=[], param_types={},
        kv_cache={**manifests[-1].kv_cache, "num_layers": config.num_hidden_layers},
        memory=_pipeline_memory([m.memory for m in manifests]), pipeline_stage=None,
        pipeline={"stages": names, "layers": [list(layers) for layers in ranges], "hidden_size": hidden})
    write_manifest(staging, whole)
    return (whole, *results[0][1:])


def _stage_entries(entries: dict[str, EntryFunction], stage: dict[str, Any]) -> dict[str, EntryFunction]:
    """A stage's entry functions: a later stage takes float32 `hidden` [.., n, hidden_size] in place of `input_ids`
    [.., n]; all but the last give `hidden` of their input's positions in place of logits."""
    described: dict[str, EntryFunction] = {}
    for function, entry in entries.items():
        inputs, outputs = entry["inputs"], entry.get("outputs")
        if not inputs or outputs is None or inputs[0]["name"] != "input_ids":
            described[function] = entry
            continue
        hidden = tensor_arg("hidden", [*inputs[0].get("shape", []), stage["hidden_size"]], "float32")
        first = inputs[0] if stage["input"] == "token_ids" else hidden
        last = outputs[0] if stage["output"] == "logits" else hidden
        described[function] = {**entry, "inputs": [first, *inputs[1:]], "outputs": [last, *outputs[1:]]}
    return described


def _pipeline_memory(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The memory of the whole pipeline: its stages' weights and KV cache added, the largest workspace."""
    return {"weight_bytes": sum(m["weight_bytes"] for m in stages),
            "expert_weight_bytes": sum(m["expert_weight_bytes"] for m in stages),
            "active_weight_bytes": sum(m["active_weight_bytes"] for m in stages),
            "kv_bytes_per_token": sum(m["kv_bytes_per_token"] for m in stages),
            "context_window": stages[0]["context_window"],
            "peak_workspace_bytes": max(m["peak_workspace_bytes"] for m in stages), "workspace_bytes": {}}


def check_pipeline_options(options: CompileOptions) -> None:
    """Refuse, before any work, a --pipeline-stages below 1 or with an option a split model cannot have."""
    count = options.pipeline_stages
    if count is None:
        return
    if count < 1:
        raise EmberError(f"--pipeline-stages {count}: must be at least 1 (the number of stages to split the "
                         "model's layers into)")
    if options.embeddings:
        raise EmberError(f"--pipeline-stages {count} cannot be combined with --embeddings: the embed entry's "
                         "final norm is on the last stage; compile the embedding model whole")
    if options.kv_quant:
        raise EmberError(f"--pipeline-stages {count} cannot be combined with --kv-quant: the quantized KV cache "
                         "is not split by layers")


def _check_pipeline_stages(count: int, config: ModelConfig, long_factors_above: int | None) -> None:
    """Refuse a --pipeline-stages the model cannot be split into: more stages than layers, a sliding window,
    longrope (whose keys are computed again from the tokens when a sequence passes its switch)."""
    if count > config.num_hidden_layers:
        raise EmberError(f"--pipeline-stages {count}: the model has {config.num_hidden_layers} layers; give at most "
                         f"{config.num_hidden_layers} stages")
    if config.sliding_window:
        raise EmberError(f"--pipeline-stages {count}: the model attends through a sliding window of "
                         f"{config.sliding_window} tokens, which a pipeline's stages do not support")
    if long_factors_above is not None:
        raise EmberError(f"--pipeline-stages {count}: the model's longrope factors switch when a sequence passes "
                         f"{long_factors_above} tokens, computing its keys again from its tokens, which a pipeline's "
                         "stages do not support")


def _add_json_function(lowered: tvm.IRModule, name: str, data: dict[str, Any]) -> None:
    """Add to `lowered` a function `name` returning `data` as JSON: what the library was built for, which the loader
    compares with the manifest (`PARAM_TYPES_FUNCTION`: the weights' shapes and dtypes; `BUILT_FOR_FUNCTION`: the
    formats and sizes its kernels assume, `built_for`). A library of another artifact, or a manifest edited and
    resealed, is refused at load rather than failing in a kernel or computing with sizes the kernels were not built
    for."""
    text = tvm.ir.StringImm(json.dumps(data, sort_keys=True))
    func = relax.Function([], relax.SeqExpr([], text), tvm.ir.StringType())
    lowered[name] = func.with_attr("global_symbol", name)


def _attention_as_built(mod: tvm.IRModule, config: ModelConfig) -> ModelConfig:
    """`config` with the KV cache's shape as the graph built it (`KV_CACHE_ATTR`), which the manifest, the memory
    report and `ember analyze` read. The same values for ember's own definitions; for an imported graph, the
    attention found in it, the authority where a family names its sizes its own way (Falcon's `multi_query`) or
    a file has no config of them (ONNX)."""
    built = mod.attrs[KV_CACHE_ATTR]
    windows = recorded_layer_windows(mod)
    return dataclasses.replace(
        config, num_hidden_layers=int(built["num_layers"]), num_attention_heads=int(built["num_heads"]),
        num_key_value_heads=int(built["num_kv_heads"]), head_dim=int(built["head_dim"]),
        sliding_window=max(windows, default=0) or None, layer_windows=windows)


def _check_lora(options: CompileOptions, target: TargetSpec) -> None:
    """Refuse adapter slots this compile cannot build: a rank or slot count below 1, a GPU target, a float16
    model, a split model."""
    lora = options.lora
    if lora is None:
        return
    if lora.rank < 1 or lora.slots < 1:
        raise EmberError(f"--lora-rank {lora.rank} --lora-slots {lora.slots}: both must be at least 1")
    if not lora.targets:
        raise EmberError("--lora-targets: name at least one projection (e.g. q_proj,v_proj)")
    if target.is_gpu:
        raise EmberError(f"--lora-rank: the adapter kernel is a CPU kernel; {target.describe()} is a GPU target")
    if FORMATS[options.quantization].dtype != "float32":
        raise EmberError(f"--lora-rank: --quant {options.quantization} computes in "
                         f"{FORMATS[options.quantization].dtype}; adapters are added to float32 projections "
                         "(--quant q0f32, q8f32 or q4f32)")
    if options.pipeline_stages is not None:
        raise EmberError("--lora-rank cannot be combined with --pipeline-stages: adapters are not split by layers")


def _lora_record(lora: LoraSlots | None, recipes: dict[str, dict],
                 param_types: dict[str, dict[str, Any]]) -> LoraRecord | None:
    """The manifest's `lora` field: where each targeted module's adapters lie, from the adapter stacks' recipes."""
    if lora is None:
        return None
    modules: dict[str, LoraModule] = {}
    for a, recipe in recipes.items():
        if recipe["op"] == ADAPTER_OP and recipe["part"] == "A":
            b = a.removesuffix("lora_A") + "lora_B_t"
            for member in recipe["members"]:
                modules[member["module"]] = {"a": a, "b": b, "a_row": member["a_row"], "b_column": member["b_column"],
                                             "input": param_types[a]["shape"][2], "output": member["output"]}
    return {"rank": lora.rank, "slots": lora.slots, "modules": modules}


def _check_kv_quant(options: CompileOptions, target: TargetSpec) -> None:
    """Refuse a --kv-quant this compile cannot build: an unknown one, a GPU target, a float16 model."""
    if options.kv_quant is None:
        return
    if options.kv_quant not in KV_QUANTIZATIONS:
        raise EmberError(f"--kv-quant {options.kv_quant!r} is not supported; choose {', '.join(KV_QUANTIZATIONS)}")
    if target.is_gpu:
        raise EmberError(f"--kv-quant {options.kv_quant}: the quantized KV cache's kernels are CPU kernels; "
                         f"{target.describe()} is a GPU target")
    if FORMATS[options.quantization].dtype != "float32":
        raise EmberError(f"--kv-quant {options.kv_quant}: --quant {options.quantization} computes in "
                         f"{FORMATS[options.quantization].dtype}; the {options.kv_quant} KV cache is built for float32 "
                         "models")


def _kv_bytes_per_token(config: ModelConfig, model_dtype: str, kv_quant: str | None) -> int:
    """Bytes the KV cache holds per token: keys and values of every layer, in the model's dtype or as packed rows."""
    if kv_quant:
        return KV_ROWS[kv_quant](config.num_attention_heads, config.num_key_value_heads,
                                 config.head_dim).bytes_per_token(config.num_hidden_layers)
    return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
            * tvm.runtime.DataType(model_dtype).bits // 8)


def _stage_printer(show: bool, start: float) -> Callable[..., None]:
    """Announces each stage of a compile on stderr with the seconds since it began (logged under `-v` if not shown);
    with `detail=True`, a line about the stage announced last, indented under it."""

    def stage(what: str, detail: bool = False) -> None:
        if show:
            print(f"{'':10}{what}" if detail else f"[{time.perf_counter() - start:5.1f} s] {what}", file=sys.stderr,
                  flush=True)
        else:
            log.info("%s", what)

    return stage


def _memory_budget(options: CompileOptions, target: TargetSpec, memory: MemoryReport) -> int | None:
    """The budget the KV cache is sized by: the user's or the target's; for a CPU without one,
    half of this machine's memory where the whole cache (`--max-batch` full contexts) would not
    fit in it (a config may claim a context of 10**12 tokens), else None: no bound needed. The memory
    is the least of the physical memory and the room under this process's rlimits and cgroup limits."""
    if options.memory_budget is not None or target.is_gpu:
        return options.memory_budget
    host = min([n for n in (host_memory_bytes(), *(room for room, _ in memory_limits())) if n], default=0)
    whole = (memory.weight_bytes + memory.peak_workspace_bytes
             + options.max_batch * memory.context_window * memory.kv_bytes_per_token)
    if not host or whole <= host:
        return None
    budget = host // 2
    log.warning("the KV cache of %d sequences x %d tokens (%.3g GiB) does not fit this machine's memory "
                "(%.1f GiB); sized to half of it instead (choose with --memory-budget)",
                options.max_batch, memory.context_window, whole / 2**30, host / 2**30)
    return budget


def _with_defaults(options: CompileOptions, target: TargetSpec, model: Path) -> CompileOptions:
    """`options` with what was left open filled in: the quantization (a GGUF file's own, else the
    target's) and the target's memory budget."""
    return dataclasses.replace(
        options,
        quantization=options.quantization or model_source.default_quantization(model, target.default_quantization),
        memory_budget=options.memory_budget or target.default_memory_budget,
    )


def _formats_used(quantized: dict[str, QuantFormat], quantization: str) -> str:
    """The formats the weights are stored in (`quantized`: checkpoint tensor -> its format): `quantization`,
    or each of a mixed file's."""
    used = sorted({fmt.name for fmt in quantized.values()})
    return ", ".join(used) if len(used) > 1 else quantization


def activations(lowered: tvm.IRModule) -> str:
    """"int8" if the projections quantize their activations (`schedules/int8_matmul.py`, `amx_matmul.py`), else
    "float"."""
    sources = {str((func.attrs or {}).get(KERNEL_SOURCE_ATTR, "")) for _, func in lowered.functions_items()}
    return "int8" if sources & set(amx_matmul.INT8_KERNEL_SOURCES) else "float"


def _long_factors_above(lowered: tvm.IRModule) -> int | None:
    """Longrope's switch (`ember.ir_passes.longrope_choice`): the sequence length past which the graph rotates with
    the long factors, where prefill and verify take the prompt's end; None for other models."""
    switch = dict((lowered.attrs or {}).get(ROPE_ATTR, {})).get("long_factors_above")
    return None if switch is None else int(switch)


def _adapter_inputs(lora: LoraSlots | None, tokens: str) -> list[EntryArg]:
    """The entries' inputs naming each token's adapter slot and scale, in an artifact with adapter slots."""
    if lora is None:
        return []
    return [tensor_arg(SLOTS_INPUT, [tokens], "int32"), tensor_arg(SCALES_INPUT, [tokens], "float32")]


def _manifest(imported, config, target, options, prefill_chunk, params, memory, model_dir, source,
              activations, long_factors_above: int | None) -> Manifest:
    max_context = memory.max_context(options.memory_budget) if options.memory_budget else config.context_window
    # The runtime allocates the whole KV cache up front: max_batch full contexts, or
    # what the budget holds if that is less.
    kv_tokens = (memory.kv_capacity(options.memory_budget, options.max_batch) if options.memory_budget
                 else options.max_batch * config.context_window)
    ends = [tensor_arg(PROMPT_END_INPUT, [1], "int32")] if long_factors_above is not None else []
    adapters = {tokens: _adapter_inputs(options.lora, tokens) for tokens in ("seq_len", "batch_size", "n")}
    cache = object_arg("kv_cache")
    switch = {"long_factors_above": long_factors_above} if long_factors_above is not None else {}
    return Manifest(
        format_version=FORMAT_VERSION,
        ember_version=ember.__version__,
        tvm_version=tvm.__version__,
        model=config.to_json(),
        quantization=options.quantization,
        kept_float={"embedding": options.keep_embedding, "lm_head": options.keep_lm_head},
        activations=activations,
        model_dtype=imported.model_dtype,
        target=target.to_json(),
        entry_functions={
            "prefill": {"inputs": [tensor_arg("input_ids", [1, "seq_len"], "int32"),
                                   tensor_arg("logit_positions", ["num_logits"], "int32"), *ends,
                                   *adapters["seq_len"], cache],
                        "outputs": [tensor_arg("logits", [1, "num_logits", "vocab"], "float32"), cache]},
            "decode": {"inputs": [tensor_arg("input_ids", ["batch_size", 1], "int32"), *adapters["batch_size"], cache],
                       "outputs": [tensor_arg("logits", ["batch_size", 1, "vocab"], "float32"), cache]},
            "verify": {"inputs": [tensor_arg("input_ids", [1, "n"], "int32"), *ends, *adapters["n"], cache],
                       "outputs": [tensor_arg("logits", [1, "n", "vocab"], "float32"), cache],
                       # Like a prefill chunk, no more tokens than a window.
                       "max_tokens": min(VERIFY_TOKENS, config.sliding_window or VERIFY_TOKENS)},
            **({"embed": {"inputs": [tensor_arg("input_ids", [1, "seq_len"], "int32"), *adapters["seq_len"], cache],
                          "outputs": [tensor_arg("hidden", [1, "seq_len", "hidden_size"], "float32"), cache]}}
               if options.embeddings else {}),
            "create_paged_kv_cache": {"inputs": [object_arg(name) for name in CREATE_ARGUMENTS]},
        },
        kv_cache={
            "kind": "tir_paged",
            "page_size": PAGE_SIZE,
            "prefill_chunk": prefill_chunk,
            "max_batch": options.max_batch,
            "max_context": max_context,
            "max_total_tokens": kv_tokens,
            "memory_budget": options.memory_budget,
            "num_layers": config.num_hidden_layers,
            "num_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "dtype": imported.model_dtype,
            "sliding_window": config.sliding_window,
            "rope": {"theta": config.rope_theta, "scaling": config.rope_scaling, **switch},
            "quantization": options.kv_quant,
        },
        params=[name for name, _ in params],
        memory=memory.to_json(),
        source=str(model_dir.resolve()),
        source_weights=source,
    )
