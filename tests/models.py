"""Random-weight tiny checkpoints of every model family ember compiles.

`write_checkpoint(name, out_dir)` writes a complete Hugging Face checkpoint
directory (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json with a chat template) built from transformers' own config
classes, never the hub. The tests compile each of `TINY_MODELS` once; benchmark
scripts can reuse the same builders with larger shapes via `make_config(...,
**overrides)`.

Weights are drawn wider than transformers' default init (std 0.02) so that
logits spread over several units: greedy argmax then has clear winners, and a
kernel bug shows up as a wrong token rather than as noise below the tolerance.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

SEED = 0
VOCAB_SIZE = 256
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as in Llama's tokenizer
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TINY_SHAPES: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

# name -> (model_type, config overrides). Between them: GQA everywhere, tied and
# untied embeddings, default and llama3 RoPE, a sliding window, q/k/v biases.
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    # original_max_position_embeddings=64 with low/high freq factors 1/4 puts the
    # 8 RoPE frequencies of head_dim 16 in all three llama3 regions (kept,
    # interpolated, divided by `factor`).
    "llama3_rope": ("llama", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=16)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
}


# Families ember has no hand-written definition for: compiled through `--frontend torch-export` only.
_EXPORTED_COMMON: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, initializer_range=0.1, bos_token_id=BOS_ID,
                                        eos_token_id=EOS_ID)
_EXPORTED_SHAPES: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256)
EXPORTED_MODELS: dict[str, dict[str, Any]] = {
    # Learned absolute positions, LayerNorm, GELU (tanh), one fused c_attn Conv1D stored [in, out], tied embeddings.
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    # Parallel residual (attention and MLP read the same input), rotary on a quarter of each head (rotate-half),
    # one fused query_key_value, an untied head saved as `embed_out`.
    "gpt_neox": dict(_EXPORTED_SHAPES, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
    # Interleaved rotary (rotate every two) on 8 of 16 dims, parallel attention and MLP.
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8, tie_word_embeddings=False),
    # Learned positions counted by a cumulative sum over an all-ones mask, offset by 2; ReLU.
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                word_embed_proj_dim=64, pad_token_id=0),
    # Multi-query attention (one key/value head, split with indices from the end), parallel attention and MLP.
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True, parallel_attn=True,
                   new_decoder_architecture=False, bias=False, alibi=False, max_position_embeddings=256),
}


# The window of the windowed families below: the tests' prompts are 3x as long.
WINDOW = 16
_GQA = dict(_EXPORTED_SHAPES, num_key_value_heads=2)
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"
# Longrope switching from short to long factors past 32 tokens (the tests' prompts of 3 windows pass it), over a
# rotary dimension of 48 (24 factors each).
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
                 short_factor=[1.0 + 0.05 * i for i in range(24)], long_factor=[1.5 + 0.4 * i for i in range(24)])

# The families table (`tests/test_families.py`): name -> (transformers model type, config), every one compiled
# through `--frontend torch-export` against transformers. Between them: head dims 16 to 256, GQA, MQA and MHA,
# tied and untied heads, windows on every layer, on some (alternating, patterned, from a layer on) or none,
# soft-capped scores and logits, ALiBi, LayerNorm and RMSNorm, q/k norms, parallel residuals, partial rotary.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", dict(_GQA, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)),  # head dim 64, MQA
    "mistral": TINY_MODELS["mistral"],  # the tiny models' own (their names write their checkpoints)
    "qwen2_windowed": ("qwen2", dict(_GQA, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                     max_window_layers=1)),  # windows from layer 1 on
    "qwen3": ("qwen3", dict(_GQA, head_dim=128, tie_word_embeddings=True)),
    "qwen3_head_dim_16": ("qwen3", dict(_GQA, head_dim=16)),  # q/k RMSNorm over a small axis
    "gemma": ("gemma", dict(_EXPORTED_SHAPES, num_attention_heads=2, num_key_value_heads=1, head_dim=256)),
    "gemma2": ("gemma2", dict(_GQA, head_dim=32, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0)),  # soft-capped, alternating windows
    "gemma3": ("gemma3_text", dict(_GQA, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                                   layer_types=[_LOCAL, _LOCAL, _GLOBAL, _LOCAL])),
    "gemma3_head_dim_16": ("gemma3_text", dict(_GQA, head_dim=16, sliding_window=WINDOW,
                                               layer_types=[_LOCAL, _GLOBAL])),
    "phi": ("phi", dict(_EXPORTED_SHAPES, partial_rotary_factor=0.5)),
    "phi3": ("phi3", dict(_GQA, sliding_window=WINDOW)),
    # Phi-4-mini's shape: longrope past original_max_position_embeddings (prompts of 3 windows cross it), rotary on
    # 3/4 of each head, one key/value head, tied head.
    "phi4_mini": ("phi3", dict(_EXPORTED_SHAPES, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                               partial_rotary_factor=0.75, tie_word_embeddings=True, rope_parameters=_LONGROPE,
                               original_max_position_embeddings=32)),
    "stablelm": ("stablelm", dict(_GQA)),
    "olmo": ("olmo", dict(_EXPORTED_SHAPES)),
    "olmo2": ("olmo2", dict(_GQA)),
    "granite": ("granite", dict(_GQA)),
    "gpt2": ("gpt2", EXPORTED_MODELS["gpt2"]),
    "gpt_neox": ("gpt_neox", EXPORTED_MODELS["gpt_neox"]),
    "gptj": ("gptj", EXPORTED_MODELS["gptj"]),
    "falcon": ("falcon", EXPORTED_MODELS["falcon"]),
    "opt": ("opt", EXPORTED_MODELS["opt"]),
    "smollm3": ("smollm3", dict(_GQA)),
    "glm": ("glm", dict(_GQA)),
    "glm4": ("glm4", dict(_GQA)),
    "exaone4": ("exaone4", dict(_GQA, num_hidden_layers=4, sliding_window=WINDOW)),  # local, local, local, global
    "starcoder2": ("starcoder2", dict(_GQA, sliding_window=WINDOW)),
    "cohere": ("cohere", dict(_GQA)),  # LayerNorm's mean, logits scaled
    "cohere2": ("cohere2", dict(_GQA, num_hidden_layers=4, sliding_window=WINDOW)),  # every 4th layer global
    "olmo3": ("olmo3", dict(_GQA, num_hidden_layers=4, sliding_window=WINDOW)),
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, seq_length=256)),  # ALiBi
    "falcon_alibi": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                                    max_position_embeddings=256)),
    # Mixtures of experts (`ir_passes/lower_moe.py`): softmax then top-k, renormalised or not, top-k then softmax,
    # per-expert and stacked checkpoint tensors, a shared expert behind a sigmoid gate, windows beside experts,
# head dims 16 and 32, GQA and MQA, tied and untied heads.
    "qwen3_moe": ("qwen3_moe", dict(_GQA, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(_GQA, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW)),
    "granitemoe": ("granitemoe", dict(_GQA, num_key_value_heads=1, num_local_experts=4,
                                      num_experts_per_tok=2)),  # MQA; experts stacked in the file
    "olmoe": ("olmoe", dict(_GQA, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=True)),  # not renormalised
    "qwen2_moe": ("qwen2_moe", dict(_GQA, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)),
    # gpt-oss: attention sinks (a learned logit per head in each softmax's denominator) with alternating windows,
    # biased projections, a router with a bias choosing top-k then softmax, experts stored [E, in, out] with biases
    # and a clamped SwiGLU over interleaved gate/up columns, YaRN rotary embeddings.
    "gpt_oss": ("gpt_oss", dict(_GQA, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW, layer_types=[_LOCAL, _GLOBAL])),
    # Its attention with one key/value head for eight query heads of 16 (a sink carrier full of sinks), untied.
    "gpt_oss_mqa": ("gpt_oss", dict(_EXPORTED_SHAPES, num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                                    num_local_experts=4, num_experts_per_tok=1, sliding_window=WINDOW,
                                    layer_types=[_GLOBAL, _LOCAL], tie_word_embeddings=False)),
}


def write_exported_checkpoint(name: str, out_dir: Path, seed: int = SEED) -> Path:
    """Write the tiny checkpoint `name` of `EXPORTED_MODELS` or `FAMILIES` to `out_dir`; returns `out_dir`."""
    model_type, overrides = FAMILIES[name] if name in FAMILIES else (name, EXPORTED_MODELS[name])
    return write_config_checkpoint(model_type, overrides, out_dir, seed)


def write_config_checkpoint(model_type: str, overrides: dict[str, Any], out_dir: Path, seed: int = SEED) -> Path:
    """Write a tiny checkpoint of transformers' `model_type` with `overrides` (and the tiny vocabulary's token ids)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **_EXPORTED_COMMON, **overrides)
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= config.vocab_size:
        config.pad_token_id = 0  # a family's default (Phi-3's 32000) outside the tiny vocabulary
    return write_model(random_model(config, seed), out_dir)


