"""The artifact manifest: the versioned contract between `ember compile` and the runtime.

An artifact is a directory:

    manifest.json        this contract
    model.so             the compiled library (Relax VM executable + kernels)
    params/              weights as TVM tensor-cache shards
    tokenizer.json ...   the checkpoint's tokenizer files, if it had them

The manifest records what produced the artifact (format, ember and TVM versions),
what it computes (model config, quantization, target, entry functions, weight
order, KV-cache layout and bounds), the size and sha256 of every other file, and
the sha256 of its own content (`manifest_sha256`). `read_manifest` refuses a
manifest that was edited or does not have the shape this format promises, so no
reader meets a missing key; `verify_files` refuses a directory that does not hold
exactly the listed files, as regular files of the recorded sizes and hashes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import reprlib
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Required, TypedDict

from ember.core.errors import ArtifactError

# Format versions: 4: quantized weights store float16 scales; 5: kv_cache.quantization; 6: model.layer_windows;
# 7: entry functions' arguments as records ({name, shape, dtype}), not text; 8: `lora` (adapter slots).
FORMAT_VERSION = 8
MANIFEST_NAME = "manifest.json"
LIBRARY_NAME = "model.so"
PARAMS_DIR = "params"
WEIGHT_INDEX = "tensor-cache.json"  # in PARAMS_DIR, as TVM's tensor cache names it
REQUIRED_FILES = (LIBRARY_NAME, f"{PARAMS_DIR}/{WEIGHT_INDEX}")
# Far above any real manifest (a few KiB), low enough to read into memory.
MAX_MANIFEST_BYTES = 64 * 2**20
# The names of `ember.ir.quant_formats.FORMATS`, repeated here because the runtime
# reads manifests and must not import the compiler (a test keeps the two equal).
QUANTIZATIONS = ("q0f32", "q0f16", "q8f32", "q8f16", "q4f32", "q4f16", "q4f32_zp", "q4f16_zp")
# kv_cache.quantization's values besides null (`compile --kv-quant`): the keys of `ember.ir.kv_cache.KV_ROWS`,
# repeated for the same reason (the same test keeps them equal).
KV_QUANTIZATIONS = ("q8", "f16")
# An input of `prefill` and `verify` where longrope chooses its rotary factors by the sequence's length
# (`ember.ir_passes.longrope_choice`): [1] int32, the sequence's length once the call's whole prompt is appended.
PROMPT_END_INPUT = "prompt_end"


class _Target(TypedDict):
    name: str
    tvm_target: dict[str, Any]
    arch: str
    hardware: str
    memory_bytes: int


class TargetRecord(_Target, total=False):
    """`target`: what the library was compiled for."""

    cpu_features: list[str]  # the CPU flags the library needs; absent before 2026-11-28


class KVCacheRecord(TypedDict):
    """`kv_cache`: the paged KV cache's layout and the sizes the runtime creates it with."""

    kind: str
    page_size: int
    prefill_chunk: int
    max_batch: int
    max_context: int
    max_total_tokens: int
    memory_budget: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    sliding_window: int | None
    rope: dict[str, Any]
    quantization: str | None


class _Memory(TypedDict):
    weight_bytes: int
    kv_bytes_per_token: int
    context_window: int
    peak_workspace_bytes: int
    workspace_bytes: dict[str, int]


class MemoryRecord(_Memory, total=False):
    """`memory`: the compile-time memory report (`ember.ir_passes.memory_report.MemoryReport`)."""

    expert_weight_bytes: int  # absent before 2026-12-07
    active_weight_bytes: int


class KeptFloat(TypedDict):
    """`kept_float`: weights a quantized format left in the compute dtype."""

    embedding: bool
    lm_head: bool


class LoraModule(TypedDict):
    """One module with room for adapters: the parameters holding them, A [slots, members * rank, in] and B
    transposed [slots, rank, out] (`schedules/lora.py`; shared by the modules of a fused projection), the module's
    first row of A and first column of B, and its sizes."""

    a: str
    b: str
    a_row: int
    b_column: int
    input: int
    output: int


