"""Pick the importer for a model path: a GGUF file, an ONNX file, or a Hugging Face checkpoint directory; and read
back what an artifact's manifest records of its source.

The importers build Relax, so they and TVM's compiler are imported by `import_model` alone: reading a manifest's
records (`ember inspect`) loads neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.core.errors import EmberError
from ember.frontend import gguf
from ember.frontend.files import is_onnx_file

if TYPE_CHECKING:
    import tvm

    from ember.frontend.hf import ImportedModel

FRONTENDS = ("builtin", "torch-export")


def import_model(path: Path, target: tvm.target.Target, model_dtype: str = "float32",
                 workdir: Path | None = None, frontend: str = "builtin",
                 tokenizer_dir: Path | None = None, embeddings: bool = False) -> ImportedModel:
    """Import `path`: a GGUF file (by suffix or magic), an ONNX file (by suffix; its tokenizer and config.json in
    `tokenizer_dir`, by default beside it) or a Hugging Face checkpoint directory, whose graph `frontend` builds:
    ember's hand-written model definition, or `torch.export` of transformers' own code.

    `workdir` receives files the importer writes (a GGUF file's tokenizer.json); see `import_gguf_model`.
    `embeddings` adds the `embed` entry (`/v1/embeddings`), which only ember's own model definition has.
    """
    path = Path(path)
    if frontend not in FRONTENDS:
        raise EmberError(f"--frontend {frontend!r} is not supported; choose one of {', '.join(FRONTENDS)}")
    if tokenizer_dir is not None and not is_onnx_file(path):
        raise EmberError(f"--tokenizer {tokenizer_dir}: only an ONNX file takes its tokenizer from another "
                         f"directory; {path} has its own")
    if embeddings and (frontend != "builtin" or gguf.is_gguf_file(path) or is_onnx_file(path)):
        what = f"--frontend {frontend}" if frontend != "builtin" else f"a {path.suffix} file"
        raise EmberError(f"--embeddings: {path}: only a checkpoint directory imported by ember's own model "
                         f"definition (--frontend builtin) has the embed entry; {what} does not")
    if gguf.is_gguf_file(path) or is_onnx_file(path):
        if frontend != "builtin":
            raise EmberError(f"--frontend {frontend}: {path} is a {path.suffix} file, which is imported as it is")
        if is_onnx_file(path):
            from ember.frontend.onnx import import_onnx_model

            return import_onnx_model(path, tokenizer_dir, model_dtype)
        return gguf.import_gguf_model(path, target, model_dtype, workdir)
    from ember.frontend.hf import import_hf_model

    return import_hf_model(path, target, model_dtype, exported=frontend == "torch-export", embeddings=embeddings)


def default_quantization(path: Path, target_default: str) -> str:
    """The `--quant` a model compiles to when none is given: a GGUF file's own (the format that keeps its
    dominant weight type as stored), else `target_default` (the target's)."""
    return gguf.default_quantization(Path(path)) if gguf.is_gguf_file(Path(path)) else target_default


def stored_formats(imported: ImportedModel) -> dict[str, str]:
    """Per weight, the format keeping the type it is stored in: a GGUF file's own per-tensor types
    (`GGUFWeights.stored_formats`); none for a Hugging Face checkpoint, whose weights share one --quant."""
    if not isinstance(imported.weights, gguf.GGUFWeights):
        return {}
    return imported.weights.stored_formats(imported.model_dtype)


def recorded_formats(record: dict[str, Any], model_dtype: str) -> dict[str, str]:
    """Per tensor, the format an artifact stores it in, from its manifest's `source_record`: a GGUF
    file's `stored_as` entries (float as the compute dtype's q0 format); none for a Hugging Face
    checkpoint, whose weights all take the manifest's quantization. What rebuilds the artifact's kernels."""
    float_format = "q0f16" if model_dtype == "float16" else "q0f32"
    return {name: float_format if entry["stored_as"] == "float" else entry["stored_as"]
            for name, entry in record.get("conversion", {}).items()}


def recorded_frontend(record: dict[str, Any]) -> str:
    """The `--frontend` an artifact's manifest `source_record` says built its graph (an ONNX file's is implied by
    the file)."""
    frontend = record.get("frontend", "builtin")
    return frontend if frontend in FRONTENDS else "builtin"


def recorded_config_dir(record: dict[str, Any]) -> Path | None:
    """Where an ONNX source's config.json and tokenizer were read, as its artifact's manifest records it."""
    return Path(record["config_dir"]) if record.get("config_dir") else None


def source_record(imported: ImportedModel, quantized: dict[str, Any]) -> dict[str, Any]:
    """What the manifest records of the weights' source beyond its path: for a GGUF file its hash and,
    per tensor, the stored type and whether its format in `quantized` (tensor name -> `QuantFormat`, the
    quantized ones) kept it or converted it (with the conversion's error)."""
    if imported.frontend == "onnx":
        return {"format": "onnx", "frontend": "onnx", "config_dir": str(imported.config_dir.resolve())}
    if not isinstance(imported.weights, gguf.GGUFWeights):
        return {"format": "huggingface", "frontend": imported.frontend}
    return {**gguf.source_record(imported.weights), "conversion": imported.weights.conversion_report(quantized)}
