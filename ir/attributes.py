"""The names ember's stages mark IR with: function and module attributes, and symbolic sizes.

Frontends set them, passes and schedules read them; each says who sets it and what it holds.
"""

# Set by the frontend on PrimFuncs written by hand in TVM's LLM library (paged KV cache).
KERNEL_SOURCE_ATTR = "ember.kernel_source"
# Set by the quantization pass on weight-unpacking blocks: how many consecutive values
# along K are unpacked from one packed element and one scale (the widest useful vector).
VECTOR_RUN_ATTR = "ember.vector_run"
# Set by the frontend on the IRModule: the rotary embedding the KV cache applies,
# {"theta": float, "scaling": dict (config's rope_scaling, {} for plain RoPE), "rotary_dim": int}; "in-graph"
# as "mode" where the graph rotates q and k itself.
ROPE_ATTR = "ember.rope"
# The entries' symbolic token counts: a prefill chunk's length, and decode's batch (one token per sequence, so
# its kernels are sized for a few rows; an imported graph's decode runs the batch as one row of BATCH_SIZE tokens).
SEQ_LEN, BATCH_SIZE = "seq_len", "batch_size"
# The symbolic length of the `verify` entry's input (speculative decoding's pending token and guesses)
# and its bound: as many rows as a decode batch (`schedules/matmul.py`'s FEW_ROWS), so its kernels are
# scheduled as decode's, a few rows reusing each weight load.
VERIFY_LEN, VERIFY_TOKENS = "verify_len", 8
# The one function an importer writes (`frontend/torch_export.py`, `frontend/onnx.py`): a decoder's
# full-sequence forward, `forward(input_ids[1, seq], *weights) -> logits[1, seq, vocab]`, with
# `tir_var_upper_bound` {"seq": context window}; `ir_passes/specialize_attention.py` turns it into the entries.
FORWARD = "forward"
# Set on the IRModule by whoever adds the KV cache (`ir/kv_cache.py`): what the cache holds,
# {"num_layers", "num_heads", "num_kv_heads", "head_dim"}; the compiler checks the model config against it.
KV_CACHE_ATTR = "ember.kv_cache"
# Set by an importer on the IRModule (`forward`'s module): per attention layer, the sliding window its config
# names (0: the whole context), as `frontend.config.layer_windows` reads it; `specialize_attention` proves each
# layer's mask in the graph equal to it, or refuses.
CONFIG_WINDOWS_ATTR = "ember.config_windows"
