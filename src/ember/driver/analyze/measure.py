"""`ember analyze ARTIFACT --measure`: time every kernel of a compiled artifact on this
machine and place it on the measured `host` roofline, next to analyze's predictions.

1. What each kernel computes. The artifact's kernels are rebuilt as TIR from its
   manifest: the frontend's graph of the recorded config, through the pipeline's graph
   and legalization phases, which name and fuse the kernels (scheduling, which runs
   later, changes loops, not names or arithmetic). A kernel's operations are TVM's
   `estimate_tir_flops` of its PrimFunc specialized to the shapes of the call; its
   bytes are the tensors it reads and writes, each once (analyze's convention). The
   paged KV cache's attention is a runtime builtin, not a PrimFunc of the model: its
   work is `attention_work`'s formula.
2. Which calls a step makes. One prefill of S tokens (one sequence, as the artifact
   prefills) and one decode step (B sequences at context S + 1) run with a VM
   instrument that sees every call: the kernel, its arguments and which of them are
   weights (by data pointer), whose names say which analyze operators it implements.
3. How long each takes. At its first call with given shapes, a kernel is timed with
   TVM's time evaluator on the same arguments: the best of `repeats` runs, each after
   the caches are flushed, since the roofline charges every operand to memory. Both
   steps are also timed end to end without the instrument; what the kernels leave
   unexplained is VM overhead, bookkeeping builtins and Python.
4. How good that is. A kernel's share of its roofline is the roofline time
   max(ops / peak, bytes / bandwidth) over the measured time; for a kernel that does
   arithmetic this equals achieved op/s over attainable op/s. An artifact whose
   projections multiply int8 activations (`schedules/int8_matmul.py`) is placed on an
   int8 roof: the host's is measured with ember's own int8 prefill matmul (numpy, which
   measures the fp32 roof, has no int8 matmul of that speed), as the fp32 roof is
   numpy's BLAS: attainable, not theoretical. Against the fp32 roof, those kernels
   read as 4x-9x their roofline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx
from tvm import runtime as tvm_runtime
from tvm.s_tir.analysis import estimate_tir_flops

from ember.core.errors import ArtifactError, EmberError, ModelError
from ember.core.files import read_json_object
from ember.core.manifest import LIBRARY_NAME, Manifest
from ember.driver.analyze.operators import (
    Architecture,
    FormatPrecision,
    Operator,
    Precision,
    architecture_from_config,
    decode,
    prefill,
    visible_keys,
)
from ember.driver.analyze.roofline import Point, StageResult, evaluate, place
from ember.driver.tvm_log import tvm_warnings_hidden
from ember.frontend.config import ModelConfig
from ember.frontend.hf import build_module
from ember.frontend.records import recorded_config_dir, recorded_formats, recorded_frontend
from ember.frontend.source import import_model
from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir.quant_formats import FORMATS, INTERLEAVED, QUANTIZED_PARTS
from ember.ir_passes import pipeline, specialize_cpu_rope
from ember.ir_passes.merge_equal_kernels import equal_but_for_bounds
from ember.runtime import Engine, load_artifact
from ember.runtime.amx import request_amx_permission
from ember.runtime.artifact import load_library
from ember.schedules import amx_bf16_matmul, amx_matmul, int8_matmul
from ember.schedules.moe import MOE_MATMUL_ATTR, MOE_ROUTE_ATTR
from ember.targets.hardware import Hardware, load_host
from ember.targets.registry import resolve_target

REPEATS = 10
# Copied before each timed run: more than the last-level cache a core sees on the CPUs
# ember targets (32-96 MB per chiplet), so every operand comes from memory again.
CACHE_FLUSH_BYTES = 64 * 2**20
ATTENTION_BUILTIN = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
ATTENTION_OPERATORS = ("rope", "qk_matmul", "softmax", "sv_matmul")
# Weight names -> analyze operators; projections (fused or not) map by their `<a>_<b>_proj` name.
_WEIGHT_OPERATORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "norm": "final_norm",
                     "embed_tokens": "embed_tokens", "lm_head": "lm_head", "gate": "router"}
_TIME_EVALUATOR = "runtime.RPCTimeEvaluator"
# Unpacking a quantized value takes a handful of operations; a dot product, 2 per input.
GATHER_OPS_PER_OUTPUT = 8


@dataclasses.dataclass(frozen=True)
class KernelTiming:
    """One kernel of a step: what it implements, how often it runs, and its work and time per call."""

    name: str                     # the kernel's symbol in the artifact
    implements: tuple[str, ...]   # analyze's operators it computes; empty where analyze has none
    calls: int
    seconds: float                # per call, best of the timed runs
    point: Point                  # its ops and bytes per call on the host roofline
    predicted: float | None       # analyze's time for `implements` on the host, per call

    @property
    def achieved(self) -> float:
        """Operations per second reached."""
        return self.point.op.ops / self.seconds

    @property
    def fraction(self) -> float:
        """Roofline time over measured time: achieved op/s over attainable op/s (bytes/s for pure data movement)."""
        return self.point.time / self.seconds


@dataclasses.dataclass(frozen=True)
class MeasuredStage:
    """A step's kernels as measured, the step timed end to end, and analyze's prediction of it."""

    name: str
    batch: int
    new_tokens: int
    context: int
    kernels: tuple[KernelTiming, ...]
    step_seconds: float           # best end-to-end time of the step, without the instrument
    predicted: StageResult

    @property
    def kernel_seconds(self) -> float:
        """Sum of every kernel call's measured time."""
        return sum(k.calls * k.seconds for k in self.kernels)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """An artifact's prefill and decode step, timed kernel by kernel on this machine."""

    artifact: Path
    arch: Architecture
    hardware: Hardware
    precision: Precision
    repeats: int
    cache_flush_bytes: int
    prefill: MeasuredStage
    decode: MeasuredStage


