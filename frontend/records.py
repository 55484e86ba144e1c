"""What an artifact's manifest records of its source (`Manifest.source_weights`), written at compile time and read
back to rebuild the artifact's kernels (`ember tune`, `ember analyze --measure`) or to describe it (`ember inspect`).

Imports no TVM: `ember inspect` reads a manifest without the compiler.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.frontend import gguf

if TYPE_CHECKING:
    from ember.frontend.hf import ImportedModel

# The importers of a checkpoint directory's graph (`--frontend`): ember's hand-written model definitions, or
# torch.export of transformers' own code.
FRONTENDS = ("builtin", "torch-export")


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
