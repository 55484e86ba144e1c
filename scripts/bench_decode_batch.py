"""Batched decode: the time of one engine step at each batch size, for artifacts side by side.

Each artifact (e.g. the same checkpoint compiled by two versions of ember) is loaded in
this process with `max(--batch)` sequences, each prefilled with a `--prompt`-token prompt.
Then, round-robin over the artifacts and `--repeats` rounds, `--steps` decode steps
(`Engine.decode`, as the serving scheduler calls it) of the first b sequences are timed,
and the sequences cut back to their prompts, so every round decodes at the same context.
Per artifact and batch size: the median step time, tokens/s, tokens/s over batch 1, and
the step time of the first artifact over this one.

    python scripts/bench_decode_batch.py /tmp/old-q4f32 /tmp/new-q4f32 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ember.core.errors import EmberError
from ember.runtime import Engine, load_artifact

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402


def step_times(engine: Engine, seq_ids: list[int], prompt: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `seq_ids`, which are then cut back to `prompt` tokens."""
    rng = np.random.default_rng(len(seq_ids))
    times = []
    for _ in range(steps):
        tokens = rng.integers(3, engine.vocab_size, len(seq_ids)).tolist()
        start = time.perf_counter()
        engine.decode(seq_ids, tokens)
        times.append(time.perf_counter() - start)
    for seq_id in seq_ids:
        engine.truncate(seq_id, prompt)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",") if b.strip().isdigit() and int(b) > 0]
    if not batches or len(batches) != len(args.batch.split(",")):
        parser.error(f"--batch {args.batch}: comma-separated positive integers")
    for option in ("prompt", "steps", "repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} {getattr(args, option)}: at least 1")
    engines, sequences = {}, {}
    for path in args.artifacts:
        try:
            engine = Engine(load_artifact(path, threads=args.threads))
            prompt = np.random.default_rng(0).integers(3, engine.vocab_size, args.prompt).tolist()
            sequences[path] = [engine.add_sequence() for _ in range(max(batches))]
            for seq_id in sequences[path]:
                engine.prefill(seq_id, prompt)
            step_times(engine, sequences[path], args.prompt, args.steps)  # warm-up, as far as the rounds go
        except EmberError as err:  # not an artifact, a batch past its --max-batch, a prompt past its context
            parser.error(str(err) if str(path) in str(err) else f"{path}: {err}")
        engines[path] = engine
    samples = {(path, b): [] for path in engines for b in batches}
    for _ in range(args.repeats):
        for b in batches:
            for path, engine in engines.items():
                samples[path, b] += step_times(engine, sequences[path][:b], args.prompt, args.steps)
    median = {key: statistics.median(values) for key, values in samples.items()}
    first = args.artifacts[0]
    print(bench_cpu.host_line())
    print(f"decode steps, {args.prompt}-token prompts, median of {args.repeats} x {args.steps} steps, round-robin")
    print(f"{'artifact':<40} {'batch':>5} {'ms/step':>8} {'tok/s':>8} {f'x batch {batches[0]}':>9} {'first/this':>10}")
    for path in engines:
        for b in batches:
            seconds = median[path, b]
            over_first_batch = (b / seconds) / (batches[0] / median[path, batches[0]])
            print(f"{str(path):<40} {b:>5} {seconds * 1e3:>8.2f} {b / seconds:>8.1f} "
                  f"{over_first_batch:>8.2f}x {median[first, b] / seconds:>9.2f}x")


if __name__ == "__main__":
    main()