def measure(artifact_dir: Path, prompt_len: int = 128, batch: int = 1, repeats: int = REPEATS,
            hardware: Hardware | None = None, on_start: Callable[[], None] = lambda: None) -> Measurement:
    """Time every kernel of the artifact's prefill of `prompt_len` tokens and of a decode step of `batch` sequences.

    `on_start` is called once the artifact and the request are found good, before the timing.
    """
    artifact = load_artifact(Path(artifact_dir))
    manifest = artifact.manifest
    engine = Engine(artifact)
    if prompt_len > engine.prefill_chunk or prompt_len + 1 > engine.context_window:
        raise EmberError(f"--prompt-len {prompt_len}: {artifact_dir} prefills at most {engine.prefill_chunk} tokens "
                         f"per call and holds {engine.context_window}; measure a prompt that fits one call")
    if batch > engine.max_batch:
        raise EmberError(f"--batch {batch}: {artifact_dir} decodes at most {engine.max_batch} sequences")
    on_start()
    int8_projections = manifest.activations == "int8"
    if hardware is None:
        hardware = load_host()
        if int8_projections and "int8" not in hardware.peak_flops:
            hardware = with_int8_peak(hardware, json.dumps(manifest.target["tvm_target"]))
    config = _config(manifest, artifact_dir)
    bits = tvm_runtime.DataType(manifest.model_dtype).bits
    # Weights at their stored width (a quantized format's bits per weight, scales included); likewise the KV cache.
    # Projections of int8 activations compute in int8, on the int8 roof.
    precision = FormatPrecision(_stored_bits_per_weight(manifest, config), bits, _kv_bits(manifest, config),
                                "bf16" if manifest.model_dtype == "bfloat16" else "fp16",
                                int8_projections=int8_projections)
    kernels = rebuild_kernels(manifest)
    arch = _architecture(Path(artifact_dir).resolve().name, config, manifest, kernels)

    prompt = [int(t) for t in (np.arange(prompt_len) * 7919 + 3) % config.vocab_size]  # any in-vocabulary ids
    step_seconds = _time_steps(engine, prompt, batch, repeats)
    weights = {t.data_ptr(): name for t, name in zip(artifact.params, manifest.params)}
    names = {gv.name_hint for gv, func in kernels.functions_items() if isinstance(func, tirx.PrimFunc)}
    library = load_library(Path(artifact_dir) / LIBRARY_NAME)
    routed = {gv.name_hint: func.attrs[MOE_MATMUL_ATTR]["experts"] for gv, func in kernels.functions_items()
              if isinstance(func, tirx.PrimFunc) and MOE_MATMUL_ATTR in (func.attrs or {})}
    recorder = _Recorder(names, library, artifact.device, weights, repeats, routed)
    artifact.vm.set_instrument(recorder)
    seqs = [engine.add_sequence() for _ in range(batch)]
    with recorder.recording() as prefill_calls:
        engine.prefill(seqs[0], prompt)
    for seq in seqs[1:]:
        engine.prefill(seq, prompt)
    with recorder.recording() as decode_calls:
        engine.decode(seqs, [prompt[-1]] * batch)
    inputs = kernel_inputs(kernels, prefill_calls + decode_calls, artifact_dir)

    stages = {}
    for name, calls, step in (("prefill", prefill_calls, prefill(arch, precision, 1, prompt_len)),
                              ("decode", decode_calls, decode(arch, precision, batch, prompt_len + 1))):
        predicted = evaluate(step, hardware)
        timings = _kernel_timings(calls, kernels, inputs, recorder.times, config, step.batch, step.new_tokens,
                                  step.past_tokens, precision, predicted, hardware)
        stages[name] = MeasuredStage(name, step.batch, step.new_tokens, step.past_tokens + step.new_tokens,
                                     timings, step_seconds[name], predicted)
    return Measurement(Path(artifact_dir), arch, hardware, precision, repeats, CACHE_FLUSH_BYTES,
                       stages["prefill"], stages["decode"])


