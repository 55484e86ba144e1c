"""Operations and bytes moved by each operator of a decoder forward step.

A step feeds `new` tokens of each of `batch` sequences whose KV caches already hold
`past` tokens: prefill is new = prompt length, past = 0; one decode step is new = 1,
past = context - 1. The step is a list of operators every decoder layer runs, plus a
few run once per model (embedding lookup, final norm, lm_head).

Conventions shared by every formula below:
- One multiply-accumulate is 2 operations. Elementwise work counts the arithmetic per
  element written next to each operator (exp, rsqrt and divide count 1 each).
- Every operator is its own kernel: it reads each input from memory once and writes
  each output once (perfect reuse inside the kernel, none across kernels). Fused
  FlashAttention is the one exception, and it re-reads K/V once per query tile.
- Linear-layer weights (embeddings and lm_head included) are stored at `wbits`,
  activations, norm weights and biases at `abits`, the KV cache at `kvbits`.
  Quantization scales and zero points are not counted (about 0.125-0.25 extra bits per
  weight at group size 128).
- N = batch x new is the rows of the step; h hidden size, I intermediate size, H and
  Hkv query and key/value heads, d head dim, V vocabulary, E experts, k experts/token.

These follow LLM-Viewer's per-layer method (github.com/hahnyuan/LLM-Viewer,
model_analyzer.py) and differ where it miscounts: its lm_head counts one operation per
MAC, its residual add reads one input instead of two, its SwiGLU activation runs over
the hidden instead of the intermediate size, its prefill qk matmul reads Q with the KV
head count, and its norms count LayerNorm's 7 operations per element (RMSNorm does 4).
RoPE, sliding windows, mixture-of-experts and FlashAttention's skipping of masked
tiles are modelled here and not there.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path

from ember import DEMO_MODEL_DIR
from ember.core.errors import ModelError
from ember.core.files import read_json_object
from ember.frontend.config import SUPPORTED_MODEL_TYPES, ModelConfig, imported_config, parse_model_config
from ember.frontend.gguf import gguf_config, is_gguf_file, open_gguf, read_through_transformers
from ember.frontend.gguf_traced import transformers_config
from ember.ir.quant_formats import FORMATS

PRESET_DIR = Path(__file__).with_name("presets")
VECTOR_DTYPE = "fp32"  # elementwise work runs on vector units, accumulating in fp32


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A decoder as the formulas see it: the HF-derived config plus mixture-of-experts sizes."""

    name: str
    config: ModelConfig
    num_experts: int = 1
    experts_per_token: int = 1
    expert_intermediate_size: int = 0  # each expert's FFN width; 0: the config's intermediate_size (Mixtral)
    shared_expert_intermediate_size: int = 0  # an always-run shared expert's FFN width (Qwen2-MoE); 0: none

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a routed mixture of experts (Mixtral, Qwen3-MoE, ...)."""
        return self.num_experts > 1

    @property
    def expert_width(self) -> int:
        """Each routed expert's FFN width."""
        return self.expert_intermediate_size or self.config.intermediate_size


@dataclasses.dataclass(frozen=True)
class Precision:
    """Storage bit widths of weights, activations and the KV cache."""

    wbits: float = 16
    abits: float = 16
    kvbits: float = 16
    float16: str = "fp16"  # "bf16" for bf16 checkpoints: the 16-bit type computed in

    @property
    def wbytes(self) -> float:
        """Bytes per weight."""
        return self.wbits / 8

    @property
    def abytes(self) -> float:
        """Bytes per activation."""
        return self.abits / 8

    @property
    def kvbytes(self) -> float:
        """Bytes per cached key or value."""
        return self.kvbits / 8

    def matmul_dtype(self, *bits: float) -> str:
        """The data type a matmul with operands of these widths computes in.

        The wider operand decides: W4A16 dequantizes to 16-bit floats, W8A8 runs int8.
        """
        widest = max(bits)
        if widest <= 4:
            return "int4"
        if widest <= 8:
            return "int8"
        return self.float16 if widest <= 16 else "fp32"

    def label(self) -> str:
        """Short form, e.g. "W4A16 KV8"."""
        return f"W{self.wbits:g}A{self.abits:g} KV{self.kvbits:g}"


