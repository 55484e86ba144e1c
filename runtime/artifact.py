"""Load a compiled artifact: check its manifest, files and memory needs, load library and weights."""

from __future__ import annotations

import json
import math
import mmap
import os
import platform
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import runtime as tvm_runtime
from tvm.runtime.vm import VirtualMachine

from ember.core.errors import ArtifactError
from ember.core.machine import available_memory, host_cpu_flags
from ember.core.manifest import (
    LIBRARY_NAME,
    PARAMS_DIR,
    WEIGHT_INDEX,
    Manifest,
    check_whole_model,
    read_manifest,
    verify_files,
)
from ember.runtime.amx import needs_amx, request_amx_permission
from ember.runtime.device import open_device
from ember.runtime.tokenizer import Tokenizer

# TVM wraps host memory without a copy only at this alignment.
TENSOR_ALIGNMENT = 64
HUGE_PAGE = 2 * 2**20
# The library's function returning its weights' shapes and dtypes as JSON (`Manifest.param_types`' content).
PARAM_TYPES_FUNCTION = "_ember_param_types"
# The library's function returning, as JSON, the formats and sizes its kernels were built for (`built_for`).
BUILT_FOR_FUNCTION = "_ember_built_for"
# platform.machine() spellings of the names LLVM triples use.
_MACHINE_NAMES = {"amd64": "x86_64", "arm64": "aarch64"}


@dataclass
class Artifact:
    """A loaded artifact: its manifest, VM, weights (in graph order) and tokenizer."""

    path: Path
    manifest: Manifest
    vm: VirtualMachine
    params: list[tvm_runtime.Tensor]
    tokenizer: Tokenizer | None
    device: tvm_runtime.Device
    # An artifact with adapter slots (`manifest.lora`): each adapter parameter's array, which `params` shares, so
    # that writing a slot (`ember.runtime.lora.AdapterSlots`) changes what the next call reads.
    adapter_stacks: dict[str, np.ndarray] = field(default_factory=dict)