class LoraRecord(TypedDict):
    """`lora`: room for LoRA adapters (`ember compile --lora-rank`): `slots` adapters at once, each of rank up to
    `rank`, on the projections of `modules` (by checkpoint module name, as PEFT names them). The entries take each
    row's adapter slot and scale (`adapter_slots`, `adapter_scales`); the adapters' parameters are not in the
    weight shards: the runtime allocates them as zeros and fills a slot per adapter it loads."""

    rank: int
    slots: int
    modules: dict[str, LoraModule]


class EntryArg(TypedDict, total=False):
    """One argument or result of an entry function: a tensor's name, shape (sizes, and dimensions named where the
    call decides them, such as "seq_len") and dtype; a runtime object (the KV cache, a cache setting) by name alone."""

    name: Required[str]
    shape: list[int | str]
    dtype: str


class EntryFunction(TypedDict, total=False):
    """An entry function of the library: its arguments in order, before the weights, and its results."""

    inputs: Required[list[EntryArg]]
    outputs: list[EntryArg]
    max_tokens: int  # verify's: tokens one call checks at most


def tensor_arg(name: str, shape: list[int | str], dtype: str) -> EntryArg:
    """A tensor argument or result of an entry function."""
    return {"name": name, "shape": shape, "dtype": dtype}


def object_arg(name: str) -> EntryArg:
    """An argument that is a runtime object or a setting, not a tensor."""
    return {"name": name}


def signature_text(arg: EntryArg) -> str:
    """An argument as people write it: "input_ids[1, seq_len] int32", or its name alone."""
    if "shape" not in arg:
        return arg["name"]
    return f"{arg['name']}[{', '.join(map(str, arg['shape']))}] {arg.get('dtype', '')}".rstrip()


@dataclass
class Manifest:
    """Everything the runtime needs to know about an artifact, as plain data."""

    format_version: int
    ember_version: str
    tvm_version: str
    model: dict[str, Any]
    quantization: str
    model_dtype: str
    target: TargetRecord
    entry_functions: dict[str, EntryFunction]
    kv_cache: KVCacheRecord
    params: list[str]
    memory: MemoryRecord
    source: str
    # The weights' source beyond its path (`ember.frontend.records.source_record`): {"format": "huggingface",
    # "frontend": "builtin" | "torch-export"}; for an ONNX file {"format": "onnx", "config_dir": its config and
    # tokenizer's directory}; for a GGUF file its sha256 and per tensor its stored type and what ember made of it.
    source_weights: dict[str, Any]
    # Every file but the manifest, by path relative to the artifact: {"sha256": hex, "size": bytes}.
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Weights left in the compute dtype by a quantized format: {"embedding": bool, "lm_head": bool}.
    kept_float: KeptFloat = field(default_factory=lambda: KeptFloat(embedding=False, lm_head=False))
    # "int8": the quantized projections multiply int8-quantized activations (llama.cpp's
    # Q8_0 rounding, per group of 32); "float": activations stay in the compute dtype.
    activations: str = "float"
    # Each weight's shape and dtype as the compiled graph takes it, {name: {"shape": [...], "dtype": "float32"}}:
    # what the weight index must hold. Empty in manifests written before the field (then unchecked).
    param_types: dict[str, dict[str, Any]] = field(default_factory=dict)
    # A pipeline artifact's (`compile --pipeline-stages`): {"stages": ["stage-0", ...], "layers": [[begin, end], ...],
    # "hidden_size": H}, each stage an artifact in its own directory; None (and absent from the JSON) otherwise.
    pipeline: dict[str, Any] | None = None
    # One stage's: {"index": i, "count": K, "layers": [begin, end], "input": "token_ids" | "hidden",
    # "output": "hidden" | "logits", "hidden_size": H}; None (and absent) for a whole model.
    pipeline_stage: dict[str, Any] | None = None
    lora: LoraRecord | None = None  # an artifact with adapter slots; None (and absent from the JSON) otherwise
    manifest_sha256: str = ""  # `manifest_digest` of every other field, set by `write_manifest`

    def entry_inputs(self, function: str) -> list[str]:
        """The names of the entry `function`'s inputs, in order (none for an entry the artifact lacks)."""
        entry = self.entry_functions.get(function)
        return [arg["name"] for arg in entry["inputs"]] if entry else []

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON data (the pipeline and lora fields only where set)."""
        data = asdict(self)
        for key in _OPTIONAL_FIELDS:
            if data[key] is None:
                del data[key]
        return data


_OPTIONAL_FIELDS = ("pipeline", "pipeline_stage", "lora")


def required_files(data: dict[str, Any]) -> list[str]:
    """The files a manifest must list: the library and weight index, in each stage's directory for a pipeline."""
    pipeline = data.get("pipeline")
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    if isinstance(stages, list) and stages and all(isinstance(stage, str) for stage in stages):
        return [f"{stage}/{relpath}" for stage in stages for relpath in REQUIRED_FILES]
    return list(REQUIRED_FILES)


