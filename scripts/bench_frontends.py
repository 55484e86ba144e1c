"""ember's two frontends side by side: the hand-written model definition and `--frontend torch-export`.

For one checkpoint and each `--quant`, compiles the model twice (`--frontend builtin`, the
Llama-family definition in `frontend/llama.py`, and `--frontend torch-export`, the graph
transformers' own code traces, with `ir_passes/specialize_attention.py` finding its
attention), timing each compile and its peak RSS; then runs both artifacts and PyTorch
eager on the same weights, each in a fresh process, round-robin over the repeats after
waiting for a quiet machine: prefill tok/s over the prompt, greedy decode tok/s, peak RSS,
and whether the greedy tokens agree. The goal is parity: a gap between the frontends is
a fusion the imported graph misses.

    python scripts/bench_frontends.py --model /tmp/llama110m --quant q0f32,q4f32 --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
import peers  # noqa: E402

FRONTENDS = ("builtin", "torch-export")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a Llama-family checkpoint directory")
    parser.add_argument("--quant", default="q0f32", help="ember --quant formats, comma-separated")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch eager out")
    peers.add_run_options(parser)
    args = parser.parse_args()
    bandwidth = bench_cpu.read_bandwidth()
    flags = set(open("/proc/cpuinfo").read().split())
    print(f"{args.model}   threads: {args.threads}   prompt {args.prompt_len} + {args.new_tokens} new tokens, "
          f"median of {args.repeats}, round-robin   read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("host ISA flags: " + " ".join(f for f in bench_cpu.SHOWN_FLAGS if f in flags))
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 1000, args.prompt_len)]
    with tempfile.TemporaryDirectory(prefix="ember-frontends-") as tmp:
        artifacts = {}
        print("\ncompile                    seconds   peak RSS MB")
        for quant in args.quant.split(","):
            for frontend in FRONTENDS:
                out = Path(tmp) / f"{quant}-{frontend}"
                seconds, rss = _compile_measured(args.model, out, quant, frontend)
                artifacts[f"ember {quant} {frontend}"] = out
                print(f"  {quant} {frontend:<14} {seconds:>9.1f} {rss:>13.0f}")
        runners = {name: (lambda path=path: bench_cpu.measure_ember(path, prompt, args.new_tokens, args.threads))
                   for name, path in artifacts.items()}
        if not args.no_torch:
            runners["pytorch eager f32"] = lambda: peers.measure_torch_eager(args.model, prompt, args.new_tokens,
                                                                             args.threads)
        runs: dict[str, list[peers.Measurement]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
                runs[name].append(run())
    print(f"\n{'runtime':<28} {'prefill tok/s':>13} {'decode tok/s':>12} {'peak RSS MB':>11}  greedy tokens")
    first = {}
    for name, measured in runs.items():
        prefill = statistics.median(m.prefill_tokens_per_s for m in measured)
        decode = statistics.median(m.decode_tokens_per_s for m in measured)
        rss = max(m.peak_rss_mb for m in measured)
        quant = name.split()[1] if name.startswith("ember") else None
        tokens = measured[-1].token_ids
        same = "" if quant is None else ("= builtin" if first.setdefault(quant, tokens) == tokens else "differ")
        print(f"{name:<28} {prefill:>13.1f} {decode:>12.2f} {rss:>11.0f}  {same}")
    for quant in args.quant.split(","):
        built, exported = (runs[f"ember {quant} {f}"] for f in FRONTENDS)
        ratio = [statistics.median(m.prefill_tokens_per_s for m in exported)
                 / statistics.median(m.prefill_tokens_per_s for m in built),
                 statistics.median(m.decode_tokens_per_s for m in exported)
                 / statistics.median(m.decode_tokens_per_s for m in built)]
        print(f"  {quant}: torch-export / builtin: prefill {ratio[0]:.2f}x, decode {ratio[1]:.2f}x")


def _compile_measured(model: Path, out: Path, quant: str, frontend: str) -> tuple[float, float]:
    """Compile in a grandchild whose own peak RSS its parent reports."""
    code = ("import resource, subprocess, sys, time; s = time.perf_counter(); "
            "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(time.perf_counter() - s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    command = [sys.executable, "-m", "ember", "compile", str(model), "-o", str(out), "--quant", quant,
               "--frontend", frontend, "--no-progress"]
    result = subprocess.run([sys.executable, "-c", code, *command], check=True, capture_output=True, text=True,
                            env={**os.environ})
    seconds, rss = result.stdout.split()
    return float(seconds), float(rss)


if __name__ == "__main__":
    main()
