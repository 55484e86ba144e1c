"""Import a GGUF file (llama.cpp's format): config, weights and tokenizer from one file.

The file is read with the `gguf` package (maintained with llama.cpp), memory-mapped:
tensors are read one at a time, so a file larger than RAM is never read whole. Its
reader raises bare errors on bad input, so the header is checked here first (magic,
version) and every tensor's type, shape and byte range before the reader slices it;
each failure is one line naming the file and the tensor or metadata key.

Llama and Qwen2 files are built by ember's own definition (other architectures go
through the graph transformers traces, `frontend/gguf_traced.py`). Metadata becomes a
Hugging Face style config dict checked by `parse_model_config`, tensor names become
Hugging Face names, and llama.cpp's row permutation of the Llama q/k projections
(its RoPE pairs adjacent channels) is undone, so the rest of
ember sees the checkpoint it would have read from the original directory. Llama 3's
RoPE scaling, which llama.cpp's converter stores as per-frequency divisors in the
`rope_freqs.weight` tensor, becomes the `rope_scaling` it came from (`gguf_rope`).

Each weight keeps its own type (`stored_formats`: a mixed file such as Q4_K_M stays
mixed). Types ember stores natively are kept as stored: Q8_0, Q4_0 and Q4_1 blocks
hand their integer levels, scales and minimums to `q8*`, `q4*` and `q4*_zp` unchanged
(`stored_quantization`); F32/F16/BF16 stay float. The other block types become the
closest ember format with at least their precision: Q4_K/Q2_K/Q3_K (a scale and a
minimum per sub-block) `q4*_zp`, the 5- and 6-bit types (Q5_K, Q6_K, Q5_0, Q5_1) `q8*`,
so a Q6_K output head is not cut to 4 bits. Those are dequantized and re-quantized,
which costs a little accuracy: `GGUFWeights.conversion_report` measures it. An explicit
`--quant` instead stores every weight in that one format.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.core.errors import ModelError
from ember.core.files import short_repr
from ember.frontend import gguf_rope
from ember.frontend.config import ModelConfig, parse_model_config

if TYPE_CHECKING:
    import tvm

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_FLOAT_TYPES = ("F32", "F16", "BF16")
_STORED_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}  # types whose blocks ember's formats hold as they are
_CONVERTED_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q8_1")
SUPPORTED_TENSOR_TYPES = _FLOAT_TYPES + tuple(_STORED_TYPES) + _CONVERTED_TYPES
# The ember format (before its compute dtype: q8 + f32 = q8f32) holding each GGUF type: as stored, or the
# closest with at least the type's precision.
_FORMAT_OF_TYPE = {"F32": ("q0", ""), "F16": ("q0", ""), "BF16": ("q0", ""), "Q8_0": ("q8", ""),
                   "Q4_0": ("q4", ""), "Q4_1": ("q4", "_zp"), "Q4_K": ("q4", "_zp"), "Q2_K": ("q4", "_zp"),
                   "Q3_K": ("q4", "_zp"), "Q5_K": ("q8", ""), "Q6_K": ("q8", ""), "Q5_0": ("q8", ""),
                   "Q5_1": ("q8", ""), "Q8_1": ("q8", "")}
# The re-quantization error of a converted tensor is measured on this many of its rows (the error of a
# 4-bit group is independent of where the row is: 1024 rows of >= 1024 values give it to ~0.1%), in blocks.
ERROR_ROWS, ERROR_BLOCK_ROWS = 1024, 256
_BLOCK_PREFIX = "blk."
# GGUF tensor name (the part after `blk.N.` for layers) -> Hugging Face name.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is named *.gguf (and is not a directory) or is a file that starts with the GGUF magic."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return True
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def _reader_class():
    """A `gguf.GGUFReader` that checks each tensor's header entry before the reader slices the file."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            _check_tensor_fields(Path(self.data.filename), len(self.data), start_offs, fields)
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _check_tensor_fields(path: Path, file_size: int, data_start: int, fields: list) -> None:
    import gguf

    spans = []
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        code = int(raw_type[0])
        try:
            qtype = gguf.GGMLQuantizationType(code)
        except ValueError:
            raise ModelError(f"{path}: tensor {name!r} has unknown tensor type code {code}") from None
        if qtype.name not in SUPPORTED_TENSOR_TYPES:
            raise ModelError(f"{path}: tensor {name!r} has type {qtype.name}, which ember does not read; "
                             f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = [int(d) for d in dims]
        if not shape or shape[0] % block:
            raise ModelError(f"{path}: tensor {name!r} of type {qtype.name} has shape {shape}: its first dimension "
                             f"must be a multiple of the type's block of {block}")
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        begin = data_start + int(offset[0])
        if begin + nbytes > file_size:
            raise ModelError(f"{path}: truncated or corrupt file: tensor {name!r} ({qtype.name}, shape {shape}) "
                             f"spans bytes {begin}..{begin + nbytes}, past the end of the file ({file_size} bytes)")
        spans.append((begin, nbytes, name))
    end, previous = 0, ""
    for begin, nbytes, name in sorted(spans):
        if nbytes and begin < end:
            raise ModelError(f"{path}: tensor {name!r} overlaps the bytes of tensor {previous!r}")
        if nbytes:
            end, previous = begin + nbytes, name


def check_gguf_header(path: Path) -> None:
    """Refuse, in one line, a path that is not a regular file starting with a GGUF header ember reads.

    Reads 8 bytes and needs neither TVM nor the `gguf` package: the CLI calls it before importing the compiler.
    """
    path = Path(path)
    if not path.is_file():  # never open a FIFO or a device: a FIFO blocks open() forever
        raise ModelError(f"{path}: not a regular file (expected a GGUF file)")
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as err:
        raise ModelError(f"{path}: cannot read: {err.strerror}") from None
    if len(head) < 8:
        raise ModelError(f"{path}: truncated GGUF file ({len(head)} bytes, no header)")
    if head[:4] != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    (version,) = struct.unpack("<I", head[4:])
    if version not in SUPPORTED_VERSIONS:
        raise ModelError(f"{path}: GGUF version {version} is not supported (ember reads versions "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))})")


