"""ember's LoRA kernel: a projection's output plus each row's adapter, written as loops already scheduled for CPUs.

A LoRA adapter changes a projection y = W x into y + s * B (A x), A [r, K] and B [N, r] of a small rank r.
An artifact compiled with adapter slots (`ir_passes/add_lora_slots.py`) holds, per targeted projection, the
A and B of `slots` adapters, and each row of a batch names its own (a sequence's adapter) and scale:

    lora_apply(x[b, s, K], y[b, s, N], a[slots, R, K], b_t[slots, R, N], slot[b * s], scale[b * s])
        -> out[b, s, N],   out[i, j] = y[i, j] + scale[t] * b_t[slot[t]]^T (a[slot[t]] x[i, j]),  t = i * s + j

a slot and scale per token, in the order the call's tokens come (a decode step's sequences, a prompt chunk's
positions), whichever axis a graph keeps them on.

B is stored transposed, [R, N], so both halves stream contiguous rows: the rank's R dot products over K,
then R scaled rows of B added into the output, vectorized along N. A row whose scale is 0 (the base model)
copies y and reads no adapter: a batch of base sequences pays a copy of its outputs, not the adapters' bytes.
Adapters of a lower rank than R are stored with zero rows past their rank, which add nothing.

Tokens run in parallel: a decode step's sequences, or a prompt chunk's tokens (whose A rows then come from
cache after the first). The dot products accumulate in float32, whatever the projection's weight format.
"""

from __future__ import annotations

import functools

from tvm import relax, tirx
from tvm.script import tirx as T

_OPAQUE = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8}  # 8: opaque, never fused
# The kernels' attribute {"k", "n", "rank", "slots"}, so analyses find them.
LORA_ATTR = "ember.lora_apply"


def _lanes(size: int, vector_bits: int) -> int:
    """float32 lanes along a row of `size`: the target's vector width where the row is whole vectors of it."""
    lanes = vector_bits // 32
    while size % lanes:
        lanes //= 2
    return lanes


@functools.cache
def lora_apply(k: int, n: int, rank: int, slots: int, vector_bits: int) -> tirx.PrimFunc:
    """The kernel adding each token's adapter to a [batch, seq, n] float32 projection of a [batch, seq, k] input
    (see the module docstring)."""
    lanes_k, lanes_n = _lanes(k, vector_bits), _lanes(n, vector_bits)

    @T.prim_func(s_tir=True, private=True)
    def apply(x_handle: T.handle, y_handle: T.handle, a: T.Buffer((slots, rank, k), "float32"),
              b_t: T.Buffer((slots, rank, n), "float32"), slot_handle: T.handle, scale_handle: T.handle,
              out_handle: T.handle):
        T.func_attr(_OPAQUE)
        batch, seq = T.int64(), T.int64()
        x = T.match_buffer(x_handle, (batch, seq, k), "float32")
        y = T.match_buffer(y_handle, (batch, seq, n), "float32")
        slot = T.match_buffer(slot_handle, (batch * seq,), "int32")
        scale = T.match_buffer(scale_handle, (batch * seq,), "float32")
        out = T.match_buffer(out_handle, (batch, seq, n), "float32")
        for t in T.parallel(batch * seq):
            with T.sblock("lora"):
                T.reads()
                T.writes()
                down = T.sblock_alloc_buffer((rank, lanes_k), "float32")
                i: T.let[T.int64] = t // seq
                j: T.let[T.int64] = t % seq
                if scale[t] == T.float32(0):
                    for c in T.serial(n // lanes_n):
                        for v in T.vectorized(lanes_n):
                            out[i, j, c * lanes_n + v] = y[i, j, c * lanes_n + v]
                else:
                    s: T.let[T.int32] = slot[t]
                    for r in T.serial(rank):
                        for v in T.vectorized(lanes_k):
                            down[r, v] = T.float32(0)
                        for c in T.serial(k // lanes_k):
                            for v in T.vectorized(lanes_k):
                                down[r, v] = down[r, v] + a[s, r, c * lanes_k + v] * x[i, j, c * lanes_k + v]
                        for v in T.serial(lanes_k - 1):
                            down[r, 0] = down[r, 0] + down[r, v + 1]
                        down[r, 0] = down[r, 0] * scale[t]
                    for c in T.serial(n // lanes_n):
                        for v in T.vectorized(lanes_n):
                            out[i, j, c * lanes_n + v] = y[i, j, c * lanes_n + v]
                        for r in T.serial(rank):
                            for v in T.vectorized(lanes_n):
                                out[i, j, c * lanes_n + v] = (out[i, j, c * lanes_n + v]
                                                              + down[r, 0] * b_t[s, r, c * lanes_n + v])

    return apply.with_attr(LORA_ATTR, {"k": k, "n": n, "rank": rank, "slots": slots})


def is_lora(mod, value: relax.Expr) -> bool:
    """Whether `value` calls a `lora_apply` kernel of `mod` through call_tir."""
    if not isinstance(value, relax.Call) or not value.args or not isinstance(value.args[0], relax.GlobalVar):
        return False
    func = mod.functions.get(value.args[0]) if value.args[0] in mod.functions else None
    return isinstance(func, tirx.PrimFunc) and LORA_ATTR in (func.attrs or {})
