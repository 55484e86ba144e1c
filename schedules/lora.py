"""ember's LoRA kernel: each token's adapter term added into a projection's output, as loops already scheduled for
CPUs.

A LoRA adapter changes a projection y = W x into y + s * B (A x), A [r, K] and B [N, r] of a small rank r.
An artifact compiled with adapter slots (`ir_passes/add_lora_slots.py`) holds, per targeted projection, the
A and B of `slots` adapters, and each token of a call names its own (its sequence's adapter) and scale:

    lora_apply(x[b, s, K], y[b, s, N], a[slots, M * R, K], b_t[slots, R, N], slot[b * s], scale[b * s])
        y[i, j] += scale[t] * b_t[slot[t]]^T (a[slot[t]] x[i, j]),  t = i * s + j     (in place)

A fused projection (q/k/v, gate/up) is one call: its columns are its members' in turn (`segments`), the targeted
members' A rows stacked (M of them, R rows each), and B_t's columns of member m read only m's R down-projected
values. Tokens run in parallel, each thread on a contiguous run of them: a decode step's sequences, which
`Engine.decode` orders by adapter so that a thread's tokens of one adapter read its bytes once (from cache after
the first), or a prompt chunk's positions. Per token, its adapter's M * R dot products over K, scaled, then R
rows of B_t added into each output tile (B is stored transposed, [R, N], so a tile is contiguous), vectorized.

A token whose scale is 0 (the base model) is skipped, and a call with no other starts no parallel loop: a batch
of base sequences costs one pass over their scales. Adapters of a lower rank than R are stored with zero rows
past their rank, which add nothing. The dot products accumulate in float32, whatever the projection's weight
format.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from ember.schedules.common import SCHEDULED_OPAQUE, float_lanes


def _member_of(column, segments: tuple[tuple[int, int, int], ...]):
    """The index among the targeted members of the member owning `column` (an expression), -1 if not targeted."""
    owner = T.int32(segments[0][2])
    for begin, _size, index in segments[1:]:
        owner = T.Select(column >= begin, T.int32(index), owner)
    return owner


@functools.cache
def lora_apply(k: int, n: int, rank: int, slots: int, segments: tuple[tuple[int, int, int], ...],
               vector_bits: int) -> tirx.PrimFunc:
    """The kernel adding each token's adapter term into a [batch, seq, n] float32 projection (in place) of a
    [batch, seq, k] input; `segments`: its members' (first column, columns, index among the targeted or -1) (see
    the module docstring)."""
    lanes_k = float_lanes((k,), vector_bits)
    lanes_n = float_lanes(tuple(size for segment in segments for size in segment[:2]), vector_bits)
    downs = rank * sum(index >= 0 for _, _, index in segments)

    @T.prim_func(s_tir=True, private=True)
    def apply(x_handle: T.handle, y_handle: T.handle, a: T.Buffer((slots, downs, k), "float32"),
              b_t: T.Buffer((slots, rank, n), "float32"), slot_handle: T.handle, scale_handle: T.handle):
        T.func_attr(SCHEDULED_OPAQUE)
        batch, seq = T.int64(), T.int64()
        x = T.match_buffer(x_handle, (batch, seq, k), "float32")
        y = T.match_buffer(y_handle, (batch, seq, n), "float32")
        slot = T.match_buffer(slot_handle, (batch * seq,), "int32")
        scale = T.match_buffer(scale_handle, (batch * seq,), "float32")
        with T.sblock("any"):
            T.reads()
            T.writes()
            active = T.sblock_alloc_buffer((1,), "int32")
            active[0] = 0
            for t in T.serial(batch * seq):
                if scale[t] != T.float32(0):
                    active[0] = 1
            if active[0] == 1:
                for t in T.parallel(batch * seq):
                    with T.sblock("lora"):
                        T.reads()
                        T.writes()
                        down = T.sblock_alloc_buffer((downs, lanes_k), "float32")
                        i: T.let[T.int64] = t // seq
                        j: T.let[T.int64] = t % seq
                        if scale[t] != T.float32(0):
                            s: T.let[T.int32] = slot[t]
                            for r in T.serial(downs):
                                for v in T.vectorized(lanes_k):
                                    down[r, v] = T.float32(0)
                                for c in T.serial(k // lanes_k):
                                    for v in T.vectorized(lanes_k):
                                        down[r, v] = down[r, v] + a[s, r, c * lanes_k + v] * x[i, j, c * lanes_k + v]
                                for v in T.serial(lanes_k - 1):
                                    down[r, 0] = down[r, 0] + down[r, v + 1]
                                down[r, 0] = down[r, 0] * scale[t]
                            for c in T.serial(n // lanes_n):
                                member: T.let[T.int32] = _member_of(c * lanes_n, segments)
                                if member >= 0:
                                    for r in T.serial(rank):
                                        for v in T.vectorized(lanes_n):
                                            y[i, j, c * lanes_n + v] = (y[i, j, c * lanes_n + v] + down[
                                                member * rank + r, 0] * b_t[s, r, c * lanes_n + v])

    return apply