def load_artifact(path: Path, verify: bool = True, threads: int | None = None, stage: bool = False) -> Artifact:
    """Open the artifact at `path` on the device it was compiled for, refusing a mismatched or tampered one.

    `threads`: how many threads a CPU artifact's kernels use (default: one per physical core,
    or `TVM_NUM_THREADS`); see `ember.runtime.device.use_cpu_threads`. `stage`: open one stage of a pipeline
    artifact (for `ember.runtime.pipeline.StageEngine`); otherwise a stage is refused, as it is no whole model.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if not stage:
        check_whole_model(path, manifest)
    if manifest.pipeline is not None:
        raise ArtifactError(f"{path}: a model split into {len(manifest.pipeline['stages'])} pipeline stages "
                            f"(`--pipeline-stages`); serve it with `ember serve --ray`, or run it with "
                            f"ember.runtime.pipeline.LocalPipeline")
    _check_machine(path, manifest)
    if manifest.tvm_version != tvm.__version__:
        raise ArtifactError(
            f"{path}: compiled with TVM {manifest.tvm_version}, this runtime has TVM {tvm.__version__}; "
            f"recompile with `ember compile {manifest.source} --quant {manifest.quantization} -o {path}`"
        )
    if verify:
        verify_files(path, manifest)
    _check_host_memory(path, manifest)
    dev = open_device(manifest.target, path, threads)
    library = load_library(path / LIBRARY_NAME)
    vm = VirtualMachine(library, dev)
    _check_library(path / LIBRARY_NAME, manifest, vm)
    adapter_stacks = _adapter_stacks(manifest, dev)
    params = _load_params(path / PARAMS_DIR, manifest, dev, adapter_stacks)
    has_tokenizer = (path / "tokenizer.json").exists()
    tokenizer = Tokenizer.from_dir(path, manifest.kv_cache["max_context"]) if has_tokenizer else None
    return Artifact(path, manifest, vm, params, tokenizer, dev, adapter_stacks)


def _adapter_stacks(manifest: Manifest, dev: tvm_runtime.Device) -> dict[str, np.ndarray]:
    """Zeroed arrays of the adapter parameters of an artifact with adapter slots (no slot holds an adapter yet),
    each a view of a tensor TVM allocated, aligned as its kernels need."""
    stacks = {}
    for module in (manifest.lora or {"modules": {}})["modules"].values():
        for name in (module["a"], module["b"]):
            array = np.from_dlpack(tvm_runtime.empty(manifest.param_types[name]["shape"], "float32", device=dev))
            array[...] = 0
            stacks[name] = array
    return stacks


def load_library(path: Path) -> tvm_runtime.Module:
    """The compiled library at `path`, loaded under a file name never used before in this process.

    The dynamic loader hands back a library already loaded under the same path name without reading the file
    again: an artifact recompiled or replaced at a path this process loaded before would run the old code (seen:
    the kernels of a q4f32 artifact run for the q8f32 one copied over it). A symbolic link does not help, as TVM
    loads the path it resolves to; a hard link (a copy across file systems) has a name of its own, and matches a
    loaded library only if it is the same file (device and inode), which is then the right one."""
    with tempfile.TemporaryDirectory(prefix="ember-library-") as staging:
        alias = Path(staging) / f"{uuid.uuid4().hex}-{path.name}"
        try:
            os.link(path, alias)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(path, alias)
        return tvm_runtime.load_module(str(alias))


def _check_machine(path: Path, manifest: Manifest) -> None:
    """Refuse a CPU artifact linked for another architecture before dlopen would fail on it, or one whose code
    uses instruction-set extensions this CPU lacks before its first kernel would die of SIGILL."""
    compiled_for = manifest.target.get("arch", "") if manifest.target["name"] == "cpu" else ""
    here = _MACHINE_NAMES.get(platform.machine().lower(), platform.machine().lower())
    if compiled_for and compiled_for != here:
        raise ArtifactError(f"{path}: compiled for {compiled_for}, this machine is {here}; recompile with "
                            f"`ember compile {manifest.source} --target cpu` here, or run it on the {compiled_for} "
                            f"device")
    host_flags = host_cpu_flags() if compiled_for else None
    missing = [flag for flag in manifest.target.get("cpu_features", []) if host_flags and flag not in host_flags]
    if missing:
        raise ArtifactError(f"{path}: compiled for a CPU with {', '.join(missing)}, which this machine lacks (the "
                            f"library would die of an illegal instruction); recompile with `ember compile "
                            f"{manifest.source} --target cpu` here, or run it on a CPU that has them")
    if compiled_for and needs_amx(manifest.target.get("cpu_features", [])):
        request_amx_permission(str(path))  # before the first tile instruction, which would otherwise be SIGILL


def _check_library(library: Path, manifest: Manifest, vm: VirtualMachine) -> None:
    """Refuse a library that is not the manifest's (another artifact's, its hash resealed into this manifest) before
    a kernel meets weights it was not built for: each entry function must exist and take the manifest's inputs,
    then the manifest's weights in order (VM bytecode metadata: no kernel runs)."""
    for function in manifest.entry_functions:
        inputs = manifest.entry_inputs(function)
        if not _has_function(vm, function):
            raise ArtifactError(f"{library}: has no function {function!r}, which the manifest lists: the library "
                                f"is not this artifact's; recompile the artifact")
        names = [vm._get_function_param_name(function, i) for i in range(vm._get_function_arity(function))]
        expected = inputs + (manifest.params if names[len(inputs):] else [])
        if names != expected:
            at = next((i for i, (a, b) in enumerate(zip(names, expected)) if a != b), min(len(names), len(expected)))
            found = repr(names[at]) if at < len(names) else "nothing"
            wanted = repr(expected[at]) if at < len(expected) else "nothing"
            raise ArtifactError(f"{library}: its {function} function takes {found} as argument {at} where the "
                                f"manifest has {wanted}: the library is not this artifact's; recompile the artifact")
    if manifest.param_types and _has_function(vm, PARAM_TYPES_FUNCTION):
        weight_types = json.loads(str(vm[PARAM_TYPES_FUNCTION]()))
        differing = next((name for name in manifest.params
                          if weight_types.get(name) != manifest.param_types.get(name)), None)
        if differing is not None:
            raise ArtifactError(f"{library}: built for weight {differing!r} of "
                                f"{_describe(weight_types.get(differing))}, "
                                f"the manifest has {_describe(manifest.param_types.get(differing))}: the library is "
                                f"not this artifact's; recompile the artifact")
    if _has_function(vm, BUILT_FOR_FUNCTION):
        built = json.loads(str(vm[BUILT_FOR_FUNCTION]()))
        for fact, given in built_for(manifest).items():
            if fact not in built:  # a fact this library does not record
                continue
            fits = given <= built[fact] if fact == CONTEXT_FIELD else given == built[fact]
            if not fits:
                raise ArtifactError(f"{library}: built for {fact} {built[fact]!r}, the manifest has {given!r}: the "
                                    "manifest was changed after compile or the library is another artifact's; "
                                    "recompile the artifact")


# The one fact of `built_for` the manifest may hold less of than its library: a shorter context than it was built for.
CONTEXT_FIELD = "kv_cache.max_context"