@dataclasses.dataclass(frozen=True)
class FormatPrecision(Precision):
    """An ember `--quant` format as the roofline sees it: weights at the format's stored bits per
    weight (scales included), activations and KV cache in its float compute dtype, and with
    `int8_projections` the linear layers (the matmuls whose operands are (wbits, abits)) multiplying
    in int8 as `schedules/int8_matmul.py` does, while attention stays float."""

    int8_projections: bool = False

    @classmethod
    def of(cls, name: str) -> FormatPrecision:
        """The precision of the format `name` (q0f32, q8f32, q4f32, ...)."""
        fmt = FORMATS[name]
        float_bits = 32 if fmt.dtype == "float32" else 16
        int8 = fmt.quantizes and fmt.dtype == "float32"
        return cls(fmt.bits_per_weight, float_bits, float_bits, int8_projections=int8)

    def matmul_dtype(self, *bits: float) -> str:
        """int8 for the projections of an int8-activation format, else the base rule."""
        if self.int8_projections and bits == (self.wbits, self.abits):
            return "int8"
        return super().matmul_dtype(*bits)

    def label(self) -> str:
        return f"W{self.wbits:g}A{self.abits:g} KV{self.kvbits:g}" + (" int8 matmuls" if self.int8_projections else "")


@dataclasses.dataclass(frozen=True)
class Operator:
    """One kernel's work: operations, and the bytes it moves split by what they are."""

    name: str
    dtype: str
    ops: float
    weight_bytes: float = 0.0
    act_read: float = 0.0
    act_write: float = 0.0
    kv_read: float = 0.0
    kv_write: float = 0.0

    @property
    def bytes(self) -> float:
        """All bytes moved to and from memory."""
        return self.weight_bytes + self.act_read + self.act_write + self.kv_read + self.kv_write


@dataclasses.dataclass(frozen=True)
class Stage:
    """The operators of one forward step: those each decoder layer runs, and those run once."""

    name: str
    batch: int
    new_tokens: int
    past_tokens: int
    num_layers: int
    layer: tuple[Operator, ...]
    once: tuple[Operator, ...]


def prefill(arch: Architecture, prec: Precision, batch: int, prompt_len: int,
            flash_tile: int | None = None) -> Stage:
    """The prompt's forward step: `prompt_len` new tokens per sequence, empty KV cache."""
    return forward_step(arch, prec, batch, prompt_len, 0, flash_tile, "prefill")


def decode(arch: Architecture, prec: Precision, batch: int, context: int,
           flash_tile: int | None = None) -> Stage:
    """One decode step whose new token attends to `context` tokens, itself included."""
    return forward_step(arch, prec, batch, 1, context - 1, flash_tile, "decode")


def forward_step(arch: Architecture, prec: Precision, batch: int, new: int, past: int,
                 flash_tile: int | None, name: str) -> Stage:
    """All operators of one step; `flash_tile` (query rows per tile) selects fused attention."""
    c = arch.config
    h, d, heads, kv_heads = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    rows = batch * new
    # The window bounds the keys read where every layer has it; with whole-context layers among them, every
    # layer is charged the whole context (an upper bound for the windowed ones).
    window = c.sliding_window if c.layer_windows and all(c.layer_windows) else None
    if flash_tile:
        attention = [flash_attention(prec, batch, new, past, window, heads, kv_heads, d, flash_tile)]
    else:
        keys = visible_keys(past, new, window)
        attention = [
            attention_scores(prec, batch, new, keys, heads, kv_heads, d),
            softmax(prec, batch, new, keys, heads),
            attention_values(prec, batch, new, keys, heads, kv_heads, d),
        ]
    bias = c.attention_bias
    layer = [
        rms_norm("attn_norm", prec, rows, h),
        linear("q_proj", prec, rows, h, heads * d, bias=bias),
        linear("k_proj", prec, rows, h, kv_heads * d, bias=bias),
        linear("v_proj", prec, rows, h, kv_heads * d, bias=bias, to_cache=True),
        rope(prec, rows, heads, kv_heads, d),
        *attention,
        linear("o_proj", prec, rows, heads * d, h),
        residual_add("attn_add", prec, rows, h),
        rms_norm("mlp_norm", prec, rows, h),
        *(moe_mlp(arch, prec, rows) if arch.is_moe else dense_mlp(prec, rows, h, c.intermediate_size)),
        residual_add("mlp_add", prec, rows, h),
    ]
    # Only the last position of each sequence needs logits, so the head runs on `batch` rows.
    once = [
        embedding(prec, rows, h),
        rms_norm("final_norm", prec, batch, h),
        linear("lm_head", prec, batch, h, c.vocab_size),
    ]
    return Stage(name, batch, new, past, c.num_hidden_layers, tuple(layer), tuple(once))


def dense_mlp(prec: Precision, rows: int, h: int, inter: int) -> list[Operator]:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    return [
        linear("gate_proj", prec, rows, h, inter),
        linear("up_proj", prec, rows, h, inter),
        swiglu(prec, rows, inter),
        linear("down_proj", prec, rows, inter, h),
    ]


