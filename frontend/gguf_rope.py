"""Llama 3 RoPE scaling from a GGUF file's `rope_freqs.weight` tensor.

llama.cpp's converter (`convert_hf_to_gguf.py`) does not store a Llama 3 checkpoint's `rope_scaling` as
metadata: it stores one divisor per rotary frequency, `rope_freqs.weight`, which llama.cpp divides each
frequency by. The divisor is 1 for short wavelengths, `factor` for long ones, and between them

    1 / divisor = (1 - smooth) / factor + smooth,   smooth = (L / wavelength - low) / (high - low)

with L = original_max_position_embeddings, low/high = low_freq_factor/high_freq_factor. Since
1 / wavelength = freq / 2 pi, smooth = alpha * freq - beta is linear in the frequency, with
alpha = L / (2 pi (high - low)) and beta = low / (high - low); the divisors fix `factor`, alpha and beta,
which is all the rotation depends on (TVM's llama3 RoPE computes exactly this, clamped to [0, 1]).
L cannot be told apart from a common scale of low and high, so it is taken as Llama 3's 8192. Every
recovered divisor is checked against the tensor; a tensor that is not Llama 3 scaling is refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.errors import ModelError

TENSOR = "rope_freqs.weight"
ORIGINAL_CONTEXT = 8192  # Llama 3's original_max_position_embeddings; only low/L and high/L matter
META_HIGH_OVER_LOW = 4.0  # Meta's high_freq_factor / low_freq_factor, assumed when the divisors leave it open
RELATIVE_TOLERANCE = 1e-4  # the divisors are float32, computed from float32 frequencies


def llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any] | None:
    """The `rope_scaling` whose divisors are `divisors` (None: all 1, no scaling), or a ModelError."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.size != head_dim // 2:
        raise ModelError(f"{path}: tensor {TENSOR!r} has {divisors.size} values; a head of {head_dim} rotates "
                         f"{head_dim // 2} frequencies")
    if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise ModelError(f"{path}: tensor {TENSOR!r} holds values that are not finite positive numbers")
    if np.allclose(divisors, 1.0, rtol=0, atol=RELATIVE_TOLERANCE):
        return None
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))
    freqs = freqs.astype(np.float64)
    factor = float(divisors.max())
    if factor <= 1.0:
        raise _not_llama3(path, "no divisor exceeds 1")
    smooth = (1.0 / divisors - 1.0 / factor) / (1.0 - 1.0 / factor)
    alpha, beta = _fit(freqs, smooth)
    if not (alpha > 0 and beta > 0):
        raise _not_llama3(path, "its divisors do not fall from `factor` to 1 as the frequency rises")
    span = ORIGINAL_CONTEXT / (2 * math.pi * alpha)  # high - low
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": beta * span,
               "high_freq_factor": (beta + 1) * span, "original_max_position_embeddings": ORIGINAL_CONTEXT}
    expected = llama3_divisors(freqs, scaling)
    worst = int(np.argmax(np.abs(expected - divisors) / divisors))
    if abs(expected[worst] - divisors[worst]) > RELATIVE_TOLERANCE * divisors[worst]:
        raise _not_llama3(path, f"divisor {worst} is {divisors[worst]:.6g}, the closest Llama 3 scaling gives "
                                f"{expected[worst]:.6g}")
    return scaling


def llama3_divisors(freqs: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter's divisor of each frequency under Llama 3 `scaling`."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelengths = 2 * math.pi / np.asarray(freqs, dtype=np.float64)
    smooth = np.clip((context / wavelengths - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _fit(freqs: np.ndarray, smooth: np.ndarray) -> tuple[float, float]:
    """(alpha, beta) of smooth = alpha * freq - beta: a line through the blended frequencies when there are
    two or more; otherwise Meta's high/low ratio fixes beta and alpha is taken between the bounds the kept
    (smooth 1) and divided (smooth 0) frequencies put on it."""
    blended = (smooth > RELATIVE_TOLERANCE) & (smooth < 1 - RELATIVE_TOLERANCE)
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(freqs[blended], smooth[blended], 1)
        return float(slope), float(-intercept)
    beta = 1.0 / (META_HIGH_OVER_LOW - 1.0)
    if blended.any():
        index = int(np.flatnonzero(blended)[0])
        return float((smooth[index] + beta) / freqs[index]), beta
    kept, divided = freqs[smooth >= 1 - RELATIVE_TOLERANCE], freqs[smooth <= RELATIVE_TOLERANCE]
    lowest = (1 + beta) / kept.min() if kept.size else 0.0  # alpha * f - beta >= 1 for every kept f
    highest = beta / divided.max() if divided.size else math.inf  # alpha * f - beta <= 0 for every divided f
    if lowest == 0.0:
        return highest / 2, beta
    if highest == math.inf:
        return lowest * 2, beta
    return math.sqrt(lowest * highest), beta


def _not_llama3(path: Path, why: str) -> ModelError:
    return ModelError(f"{path}: tensor {TENSOR!r} is not Llama 3 RoPE scaling ({why}); ember computes Llama 3 "
                      "scaling only")
