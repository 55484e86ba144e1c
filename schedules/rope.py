"""ember's CPU rotary embedding for fused q/k/v: each position's angles once, not once per head.

TVM's `llama_rope_with_position_map` (the KV cache's `fused_rope`, run on every
layer's fused qkv projection before attention) evaluates the rotation angle of every
element: a `pow`, a `cos` and a `sin` libm call for each (token, head, dim), the same
angles recomputed for all heads, a cost that shows in prefill (measured in
docs/benchmarks.md#schedule-measurements). This kernel has the same signature and results:

    parallel token s
      for d < rotary_dim / 2:  cos_t[d] = cos_t[d + half], sin_t[d] = sin_t[d + half]
                               = TVM's angle expressions at (position[s], d)   # same angle
      for q and k heads h:  out[s, h, :] = cos_t * x + sin_t * rotate_half(x)    # vectors
      v heads:              copied

The angle expressions are TVM's own (`switch_rope_freq_func`, including llama3's
frequency smoothing), so the arithmetic per element is unchanged (LLVM may contract
llama3's smoothing into FMAs differently: results agree to ~1e-7); only the sharing is new (TVM's
angle for dim d depends on 2d mod rotary_dim, the same for d and d + rotary_dim / 2).
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import tirx
from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func
from tvm.script import tirx as T

from ember.ir.attributes import ROPE_ATTR

# The exported symbol of TVM's kernel, which the KV cache runtime calls.
ROPE_SYMBOL = "fused_rope"


def supports(rope_scaling: dict[str, Any]) -> bool:
    """Whether this kernel computes the rotary embedding of `rope_scaling` (rotate-half layouts)."""
    return rope_scaling.get("rope_type", "default") in ("default", "llama3")


class Rotary:
    """The rotation of one model's q and k heads, as TIR pieces a kernel over fused q/k/v rows uses:
    `fill_angles` a token's cos and sin tables, `rotate` one element of a head from them."""

    def __init__(self, head_dim: int, dtype: str, theta: float, rope_scaling: dict[str, Any],
                 rotary_dim: int | None = None) -> None:
        if not supports(rope_scaling):
            raise ValueError(f"ember's rotary embedding does not compute rope_type {rope_scaling.get('rope_type')!r}")
        self.head_dim, self.dtype = head_dim, dtype
        self.rotary_dim = rotary_dim or head_dim
        self.half = self.rotary_dim // 2
        angle = switch_rope_freq_func(rope_scaling)
        rotary_dim, half = self.rotary_dim, self.half

        def cos_sin(position, d):
            """TVM's (cos, sin) of the rotation angle at `position` for dim `d`."""
            cos, sin, bindings = angle(T.Cast("float32", position), d, rotary_dim, theta, "float32")
            for var, value in bindings.items():
                cos, sin = tirx.Let(var, value, cos), tirx.Let(var, value, sin)
            return cos, sin

        @T.macro
        def fill_angles(cos_t, sin_t, position):
            for d in T.serial(half):  # dims d and d + half rotate by the same angle
                cos_t[d] = cos_sin(position, d)[0]
                sin_t[d] = cos_sin(position, d)[1]
                cos_t[d + half] = cos_t[d]
                sin_t[d + half] = sin_t[d]

        self.fill_angles = fill_angles

    def rotate(self, qkv, cos_t, sin_t, apply_rope, s, h, d):
        """Element d of head h of token s in qkv [tokens, heads, head_dim], rotated as TVM's kernel rotates it
        (rotate-half pairs) where apply_rope > 0; cos_t and sin_t hold the token's angles (`head_dim` floats)."""
        head_dim, half, rotary_dim, dtype = self.head_dim, self.half, self.rotary_dim, self.dtype
        x = qkv[s, h, d]
        partner = T.if_then_else(d < half, -qkv[s, h, T.min(d + half, head_dim - 1)], qkv[s, h, T.max(d - half, 0)])
        column = T.min(d, rotary_dim - 1)
        rotated = cos_t[column] * T.Cast("float32", x) + sin_t[column] * T.Cast("float32", partner)
        return T.if_then_else(tirx.all(apply_rope > 0, d < rotary_dim), T.Cast(dtype, rotated), x)


def recorded_rotary(mod: tvm.IRModule, head_dim: int, dtype: str) -> Rotary | None:
    """The rotation the frontend recorded on `mod` (`ROPE_ATTR`), if the cache applies it and this module computes
    it; None for an imported graph (it rotates q and k itself), no record, or another RoPE variant."""
    record = (mod.attrs or {}).get(ROPE_ATTR)
    if record is None or record.get("mode") == "in-graph":
        return None
    scaling = {str(key): str(value) if isinstance(value, str) else value for key, value in record["scaling"].items()}
    if not supports(scaling):
        return None
    return Rotary(head_dim, dtype, float(record["theta"]), scaling, int(record["rotary_dim"]))


def fused_qkv_rope(num_q_heads: int, num_kv_heads: int, rotary: Rotary):
    """Replacement for TVM's `fused_rope`: qkv [tokens, q + 2 kv heads, head_dim] -> q, k, v."""
    head_dim, dtype = rotary.head_dim, rotary.dtype
    fused_heads = num_q_heads + 2 * num_kv_heads
    rotated_heads = num_q_heads + num_kv_heads

    @T.prim_func(s_tir=True)
    def rope(qkv_handle: T.handle, position_map_handle: T.handle, q_handle: T.handle, k_handle: T.handle,
             v_handle: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": ROPE_SYMBOL, "tirx.noalias": True,
                     "op_pattern": 8})
        seq_len = T.int32()
        position_offset = T.int32()
        qkv = T.match_buffer(qkv_handle, (seq_len, fused_heads, head_dim), dtype)
        q = T.match_buffer(q_handle, (seq_len, num_q_heads, head_dim), dtype)
        k = T.match_buffer(k_handle, (seq_len, num_kv_heads, head_dim), dtype)
        v = T.match_buffer(v_handle, (seq_len, num_kv_heads, head_dim), dtype)
        position_map = T.match_buffer(position_map_handle, (seq_len,), "int32", elem_offset=position_offset)
        for s in T.parallel(seq_len):
            with T.sblock("token"):
                T.reads()
                T.writes()
                cos_t = T.sblock_alloc_buffer((head_dim,), "float32")
                sin_t = T.sblock_alloc_buffer((head_dim,), "float32")
                rotary.fill_angles(cos_t, sin_t, position_map[s])
                for h in T.serial(num_q_heads):
                    for d in T.vectorized(head_dim):
                        q[s, h, d] = rotary.rotate(qkv, cos_t, sin_t, apply_rope, s, h, d)
                for h in T.serial(num_kv_heads):
                    for d in T.vectorized(head_dim):
                        k[s, h, d] = rotary.rotate(qkv, cos_t, sin_t, apply_rope, s, num_q_heads + h, d)
                for h, d in T.grid(num_kv_heads, head_dim):
                    v[s, h, d] = qkv[s, rotated_heads + h, d]

    return rope