def _architecture(name: str, config: ModelConfig, manifest: Manifest, kernels: tvm.IRModule) -> Architecture:
    """The artifact's model as analyze's formulas see it: its config and, where its kernels route tokens to experts,
    their count, how many a token uses and their width, as ember's MoE kernels hold them (a shared expert's width
    from the checkpoint's config.json, where the source is a checkpoint directory)."""
    attrs = [func.attrs for _, func in kernels.functions_items() if isinstance(func, tirx.PrimFunc) and func.attrs]
    route = next((a[MOE_ROUTE_ATTR] for a in attrs if MOE_ROUTE_ATTR in a), None)
    if route is None:
        return Architecture(name, config)
    # The down projection's inputs are an expert's width wide, the gate and up projections' the hidden size.
    width = next((int(a[MOE_MATMUL_ATTR]["k"]) for a in attrs
                  if MOE_MATMUL_ATTR in a and int(a[MOE_MATMUL_ATTR]["k"]) != config.hidden_size), config.hidden_size)
    source = Path(manifest.source) / "config.json"
    shared = architecture_from_config(read_json_object(source), source, name).shared_expert_intermediate_size \
        if source.is_file() else 0
    return Architecture(name, config, int(route["experts"]), int(route["top_k"]), width, shared)


# The int8 roof's matmul: the ~110M Llama's gate/up projection over a 128-token prompt, in q8f32.
INT8_PEAK_SHAPE = (128, 4096, 768)


def with_int8_peak(hardware: Hardware, target_spec: str, shape: tuple[int, int, int] = INT8_PEAK_SHAPE) -> Hardware:
    """`hardware` (the host) with an int8 peak, the roof of the projections of quantized weights: the op/s of ember's
    prefill matmul for `target_spec` (the artifact's CPU target: the int8 dot product's kernel, or with AMX the tile
    kernel its prefill runs, bfloat16's where the CPU has AMX-BF16) on an [m, k] x [n, k] product from warm caches,
    best of 5 runs."""
    target = resolve_target(target_spec)
    if target.int8_dot is None:
        return hardware
    m, n, k = shape
    fmt = FORMATS["q8f32"]
    rng = np.random.default_rng(0)
    if target.int8_dot.tiles:
        request_amx_permission("ember analyze --measure")
    if target.int8_dot.tiles == "bf16":
        kernel, name = amx_bf16_matmul.amx_bf16_matmul(fmt, n, k), "AMX-BF16 prefill matmul"
    elif target.int8_dot.tiles:
        kernel, name = amx_matmul.amx_int8_matmul(fmt, n, k), "AMX int8 prefill matmul"
    else:
        kernel, name = int8_matmul.int8_dot_matmul(fmt, n, k, target.int8_dot, True, target.vector_bits), (
            "int8 prefill matmul")
    with tvm_warnings_hidden():
        library = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target.target)
    weight = fmt.quantize(rng.standard_normal((n, k), dtype=np.float32), INTERLEAVED)
    args = [tvm_runtime.tensor(rng.standard_normal((1, m, k), dtype=np.float32)),
            *(tvm_runtime.tensor(weight[part]) for part in fmt.parts),
            tvm_runtime.tensor(np.zeros((1, m, n), np.float32))]
    timer = library.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=5, min_repeat_ms=50)
    seconds = min(timer(*args).results)
    return dataclasses.replace(
        hardware, peak_flops={**hardware.peak_flops, "int8": 2 * m * n * k / seconds},
        source=f"{hardware.source}; int8 peak: ember's {name} ({m}x{n}x{k}, warm caches)")


