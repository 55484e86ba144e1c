"""Lazy, validated access to the safetensors weights of a Hugging Face checkpoint.

Each shard's header is checked field by field (`ember.core.safetensors_header`), and no
tensor may be in two shards. Tensors are memory-mapped and read one at a time: a
checkpoint larger than RAM is never read whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ember.core.errors import ModelError
from ember.core.files import checkpoint_file, optional_checkpoint_file, read_json_object
from ember.core.safetensors_header import TensorRecord, read_header, read_tensor


class CheckpointWeights:
    """The tensors of a checkpoint directory, read lazily by name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.records: dict[str, TensorRecord] = {}
        for path in _shard_paths(self.model_dir):
            for record in read_header(path):
                if record.name in self.records:
                    raise ModelError(f"{path}: tensor {record.name!r} is also in {self.records[record.name].path}")
                self.records[record.name] = record

    def record(self, name: str) -> TensorRecord:
        """The location of `name`, or a `ModelError` that names the missing tensor."""
        if name not in self.records:
            files = ", ".join(sorted({r.path.name for r in self.records.values()}))
            raise ModelError(
                f"{self.model_dir}: tensor {name!r} is missing from the checkpoint "
                f"(found {len(self.records)} tensors in {files})"
            )
        return self.records[name]

    def load(self, name: str) -> np.ndarray:
        """Read one tensor into memory (a copy, independent of the file)."""
        return read_tensor(self.record(name))


def _shard_paths(model_dir: Path) -> list[Path]:
    index_path = optional_checkpoint_file(model_dir, "model.safetensors.index.json")
    if index_path:
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{index_path}: malformed index ('weight_map' must map tensor names to shard file names)")
        return [checkpoint_file(model_dir, name, listed_in=index_path) for name in dict.fromkeys(weight_map.values())]
    single_path = optional_checkpoint_file(model_dir, "model.safetensors")
    if single_path:
        return [single_path]
    found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
    hint = f" (found {', '.join(found)}; ember reads safetensors only, never pickles)" if found else ""
    raise ModelError(f"{model_dir}: no model.safetensors or model.safetensors.index.json{hint}")