def moe_mlp(arch: Architecture, prec: Precision, rows: int) -> list[Operator]:
    """Routed SwiGLU experts: each row runs through its top-k experts, outputs summed by router weight.

    Expert projections do k x the dense MLP's operations, but read the weights of every
    expert that at least one row picked: `experts_touched` of them, all E in a long prefill,
    only k in a batch-1 decode step.
    """
    h, inter, experts, k = arch.config.hidden_size, arch.expert_width, arch.num_experts, arch.experts_per_token
    routed = rows * k
    touched = experts_touched(experts, k, rows)
    shared = arch.shared_expert_intermediate_size
    return [
        linear("router", prec, rows, h, experts),
        linear("gate_proj", prec, routed, h, inter, copies=touched),
        linear("up_proj", prec, routed, h, inter, copies=touched),
        swiglu(prec, routed, inter),
        linear("down_proj", prec, routed, inter, h, copies=touched),
        expert_combine(prec, rows, k, h),
        *([linear("shared_gate_proj", prec, rows, h, shared), linear("shared_up_proj", prec, rows, h, shared),
           swiglu(prec, rows, shared, "shared_mlp_act"), linear("shared_down_proj", prec, rows, shared, h)]
          if shared else []),
    ]


def experts_touched(experts: int, k: int, rows: int) -> float:
    """Expected number of distinct experts picked by `rows` tokens, routing uniformly at random.

    Each expert is missed by one token with probability 1 - k/E, by all with (1 - k/E)^rows.
    """
    return experts * (1 - (1 - k / experts) ** rows)


def visible_keys(past: int, new: int, window: int | None) -> int:
    """Keys the step's queries can see together: positions [max(0, past - W + 1), past + new).

    An unfused kernel computes this whole rectangle and masks the causal triangle
    (prefill: S x S), so every query row is charged the full span.
    """
    first = max(0, past - window + 1) if window else 0
    return past + new - first


def linear(name: str, prec: Precision, rows: float, d_in: int, d_out: int, *, bias: bool = False,
           to_cache: bool = False, copies: float = 1) -> Operator:
    """y = x W (+ b), x: rows x d_in, W: d_in x d_out.

    ops = 2 rows d_in d_out (+ rows d_out for the bias)
    bytes = copies d_in d_out wbytes (+ d_out abytes bias) + rows d_in abytes (x)
            + rows d_out abytes (y), or kvbytes when y is appended to the KV cache.
    `copies` counts distinct weight matrices read (experts touched; 1 otherwise).
    """
    out_bytes = rows * d_out
    return Operator(
        name,
        prec.matmul_dtype(prec.wbits, prec.abits),
        ops=2 * rows * d_in * d_out + (rows * d_out if bias else 0),
        weight_bytes=copies * (d_in * d_out * prec.wbytes + (d_out * prec.abytes if bias else 0)),
        act_read=rows * d_in * prec.abytes,
        act_write=0 if to_cache else out_bytes * prec.abytes,
        kv_write=out_bytes * prec.kvbytes if to_cache else 0,
    )


def rms_norm(name: str, prec: Precision, rows: int, h: int) -> Operator:
    """y = x / sqrt(mean(x^2) + eps) * g.

    ops = 4 rows h (square, sum, scale by the rsqrt, multiply by g; the per-row rsqrt is negligible)
    bytes = rows h abytes (x) + rows h abytes (y) + h abytes (g)
    """
    return Operator(name, VECTOR_DTYPE, ops=4 * rows * h, weight_bytes=h * prec.abytes,
                    act_read=rows * h * prec.abytes, act_write=rows * h * prec.abytes)


def rope(prec: Precision, rows: int, heads: int, kv_heads: int, d: int) -> Operator:
    """Rotary position embedding of q and k; the rotated k is appended to the KV cache.

    Each pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin): 3 ops per element.
    ops = 3 rows (H + Hkv) d
    bytes = rows (H + Hkv) d abytes (q, k in) + rows H d abytes (q out)
            + rows Hkv d kvbytes (k into the cache) + rows d abytes (cos/sin of each position)
    """
    q, k = rows * heads * d, rows * kv_heads * d
    return Operator("rope", VECTOR_DTYPE, ops=3 * (q + k),
                    act_read=(q + k + rows * d) * prec.abytes, act_write=q * prec.abytes,
                    kv_write=k * prec.kvbytes)