def _stored_bits_per_weight(manifest: Manifest, config: ModelConfig) -> float:
    """Bits per weight value (scales included) of the artifact's weight matrices: its format's, or for a
    GGUF file compiled with its own per-tensor types the mean of theirs, weighted by the tensors' sizes."""
    formats = recorded_formats(manifest.source_weights, manifest.model_dtype)
    if len(set(formats.values())) <= 1:
        return FORMATS[manifest.quantization].bits_per_weight
    _, shapes = build_module(config, resolve_target("cpu").target, manifest.model_dtype)
    sizes = {name: math.prod(shape) for name, shape in shapes.items() if len(shape) == 2 and name in formats}
    return sum(FORMATS[formats[name]].bits_per_weight * size for name, size in sizes.items()) / sum(sizes.values())


def _kv_bits(manifest: Manifest, config: ModelConfig) -> float:
    """Bits per cached key or value element, from the bytes per token the artifact's memory report counted
    (the model dtype's, or the q8 cache's int8 values and row scales)."""
    elements = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return 8 * manifest.memory["kv_bytes_per_token"] / elements


def rebuild_kernels(manifest: Manifest) -> tvm.IRModule:
    """The artifact's kernels as TIR before scheduling, rebuilt from its manifest as `ember compile` built them."""
    config = _config(manifest, "the artifact")
    target = resolve_target(json.dumps(manifest.target["tvm_target"]))
    frontend = recorded_frontend(manifest.source_weights)
    if frontend == "builtin" and manifest.source_weights["format"] == "huggingface":
        mod, _ = build_module(config, target.target, manifest.model_dtype)
    else:  # an imported graph (a GGUF file's too: ember's definition or transformers', as the file decides) is
        # imported again, from its source
        if not Path(manifest.source).exists():
            raise ModelError(f"{manifest.source}: the artifact's graph was imported from this source, which is "
                             "gone; measuring rebuilds its kernels from it")
        mod = import_model(Path(manifest.source), target.target, manifest.model_dtype, frontend=frontend,
                           tokenizer_dir=recorded_config_dir(manifest.source_weights)).mod
    kv = manifest.kv_cache
    options = pipeline.LowerOptions(FORMATS[manifest.quantization], kv["prefill_chunk"], kv["max_batch"],
                                    manifest.kept_float["embedding"], manifest.kept_float["lm_head"],
                                    int8_activations=manifest.activations == "int8",
                                    tensor_formats=recorded_formats(manifest.source_weights, manifest.model_dtype),
                                    kv_quant=kv["quantization"])
    with tvm_warnings_hidden():
        return pipeline.to_kernels(mod, target, options)


def tir_ops(func: tirx.PrimFunc, shapes: list[tuple[int, ...] | None]) -> float:
    """Operations of `func` called on tensors of `shapes` (None for a scalar argument), by TVM's `estimate_tir_flops`.

    Symbolic dimensions (sequence length, batch) are bound by specializing the PrimFunc
    to the call's shapes; TVM counts every arithmetic operation of floating type once.
    The matmuls of quantized weights (int8 dot products, AMX tiles) are written in vector and tile operations TVM's
    counter does not read: each counts as the matmul it computes, 2 * rows * k * n. ember's rotary kernel (a graph
    kernel where the q8 KV cache moved it out of the cache) counts as analyze's `rope`.
    """
    source = (func.attrs or {}).get(KERNEL_SOURCE_ATTR)
    if source in amx_bf16_matmul.PROJECTION_KERNEL_SOURCES:
        x_shape, *_, y_shape = shapes
        return 2.0 * math.prod(x_shape) * y_shape[-1]
    if source == specialize_cpu_rope.__name__:  # written with lets, which the counter cannot read
        (tokens, q_heads, head_dim), (_, kv_heads, _) = shapes[2], shapes[3]  # (qkv, positions, q, k, v)
        return 3.0 * tokens * (q_heads + kv_heads) * head_dim  # as analyze's `rope`
    bindings = {}
    for param, shape in zip(func.params, shapes):
        buffer_shape = getattr(param.ty, "shape", None)
        if shape is None or buffer_shape is None or not any(isinstance(d, tirx.Var) for d in buffer_shape):
            continue
        dims = [tirx.IntImm(str(d.ty.dtype), n)
                for d, n in zip(buffer_shape, shape)]
        bindings[param] = tirx.decl_buffer(dims, param.dtype)
    return float(estimate_tir_flops(tvm.IRModule({"main": func.specialize(bindings) if bindings else func})))