def write_onnx(model_dir: Path, out_path: Path) -> Path:
    """The checkpoint at `model_dir` exported by `torch.onnx.export` (its dynamo exporter) as a full-sequence
    forward, logits = f(input_ids[1, seq]), weights in an external data file beside `out_path`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # sdpa attention, the default

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.tensor([[5, 7, 9, 11, 13]])
    seq = torch.export.Dim("seq", max=model.config.max_position_embeddings)
    torch.onnx.export(Logits().eval(), (ids,), str(out_path), dynamo=True, input_names=["input_ids"],
                      output_names=["logits"], dynamic_shapes={"input_ids": {1: seq}}, verbose=False)
    return out_path


def make_config(model_type: str, **overrides: Any):
    """A transformers config of `model_type` with the tiny shapes (or `overrides`)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    config = classes[model_type](**{**TINY_SHAPES, **overrides})
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def random_model(config, seed: int = SEED):
    """A float32 causal LM for `config` with random weights, nonzero biases and norm scales."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)  # Qwen2's q/k/v biases: zero-init would hide a dropped bias
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    return model.eval()


def write_checkpoint(name: str, out_dir: Path, seed: int = SEED) -> Path:
    """Write the tiny checkpoint `name` of `TINY_MODELS` to `out_dir`; returns `out_dir`."""
    model_type, overrides = TINY_MODELS[name]
    return write_model(random_model(make_config(model_type, **overrides), seed), out_dir)


def write_model(model, out_dir: Path) -> Path:
    """Save `model` as safetensors plus the tiny tokenizer files."""
    out_dir = Path(out_dir)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, model.config.vocab_size)
    return out_dir


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A character-level BPE tokenizer of exactly `vocab_size` tokens that prepends <s>.

    The alphabet is printable ASCII plus newline; merges of lowercase letter pairs
    fill the rest of the vocabulary, so every id the model can emit decodes to text.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    alphabet = ["\n"] + [c for c in string.printable if c.isprintable()]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    merges = []
    letters = string.ascii_lowercase
    for pair in ((a, b) for a in "etaoinshrdlu" for b in letters):
        if len(vocab) >= vocab_size:
            break
        merges.append(pair)
        vocab["".join(pair)] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot build a tokenizer of {vocab_size} tokens (got {len(vocab)})")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Write tokenizer.json and tokenizer_config.json (with `CHAT_TEMPLATE`) to `out_dir`."""
    out_dir = Path(out_dir)
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_reference(model_dir: Path):
    """The checkpoint at `model_dir` in transformers, float32, eager attention, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
