"""Lazy, validated access to the safetensors weights of a Hugging Face checkpoint.

The safetensors header is parsed here rather than by the `safetensors` package so
that every failure names its file and tensor (a truncated shard, a tensor whose
bytes run past the end of the file) and so that bfloat16 maps onto `ml_dtypes`.
Tensors are memory-mapped and read one at a time: a checkpoint larger than RAM is
never read whole.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ember.errors import ModelError

_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives: its file, dtype, shape and byte range."""

    name: str
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class CheckpointWeights:
    """The tensors of a checkpoint directory, read lazily by name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.records: dict[str, TensorRecord] = {}
        for path in _shard_paths(self.model_dir):
            for record in _read_header(path):
                self.records[record.name] = record

    def record(self, name: str) -> TensorRecord:
        """The location of `name`, or a `ModelError` that names the missing tensor."""
        if name not in self.records:
            raise ModelError(
                f"{self.model_dir}: tensor {name!r} is missing from the checkpoint "
                f"(found {len(self.records)} tensors in {', '.join(sorted({r.path.name for r in self.records.values()}))})"
            )
        return self.records[name]

    def load(self, name: str) -> np.ndarray:
        """Read one tensor into memory (a copy, independent of the file)."""
        record = self.record(name)
        data = np.memmap(record.path, dtype=np.uint8, mode="r", offset=record.offset, shape=(record.nbytes,))
        return np.array(data.view(record.dtype).reshape(record.shape))


def _shard_paths(model_dir: Path) -> list[Path]:
    index_path = model_dir / "model.safetensors.index.json"
    single_path = model_dir / "model.safetensors"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelError(f"{index_path}: malformed index ({err})") from None
        paths = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for path in paths:
            if not path.exists():
                raise ModelError(f"{index_path}: lists shard {path.name}, which does not exist")
        return paths
    if single_path.exists():
        return [single_path]
    found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
    hint = f" (found {', '.join(found)}; ember reads safetensors only, never pickles)" if found else ""
    raise ModelError(f"{model_dir}: no model.safetensors or model.safetensors.index.json{hint}")


def _read_header(path: Path) -> list[TensorRecord]:
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise ModelError(f"{path}: truncated or corrupt safetensors header (declares {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelError(f"{path}: corrupt safetensors header: {err}") from None
    data_start = 8 + header_len
    records = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ModelError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ModelError(f"{path}: tensor {name!r} byte range does not match shape {shape}")
        if data_start + end > file_size:
            raise ModelError(
                f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, "
                f"file has {file_size} bytes"
            )
        records.append(TensorRecord(name, path, dtype, shape, data_start + begin, end - begin))
    return records