def attention_work(config: ModelConfig, batch: int, new: int, past: int, element_bytes: float) -> tuple[float, float]:
    """Operations and bytes of one layer's paged-KV-cache attention: RoPE on q and k, K and V
    appended to the cache, causal attention over the cached keys, all in one builtin.

    ops = 3 rows (H + Hkv) d                 RoPE, as analyze's `rope`
        + batch H P (4 d + 5)                qk and sv (2 d each) and an online softmax (5) per
                                             (query, key) pair; P pairs pass the causal mask
    bytes = s rows (H + 2 Hkv) d             the fused q, k, v in
          + s rows H d                       the output
          + 2 s rows Hkv d                   K and V appended to the cache
          + 2 s batch K Hkv d                the visible K and V rows, read once per KV head
    with rows = batch new, K the keys the step's queries see (analyze's `visible_keys`),
    s bytes per element.
    """
    c = config
    d, heads, kv_heads = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    rows = batch * new
    window = c.sliding_window if c.layer_windows and all(c.layer_windows) else None  # as analyze's `forward_step`
    pairs = sum(visible_keys(position, 1, window) for position in range(past, past + new))
    keys = visible_keys(past, new, window)
    ops = 3 * rows * (heads + kv_heads) * d + batch * heads * pairs * (4 * d + 5)
    moved = (rows * (heads + 2 * kv_heads) * d + rows * heads * d + 2 * rows * kv_heads * d
             + 2 * batch * keys * kv_heads * d)
    return ops, moved * element_bytes


def implemented_operators(weights: list[str], ops_per_output: float) -> tuple[str, ...]:
    """analyze's operators a kernel computes, from the names of the weights it reads.

    `model.layers.0.self_attn.q_k_v_proj.weight` -> q_proj, k_proj, v_proj; the parts
    of a quantized weight (`...weight.packed`, `.scale`, `.min`) count as the weight. A
    tied embedding table read by a kernel doing a dot product per output value (more
    than GATHER_OPS_PER_OUTPUT operations) is the lm_head; a gather that only unpacks
    is the lookup.
    """
    found: list[str] = []
    for weight in weights:
        parts = weight.split(".")
        if parts[-1] in QUANTIZED_PARTS:
            parts = parts[:-1]
        role = parts[-1] if parts[-1].endswith("_proj") else parts[-2]  # stacked experts' have no ".weight"
        if role.endswith("_proj"):
            shared = "shared_" if "shared_expert" in parts else ""
            names = [f"{shared}{part}_proj" for part in role.removesuffix("_proj").split("_")]
        elif role == "embed_tokens" and ops_per_output > GATHER_OPS_PER_OUTPUT:
            names = ["lm_head"]
        else:
            names = [_WEIGHT_OPERATORS[role]] if role in _WEIGHT_OPERATORS else []
        found += [n for n in names if n not in found]
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class _Call:
    symbol: str
    signature: tuple
    shapes: list[tuple[int, ...] | None]
    nbytes: list[float]           # per argument, 0 for a scalar
    weights: list[str]
    touched: int | None = None    # an expert projection's: the experts some pair went to (the rest are not read)


