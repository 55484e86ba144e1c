"""Transcendental functions as plain TIR arithmetic, so they vectorize; and lane reductions in vectors.

LLVM lowers `T.exp2` (and `exp`, `sigmoid`) on a vector to one libm call per lane: a
softmax over a chunk of attention scores then costs a scalar function call per score. These versions are
polynomials plus integer bit tricks, which a vectorized loop turns into a handful of
SIMD instructions per vector.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

# Cephes' exp2f: 2^f = 1 + f * P(f) for f in [-0.5, 0.5], relative error below 2e-7.
_EXP2_COEFFICIENTS = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
                      5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1)
# Below this 2^x is no longer a normal float32; inputs are clamped here (2^-126 ~ 1e-38).
_SMALLEST_EXPONENT = -126.0
# 2^127 is the largest power of two a float32 holds.
_LARGEST_EXPONENT = 127.0
_LOG2_E = 1.4426950408889634


def exp2(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """2^x for a float32 expression, within 2e-7 relative for -126 <= x <= 127 (x < -126 gives 2^-126;
    above 127 the exponent field overflows, so callers pass x <= 0, as a softmax does).

    x = n + f with n = round(x), f in [-0.5, 0.5]; 2^f is the polynomial, 2^n is built
    directly as the float32 bit pattern (exponent field n + 127)."""
    x = T.max(x, T.float32(_SMALLEST_EXPONENT))
    whole = T.round(x)
    fraction = x - whole
    poly = T.float32(_EXP2_COEFFICIENTS[0])
    for coefficient in _EXP2_COEFFICIENTS[1:]:
        poly = poly * fraction + T.float32(coefficient)
    power = T.reinterpret("float32", T.shift_left(T.Cast("int32", whole) + 127, 23))
    return (poly * fraction + T.float32(1.0)) * power


def exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """e^x for a float32 expression, clamped to [2^-126, 2^128) (float32's normal range: libm
    gives 0 below and inf above); within 2e-7 relative, plus the rounding of x * log2(e)
    (|x| * 6e-8 relative: 5e-6 at x = 80)."""
    return exp2(T.min(x * T.float32(_LOG2_E), T.float32(_LARGEST_EXPONENT)))


# The widest buffer `reduce_lanes` folds.
MAX_REDUCED_LANES = 64


@T.macro
def _fold(buf, half, use_max):
    """buf[:half] = the max or the sum of buf[:half] and buf[half:2 * half], one vector op (none for half 0)."""
    if half >= 1:
        if use_max:
            for i in T.vectorized(half):
                buf[i] = T.max(buf[i], buf[i + half])
        else:
            for i in T.vectorized(half):
                buf[i] = buf[i] + buf[i + half]


@T.macro
def reduce_lanes(buf, lanes, use_max):
    """buf[0] = the max (`use_max`) or the sum of buf[:lanes], a power of two up to MAX_REDUCED_LANES: halves
    folded as vectors, log2(lanes) ops instead of a scalar loop (attention's dot products and softmax)."""
    _fold(buf, lanes // 2, use_max)
    _fold(buf, lanes // 4, use_max)
    _fold(buf, lanes // 8, use_max)
    _fold(buf, lanes // 16, use_max)
    _fold(buf, lanes // 32, use_max)
    _fold(buf, lanes // 64, use_max)
