"""Map a Hugging Face `config.json` onto ember's model-family configuration.

One `ModelConfig` describes every decoder ember builds today: the Llama family
(Llama 2/3 with llama3-style RoPE scaling), Mistral (sliding-window attention) and
Qwen2 (biased q/k/v projections). Both config layouts that transformers writes are
read: the older `rope_theta` + `rope_scaling` keys and the newer `rope_parameters`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ember.errors import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, independent of its checkpoint format."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    context_window: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    weight_dtype: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The config as plain JSON data, as stored in an artifact manifest."""
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of `to_json`: the config stored in an artifact manifest."""
        return cls(**{**data, "eos_token_ids": tuple(data["eos_token_ids"])})

    @property
    def num_parameters(self) -> int:
        """Number of weights, counting a tied embedding once."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read `model_dir/config.json` (and `generation_config.json` if present)."""
    path = Path(model_dir) / "config.json"
    generation_path = Path(model_dir) / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.exists() else {}
    return parse_model_config(read_json_object(path), path, generation)


def parse_model_config(
    raw: dict[str, Any], path: Path | str = "config.json", generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Validate a parsed HF config dict and map it onto `ModelConfig`."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{path}: model_type {model_type!r} is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )

    def require(key: str, kind: type = int) -> Any:
        if key not in raw:
            raise ModelError(f"{path}: missing required key {key!r} for model_type {model_type!r}")
        value = raw[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value <= 0):
            raise ModelError(f"{path}: {key!r} must be a positive {kind.__name__}, got {value!r}")
        return value

    hidden_size = require("hidden_size")
    num_heads = require("num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ModelError(
            f"{path}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelError(f"{path}: hidden_act {hidden_act!r} is not supported (only 'silu')")

    rope_theta, rope_scaling = _parse_rope(raw, path)
    sliding_window = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        sliding_window = None
    generation = generation or {}
    return ModelConfig(
        model_type=model_type,
        vocab_size=require("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=require("intermediate_size"),
        num_hidden_layers=require("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        context_window=require("max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        sliding_window=int(sliding_window) if sliding_window else None,
        weight_dtype=_torch_dtype_name(raw.get("torch_dtype") or raw.get("dtype") or "float32", path),
        bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=_as_id_tuple(generation.get("eos_token_id", raw.get("eos_token_id"))),
    )


def _parse_rope(raw: dict[str, Any], path: Path | str) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{path}: RoPE type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ModelError(f"{path}: llama3 RoPE scaling is missing {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: params[k] for k in keys}}


def _torch_dtype_name(name: str, path: Path | str) -> str:
    known = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
    if name not in known:
        raise ModelError(f"{path}: weight dtype {name!r} is not supported (float32, float16, bfloat16)")
    return known[name]


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse a checkpoint's JSON file, raising `ModelError` naming it if absent, malformed or not an object."""
    if not path.exists():
        raise ModelError(f"{path}: file not found (is this a Hugging Face checkpoint directory?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelError(f"{path}: malformed JSON: {err}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