class _Recorder:
    """The VM instrument: records the kernel calls of a step, timing each new (kernel, shapes) once."""

    def __init__(self, kernels: set[str], library: tvm_runtime.Module, device: tvm_runtime.Device,
                 weights: dict[int, str], repeats: int, routed: dict[str, int]) -> None:
        self.kernels = kernels
        self.routed = routed  # expert projection kernels -> their experts
        self.library = library
        self.device = device
        self.weights = weights
        self.repeats = repeats
        self.times: dict[tuple, float] = {}
        self._calls: list[_Call] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[_Call]]:
        """Collect the kernel calls made inside the context into the list it yields."""
        self._calls = []
        try:
            yield self._calls
        finally:
            self._calls = None

    def __call__(self, func, symbol: str, before_run: bool, ret_value, *args) -> int:
        if before_run and self._calls is not None and (symbol in self.kernels or symbol == ATTENTION_BUILTIN):
            tensors = [a if isinstance(a, tvm_runtime.Tensor) else None for a in args]
            shapes = [tuple(int(n) for n in t.shape) if t is not None else None for t in tensors]
            signature = (symbol, tuple(shapes), tuple(str(t.dtype) for t in tensors if t is not None))
            if signature not in self.times:
                self.times[signature] = self._time(symbol, args)
            nbytes = [t.numel() * tvm_runtime.DataType(str(t.dtype)).bits / 8 if t is not None else 0 for t in tensors]
            weights = [self.weights[t.data_ptr()] for t in tensors if t is not None and t.data_ptr() in self.weights]
            # `moe_matmul(x, weight parts..., order, offsets, y)`: expert e's pairs are offsets[e]..offsets[e + 1]
            touched = int(np.count_nonzero(np.diff(tensors[-2].numpy()))) \
                if symbol in self.routed and tensors[-2] is not None else None
            self._calls.append(_Call(symbol, signature, shapes, nbytes, weights, touched))
        return 0  # run the call as usual

    def _time(self, symbol: str, args: tuple) -> float:
        # Kernels live in a module the library imports; the attention builtin is a global
        # function, which only the raw evaluator (module None) can time, so both use it.
        module = None if symbol == ATTENTION_BUILTIN else next(
            m for m in self.library.imports if m.implements_function(symbol))
        evaluator = tvm.get_global_func(_TIME_EVALUATOR)(
            module, symbol, self.device.dlpack_device_type(), self.device.index,
            1, self.repeats,        # number of calls per run, runs
            0, 100, 0, 1,           # min_repeat_ms, limit_zero_time_iterations, cooldown_ms, repeats_to_cooldown
            CACHE_FLUSH_BYTES, "")  # flushed before each run; no preprocessing function
        blob = evaluator(*args)
        return min(struct.unpack(f"@{self.repeats}d", bytes(blob)))


def _time_steps(engine: Engine, prompt: list[int], batch: int, repeats: int) -> dict[str, float]:
    """Best end-to-end seconds of a prefill of `prompt` and of a decode step of `batch` such sequences."""
    best = {"prefill": float("inf"), "decode": float("inf")}
    for run in range(repeats + 1):  # the first run warms up
        seq = engine.add_sequence()
        start = time.perf_counter()
        engine.prefill(seq, prompt)
        if run:
            best["prefill"] = min(best["prefill"], time.perf_counter() - start)
        engine.remove_sequence(seq)
    seqs = [engine.add_sequence() for _ in range(batch)]
    for seq in seqs:
        engine.prefill(seq, prompt)
    for run in range(repeats + 1):
        start = time.perf_counter()
        engine.decode(seqs, [prompt[-1]] * batch)
        if run:
            best["decode"] = min(best["decode"], time.perf_counter() - start)
        for seq in seqs:
            engine.truncate(seq, len(prompt))
    for seq in seqs:
        engine.remove_sequence(seq)
    return best


def kernel_inputs(kernels: tvm.IRModule, calls: list[_Call], artifact_dir: Path | str) -> dict[str, int]:
    """How many of each kernel's arguments are inputs (the rest are outputs), from the rebuilt graph's calls.

    Checks on the way that the rebuild is the artifact: every kernel the graph calls
    ran (itself, or a kernel equal but for its bounds that the compiler merged it into),
    with as many arguments. Reshapes are skipped: the pipeline turns them into
    views after legalization.
    """
    called = {call.symbol: call for call in calls}
    inputs = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")
    for entry in ("prefill", "decode"):
        for block in kernels[entry].body.blocks:
            for binding in block.bindings:
                value = binding.value
                if not (isinstance(value, relax.Call) and value.op.same_as(call_tir)):
                    continue
                name = value.args[0].name_hint
                if relax.analysis.has_reshape_pattern(kernels[name]):
                    continue
                # The compiler merged kernels equal but for their bounds (`merge_equal_kernels`): the artifact ran
                # one of them under its own name.
                symbol = name if name in called else next(
                    (other for other in called if other in kernels and equal_but_for_bounds(kernels[other],
                                                                                            kernels[name])), None)
                if symbol is None or len(called[symbol].shapes) != len(kernels[name].params):
                    raise ArtifactError(
                        f"{artifact_dir}: its kernels differ from those this ember builds from its manifest "
                        f"(kernel {name}); recompile it with this ember to measure it")
                inputs[symbol] = len(value.args[1].fields)
    return inputs


