"""Map a Hugging Face `config.json` onto ember's model-family configuration.

One `ModelConfig` describes every decoder ember builds today: the Llama family
(Llama 2/3 with llama3-style RoPE scaling), Mistral (sliding-window attention) and
Qwen2 (biased q/k/v projections). `layer_windows` reads which layers attend through a
sliding window, for every family's way of saying so. Both config layouts that transformers writes are
read: the older `rope_theta` + `rope_scaling` keys and the newer `rope_parameters`.
Every key ember reads is checked against `SCHEMA` (JSON type and range) before use:
a config.json is written by whoever published the checkpoint, and a string "false"
or a negative head count must be refused by name, not turned into a wrong model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ember.core.errors import ModelError
from ember.core.files import checkpoint_file, optional_checkpoint_file, read_json_object, short_repr

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
    # Per layer, its sliding window (`sliding_window`) or 0 for the whole context; empty: no layer has one.
    layer_windows: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The config as plain JSON data, as stored in an artifact manifest."""
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        data["layer_windows"] = list(self.layer_windows)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of `to_json`: the config stored in an artifact manifest."""
        return cls(**{**data, "eos_token_ids": tuple(data["eos_token_ids"]),
                      "layer_windows": tuple(data["layer_windows"])})

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


_DIM = 2**20  # hidden, intermediate and head sizes: far above any model, far below overflowing int64 products
_CONTEXT = 2**24
_INF = float("inf")


@dataclasses.dataclass(frozen=True)
class Key:
    """What one config key may hold: a JSON type and, for numbers, a range (ints closed, floats open)."""

    kind: type
    low: float = -_INF
    high: float = _INF
    default: Any = None  # None: no default (required, or derived from other keys)


# The one description of the config.json keys ember reads, for compile and `ember analyze` alike.
# JSON null counts as absent: Hugging Face writes `"rope_scaling": null`, `"sliding_window": null`.
SCHEMA = {
    "model_type": Key(str),
    "vocab_size": Key(int, 1, 2**22),
    "hidden_size": Key(int, 1, _DIM),
    "intermediate_size": Key(int, 1, _DIM),
    "num_hidden_layers": Key(int, 1, 1024),
    "num_attention_heads": Key(int, 1, _DIM),
    "num_key_value_heads": Key(int, 1, _DIM),  # default: num_attention_heads
    "head_dim": Key(int, 1, _DIM),  # default: hidden_size // num_attention_heads
    "max_position_embeddings": Key(int, 1, _CONTEXT),
    "sliding_window": Key(int, 0, _CONTEXT),  # 0: none (Qwen2-MoE's config writes 0 when it uses none)
    "use_sliding_window": Key(bool, default=False),
    "max_window_layers": Key(int, 0, 1024),
    "sliding_window_pattern": Key(int, 1, 1024),
    "layer_types": Key(list),
    "rms_norm_eps": Key(float, 0, 1, default=1e-6),
    "rope_theta": Key(float, 0, default=10000.0),
    "rope_parameters": Key(dict),
    "rope_scaling": Key(dict),
    "hidden_act": Key(str, default="silu"),
    "tie_word_embeddings": Key(bool, default=False),
    "attention_bias": Key(bool, default=False),
    "torch_dtype": Key(str),
    "dtype": Key(str),
}
ROPE_SCHEMA = {
    "rope_type": Key(str),
    "type": Key(str),
    "rope_theta": Key(float, 0),
    "factor": Key(float, 0),
    "low_freq_factor": Key(float, 0),
    "high_freq_factor": Key(float, 0),
    "original_max_position_embeddings": Key(int, 1, _CONTEXT),
}
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a JSON boolean (true or false)", str: "a string",
               dict: "a JSON object", list: "a JSON array"}


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read `model_dir/config.json` (and `generation_config.json` if present)."""
    path = checkpoint_file(model_dir, "config.json")
    generation_path = optional_checkpoint_file(model_dir, "generation_config.json")
    generation = read_json_object(generation_path) if generation_path else {}
    return parse_model_config(read_json_object(path), path, generation, generation_path)