def manifest_digest(data: dict[str, Any]) -> str:
    """Hex sha256 of the canonical JSON of a manifest's fields other than `manifest_sha256`."""
    content = {key: value for key, value in data.items() if key != "manifest_sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a regular file, read in chunks."""
    digest = hashlib.sha256()
    with open_regular(Path(path)) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(artifact_dir: Path, manifest: Manifest) -> None:
    """Record the size and sha256 of every file under `artifact_dir` in `manifest`, seal it with
    its own digest and write it."""
    artifact_dir = Path(artifact_dir)
    manifest.files = {
        path.relative_to(artifact_dir).as_posix(): {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(artifact_dir.rglob("*"))
        if path.is_file() and path != artifact_dir / MANIFEST_NAME
    }
    manifest.manifest_sha256 = manifest_digest(manifest.to_json())
    (artifact_dir / MANIFEST_NAME).write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")


def read_manifest(artifact_dir: Path) -> Manifest:
    """Read `artifact_dir/manifest.json`, refusing one of another format version, one edited after
    compile, or one whose fields do not have the types this format promises."""
    path = Path(artifact_dir) / MANIFEST_NAME
    data = _load_manifest_json(Path(artifact_dir))
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {reprlib.repr(version)}, this ember reads version {FORMAT_VERSION}; "
            f"recompile the model with this ember (`ember compile`)"
        )
    if data.get("manifest_sha256") != manifest_digest(data):
        raise ArtifactError(f"{path}: the manifest was edited after compile (its content does not match its "
                            f"manifest_sha256); recompile the artifact with `ember compile`")
    _check_fields(path, data, SCHEMA, "")
    _check_pipeline_fields(path, data)
    _check_lora_field(path, data)
    _check_file_list(path, data["files"], required_files(data))
    _check_cpu_features(path, data["target"])
    _check_expert_bytes(path, data["memory"])
    _check_param_types(path, data.get("param_types", {}))
    _check_entry_functions(path, data["entry_functions"])
    _check_long_rope(path, data["kv_cache"]["rope"], data["entry_functions"])
    try:
        return Manifest(**data)
    except TypeError as err:
        raise ArtifactError(f"{path}: manifest fields do not match format version {FORMAT_VERSION}: {err}") from None


def verify_files(artifact_dir: Path, manifest: Manifest) -> None:
    """Check that `artifact_dir` holds exactly the manifest's files, as regular files (no links) of
    the recorded sizes, then their sha256; name the first that differs."""
    _verify_listed_files(Path(artifact_dir), manifest.files)


def check_whole_model(artifact_dir: Path, manifest: Manifest) -> None:
    """Refuse one stage of a pipeline artifact (`compile --pipeline-stages`) where a whole model is needed, naming
    the pipeline directory to give instead: alone, a stage takes or gives hidden states, which read as tokens or
    logits would be garbage."""
    stage = manifest.pipeline_stage
    if stage is not None:
        pipeline_dir = Path(artifact_dir).resolve().parent
        raise ArtifactError(f"{artifact_dir}: stage {stage['index'] + 1} of {stage['count']} of the pipeline artifact "
                            f"{pipeline_dir} (layers {stage['layers'][0]}..{stage['layers'][1] - 1}), not a whole "
                            f"model; give the pipeline directory {pipeline_dir} instead")


def pipeline_field(artifact_dir: Path, manifest: Manifest) -> dict[str, Any]:
    """The `pipeline` field of `manifest`, the manifest of the pipeline artifact at `artifact_dir`; an
    `ArtifactError` saying how to make one where it is a whole model's or one stage's."""
    if manifest.pipeline is None:
        raise ArtifactError(f"{artifact_dir}: not a pipeline artifact (compile it with `ember compile "
                            f"--pipeline-stages K`)")
    return manifest.pipeline


def verify_pipeline_stages(pipeline_dir: Path, manifest: Manifest) -> list[Path]:
    """The stage directories of the pipeline artifact `pipeline_dir` (its `manifest`, whose files are verified),
    in order, each checked as an artifact of its own: its manifest sealed and of this format, the stage the
    pipeline names in that place, and its files those its own manifest lists, so that a stage changed under a
    resealed pipeline manifest is refused."""
    pipeline_dir = Path(pipeline_dir)
    pipeline = pipeline_field(pipeline_dir, manifest)
    verify_files(pipeline_dir, manifest)
    stages = pipeline["stages"]
    dirs = []
    for index, (name, layers) in enumerate(zip(stages, pipeline["layers"])):
        stage_dir = pipeline_dir / name
        stage_manifest = read_manifest(stage_dir)
        stage = stage_manifest.pipeline_stage
        if stage is None or (stage["index"], stage["count"], list(stage["layers"])) != (index, len(stages),
                                                                                        list(layers)):
            raise ArtifactError(f"{stage_dir / MANIFEST_NAME}: not stage {index + 1} of {len(stages)} (layers "
                                f"{layers[0]}..{layers[1] - 1}) that {pipeline_dir / MANIFEST_NAME} names")
        verify_files(stage_dir, stage_manifest)
        dirs.append(stage_dir)
    return dirs


def check_ember_artifact(artifact_dir: Path) -> None:
    """Refuse `artifact_dir` unless it provably is an artifact some ember wrote, of any format version: its
    manifest carries ember's identity fields (format_version, ember_version, tvm_version) and the seal over its
    content (manifest_sha256), and the directory holds exactly the files it lists, with their sizes and hashes.
    What `ember compile -o` checks before it replaces a directory."""
    path = Path(artifact_dir) / MANIFEST_NAME
    data = _load_manifest_json(Path(artifact_dir))
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: not an ember manifest (not a JSON object)")
    for key, rule in (("format_version", _POSITIVE), ("ember_version", _TEXT), ("tvm_version", _TEXT),
                      ("files", _OBJECT)):
        if not rule[1](data.get(key)):
            raise ArtifactError(f"{path}: not an ember manifest ({key} is not {rule[0]})")
    if data.get("manifest_sha256") != manifest_digest(data):
        raise ArtifactError(f"{path}: not an ember manifest as ember wrote it (its content does not match its "
                            f"manifest_sha256)")
    _check_file_list(path, data["files"], required_files(data))
    _verify_listed_files(Path(artifact_dir), data["files"])


def _load_manifest_json(artifact_dir: Path) -> Any:
    """The JSON value of `artifact_dir/manifest.json`, read as a bounded regular file (no link, FIFO or device)."""
    path = artifact_dir / MANIFEST_NAME
    if not os.path.lexists(artifact_dir):
        raise ArtifactError(f"{artifact_dir}: no such artifact directory (`ember compile MODEL -o DIR` writes one)")
    if not os.path.lexists(path):
        raise ArtifactError(f"{artifact_dir}: not an ember artifact ({MANIFEST_NAME} is missing)")
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path}: larger than {MAX_MANIFEST_BYTES // 2**20} MiB, not an ember manifest")
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # ValueError: bad UTF-8 or JSON
        raise ArtifactError(f"{path}: malformed manifest: {err}") from None


def _verify_listed_files(artifact_dir: Path, files: dict[str, dict[str, Any]]) -> None:
    """`verify_files` for the file list `files` (a checked manifest's)."""
    sizes, directories = _artifact_tree(artifact_dir)
    missing = sorted(files.keys() - sizes.keys())
    if missing:
        raise ArtifactError(f"{artifact_dir / missing[0]}: file listed in the manifest is missing; "
                            f"recompile the artifact")
    added = sorted(sizes.keys() - files.keys())
    if added:
        raise ArtifactError(f"{artifact_dir / added[0]}: file not listed in the manifest (added after compile); "
                            f"remove it or recompile the artifact")
    parents = {str(parent) for relpath in files for parent in PurePosixPath(relpath).parents}
    unlisted = sorted(set(directories) - parents)
    if unlisted:
        raise ArtifactError(f"{artifact_dir / unlisted[0]}: directory holds no file of the manifest; "
                            f"remove it or recompile the artifact")
    # Sizes first: a truncated or partial copy is named without hashing gigabytes.
    for relpath, entry in sorted(files.items()):
        if sizes[relpath] != entry["size"]:
            raise ArtifactError(f"{artifact_dir / relpath}: {sizes[relpath]} bytes, the manifest records "
                                f"{entry['size']} (truncated or modified); recompile the artifact")
    for relpath, entry in sorted(files.items()):
        if sha256_file(artifact_dir / relpath) != entry["sha256"]:
            raise ArtifactError(
                f"{artifact_dir / relpath}: contents do not match the manifest's sha256 (modified or corrupted); "
                f"recompile the artifact with `ember compile`"
            )


def open_regular(path: Path) -> BinaryIO:
    """`path` open for reading if it is a regular file and not a symbolic link. Never follows a link
    out of the artifact nor blocks on a FIFO or device (`O_NONBLOCK`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if os.path.islink(path):
            raise ArtifactError(f"{path}: is a symbolic link; an artifact holds regular files only") from None
        raise ArtifactError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"{path}: not a regular file; an artifact holds regular files only")
    return os.fdopen(fd, "rb")


def _artifact_tree(artifact_dir: Path) -> tuple[dict[str, int], list[str]]:
    """The size of every file under `artifact_dir` but its manifest, and every directory, by relative
    path; refuses a symbolic link (never followed) or anything but files and directories."""
    sizes: dict[str, int] = {}
    directories: list[str] = []
    pending = [artifact_dir]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as entries:
                found = [(Path(entry.path), entry.stat(follow_symlinks=False)) for entry in entries]
        except OSError as err:
            raise ArtifactError(f"{directory}: cannot be read ({err.strerror})") from None
        for path, info in found:
            relpath = path.relative_to(artifact_dir).as_posix()
            if stat.S_ISLNK(info.st_mode):
                raise ArtifactError(f"{path}: is a symbolic link; an artifact holds regular files only "
                                    f"(copy it with links resolved, or recompile it)")
            if stat.S_ISDIR(info.st_mode):
                directories.append(relpath)
                pending.append(path)
            elif stat.S_ISREG(info.st_mode):
                sizes[relpath] = info.st_size
            else:
                raise ArtifactError(f"{path}: not a regular file; an artifact holds regular files only")
    sizes.pop(MANIFEST_NAME, None)
    return sizes, directories


# A field's rule: what it must be (for the message) and the test. A dict is a nested object's schema.
_Rule = tuple[str, Callable[[Any], bool]]


def _whole(low: int) -> _Rule:
    return (f"a whole number >= {low}", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low)


def _optional(rule: _Rule) -> _Rule:
    return (f"null or {rule[0]}", lambda v: v is None or rule[1](v))


def _one_of(*names: str) -> _Rule:
    return (f"one of {', '.join(names)}", lambda v: isinstance(v, str) and v in names)


def _list_of(rule: _Rule) -> _Rule:
    return (f"a list of {rule[0]}", lambda v: isinstance(v, list) and all(map(rule[1], v)))


_COUNT, _POSITIVE = _whole(0), _whole(1)
_NUMBER: _Rule = ("a finite number",
                lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
_TEXT: _Rule = ("a string", lambda v: isinstance(v, str))
_FLAG: _Rule = ("true or false", lambda v: isinstance(v, bool))
_OBJECT: _Rule = ("an object", lambda v: isinstance(v, dict))

# Every field a reader of the manifest uses (runtime, inspect, tune, analyze), with its rule.
SCHEMA: dict[str, Any] = {
    "ember_version": _TEXT,
    "tvm_version": _TEXT,
    # `ember.frontend.config.ModelConfig`'s fields (a test keeps them equal).
    "model": {
        "model_type": _TEXT, "vocab_size": _POSITIVE, "hidden_size": _POSITIVE, "intermediate_size": _POSITIVE,
        "num_hidden_layers": _POSITIVE, "num_attention_heads": _POSITIVE, "num_key_value_heads": _POSITIVE,
        "head_dim": _POSITIVE, "rms_norm_eps": _NUMBER, "rope_theta": _NUMBER, "rope_scaling": _optional(_OBJECT),
        "context_window": _POSITIVE, "tie_word_embeddings": _FLAG, "attention_bias": _FLAG,
        "sliding_window": _optional(_POSITIVE), "weight_dtype": _TEXT, "bos_token_id": _optional(_COUNT),
        "eos_token_ids": _list_of(_COUNT), "layer_windows": _list_of(_COUNT),
    },
    "quantization": _one_of(*QUANTIZATIONS),
    "model_dtype": _one_of("float32", "float16", "bfloat16"),
    "target": {"name": _TEXT, "tvm_target": _OBJECT, "arch": _TEXT, "hardware": _TEXT, "memory_bytes": _COUNT},
    "entry_functions": _OBJECT,
    "kv_cache": {
        "kind": _one_of("tir_paged"), "page_size": _POSITIVE, "prefill_chunk": _POSITIVE, "max_batch": _POSITIVE,
        "max_context": _POSITIVE, "max_total_tokens": _POSITIVE, "memory_budget": _optional(_POSITIVE),
        "num_layers": _POSITIVE, "num_kv_heads": _POSITIVE, "head_dim": _POSITIVE, "dtype": _TEXT,
        "sliding_window": _optional(_POSITIVE), "rope": _OBJECT, "quantization": _optional(_one_of(*KV_QUANTIZATIONS)),
    },
    "params": _list_of(_TEXT),
    "memory": {
        "weight_bytes": _COUNT, "kv_bytes_per_token": _POSITIVE, "context_window": _POSITIVE,
        "peak_workspace_bytes": _COUNT,
        "workspace_bytes": ("an object of byte counts",
                            lambda v: isinstance(v, dict) and all(map(_COUNT[1], v.values()))),
    },
    "source": _TEXT,
    "source_weights": {"format": _one_of("huggingface", "gguf", "onnx")},
    "files": _OBJECT,
    "kept_float": {"embedding": _FLAG, "lm_head": _FLAG},
    "activations": _one_of("int8", "float"),
}


def _check_fields(path: Path, data: dict[str, Any], schema: dict[str, Any], prefix: str) -> None:
    """Refuse `data` unless it has every field of `schema`, each passing its rule."""
    for key, rule in schema.items():
        name = prefix + key
        if key not in data:
            raise ArtifactError(f"{path}: the manifest has no {name}; recompile the artifact")
        value = data[key]
        if isinstance(rule, dict):
            if not isinstance(value, dict):
                raise ArtifactError(f"{path}: manifest field {name} must be an object, got {reprlib.repr(value)}")
            _check_fields(path, value, rule, name + ".")
        elif not rule[1](value):
            raise ArtifactError(f"{path}: manifest field {name} must be {rule[0]}, got {reprlib.repr(value)}")


def _check_cpu_features(path: Path, target: dict[str, Any]) -> None:
    """Refuse a target.cpu_features (the CPU flags the library needs, as /proc/cpuinfo names them) that is not a
    list of flag names. Manifests written before the field have none: their library's needs are unknown."""
    features = target.get("cpu_features", [])
    if not (isinstance(features, list) and all(isinstance(f, str) and f.isidentifier() for f in features)):
        raise ArtifactError(f"{path}: manifest field target.cpu_features must be a list of CPU flag names, "
                            f"got {reprlib.repr(features)}")


def _check_expert_bytes(path: Path, memory: dict[str, Any]) -> None:
    """Refuse a memory.expert_weight_bytes or memory.active_weight_bytes (a mixture of experts' weights, and those a
    decoded token reads) that is not a byte count within the weights. Manifests written before them have neither."""
    for key in ("expert_weight_bytes", "active_weight_bytes"):
        value = memory.get(key, 0)
        if not (_COUNT[1](value) and value <= memory["weight_bytes"]):
            raise ArtifactError(f"{path}: manifest field memory.{key} must be {_COUNT[0]} no larger than "
                                f"memory.weight_bytes, got {reprlib.repr(value)}")


def _check_long_rope(path: Path, rope: dict[str, Any], entries: dict[str, Any]) -> None:
    """Refuse a kv_cache.rope.long_factors_above (longrope's switch, absent for other models) that is not a
    positive whole number, or that disagrees with prefill taking the prompt's end (`PROMPT_END_INPUT`)."""
    switch = rope.get("long_factors_above")
    if switch is not None and not _POSITIVE[1](switch):
        raise ArtifactError(f"{path}: manifest field kv_cache.rope.long_factors_above must be {_POSITIVE[0]}, "
                            f"got {reprlib.repr(switch)}")
    prefill = entries.get("prefill")
    takes_end = prefill is not None and any(arg["name"] == PROMPT_END_INPUT for arg in prefill["inputs"])
    if takes_end != (switch is not None):
        raise ArtifactError(f"{path}: the manifest's prefill {'takes' if takes_end else 'does not take'} "
                            f"{PROMPT_END_INPUT} but kv_cache.rope {'has no' if takes_end else 'has a'} "
                            "long_factors_above; recompile the artifact")


_ARG_KEYS = {"name", "shape", "dtype"}
_DIMENSION: _Rule = ("sizes and dimension names",
                     lambda v: _COUNT[1](v) or (isinstance(v, str) and v.isidentifier()))


def _check_entry_functions(path: Path, entries: dict[str, Any]) -> None:
    """Refuse entry functions that are not {function: {"inputs": [args], "outputs": [args]}}, each argument
    {"name": identifier} and, for a tensor, its "shape" (sizes and dimension names) and "dtype"."""
    def arg_problem(arg: Any) -> str | None:
        if not (isinstance(arg, dict) and isinstance(arg.get("name"), str) and arg["name"].isidentifier()):
            return "an object with an identifier as its name"
        if set(arg) - _ARG_KEYS:
            return f"keys among {', '.join(sorted(_ARG_KEYS))}"
        if ("shape" in arg) != ("dtype" in arg):
            return "a shape and a dtype, or neither"
        if "shape" in arg and not (isinstance(arg["shape"], list) and all(map(_DIMENSION[1], arg["shape"]))
                                   and _TEXT[1](arg["dtype"])):
            return f"a shape of {_DIMENSION[0]}, and a dtype's name"
        return None

    for function, entry in entries.items():
        where = f"{path}: manifest field entry_functions.{function}"
        if not (isinstance(entry, dict) and isinstance(entry.get("inputs"), list)):
            raise ArtifactError(f"{where} must be an object with a list of inputs, got {reprlib.repr(entry)}")
        if not isinstance(entry.get("outputs", []), list):
            raise ArtifactError(f"{where}.outputs must be a list, got {reprlib.repr(entry['outputs'])}")
        if "max_tokens" in entry and not _POSITIVE[1](entry["max_tokens"]):
            raise ArtifactError(f"{where}.max_tokens must be {_POSITIVE[0]}, got {reprlib.repr(entry['max_tokens'])}")
        for key in ("inputs", "outputs"):
            for i, arg in enumerate(entry.get(key, [])):
                if (problem := arg_problem(arg)) is not None:
                    raise ArtifactError(f"{where}.{key}[{i}] must be {problem}, got {reprlib.repr(arg)}")


def _check_param_types(path: Path, types: Any) -> None:
    """Refuse a param_types that is not {name: {"shape": [whole numbers], "dtype": text}}."""
    def well_formed(entry: Any) -> bool:
        return (isinstance(entry, dict) and _TEXT[1](entry.get("dtype"))
                and _list_of(_COUNT)[1](entry.get("shape")))

    if not (isinstance(types, dict) and all(map(well_formed, types.values()))):
        raise ArtifactError(f"{path}: manifest field param_types must map weight names to "
                            f"{{\"shape\": [sizes], \"dtype\": name}}, got {reprlib.repr(types)}")


_LAYER_RANGE: _Rule = ("[first layer, end layer] with first < end",
                      lambda v: _list_of(_COUNT)[1](v) and len(v) == 2 and v[0] < v[1])
_PIPELINE_SCHEMA = {"stages": ("a list of directory names",
                               lambda v: _list_of(_TEXT)[1](v) and v and all(
                                   PurePosixPath(s).name == s and s not in ("", ".", "..") for s in v)),
                    "layers": _list_of(_LAYER_RANGE), "hidden_size": _POSITIVE}
_STAGE_SCHEMA = {"index": _COUNT, "count": _POSITIVE, "layers": _LAYER_RANGE,
                 "input": _one_of("token_ids", "hidden"), "output": _one_of("hidden", "logits"),
                 "hidden_size": _POSITIVE}


def _check_pipeline_fields(path: Path, data: dict[str, Any]) -> None:
    """Refuse a `pipeline` or `pipeline_stage` field (where present) of another shape than `compile
    --pipeline-stages` writes."""
    pipeline, stage = data.get("pipeline"), data.get("pipeline_stage")
    if pipeline is not None:
        if not isinstance(pipeline, dict):
            raise ArtifactError(f"{path}: manifest field pipeline must be an object, got {reprlib.repr(pipeline)}")
        _check_fields(path, pipeline, _PIPELINE_SCHEMA, "pipeline.")
        if len(pipeline["layers"]) != len(pipeline["stages"]):
            raise ArtifactError(f"{path}: manifest field pipeline names {len(pipeline['stages'])} stages and "
                                f"{len(pipeline['layers'])} layer ranges")
    if stage is not None:
        if not isinstance(stage, dict):
            raise ArtifactError(f"{path}: manifest field pipeline_stage must be an object, got {reprlib.repr(stage)}")
        _check_fields(path, stage, _STAGE_SCHEMA, "pipeline_stage.")
        if stage["index"] >= stage["count"]:
            raise ArtifactError(f"{path}: manifest field pipeline_stage.index {stage['index']} is not below its "
                                f"count {stage['count']}")


def _check_lora_field(path: Path, data: dict[str, Any]) -> None:
    """Refuse a `lora` field (where present) of another shape than `compile --lora-rank` writes, or naming
    parameters the artifact does not take."""
    lora = data.get("lora")
    if lora is None:
        return
    if not isinstance(lora, dict):
        raise ArtifactError(f"{path}: manifest field lora must be an object, got {reprlib.repr(lora)}")
    _check_fields(path, lora, _LORA_SCHEMA, "lora.")
    params = set(data["params"]) if isinstance(data.get("params"), list) else set()
    for module, entry in lora["modules"].items():
        if not isinstance(entry, dict):
            raise ArtifactError(f"{path}: manifest field lora.modules.{module} must be an object")
        _check_fields(path, entry, _LORA_MODULE_SCHEMA, f"lora.modules.{module}.")
        for part in ("a", "b"):
            if entry[part] not in params:
                raise ArtifactError(f"{path}: manifest field lora.modules.{module}.{part} names "
                                    f"{reprlib.repr(entry[part])}, not a parameter of the artifact")


_LORA_SCHEMA = {"rank": _POSITIVE, "slots": _POSITIVE, "modules": _OBJECT}
_LORA_MODULE_SCHEMA = {"a": _TEXT, "b": _TEXT, "a_row": _COUNT, "b_column": _COUNT, "input": _POSITIVE,
                       "output": _POSITIVE}


def _check_file_list(path: Path, files: dict[str, Any], required: list[str]) -> None:
    """Refuse a file list that misses a required file, or names a path outside the artifact (absolute,
    `..`, not normalized, a backslash) or an entry that is not {"sha256": hex, "size": bytes}."""
    for relpath in required:
        if relpath not in files:
            raise ArtifactError(f"{path}: the manifest does not list {relpath}; recompile the artifact")
    for relpath, entry in files.items():
        contained = (relpath and "\\" not in relpath and "\0" not in relpath and not relpath.startswith("/")
                     and posixpath.normpath(relpath) == relpath and ".." not in relpath.split("/")
                     and relpath != MANIFEST_NAME)
        if not contained:
            raise ArtifactError(f"{path}: files entry {reprlib.repr(relpath)} is not a normalized path inside "
                                f"the artifact; recompile the artifact")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _COUNT[1](entry.get("size"))):
            raise ArtifactError(f"{path}: files entry {relpath} must be {{\"sha256\": hex, \"size\": bytes}}, "
                                f"got {reprlib.repr(entry)}")
