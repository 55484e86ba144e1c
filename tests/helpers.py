"""Helpers shared by the tests: prompts, logit comparison, running the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import models

REPO_ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    """<s> followed by `length - 1` random non-special token ids."""
    rng = np.random.default_rng(seed)
    return [models.BOS_ID] + rng.integers(len(models.SPECIAL_TOKENS), models.VOCAB_SIZE, length - 1).tolist()


def q8_0_activations(x: np.ndarray) -> np.ndarray:
    """x rounded to int8 per group of 32 along its last axis, as llama.cpp's quantize_row_q8_0 does
    (exact halves to nearest even), in float64: d = max|x| / 127, q = round(x * 127 / max|x|), x' = q * d."""
    groups = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    top = np.abs(groups).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    return (np.rint(groups * inverse) * (top / np.float32(127)).astype(np.float64)).reshape(x.shape)


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str, tol: float = 1e-4) -> None:
    """Max abs difference <= tol, scaled by max |logit| when logits exceed 1."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(1.0, float(np.abs(expected).max()))
    diff = float(np.abs(actual - expected).max())
    assert diff <= tol * scale, f"{what}: max abs diff {diff:.3g} > {tol} x {scale:.3g}"


def run_ember(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ember ARGS` in a subprocess; text output captured."""
    return run_python("-m", "ember", *args, env=env, timeout=timeout)


def run_python(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` in a subprocess from the repository root."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