def built_for(manifest: Manifest) -> dict[str, Any]:
    """By manifest field, what `manifest` says of the formats, layouts and sizes its library's kernels assume: what
    `ember compile` records in the library (`BUILT_FOR_FUNCTION`, with the context the kernels were built for as
    `CONTEXT_FIELD`) and the loader holds the manifest to."""
    kv = manifest.kv_cache
    return {"quantization": manifest.quantization, "model_dtype": manifest.model_dtype,
            "activations": manifest.activations, "kv_cache.quantization": kv["quantization"],
            "kv_cache.page_size": kv["page_size"], "kv_cache.prefill_chunk": kv["prefill_chunk"],
            "kv_cache.max_batch": kv["max_batch"], CONTEXT_FIELD: kv["max_context"],
            "kv_cache.rope.long_factors_above": kv["rope"].get("long_factors_above"),
            "model.layer_windows": manifest.model["layer_windows"]}


def _has_function(vm: VirtualMachine, name: str) -> bool:
    try:
        vm._get_function_arity(name)
    except Exception:  # TVM raises ValueError or its own error types for an unknown function
        return False
    return True


def _describe(param_type: dict[str, Any] | None) -> str:
    return f"{param_type['dtype']} {param_type['shape']}" if param_type else "none"


def _check_host_memory(path: Path, manifest: Manifest) -> None:
    """Refuse a CPU artifact whose weights, workspace and whole KV cache (allocated up front by the
    engine) exceed the memory this process may still use, before allocating any of it."""
    if manifest.target["name"] != "cpu":  # a GPU's memory was sized by --memory-budget at compile
        return
    memory, kv = manifest.memory, manifest.kv_cache
    kv_bytes = kv["max_total_tokens"] * memory["kv_bytes_per_token"]
    needed = memory["weight_bytes"] + memory["peak_workspace_bytes"] + kv_bytes
    available = available_memory()
    if available is not None and needed > available[0]:
        # A mixture of experts keeps every expert resident, though a token reads only some of them.
        experts = memory.get("expert_weight_bytes", 0)
        of_which = f" of which experts {_mib(experts)}" if experts else ""
        weights_fit = memory["weight_bytes"] + memory["peak_workspace_bytes"] <= available[0]
        advice = ("recompile with a smaller --max-batch or --memory-budget" if weights_fit else
                  "its weights alone do not fit: recompile with a smaller --quant, or run it on a larger machine")
        raise ArtifactError(
            f"{path}: needs {_mib(needed)} of memory (weights {_mib(memory['weight_bytes'])}{of_which}, workspace "
            f"{_mib(memory['peak_workspace_bytes'])}, KV cache of {kv['max_total_tokens']} tokens "
            f"{_mib(kv_bytes)}), this machine has {_mib(available[0])} available (limited by {available[1]}); "
            f"{advice}"
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _load_params(params_dir: Path, manifest: Manifest, dev: tvm_runtime.Device,
                 adapter_stacks: dict[str, np.ndarray]) -> list[tvm_runtime.Tensor]:
    """Read tensor-cache shards one tensor at a time, in the graph's parameter order, the adapter parameters being
    `adapter_stacks`' arrays (a CPU artifact's), wrapped.

    On a CPU the weights are read straight into one huge-page arena (`_weight_arena`) and
    wrapped without a copy; on a GPU each tensor goes through a host buffer to the device.
    """
    index_path = params_dir / WEIGHT_INDEX
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{index_path}: unreadable weight index: {err}") from None
    shards = _checked_shards(params_dir, index, manifest.files)

    def aligned(nbytes: int) -> int:
        return -(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT

    _check_param_types(shards, manifest.param_types)
    records = [record for _, shard_records in shards for record in shard_records]
    arena = _weight_arena(sum(aligned(record["nbytes"]) for record in records)) if dev == tvm_runtime.cpu(0) else None
    loaded = {name: tvm_runtime.from_dlpack(array) for name, array in adapter_stacks.items()}
    start = 0  # of the next tensor in the arena
    for shard_path, shard_records in shards:
        with open(shard_path, "rb") as f:
            for record in shard_records:
                nbytes = record["nbytes"]
                # A private buffer (not a memory map of the shard), so peak RSS is the
                # weights plus at most one tensor, not the weights twice.
                buffer = arena[start:start + nbytes] if arena is not None else np.empty(nbytes, dtype=np.uint8)
                start += aligned(nbytes)
                f.seek(record["byteOffset"])
                # numpy's stubs declare an array's buffer protocol (`__buffer__`) only from Python 3.12 on.
                if f.readinto(buffer) != nbytes:  # type: ignore[arg-type]
                    raise ArtifactError(f"{shard_path}: truncated weight shard")
                array = buffer.view(record["dtype"]).reshape(record["shape"])
                if arena is not None:
                    tensor = tvm_runtime.from_dlpack(array)
                else:
                    tensor = tvm_runtime.empty(record["shape"], record["dtype"], device=dev)
                    tensor.copyfrom(array)
                loaded[record["name"]] = tensor
    missing = [name for name in manifest.params if name not in loaded]
    if missing:
        raise ArtifactError(f"{index_path}: weights {missing[:3]} are missing; recompile the artifact")
    return [loaded[name] for name in manifest.params]


def _checked_shards(params_dir: Path, index: Any, files: dict[str, Any]) -> list[tuple[Path, list[dict]]]:
    """The weight index's shards with their tensor records, each shard listed in the manifest and each
    record lying within its shard. After the hash check only a bug of ember's own fails this, but
    then as one line naming the shard and tensor, not a numpy error or a read past the end."""
    shards = index.get("records") if isinstance(index, dict) else None
    if not isinstance(shards, list) or not all(isinstance(shard, dict) for shard in shards):
        raise ArtifactError(f"{params_dir / WEIGHT_INDEX}: no list of weight shards; recompile the artifact")
    checked = []
    for shard in shards:
        shard_path = params_dir / str(shard.get("dataPath"))
        listed = files.get(f"{PARAMS_DIR}/{shard.get('dataPath')}")
        if listed is None:
            raise ArtifactError(f"{shard_path}: weight shard named by {WEIGHT_INDEX} is not listed in the "
                                f"manifest; recompile the artifact")
        records = shard.get("records")
        if not isinstance(records, list):
            raise ArtifactError(f"{shard_path}: {WEIGHT_INDEX} lists no tensor records for it; recompile the artifact")
        for record in records:
            problem = _record_problem(record, listed["size"])
            if problem:
                name = record.get("name") if isinstance(record, dict) else None
                raise ArtifactError(f"{shard_path}: tensor {name!r}: {problem}; recompile the artifact")
        checked.append((shard_path, records))
    return checked


def _check_param_types(shards: list[tuple[Path, list[dict]]], param_types: dict[str, dict[str, Any]]) -> None:
    """Refuse a weight whose shape or dtype is not what the compiled graph takes (`Manifest.param_types`): weights
    of another artifact, their hashes resealed into this manifest, would otherwise be read past by a kernel."""
    for shard_path, records in shards:
        for record in records:
            wanted = param_types.get(record["name"])
            if wanted and (record["shape"] != wanted["shape"] or record["dtype"] != wanted["dtype"]):
                raise ArtifactError(f"{shard_path}: tensor {record['name']!r} is {record['dtype']} {record['shape']}, "
                                    f"the compiled model takes {wanted['dtype']} {wanted['shape']}: the weights are "
                                    f"not this artifact's; recompile the artifact")


def _record_problem(record: Any, shard_size: int) -> str:
    """What is wrong with one tensor record of a shard of `shard_size` bytes, or ""."""
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        return "the record is not an object with a name"
    shape, offset, nbytes = record.get("shape"), record.get("byteOffset"), record.get("nbytes")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in [*shape, offset, nbytes]):
        return f"shape {shape!r}, byteOffset {offset!r} and nbytes {nbytes!r} must be whole numbers >= 0"
    try:
        dtype = np.dtype(record.get("dtype")) if isinstance(record.get("dtype"), str) else None
    except TypeError:
        dtype = None
    if dtype is None or not (dtype.kind in "biuf" or dtype.name == "bfloat16"):
        return f"unknown dtype {record.get('dtype')!r}"
    if nbytes != math.prod(shape) * dtype.itemsize:
        return f"nbytes {nbytes} is not the size of shape {shape} in {dtype.name}"
    if offset + nbytes > shard_size:
        return f"bytes {offset}..{offset + nbytes} lie beyond the shard's {shard_size} bytes"
    return ""


def _weight_arena(nbytes: int) -> np.ndarray:
    """One zeroed host buffer for every weight, starting on a 2 MiB boundary, backed by
    transparent huge pages where the kernel offers them (Linux `madvise`).

    Decode streams every weight from memory once per token. On 4 KiB pages that is a TLB
    miss every 4 KiB, and the hardware prefetcher stops at each page boundary; on huge
    pages a 110M model decodes 6-8% faster in float32, 2-3% in q8f32/q4f32 (side by side).
    """
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes]
