"""Pick the importer for a model path: a GGUF file, or a Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import tvm

from ember.frontend.gguf import import_gguf_model, is_gguf_file
from ember.frontend.hf import ImportedModel, import_hf_model


def import_model(path: Path, target: tvm.target.Target, model_dtype: str = "float32",
                 workdir: Path | None = None) -> ImportedModel:
    """Import `path`: a GGUF file (by suffix or magic) or a Hugging Face checkpoint directory.

    `workdir` receives files the importer writes (a GGUF file's tokenizer.json); see `import_gguf_model`.
    """
    if is_gguf_file(Path(path)):
        return import_gguf_model(Path(path), target, model_dtype, workdir)
    return import_hf_model(Path(path), target, model_dtype)
