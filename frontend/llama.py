"""The Llama family (Llama 2/3, Mistral, Qwen2) as a `relax.frontend.nn` graph.

The module tree and parameter names mirror Hugging Face's `LlamaForCausalLM`
exactly (`model.layers.0.self_attn.q_proj.weight`, ...), so a checkpoint maps onto
the graph by name, and the graph keeps HF's plain structure: separate q/k/v and
gate/up projections. Fusing them is a graph pass's job (`ir_passes/`), not the
model's.

Attention runs inside TVM's paged KV cache (`attention_with_fused_qkv`), which
applies RoPE to q and k, appends k/v to the cache and attends over the sequence's
pages. Entry functions:

- `prefill(input_ids[1, n], logit_positions[m], kv_cache) -> logits[1, m, vocab]`:
  one chunk of one sequence; logits only at the requested positions (the last
  token for generation, all of them for perplexity).
- `decode(input_ids[b, 1], kv_cache) -> logits[b, 1, vocab]`: one token for each of
  b sequences.
- `verify(input_ids[1, n], kv_cache) -> logits[1, n, vocab]`: a few tokens of one
  sequence (n <= VERIFY_TOKENS: a pending token and guesses, `runtime/speculative.py`)
  with logits at every position, in kernels sized for a few rows as decode's are.
- `embed(input_ids[1, n], kv_cache) -> hidden[1, n, hidden_size] float32`: one chunk of
  one sequence, the hidden states after the final norm (transformers' `last_hidden_state`),
  for `/v1/embeddings`; only in artifacts compiled with `ember compile --embeddings`.
- `create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size,
  page_size, support_sliding_window) -> kv_cache`.
"""

from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache
from tvm.target import Target

from ember.frontend.config import ModelConfig
from ember.ir.attributes import BATCH_SIZE, SEQ_LEN, VERIFY_LEN
from ember.ir.kv_cache import CacheShape, create_spec, paged_kv_cache

LOGITS_DTYPE = "float32"


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: str) -> None:
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        batch, seq_len, _ = x.shape
        q = op.reshape(self.q_proj(x), (batch, seq_len, self.num_heads, self.head_dim))
        k = op.reshape(self.k_proj(x), (batch, seq_len, self.num_kv_heads, self.head_dim))
        v = op.reshape(self.v_proj(x), (batch, seq_len, self.num_kv_heads, self.head_dim))
        qkv = op.concat([q, k, v], dim=2)
        out = kv_cache.attention_with_fused_qkv(
            layer_id, qkv, self.num_heads, sm_scale=self.head_dim**-0.5
        )
        return self.o_proj(op.reshape(out, (batch, seq_len, self.num_heads * self.head_dim)))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: str) -> None:
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(op.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, dtype: str) -> None:
        eps = config.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(config.hidden_size, -1, eps, bias=False, dtype=dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, -1, eps, bias=False, dtype=dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: Tensor, kv_cache: PagedKVCache, layer_id: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: str) -> None:
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False, dtype=dtype)

    def forward(self, input_ids: Tensor, kv_cache: PagedKVCache) -> Tensor:
        x = self.embed_tokens(input_ids)
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, kv_cache, layer_id)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder with a language-model head and paged-KV entry points."""

    def __init__(self, config: ModelConfig, dtype: str, target: Target) -> None:
        self.config = config
        self.dtype = dtype
        self.target = target
        self.model = DecoderStack(config, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def _logits(self, hidden: Tensor) -> Tensor:
        if self.config.tie_word_embeddings:
            weight = op.permute_dims(self.model.embed_tokens.weight)
            logits = op.matmul(hidden, weight, out_dtype=LOGITS_DTYPE)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(LOGITS_DTYPE) if logits.dtype != LOGITS_DTYPE else logits

    def prefill(self, input_ids: Tensor, logit_positions: Tensor, kv_cache: PagedKVCache):
        """Run one prompt chunk of one sequence; logits at `logit_positions` only."""
        hidden = self.model(input_ids, kv_cache)
        _, seq_len, hidden_size = hidden.shape
        picked = op.take(op.reshape(hidden, (seq_len, hidden_size)), logit_positions, axis=0)
        logits = self._logits(op.reshape(picked, (1, logit_positions.shape[0], hidden_size)))
        return logits, kv_cache

    def decode(self, input_ids: Tensor, kv_cache: PagedKVCache):
        """Run one new token for each sequence of the batch."""
        return self._logits(self.model(input_ids, kv_cache)), kv_cache

    def verify(self, input_ids: Tensor, kv_cache: PagedKVCache):
        """Run a few new tokens of one sequence; logits at every position."""
        return self._logits(self.model(input_ids, kv_cache)), kv_cache

    def embed(self, input_ids: Tensor, kv_cache: PagedKVCache):
        """Run one chunk of one sequence; its hidden states after the final norm, as float32."""
        hidden = self.model(input_ids, kv_cache)
        return (hidden.astype(LOGITS_DTYPE) if hidden.dtype != LOGITS_DTYPE else hidden), kv_cache

    def create_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        """Allocate the paged KV cache; sizes are chosen by the runtime."""
        return paged_kv_cache(self.cache_shape, self.dtype, self.target, max_batch_size, max_total_seq_len,
                              prefill_chunk_size, page_size, support_sliding_window)

    @property
    def cache_shape(self) -> CacheShape:
        """What the KV cache holds; it applies the rotary embeddings."""
        c = self.config
        return CacheShape(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.context_window, c.rope_theta, c.rope_scaling or {}, c.layer_windows)

    def export_spec(self, embeddings: bool = False) -> dict[str, Any]:
        """The `nn.Module.export_tvm` spec of the entry functions (`embed` too with `embeddings`)."""
        plain = {"param_mode": "plain", "effect_mode": "none"}
        embed = {"embed": {
            "input_ids": nn.spec.Tensor([1, SEQ_LEN], "int32"),
            "kv_cache": nn.spec.Object(object_type=PagedKVCache),
            "$": plain,
        }} if embeddings else {}
        return {
            "prefill": {
                "input_ids": nn.spec.Tensor([1, SEQ_LEN], "int32"),
                "logit_positions": nn.spec.Tensor(["num_logits"], "int32"),
                "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": plain,
            },
            "decode": {
                "input_ids": nn.spec.Tensor([BATCH_SIZE, 1], "int32"),
                "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": plain,
            },
            "verify": {
                "input_ids": nn.spec.Tensor([1, VERIFY_LEN], "int32"),
                "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": plain,
            },
            **embed,
            "create_paged_kv_cache": create_spec(),
        }
