"""Time an artifact's prefill and decode where it runs: on this machine, or on a device over RPC.

`run_benchmark` is what `ember bench` runs, in its own process or on a device of the farm
(`ember.runtime.rpc_device`): it loads the artifact, prefills a fixed prompt and decodes
greedily, a few times, and returns plain data (JSON-ready) with the times of every run,
the greedy tokens and the peak resident memory. The prompt is the same pseudo-random
token ids everywhere (no tokenizer needed), so two runs of one artifact on two machines
must produce the same tokens; the host compares and prints them (`src/ember/driver/bench.py`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.errors import GenerationError
from ember.core.machine import cpu_fingerprint
from ember.runtime.artifact import load_artifact
from ember.runtime.engine import Engine

PROMPT_SEED = 0
_WARMUP_DECODE_STEPS = 4


@dataclass(frozen=True)
class BenchOptions:
    """What to time: a prompt of `prompt_tokens` tokens, then `new_tokens` decode steps, `repeats` times."""

    prompt_tokens: int = 128
    new_tokens: int = 128
    repeats: int = 3
    threads: int | None = None  # CPU kernels' threads (None: the runtime's default)

    def to_json(self) -> dict[str, Any]:
        """Plain data (what crosses RPC)."""
        return asdict(self)


def benchmark_prompt(length: int, vocab_size: int) -> list[int]:
    """The benchmark's prompt: `length` pseudo-random token ids, the same on every machine."""
    rng = np.random.default_rng(PROMPT_SEED)
    return [int(token) for token in rng.integers(min(3, vocab_size - 1), vocab_size, length)]


def run_benchmark(artifact_dir: Path, options: BenchOptions) -> dict[str, Any]:
    """Load the artifact at `artifact_dir`, then prefill and decode greedily `options.repeats` times (after one
    short warm-up run); seconds of every run, the greedy tokens, peak memory and this machine's fingerprint."""
    if options.prompt_tokens < 1 or options.new_tokens < 1 or options.repeats < 1:
        raise GenerationError("the prompt, the new tokens and the repeats must each be at least 1")
    _reset_peak_memory()
    start = time.perf_counter()
    artifact = load_artifact(Path(artifact_dir), threads=options.threads)
    engine = Engine(artifact)
    load_seconds = time.perf_counter() - start
    needed = options.prompt_tokens + options.new_tokens
    if needed > engine.context_window:
        raise GenerationError(f"a prompt of {options.prompt_tokens} tokens and {options.new_tokens} new tokens need "
                              f"{needed} tokens of context; {artifact_dir} holds {engine.context_window}")
    prompt = benchmark_prompt(options.prompt_tokens, engine.vocab_size)
    _generate(engine, prompt[: min(len(prompt), 16)], _WARMUP_DECODE_STEPS)  # page faults, thread pool start-up
    runs = [_generate(engine, prompt, options.new_tokens) for _ in range(options.repeats)]
    return {
        "fingerprint": cpu_fingerprint(),
        "threads": int(os.environ.get("TVM_NUM_THREADS", "0")) or None,
        "load_seconds": load_seconds,
        "prefill_seconds": [run[0] for run in runs],
        "decode_seconds": [run[1] for run in runs],
        "tokens": runs[0][2],
        "tokens_repeat": all(run[2] == runs[0][2] for run in runs),
        "peak_memory_bytes": _peak_memory(),
    }


def _generate(engine: Engine, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
    """Seconds of the prefill of `prompt`, seconds of `steps` greedy decode steps, and the greedy tokens
    (the prefill's and one per step)."""
    seq = engine.add_sequence()
    try:
        start = time.perf_counter()
        tokens = [int(np.argmax(engine.prefill(seq, prompt)))]
        prefilled = time.perf_counter()
        for _ in range(steps):
            tokens.append(int(np.argmax(engine.decode([seq], [tokens[-1]])[0])))
        return prefilled - start, time.perf_counter() - prefilled, tokens
    finally:
        engine.remove_sequence(seq)


def _reset_peak_memory() -> None:
    """Start the kernel's peak-RSS count over, so it measures the benchmark (Linux >= 4.0; elsewhere a no-op)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_memory() -> int | None:
    """This process's peak resident memory in bytes, where the OS reports it (Linux's VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