# Where families name what ember reads of a graph it imports (transformers' per-family attribute maps,
# for these keys): GPT-2's n_embd, OPT's ffn_dim, Falcon's num_kv_heads, ...
_IMPORTED_KEYS = {
    "model_type": ("model_type",),
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                                "max_sequence_length", "max_seq_len"),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "torch_dtype": ("torch_dtype",),
    "dtype": ("dtype",),
    "bos_token_id": ("bos_token_id",),
    "eos_token_id": ("eos_token_id",),
    "sliding_window": ("sliding_window",),
    "use_sliding_window": ("use_sliding_window",),
    "max_window_layers": ("max_window_layers",),
    "sliding_window_pattern": ("sliding_window_pattern",),
    "layer_types": ("layer_types",),
}


# Keys only a state-space (recurrent) model's config has.
_STATE_SPACE_KEYS = ("state_size", "ssm_cfg", "d_state", "ssm_state_size", "mamba_d_state", "time_step_rank")
# What an encoder's checkpoint is saved as: heads over every token, with no causal language model among them.
_ENCODER_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                  "ForMultipleChoice", "ForPreTraining")


def unsupported_construct(raw: dict[str, Any]) -> str | None:
    """What ember does not compile that a config.json says its model is built of (a state-space model, an encoder),
    in words; None if nothing of the kind."""
    if any(key in raw for key in _STATE_SPACE_KEYS):
        return "a state-space (recurrent) model, without attention layers"
    if raw.get("is_encoder_decoder") is True:
        return "an encoder-decoder"
    architectures = raw.get("architectures")
    if (isinstance(architectures, list) and architectures and not raw.get("is_decoder")
            and all(isinstance(a, str) and a.endswith(_ENCODER_HEADS) for a in architectures)):
        return "a bidirectional encoder"
    return None


def imported_model_config(model_dir: Path) -> ModelConfig:
    """What ember reads of any architecture's `model_dir/config.json` for a graph it imports (torch.export,
    ONNX): sizes under the names families give them, the context window, token ids; the attention's layers
    and heads are the graph's (the compiler takes them from the attention it finds), and position encodings
    are computed in the graph, so rope settings are not read."""
    path = checkpoint_file(model_dir, "config.json")
    generation_path = optional_checkpoint_file(model_dir, "generation_config.json")
    generation = read_json_object(generation_path) if generation_path else {}
    return imported_config(read_json_object(path), path, generation, generation_path)


def imported_config(raw: dict[str, Any], path: Path | str, generation: dict[str, Any] | None = None,
                    generation_path: Path | str | None = None) -> ModelConfig:
    """`imported_model_config` of a parsed config.json (`raw`, read from `path`)."""
    construct = unsupported_construct(raw)
    if construct:
        raise ModelError(f"{path}: model_type {short_repr(raw.get('model_type'))} is {construct}, which ember does not "
                         "compile (it compiles causal decoders: causal or sliding-window attention)")
    canonical = {key: next((raw[name] for name in names if raw.get(name) is not None), None)
                 for key, names in _IMPORTED_KEYS.items()}
    canonical["model_type"] = canonical["model_type"] or "unknown"
    if canonical["max_position_embeddings"] is None:
        raise ModelError(f"{path}: no context length ({', '.join(_IMPORTED_KEYS['max_position_embeddings'])}); "
                         "ember sizes the KV cache by it")
    if canonical["intermediate_size"] is None and isinstance(canonical["hidden_size"], int):
        canonical["intermediate_size"] = 4 * canonical["hidden_size"]
    return parse_model_config({k: v for k, v in canonical.items() if v is not None}, path, generation,
                              generation_path, any_architecture=True)