def open_gguf(path: Path):
    """The checked `gguf.GGUFReader` of `path`, or a one-line `ModelError` naming what is wrong."""
    path = Path(path)
    check_gguf_header(path)
    try:
        return _reader_class()(path)
    except ModelError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as err:
        # The reader walks the metadata with numpy views: a truncated or corrupt header ends in one of these.
        reason = str(err).strip().splitlines() or [type(err).__name__]
        raise ModelError(f"{path}: truncated or corrupt GGUF header: {reason[0]}") from None


class Metadata:
    """Typed access to a GGUF file's metadata; errors name the key."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        """The value of `key`, checked to be of `kind` (int, float, str, bool, list); `default` if absent."""
        field = self.fields.get(key)
        if field is None:
            if required:
                raise ModelError(f"{self.path}: metadata {key!r} is missing")
            return default
        import gguf

        scalar_kinds = {
            int: {gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
                  gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                  gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64},
            float: {gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64},
            str: {gguf.GGUFValueType.STRING},
            bool: {gguf.GGUFValueType.BOOL},
            list: {gguf.GGUFValueType.ARRAY},
        }
        kind_names = {int: "an integer", float: "a float", str: "a string", bool: "a boolean", list: "an array"}
        found = field.types[0]
        if found not in scalar_kinds[kind] and not (kind is float and found in scalar_kinds[int]):
            raise ModelError(f"{self.path}: metadata {key!r} must be {kind_names[kind]}, "
                             f"got {found.name.lower()}")
        try:
            value = field.contents()
        except UnicodeDecodeError:
            raise ModelError(f"{self.path}: metadata {key!r} holds a string that is not UTF-8") from None
        return float(value) if kind is float else value

    def strings(self, key: str, required: bool = False) -> list[str] | None:
        """The array of strings at `key` (None if absent and not `required`); other item types are refused."""
        values = self.get(key, list, required=required)
        if values is not None and not all(isinstance(value, str) for value in values):
            raise ModelError(f"{self.path}: metadata {key!r} must be an array of strings")
        return values

    def numbers(self, key: str, count: int, kind: type) -> list | None:
        """The array of `count` numbers of `kind` (int or float) at `key`, None if absent."""
        values = self.get(key, list)
        if values is None:
            return None
        allowed = (int,) if kind is int else (int, float)
        if not all(isinstance(value, allowed) and not isinstance(value, bool) for value in values):
            raise ModelError(f"{self.path}: metadata {key!r} must be an array of "
                             f"{'integers' if kind is int else 'numbers'}")
        if len(values) != count:
            raise ModelError(f"{self.path}: metadata {key!r} has {len(values)} entries, "
                             f"'tokenizer.ggml.tokens' {count}")
        return values

    def token_id(self, key: str, tokens: list[str], default: int | None = None) -> int | None:
        """The token id at `key` (`default` if absent), checked to index `tokens`."""
        token_id = self.get(key, int, default)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelError(f"{self.path}: metadata {key!r} {token_id} is not a token id "
                             f"(the vocabulary has {len(tokens)})")
        return token_id


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file under its Hugging Face name: its type, and its shape as ember reads it."""

    name: str
    gguf_name: str
    type_name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    path: Path


