"""The header of a safetensors file, parsed as if a stranger wrote it.

Parsed here rather than by the `safetensors` package so that every failure names its file and tensor (a
truncated file, a tensor whose bytes run past its end) and so that bfloat16 maps onto `ml_dtypes`. A header is
checked field by field and its byte ranges must not overlap: a crafted one could otherwise make a weight out of
the header's own text or another tensor. A checkpoint's weights (`ember.frontend.weights`) and a LoRA adapter's
(`ember.runtime.lora`) are read through it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ember.core.errors import ModelError
from ember.core.files import parse_json, short_repr

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


def read_tensor(record: TensorRecord) -> np.ndarray:
    """Read one tensor into memory (a copy, independent of the file)."""
    data = np.memmap(record.path, dtype=np.uint8, mode="r", offset=record.offset, shape=(record.nbytes,))
    return np.array(data.view(record.dtype).reshape(record.shape))


def read_header(path: Path) -> list[TensorRecord]:
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise ModelError(f"{path}: truncated or corrupt safetensors header (declares {header_len} bytes)")
        header = parse_json(f.read(header_len), f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise ModelError(f"{path}: corrupt safetensors header: expected a JSON object, got {type(header).__name__}")
    data_start = 8 + header_len
    records = [_record(path, name, entry, data_start, file_size)
               for name, entry in header.items() if name != "__metadata__"]
    # A byte range shared by two tensors would make a crafted file load one tensor's data as another's.
    end = 0
    for record in sorted((r for r in records if r.nbytes), key=lambda r: r.offset):
        if record.offset < end:
            raise ModelError(f"{path}: tensor {record.name!r} overlaps the bytes of another tensor")
        end = record.offset + record.nbytes
    return records


def _record(path: Path, name: str, entry: object, data_start: int, file_size: int) -> TensorRecord:
    """One header entry, checked field by field: a hostile header may hold any JSON at all."""
    def bad(what: str) -> ModelError:
        return ModelError(f"{path}: tensor {name!r} has {what} in its safetensors header")

    if not isinstance(entry, dict):
        raise bad(f"an entry that is a {type(entry).__name__}, not an object")
    dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ModelError(f"{path}: tensor {name!r} has unsupported dtype {short_repr(dtype_name)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"a malformed shape {short_repr(shape)} (expected a list of non-negative integers)")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets)
            or offsets[0] > offsets[1]):
        raise bad(f"malformed data_offsets {short_repr(offsets)} (expected [begin, end], integers 0 <= begin <= end)")
    shape, (begin, end) = tuple(shape), offsets
    if end - begin != dtype.itemsize * math.prod(shape):
        raise ModelError(f"{path}: tensor {name!r} byte range does not match shape {shape}")
    if data_start + end > file_size:
        raise ModelError(
            f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, "
            f"file has {file_size} bytes"
        )
    return TensorRecord(name, path, dtype, shape, data_start + begin, end - begin)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