def parse_model_config(raw: dict[str, Any], path: Path | str = "config.json", generation: dict[str, Any] | None = None,
                       generation_path: Path | str | None = None, any_architecture: bool = False) -> ModelConfig:
    """Validate a parsed HF config dict (against `SCHEMA`) and map it onto `ModelConfig`.

    `any_architecture`: the graph comes from the model's own code (`--frontend torch-export`), so
    any model type and activation will do; only the sizes the runtime and the KV cache need are read."""
    values = {key: validated(raw, key, spec, path) for key, spec in SCHEMA.items()}  # every key, used or not
    model_type = values["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES and not any_architecture:
        raise ModelError(
            f"{path}: model_type {short_repr(model_type)} has no builtin definition (those: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); compile it with --frontend torch-export, which traces "
            "transformers' own code"
        )

    def get(key: str, required: bool = False) -> Any:
        if required and values[key] is None:
            raise ModelError(f"{path}: missing required key {key!r} for model_type {model_type!r}")
        return values[key]

    hidden_size = get("hidden_size", required=True)
    num_heads = get("num_attention_heads", required=True)
    num_kv_heads = get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ModelError(
            f"{path}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_dim = get("head_dim") or hidden_size // num_heads
    if head_dim == 0 or head_dim % 2 and not any_architecture:  # RoPE rotates pairs of channels
        raise ModelError(f"{path}: the head dimension (head_dim, or hidden_size // num_attention_heads) "
                         f"must be a positive even number, got {head_dim}")
    hidden_act = get("hidden_act")
    if hidden_act != "silu" and not any_architecture:
        raise ModelError(f"{path}: hidden_act {hidden_act!r} is not supported (only 'silu')")

    rope_theta, rope_scaling = _parse_rope(values, path)
    num_layers = get("num_hidden_layers", required=True)
    context_window = get("max_position_embeddings", required=True)
    # A window as long as the context never drops a key: those layers attend to the whole context.
    windows = tuple(window if window < context_window else 0 for window in layer_windows(values, num_layers, path))
    windows = windows if any(windows) else ()
    vocab_size = get("vocab_size", required=True)
    generation = generation or {}
    generation_path = generation_path or "generation_config.json"
    ids = {key: (generation, generation_path) if generation.get(key) is not None else (raw, path)
           for key in ("bos_token_id", "eos_token_id")}
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=get("intermediate_size", required=True),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("rms_norm_eps"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        context_window=context_window,
        tie_word_embeddings=get("tie_word_embeddings"),
        attention_bias=model_type == "qwen2" or get("attention_bias"),
        sliding_window=max(windows, default=0) or None,
        layer_windows=windows,
        weight_dtype=_torch_dtype_name(get("torch_dtype") or get("dtype") or "float32", path),
        bos_token_id=_token_ids(*ids["bos_token_id"], "bos_token_id", vocab_size, allow_list=False),
        eos_token_ids=_token_ids(*ids["eos_token_id"], "eos_token_id", vocab_size, allow_list=True),
    )


# Families whose config, written before `layer_types` existed, leaves the window's layers to the model code:
# every `sliding_window_pattern`-th layer attends to the whole context, the others through the window.
_DEFAULT_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
# Families whose `sliding_window` is read only with `use_sliding_window` (Qwen2's config carries a window it
# does not use), then from layer `max_window_layers` on.
_OPT_IN_WINDOWS = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def layer_windows(values: dict[str, Any], num_layers: int, path: Path | str = "config.json") -> tuple[int, ...]:
    """Per layer, the sliding window its attention reads through (0: the whole context), as the family's code
    reads its config: `layer_types` where given ("sliding_attention" / "full_attention"), else the family's rule
    over `sliding_window`, `use_sliding_window`, `max_window_layers` and `sliding_window_pattern`; () if no layer
    has a window. `values` holds the keys of `SCHEMA`, validated."""
    model_type = values.get("model_type")
    window = values.get("sliding_window") or None
    if model_type in _OPT_IN_WINDOWS and not values.get("use_sliding_window"):
        window = None
    types = values.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelError(f"{path}: 'layer_types' names {len(types)} layers, the model has {num_layers}")
        unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")}, key=str)
        if unknown:
            raise ModelError(f"{path}: 'layer_types' has {short_repr(unknown[0])}; ember compiles "
                             "'full_attention' and 'sliding_attention' layers")
        windowed = [t == "sliding_attention" for t in types]
    elif model_type in _OPT_IN_WINDOWS:
        first = values.get("max_window_layers") or 0
        windowed = [layer >= first for layer in range(num_layers)]
    else:
        pattern = values.get("sliding_window_pattern") or _DEFAULT_WINDOW_PATTERNS.get(model_type)
        windowed = [not pattern or (layer + 1) % pattern != 0 for layer in range(num_layers)]
    if window is None or not any(windowed):  # a sliding layer without a window attends to the whole context
        return ()
    return tuple(window if w else 0 for w in windowed) if any(windowed) else ()


def validated(raw: dict[str, Any], key: str, spec: Key, path: Path | str, name: str | None = None) -> Any:
    """`raw[key]` checked against `spec` (its default if absent or null), else a `ModelError` naming `name`."""
    value = raw.get(key)
    if value is None:
        return spec.default
    number = spec.kind in (int, float) and isinstance(value, int | float) and not isinstance(value, bool)
    if spec.kind is float and number:
        as_float = float(value) if abs(value) < 1e308 else _INF  # a huge int is out of range, not an OverflowError
        ok = spec.low < as_float < spec.high  # NaN compares false
        value = as_float if ok else value
    elif spec.kind is int and number:
        ok = isinstance(value, int) and spec.low <= value <= spec.high
    else:
        ok = isinstance(value, spec.kind) and not (spec.kind is int and isinstance(value, bool))
    if not ok:
        expected = _KIND_NAMES[spec.kind]
        if spec.kind is int:
            expected += f" in [{spec.low}, {spec.high}]"
        elif spec.kind is float:
            expected += f" in ({spec.low}, {spec.high})" if spec.high < _INF else f" greater than {spec.low}, finite"
        raise ModelError(f"{path}: {name or key!r} must be {expected}, got {short_repr(value)}")
    return value


def _parse_rope(values: dict[str, Any], path: Path | str) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and scaling from the newer `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    section = "rope_parameters" if values["rope_parameters"] is not None else "rope_scaling"
    params = values[section] or {}

    def get(key: str) -> Any:
        return validated(params, key, ROPE_SCHEMA[key], path, f"{section}.{key}")

    theta = get("rope_theta") or values["rope_theta"]
    rope_type = get("rope_type") or get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{path}: RoPE type {short_repr(rope_type)} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ModelError(f"{path}: llama3 RoPE scaling is missing {', '.join(missing)}")
    scaling = {k: get(k) for k in keys}
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:  # llama3 RoPE divides by their difference
        raise ModelError(f"{path}: {section}.high_freq_factor ({scaling['high_freq_factor']}) must exceed "
                         f"low_freq_factor ({scaling['low_freq_factor']})")
    return theta, {"rope_type": "llama3", **scaling}


def _torch_dtype_name(name: str, path: Path | str) -> str:
    known = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
    if name not in known:
        raise ModelError(f"{path}: weight dtype {name!r} is not supported (float32, float16, bfloat16)")
    return known[name]


def _token_ids(raw: dict[str, Any], path: Path | str, key: str, vocab_size: int, allow_list: bool) -> Any:
    """`raw[key]`: a token id in [0, vocab_size) (or, if `allow_list`, a list of them, returned as a tuple)."""
    value = raw.get(key)
    if value is None:
        return () if allow_list else None
    ids = value if allow_list and isinstance(value, list) else [value]
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            expected = "a token id" + (" or a list of token ids" if allow_list else "")
            raise ModelError(f"{path}: {key!r} must be {expected} in [0, {vocab_size}), got {short_repr(value)}")
    return tuple(ids) if allow_list else value