class GGUFWeights:
    """The tensors of a GGUF file under Hugging Face names, read lazily (as `CheckpointWeights`)."""

    def __init__(self, path: Path, reader, config: ModelConfig,
                 hf_names: Callable[[str], str | None] | None = None) -> None:
        """`hf_names`: the Hugging Face name of a GGUF tensor, None for one ember does not read (ember's names for
        the Llama family by default)."""
        self.path = Path(path)
        self._reader, self._config = reader, config
        self._tensors = {}
        self.records: dict[str, GGUFTensor] = {}
        hf_names = hf_names or _hf_name
        for tensor in reader.tensors:
            hf_name = hf_names(tensor.name)
            if hf_name is None:
                continue  # rope_freqs and other tensors ember computes itself
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            dtype = np.dtype(np.float16 if tensor.tensor_type.name == "F16" else np.float32)
            self._tensors[hf_name] = tensor
            self.records[hf_name] = GGUFTensor(hf_name, tensor.name, tensor.tensor_type.name, shape, dtype, self.path)

    def record(self, name: str) -> GGUFTensor:
        """The tensor `name`, or a `ModelError` that names it."""
        if name not in self.records:
            raise ModelError(f"{self.path}: tensor {name!r} (GGUF {_gguf_name(name)!r}) is missing from the file")
        return self.records[name]

    def load(self, name: str) -> np.ndarray:
        """Tensor `name` as float (dequantized if stored quantized), in Hugging Face layout."""
        import gguf

        tensor = self._tensors[self.record(name).name]
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return self._unpermute(name, np.asarray(values).reshape(self.records[name].shape))

    def stored_quantization(self, name: str, bits: int, zero_point: bool) -> dict[str, np.ndarray] | None:
        """The stored levels, scales (and minimums) of `name` if it is held in a block type ember's format
        (`bits`, `zero_point`) stores as is, else None: {"levels": [N, K] signed (unsigned for zero point)
        integers, "scale": [N, K/32] float32, "min": [N, K/32] float32}."""
        record = self.record(name)
        if _STORED_TYPES.get(record.type_name) != bits or (record.type_name == "Q4_1") != zero_point:
            return None
        blocks = np.asarray(self._tensors[name].data).reshape(record.shape[0], -1)
        n, groups = record.shape[0], record.shape[1] // 32
        blocks = blocks.reshape(n, groups, -1)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        parts = {"scale": scale}
        if record.type_name == "Q8_0":
            levels = blocks[..., 2:].copy().view(np.int8).astype(np.int32)
        else:
            start = 4 if zero_point else 2
            nibbles = blocks[..., start:]
            levels = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int32)
            if zero_point:
                parts["min"] = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            else:
                levels -= 8
        parts["levels"] = levels.reshape(n, -1)
        return {key: self._unpermute(name, value) for key, value in parts.items()}

    def stored_formats(self, model_dtype: str) -> dict[str, str]:
        """Per weight matrix, the ember format keeping its GGUF type (`_FORMAT_OF_TYPE`) at the compute
        dtype `model_dtype`: what `ember compile` stores each weight in when no --quant is given."""
        return {name: format_of_type(record.type_name, model_dtype)
                for name, record in self.records.items() if len(record.shape) == 2}

    def conversion_report(self, formats: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per tensor: its GGUF type and what ember stores (its `QuantFormat` in `formats`, the quantized
        tensors, else float), with "kept" (the file's values unchanged) or "converted" and the relative RMS
        weight error of re-quantizing. For the manifest and the compile-time print of what a K-quant file loses."""
        report = {}
        for name, record in sorted(self.records.items()):
            fmt = formats.get(name)
            entry = {"gguf_type": record.type_name, "stored_as": fmt.name if fmt is not None else "float"}
            if fmt is None or self.stored_quantization(name, fmt.bits, fmt.zero_point) is not None:
                entry["conversion"] = "kept"
            else:
                entry.update(conversion="converted", relative_rms_error=self._conversion_error(name, fmt))
            report[name] = entry
        return report

    def _conversion_error(self, name: str, fmt) -> float:
        """Relative RMS error of `name` re-quantized to `fmt`, over at most ERROR_ROWS of its rows spread
        evenly over it (all of a smaller tensor), dequantized from the file a few at a time: a 128k-token
        vocabulary is neither held in float nor quantized twice (the conversion itself quantizes it)."""
        import gguf

        squared_error = squared_norm = 0.0
        tensors = self._source_tensors(name)
        for tensor in tensors:
            data = np.asarray(tensor.data)
            data = data.reshape(-1, data.shape[-1])  # rows (of every expert, in a stack of experts)
            count = min(max(ERROR_ROWS // len(tensors), 1), data.shape[0])
            rows = np.unique(np.linspace(0, data.shape[0] - 1, count).astype(np.int64))
            for start in range(0, len(rows), ERROR_BLOCK_ROWS):
                block = np.asarray(gguf.quants.dequantize(data[rows[start:start + ERROR_BLOCK_ROWS]],
                                                          tensor.tensor_type), dtype=np.float32)
                block = block.reshape(block.shape[0], -1)
                requantized = fmt.dequantize(fmt.quantize(block), block.shape[1]).astype(np.float32)
                squared_error += float(np.sum((requantized - block).astype(np.float64) ** 2))
                squared_norm += float(np.sum(block.astype(np.float64) ** 2))
        return float(np.sqrt(squared_error / max(squared_norm, 1e-30)))

    def _source_tensors(self, name: str) -> list:
        """The file's tensors that hold parameter `name`."""
        return [self._tensors[self.record(name).name]]

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's Llama q/k row order (pairs of RoPE channels adjacent) on row-indexed `rows`."""
        config = self._config
        if config.model_type != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return rows
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        shape = rows.shape
        return np.ascontiguousarray(rows.reshape(heads, -1, 2, *shape[1:]).swapaxes(1, 2).reshape(shape))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith(_BLOCK_PREFIX):
        layer, _, rest = gguf_name[len(_BLOCK_PREFIX):].partition(".")
        if layer.isdigit() and rest in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"
    return None


def _gguf_name(hf_name: str) -> str:
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf_name:
            return gguf_name
    layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
    return next((f"blk.{layer}.{g}" for g, h in _LAYER_NAMES.items() if h == rest), hf_name)


def read_through_transformers(reader, path: Path) -> bool:
    """Whether the file is read through transformers' GGUF mappings (`frontend/gguf_traced.py`): every architecture
    but those ember defines itself, and those too when their layers are mixtures of experts. An architecture neither
    reads is one line naming the supported ones."""
    architecture = Metadata(reader, path).get("general.architecture", str, required=True)
    if architecture in SUPPORTED_ARCHITECTURES and not has_experts(Metadata(reader, path), architecture):
        return False
    from ember.frontend.gguf_traced import traced_architectures

    if not traced_architectures():  # transformers is what reads every other architecture
        raise ModelError(f"{path}: general.architecture {short_repr(architecture)}"
                         f"{' with experts' if architecture in SUPPORTED_ARCHITECTURES else ''} is read through "
                         "transformers' GGUF mappings, and this Python has no transformers: pip install "
                         "torch==2.13.0 transformers")
    if architecture not in traced_architectures():
        raise ModelError(f"{path}: general.architecture {short_repr(architecture)} is not supported; supported: "
                         f"{', '.join(dict.fromkeys(SUPPORTED_ARCHITECTURES + traced_architectures()))}")
    return True


def gguf_config(reader, path: Path) -> ModelConfig:
    """The model config of the file's metadata, validated as a Hugging Face config.json would be."""
    meta = Metadata(reader, path)
    arch = meta.get("general.architecture", str, required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"{path}: general.architecture {short_repr(arch)} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    tokens = meta.strings("tokenizer.ggml.tokens")
    heads = meta.get(f"{arch}.attention.head_count", int, required=True)
    hidden = meta.get(f"{arch}.embedding_length", int, required=True)
    names = {t.name for t in reader.tensors}
    raw = {
        "model_type": arch,
        "vocab_size": meta.get(f"{arch}.vocab_size", int) or (len(tokens) if tokens is not None else None),
        "hidden_size": hidden,
        "intermediate_size": meta.get(f"{arch}.feed_forward_length", int, required=True),
        "num_hidden_layers": meta.get(f"{arch}.block_count", int, required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", int, heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", int),
        "max_position_embeddings": meta.get(f"{arch}.context_length", int, required=True),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", float, 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", int),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", int),
    }
    if raw["vocab_size"] is None:
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None or len(embedding.shape) != 2:
            raise ModelError(f"{path}: no vocabulary size: metadata '{arch}.vocab_size' and 'tokenizer.ggml.tokens' "
                             "are missing and there is no 2-D 'token_embd.weight' tensor")
        raw["vocab_size"] = int(embedding.shape[1])
    sliding_window = meta.get(f"{arch}.attention.sliding_window", int)
    if sliding_window:
        raw["sliding_window"] = sliding_window
        raw["use_sliding_window"] = True
    scaling = meta.get(f"{arch}.rope.scaling.type", str)
    if scaling not in (None, "none"):
        raise ModelError(f"{path}: metadata '{arch}.rope.scaling.type' {short_repr(scaling)} is not supported")
    config = parse_model_config(raw, f"{path} (metadata)")
    rope_freqs = next((t for t in reader.tensors if t.name == gguf_rope.TENSOR), None)
    if rope_freqs is not None:
        if rope_freqs.tensor_type.name != "F32":
            raise ModelError(f"{path}: tensor {gguf_rope.TENSOR!r} is {rope_freqs.tensor_type.name}; llama.cpp "
                             "writes it as F32")
        raw["rope_scaling"] = gguf_rope.llama3_rope_scaling(rope_freqs.data, config.rope_theta, config.head_dim, path)
        config = parse_model_config(raw, f"{path} (metadata and {gguf_rope.TENSOR!r})")
    rope_dims = meta.get(f"{arch}.rope.dimension_count", int)
    if rope_dims is not None and rope_dims != config.head_dim:
        raise ModelError(f"{path}: metadata '{arch}.rope.dimension_count' is {rope_dims}; ember rotates whole "
                         "heads only (partial RoPE is not supported)")
    return config


def format_of_type(type_name: str, model_dtype: str) -> str:
    """The ember format holding GGUF weights of `type_name` with compute dtype `model_dtype`."""
    base, suffix = _FORMAT_OF_TYPE[type_name]
    return f"{base}{'f16' if model_dtype == 'float16' else 'f32'}{suffix}"


def default_quantization(path: Path) -> str:
    """The `--quant` matching the file's dominant weight type (by bytes): a GGUF file's compute dtype
    (float16 for an F16 file of ember's own definitions, else float32: a traced graph computes in float32) and the
    format of the weights not stored otherwise."""
    reader = open_gguf(path)
    sizes = Counter()
    for tensor in reader.tensors:
        if len(tensor.shape) == 2:
            sizes[tensor.tensor_type.name] += int(tensor.n_bytes)
    dominant = sizes.most_common(1)[0][0] if sizes else "F32"
    own = Metadata(reader, path).get("general.architecture", str) in SUPPORTED_ARCHITECTURES
    return format_of_type(dominant, "float16" if dominant == "F16" and own else "float32")


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file, read in chunks (for the manifest's record of the source)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def has_experts(metadata: Metadata, architecture: str) -> bool:
    """Whether the file's layers are mixtures of experts (`{architecture}.expert_count` above zero): those are
    read through transformers' definition of the architecture, whatever it is called (Mixtral's files say llama)."""
    return (metadata.get(f"{architecture}.expert_count", int) or 0) > 0


def import_gguf_model(path: Path, target: tvm.target.Target, model_dtype: str = "float32",
                      workdir: Path | None = None):
    """Build the Relax IRModule for the GGUF file at `path`.

    Its tokenizer files are written into `workdir` (the compile's staging directory); without one,
    into a temporary directory removed when the process exits.
    """
    import atexit
    import shutil
    import tempfile

    from ember.frontend.gguf_tokenizer import write_tokenizer_files
    from ember.frontend.hf import ImportedModel, _check_tensor, build_module, check_tokenizer_files

    path = Path(path)
    reader = open_gguf(path)
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="ember-gguf-"))
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    if read_through_transformers(reader, path):
        from ember.frontend.gguf_traced import import_traced_gguf

        return import_traced_gguf(path, reader, model_dtype, workdir)
    config = gguf_config(reader, path)
    weights = GGUFWeights(path, reader, config)
    tokenizer_files = write_tokenizer_files(Metadata(reader, path), workdir)
    check_tokenizer_files(tokenizer_files, config)
    mod, shapes = build_module(config, target, model_dtype)
    for name, shape in shapes.items():
        _check_tensor(weights, name, shape)
    return ImportedModel(mod, config, weights, tokenizer_files, model_dtype)


def conversion_summary(report: dict[str, dict[str, Any]]) -> list[str]:
    """One line per (GGUF type, what ember stores, kept or converted) group of a `conversion_report`,
    with the relative RMS weight error of converted groups: what compile prints and `inspect` shows."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for entry in report.values():
        key = (entry["gguf_type"], entry["stored_as"], entry["conversion"])
        groups.setdefault(key, []).append(entry.get("relative_rms_error", 0.0))
    lines = []
    for (gguf_type, stored_as, conversion), errors in sorted(groups.items()):
        count = f"{len(errors)} tensor{'s' if len(errors) > 1 else ''}"
        if conversion == "kept":
            how = "kept as stored" if stored_as != "float" or gguf_type in _FLOAT_TYPES else "dequantized to float"
            lines.append(f"{count} {gguf_type} -> {stored_as}: {how}")
        else:
            lines.append(f"{count} {gguf_type} -> {stored_as}: re-quantized, relative RMS weight error "
                         f"mean {100 * np.mean(errors):.2f}%, max {100 * max(errors):.2f}%")
    return lines


def source_record(weights: GGUFWeights) -> dict[str, Any]:
    """What the manifest should record of a GGUF source: file, hash, and each tensor's stored type."""
    return {"format": "gguf", "file": weights.path.name, "sha256": file_sha256(weights.path),
            "tensor_types": {name: r.type_name for name, r in sorted(weights.records.items())}}

