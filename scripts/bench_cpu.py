"""ember on CPU next to PyTorch eager and onnxruntime, same weights, one run.

Builds (or reuses) a Llama-shaped random checkpoint, compiles it with ember, then
measures each runtime in its own fresh process, one after another, waiting for a
quiet machine before each: prefill tok/s over the prompt, decode tok/s over the
new tokens, peak RSS. Prints one table with ratios to ember, and ember's compile
time. Greedy tokens of every runtime are compared with PyTorch's.

    python scripts/bench_cpu.py --model /tmp/llama110m --prompt-len 128 --new-tokens 128 \\
        --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402


def measure_ember(artifact: Path, prompt_ids: list[int], new_tokens: int, threads: int) -> peers.Measurement:
    """Run ember's runtime in a fresh process (TVM_NUM_THREADS=threads)."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        out = Path(tmp) / "result.json"
        request = json.dumps({"artifact": str(artifact), "prompt": prompt_ids, "new_tokens": new_tokens})
        subprocess.run([sys.executable, __file__, "--worker", request, str(out)], env=env, check=True)
        return peers.Measurement(**json.loads(out.read_text()))


def _ember_worker(request: dict, out: Path) -> None:
    from ember.runtime import Engine, load_artifact

    engine = Engine(load_artifact(Path(request["artifact"])))
    prompt, new_tokens = request["prompt"], request["new_tokens"]
    for timed in (False, True):  # one warmup run, then the timed one
        seq = engine.add_sequence()
        start = time.perf_counter()
        token = int(np.argmax(engine.prefill(seq, prompt)))
        prefill_s = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(new_tokens):
            token = int(np.argmax(engine.decode([seq], [token])[0]))
            tokens.append(token)
        decode_s = time.perf_counter() - start
        engine.remove_sequence(seq)
    result = peers.Measurement("ember q0f32", len(prompt) / prefill_s, new_tokens / decode_s,
                               peers._peak_rss_mb(), tokens)
    out.write_text(json.dumps(result.__dict__))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _ember_worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m"),
                        help="checkpoint dir; created with random weights if missing")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    if not (args.model / "config.json").exists():
        peers.make_random_llama(args.model)
    from ember.compiler import CompileOptions, compile_model

    artifact = args.model.with_name(args.model.name + "-ember-cpu")
    start = time.perf_counter()
    compile_model(args.model, artifact, CompileOptions(show_progress=False))
    compile_s = time.perf_counter() - start

    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt_len).tolist()
    runners = {
        "ember q0f32": lambda: measure_ember(artifact, prompt, args.new_tokens, args.threads),
        "pytorch-eager": lambda: peers.measure_torch_eager(args.model, prompt, args.new_tokens, args.threads),
        "onnxruntime": lambda: peers.measure_onnxruntime(args.model, prompt, args.new_tokens, args.threads),
    }
    rows = []
    for name, run in runners.items():
        runs = []
        for _ in range(args.repeats):
            peers.wait_for_quiet_machine()
            runs.append(run())
        rows.append(peers.summarize(runs))
    ember_row = rows[0]
    print(f"\nember compile time: {compile_s:.1f} s   threads: {args.threads}   "
          f"prompt {args.prompt_len} + {args.new_tokens} new tokens, median of {args.repeats}\n")
    print(f"{'runtime':<16} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs ember':>16} {'peak RSS MB':>12}"
          f" {'tokens = torch':>15}")
    reference = rows[1].token_ids
    for row in rows:
        same = row.token_ids[:16] == reference[:16]
        print(f"{row.name:<16} {row.prefill_tokens_per_s:>14.1f} {row.decode_tokens_per_s:>13.2f} "
              f"{row.decode_tokens_per_s / ember_row.decode_tokens_per_s:>15.2f}x {row.peak_rss_mb:>12.0f}"
              f" {str(same):>15}")


if __name__ == "__main__":
    main()