def _kernel_timings(calls: list[_Call], kernels: tvm.IRModule, inputs: dict[str, int], times: dict[tuple, float],
                    config: ModelConfig, batch: int, new: int, past: int, precision: Precision,
                    predicted: StageResult, hardware: Hardware) -> tuple[KernelTiming, ...]:
    """Group a step's calls by kernel, shapes and implemented operators, in order of first call."""
    predicted_time = {p.op.name: p.time for p in predicted.layer + predicted.once}
    # ember's matmuls of quantized weights are on the int8 roof (`FormatPrecision.int8_projections`; AMX-BF16's
    # prefill kernel too, which measured that roof where it runs), every other kernel in the float dtype.
    float_dtype = Precision.matmul_dtype(precision, precision.wbits, precision.abits)
    int8_dtype = precision.matmul_dtype(precision.wbits, precision.abits)
    groups: dict[tuple, list[_Call]] = {}
    work: dict[tuple, tuple[float, float]] = {}
    for call in calls:
        key = (call.signature, call.touched)
        if key not in work:
            if call.symbol == ATTENTION_BUILTIN:
                work[key] = attention_work(config, batch, new, past, precision.abytes)
            elif call.touched is not None:
                work[key] = expert_work(kernels[call.symbol], call)
            else:
                ops = tir_ops(kernels[call.symbol], call.shapes)
                work[key] = (ops, moved_bytes(call.nbytes, inputs[call.symbol], ops))
        ops = work[key][0]
        outputs = math.prod(call.shapes[-1] or (1,))
        implements = (ATTENTION_OPERATORS if call.symbol == ATTENTION_BUILTIN
                      else implemented_operators(call.weights, ops / max(outputs, 1)))
        # Weights of an imported graph may have names the roofline's Llama-shaped model has no operator for
        # (GPT-2's c_proj): such a kernel is timed and placed on the roofline, without a prediction.
        implements = tuple(name for name in implements if name in predicted_time)
        groups.setdefault((key, implements), []).append(call)
    timings = []
    for ((signature, touched), implements), group in groups.items():
        ops, nbytes = work[(signature, touched)]
        symbol = group[0].symbol
        int8 = (symbol != ATTENTION_BUILTIN
                and (kernels[symbol].attrs or {}).get(KERNEL_SOURCE_ATTR) in amx_bf16_matmul.PROJECTION_KERNEL_SOURCES)
        point = place(Operator(symbol, int8_dtype if int8 else float_dtype, ops, act_read=nbytes), hardware)
        expected = sum(predicted_time[n] for n in implements) if implements else None
        timings.append(KernelTiming(symbol, implements, len(group), times[signature], point, expected))
    return tuple(timings)


def expert_work(func: tirx.PrimFunc, call: _Call) -> tuple[float, float]:
    """Operations and bytes of an expert projection (`schedules/moe.moe_matmul`): 2 n k a (token, expert) pair, and
    of its weights only the `touched` experts' rows, read once each, besides the pairs' inputs and outputs."""
    shape = func.attrs[MOE_MATMUL_ATTR]
    experts, n, k = int(shape["experts"]), int(shape["n"]), int(shape["k"])
    pairs = call.shapes[0][0]
    weights = sum(call.nbytes[1:-3]) * (call.touched or 0) / experts
    return 2.0 * pairs * n * k, weights + call.nbytes[0] + sum(call.nbytes[-3:])


def moved_bytes(nbytes: list[float], num_inputs: int, ops: float) -> float:
    """Bytes a kernel moves: every input read once, every output written once.

    A kernel without arithmetic only moves data, and reads no more than it writes: a
    gather (embedding lookup, picking the rows that get logits) reads just the rows
    it picks, not the whole table it is given.
    """
    read, written = sum(nbytes[:num_inputs]), sum(nbytes[num_inputs:])
    return written + (min(read, written) if ops == 0 else read)


def _config(manifest: Manifest, origin: Path | str) -> ModelConfig:
    try:
        return ModelConfig.from_json(manifest.model)
    except (TypeError, KeyError) as err:
        raise ArtifactError(f"{origin}: the manifest's model config is not this ember's ({err}); "
                            "recompile it") from None