def attention_scores(prec: Precision, batch: int, new: int, keys: int, heads: int, kv_heads: int,
                     d: int) -> Operator:
    """qk matmul: scores = q K^T per head (the 1/sqrt(d) scale is folded into q).

    ops = 2 batch H new keys d
    bytes = batch new H d abytes (q) + batch keys Hkv d kvbytes (K, each KV head read once
            for its query group) + batch H new keys abytes (scores)
    """
    return Operator(
        "qk_matmul", prec.matmul_dtype(prec.abits, prec.kvbits),
        ops=2 * batch * heads * new * keys * d,
        act_read=batch * new * heads * d * prec.abytes,
        act_write=batch * heads * new * keys * prec.abytes,
        kv_read=batch * keys * kv_heads * d * prec.kvbytes,
    )


def softmax(prec: Precision, batch: int, new: int, keys: int, heads: int) -> Operator:
    """Row softmax of the scores (with the causal mask applied in the same pass).

    ops = 5 batch H new keys (max, subtract, exp, sum, divide)
    bytes = 2 batch H new keys abytes (scores in, probabilities out)
    """
    elements = batch * heads * new * keys
    return Operator("softmax", VECTOR_DTYPE, ops=5 * elements,
                    act_read=elements * prec.abytes, act_write=elements * prec.abytes)


def attention_values(prec: Precision, batch: int, new: int, keys: int, heads: int, kv_heads: int,
                     d: int) -> Operator:
    """sv matmul: out = P V per head.

    ops = 2 batch H new keys d
    bytes = batch H new keys abytes (P) + batch keys Hkv d kvbytes (V) + batch new H d abytes (out)
    """
    return Operator(
        "sv_matmul", prec.matmul_dtype(prec.abits, prec.kvbits),
        ops=2 * batch * heads * new * keys * d,
        act_read=batch * heads * new * keys * prec.abytes,
        act_write=batch * new * heads * d * prec.abytes,
        kv_read=batch * keys * kv_heads * d * prec.kvbytes,
    )


def flash_tile_rows(onchip_bytes: int, head_dim: int, prec: Precision) -> int:
    """Query rows per FlashAttention tile: B_r = min(ceil(M / (4 d)), d), M the on-chip memory in elements.

    This is the block size of FlashAttention (Dao et al. 2022, Algorithm 1), M being one
    compute unit's SRAM.
    """
    elements = onchip_bytes / prec.abytes
    return max(1, min(math.ceil(elements / (4 * head_dim)), head_dim))


def flash_attention(prec: Precision, batch: int, new: int, past: int, window: int | None, heads: int,
                    kv_heads: int, d: int, tile: int) -> Operator:
    """qk matmul, softmax and sv matmul fused, the scores never leaving on-chip memory.

    Query rows are split into tiles of `tile` rows; a tile streams the K/V rows its rows can
    see (causal, sliding window) through on-chip memory, skipping tiles above the diagonal.
    With P the (query, key) pairs the tiles compute and R the K/V rows they stream:
    ops = batch H P (4 d + 5)            (qk and sv: 2 d each; online softmax: 5)
    bytes = 2 batch new H d abytes (q in, out) + 2 batch G R d kvbytes (K and V)
    where G = H in prefill (one tile per query head, as FlashAttention-2) and G = Hkv in
    decode (one query row per head, so a tile holds a KV head's whole query group, as
    flash-decoding kernels do). This is FlashAttention's own IO model: re-reads that an L2
    cache would catch still count as memory traffic.
    """
    pairs = streamed = 0
    for start in range(past, past + new, tile):
        end = min(start + tile, past + new)
        span = visible_keys(start, end - start, window)
        pairs += (end - start) * span
        streamed += span
    readers = kv_heads if new == 1 else heads
    return Operator(
        "flash_attention", prec.matmul_dtype(prec.abits, prec.kvbits),
        ops=batch * heads * pairs * (4 * d + 5),
        act_read=batch * new * heads * d * prec.abytes,
        act_write=batch * new * heads * d * prec.abytes,
        kv_read=2 * batch * readers * streamed * d * prec.kvbytes,
    )


def residual_add(name: str, prec: Precision, rows: int, h: int) -> Operator:
    """x + f(x).

    ops = rows h; bytes = 2 rows h abytes (two inputs) + rows h abytes (sum)
    """
    return Operator(name, VECTOR_DTYPE, ops=rows * h,
                    act_read=2 * rows * h * prec.abytes, act_write=rows * h * prec.abytes)


