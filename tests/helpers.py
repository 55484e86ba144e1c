"""Helpers shared by the tests: prompts, logit comparison, running the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import artifact_cache
import models
import numpy as np

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


def compile_cached(what: str, model: Path, dest: Path, *args: str) -> None:
    """`ember compile MODEL -o DEST ARGS` in a subprocess (it must succeed), or its artifact from the test-artifact
    cache: for tests whose artifact is an input, not what they check. Not for a model whose KV cache the CLI would
    size to this machine's free memory (the key does not cover it)."""
    def compile_into(into: Path) -> None:
        result = run_ember("compile", str(model), "-o", str(into), *args)
        assert result.returncode == 0, result.stderr

    key = artifact_cache.artifact_key(what, args, [model])
    artifact_cache.build(key, dest, compile_into)


def run_python(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` in a subprocess from the repository root."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *expected: str, returncode: int = 1) -> None:
    """The CLI failed as users should see it fail: `returncode`, no traceback, and stderr one
    `ember: error:` line (argparse's usage lines allowed before it for exit 2) containing each of `expected`."""
    assert result.returncode == returncode, f"exit {result.returncode}:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if returncode == 2:  # argparse: "usage: ..." lines, then "ember ...: error: ..."
        lines = [line for line in lines if ": error: " in line]
    else:
        assert len(lines) == 1 and lines[0].startswith("ember: error: "), f"expected one error line:\n{result.stderr}"
    assert len(lines) == 1, f"expected one error line:\n{result.stderr}"
    for text in expected:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


def tree_snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under `root` (itself excluded) with its bytes, a link's target, or "dir":
    compare two snapshots to show nothing on disk changed."""
    snapshot: dict[str, bytes | str] = {}
    for path in sorted(Path(root).rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            snapshot[key] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            snapshot[key] = "dir"
        elif path.is_file():
            snapshot[key] = path.read_bytes()
        else:
            snapshot[key] = "special"
    return snapshot


@contextmanager
def ember_serve(artifact: Path, api_key_file: Path, timeout: float, *options: str) -> Iterator[str]:
    """`ember serve ARTIFACT [options]` in a subprocess on a free loopback port, one thread: its base URL
    (http://127.0.0.1:PORT), once it listens; stopped by its own process handle at the end."""
    process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(artifact), "--port", "0",
                                "--api-key-file", str(api_key_file), "--threads", "1", *options],
                               cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()  # blocks until the server listens, or the process ends
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line + process.stderr.read() if process.poll() is not None else line
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=timeout)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`ember ARGS` in this process, as a CompletedProcess (argparse's exit becomes the return code)."""
    from ember import cli

    try:
        code = cli.main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@contextmanager
def deadline(seconds: int = 60):
    """Fail instead of hanging if the body runs longer than `seconds` (reading /dev/zero, opening a FIFO)."""
    def expire(_signum, _frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
