"""The packed KV caches (`--kv-quant q8` and `f16`) against the float32 cache, side by side in one run.

On the ~110M random-weight Llama of `bench_cpu.py` with a context window of 8,448 tokens,
compiled three times with the same `--quant` (default q4f32: weights small, so attention's reads
matter), once per cache: decode tok/s at contexts of 2,048 and 8,192 tokens (a random
prompt of that length prefilled, then `--new-tokens` decoded greedily and rolled back,
round-robin over `--repeats` passes, each after waiting for a quiet machine; the median
pass), and the KV cache's bytes: per token (the memory report) and held at that context.
The greedy tokens of each packed cache are compared with the float32 cache's, as a share that agree.

    python scripts/bench_kv_quant.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import bench_cpu  # noqa: E402
import peers  # noqa: E402

CONTEXTS = (2048, 8192)
WINDOW = 8448  # the longest context plus room for the decoded tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m-8k"),
                        help="checkpoint dir; created with random weights (110M shape, 8,448-token window) if missing")
    parser.add_argument("--quant", default="q4f32", help="ember --quant of both builds (default q4f32)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    if not (args.model / "config.json").exists():
        peers.make_random_llama(args.model, **bench_cpu.SHAPES["110m"], context=WINDOW)
    from ember.core.manifest import read_manifest
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.runtime import Engine, load_artifact

    builds = {}
    for cache in ("float32", "q8", "f16"):
        artifact = args.model.with_name(f"{args.model.name}-{args.quant}-kv-{cache}")
        start = time.perf_counter()
        compile_model(args.model, artifact, CompileOptions(quantization=args.quant, max_batch=1,
                                                           kv_quant=None if cache == "float32" else cache,
                                                           show_progress=False))
        builds[cache] = (artifact, time.perf_counter() - start)

    rng = np.random.default_rng(0)
    results = {}  # (context, cache) -> list of decode tok/s
    tokens = {}  # (context, cache) -> greedy tokens of the first pass
    prefill_s = {}
    for context in CONTEXTS:
        prompt = rng.integers(0, 32000, context).tolist()
        engines = {}
        for cache, (artifact, _) in builds.items():
            engine = Engine(load_artifact(artifact))
            seq = engine.add_sequence()
            start = time.perf_counter()
            logits = engine.prefill(seq, prompt)
            prefill_s[context, cache] = time.perf_counter() - start
            engines[cache] = (engine, seq, int(np.argmax(logits[-1])))
        for _ in range(args.repeats):
            for cache, (engine, seq, first) in engines.items():
                peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
                token, produced = first, []
                start = time.perf_counter()
                for _ in range(args.new_tokens):
                    token = int(np.argmax(engine.decode([seq], [token])[0]))
                    produced.append(token)
                elapsed = time.perf_counter() - start
                engine.truncate(seq, context)
                results.setdefault((context, cache), []).append(args.new_tokens / elapsed)
                tokens.setdefault((context, cache), produced)
        del engines

    bandwidth = bench_cpu.read_bandwidth()
    print(f"\n{args.model} (110M shape, --quant {args.quant})   threads: {args.threads}   {args.new_tokens} decoded "
          f"tokens after each context, median of {args.repeats}, round-robin   read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (measured in this run)")
    print(bench_cpu.host_line())
    print("compile: " + ", ".join(f"{cache} cache {seconds:.1f} s" for cache, (_, seconds) in builds.items()))
    per_token = {cache: read_manifest(artifact).memory["kv_bytes_per_token"] for cache, (artifact, _) in builds.items()}
    print("KV bytes per token: " + ", ".join(f"{cache} {size} ({size / per_token['float32']:.3f}x)"
                                             for cache, size in per_token.items()))
    print(f"{'context':>8} {'cache':>8} {'prefill s':>10} {'decode tok/s':>13} {'/ float32':>11} "
          f"{'KV held':>10} {'tokens agree':>13}")
    for context in CONTEXTS:
        base = statistics.median(results[context, "float32"])
        for cache in builds:
            rate = statistics.median(results[context, cache])
            agree = np.mean(np.array(tokens[context, cache]) == np.array(tokens[context, "float32"]))
            print(f"{context:>8} {cache:>8} {prefill_s[context, cache]:>10.1f} {rate:>13.1f} {rate / base:>10.2f}x "
                  f"{context * per_token[cache] / 2**20:>7.1f} MiB {agree:>12.0%}")


if __name__ == "__main__":
    main()
