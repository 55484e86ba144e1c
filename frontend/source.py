"""Pick the importer for a model path: a GGUF file, an ONNX file, or a Hugging Face checkpoint directory.

What an artifact's manifest records of its source is written and read by `ember.frontend.records`, which imports
no TVM."""

from __future__ import annotations

from pathlib import Path

import tvm

from ember.core.errors import EmberError
from ember.core.files import is_onnx_file
from ember.frontend import gguf, onnx
from ember.frontend.hf import ImportedModel, import_hf_model
from ember.frontend.records import FRONTENDS


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
            return onnx.import_onnx_model(path, tokenizer_dir, model_dtype)
        return gguf.import_gguf_model(path, target, model_dtype, workdir)
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