def swiglu(prec: Precision, rows: float, inter: int, name: str = "mlp_act") -> Operator:
    """silu(gate) * up, silu(x) = x / (1 + exp(-x)).

    ops = 5 rows I (negate, exp, add, divide, multiply by up)
    bytes = 2 rows I abytes (gate, up) + rows I abytes (out)
    """
    return Operator(name, VECTOR_DTYPE, ops=5 * rows * inter,
                    act_read=2 * rows * inter * prec.abytes, act_write=rows * inter * prec.abytes)


def expert_combine(prec: Precision, rows: int, k: int, h: int) -> Operator:
    """Weighted sum of each row's k expert outputs (top-k selection over E logits not counted).

    ops = 2 rows k h; bytes = rows k h abytes (expert outputs) + rows h abytes (sum)
    """
    return Operator("expert_combine", VECTOR_DTYPE, ops=2 * rows * k * h,
                    act_read=rows * k * h * prec.abytes, act_write=rows * h * prec.abytes)


def embedding(prec: Precision, rows: int, h: int) -> Operator:
    """Gather one embedding row per token: no arithmetic.

    ops = 0; bytes = rows h wbytes (rows read) + rows h abytes (written)
    """
    return Operator("embed_tokens", VECTOR_DTYPE, ops=0, weight_bytes=rows * h * prec.wbytes,
                    act_write=rows * h * prec.abytes)


def model_presets() -> list[str]:
    """Names of the shipped model configs, sorted."""
    return sorted((p.stem for p in PRESET_DIR.glob("*.json")), key=str.lower)


def load_architecture(spec: str) -> Architecture:
    """A model from an HF checkpoint directory, a config.json path, a GGUF file, a preset name, or
    `demo` (the bundled demo model, as for `ember compile`)."""
    path = DEMO_MODEL_DIR if spec == "demo" else Path(spec)
    if is_gguf_file(path):
        reader = open_gguf(path)
        if read_through_transformers(reader, path):  # its sizes and experts as compile reads them
            return architecture_from_config(transformers_config(path, reader), path, path.stem)
        return Architecture(path.stem, gguf_config(reader, path))
    if path.is_dir():
        path = path / "config.json"
        name = path.resolve().parent.name
    elif path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    else:
        presets = {p.lower(): p for p in model_presets()}
        if spec.lower() not in presets:
            close = difflib.get_close_matches(spec.lower(), presets, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(presets[c] for c in close)}? " if close else ""
            raise ModelError(f"MODEL {spec!r} is neither a directory, a config.json file nor a preset; "
                             f"{hint}presets: {', '.join(presets.values())}")
        name = presets[spec.lower()]
        path = PRESET_DIR / f"{name}.json"
    return architecture_from_config(read_json_object(path), path, name)


# Where families name their experts' sizes: the routed experts' count, how many each token uses, each expert's FFN
# width (Mixtral, GraniteMoE and OLMoE use intermediate_size for it) and a shared expert's.
_EXPERT_KEYS = {"num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                "experts_per_token": ("num_experts_per_tok",),
                "expert_intermediate_size": ("moe_intermediate_size",),
                "shared_expert_intermediate_size": ("shared_expert_intermediate_size",)}


def architecture_from_config(raw: dict, path: Path | str, name: str) -> Architecture:
    """Map a parsed HF config dict onto an `Architecture`: ember's builtin families by their definition, any other
    decoder by the sizes `--frontend torch-export` reads (`imported_config`), and its experts' sizes if it routes
    its MLP to experts."""
    model_type = raw.get("model_type")
    config = parse_model_config(raw, path) if model_type in SUPPORTED_MODEL_TYPES else imported_config(raw, path)
    sizes = {}
    for field, keys in _EXPERT_KEYS.items():
        key = next((key for key in keys if raw.get(key) is not None), None)
        value = raw.get(key) if key else None
        if key and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ModelError(f"{path}: {key!r} must be a positive int, got {value!r}")
        sizes[field] = (key, value)
    (experts_key, experts), (k_key, k) = sizes["num_experts"], sizes["experts_per_token"]
    if experts is None or experts <= 1:
        return Architecture(name, config)
    if k is None:
        raise ModelError(f"{path}: {experts_key!r} is {experts} and 'num_experts_per_tok' is missing")
    if k > experts:
        raise ModelError(f"{path}: {k_key} ({k}) exceeds {experts_key} ({experts})")
    shared = sizes["shared_expert_intermediate_size"][1] or 0
    if not shared and isinstance(raw.get("n_shared_experts"), int) and sizes["expert_intermediate_size"][1]:
        shared = raw["n_shared_experts"] * sizes["expert_intermediate_size"][1]  # DeepSeek's shared experts
    return Architecture(name, config, experts, k, sizes["expert_intermediate_size"][1] or 0, shared)

