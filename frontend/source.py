"""Pick the importer for a model path: a GGUF file, or a Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tvm

from ember.frontend import gguf
from ember.frontend.hf import ImportedModel, import_hf_model


def import_model(path: Path, target: tvm.target.Target, model_dtype: str = "float32",
                 workdir: Path | None = None) -> ImportedModel:
    """Import `path`: a GGUF file (by suffix or magic) or a Hugging Face checkpoint directory.

    `workdir` receives files the importer writes (a GGUF file's tokenizer.json); see `import_gguf_model`.
    """
    if gguf.is_gguf_file(Path(path)):
        return gguf.import_gguf_model(Path(path), target, model_dtype, workdir)
    return import_hf_model(Path(path), target, model_dtype)


def default_quantization(path: Path, target_default: str) -> str:
    """The `--quant` a model compiles to when none is given: a GGUF file's own (the format that keeps its
    dominant weight type as stored), else `target_default` (the target's)."""
    return gguf.default_quantization(Path(path)) if gguf.is_gguf_file(Path(path)) else target_default


def source_record(imported: ImportedModel, fmt, quantized_names: set[str]) -> dict[str, Any]:
    """What the manifest records of the weights' source beyond its path: for a GGUF file its hash and,
    per tensor, the stored type and whether `fmt` kept it or converted it (with the conversion's error)."""
    if not isinstance(imported.weights, gguf.GGUFWeights):
        return {"format": "huggingface"}
    return {**gguf.source_record(imported.weights),
            "conversion": imported.weights.conversion_report(fmt, quantized_names)}
