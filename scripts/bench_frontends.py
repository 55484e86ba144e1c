"""ember's frontends side by side: the hand-written definition, torch.export and an ONNX file, with PyTorch eager.

For one checkpoint and each `--quant`, compiles the model once per frontend: `builtin` (the
Llama-family definition in `frontend/llama.py`), `torch-export` (the graph transformers' own
code traces; `ir_passes/specialize_attention.py` finds its attention) and `onnx` (the same
checkpoint written by `torch.onnx.export`, compiled from the .onnx file), timing each compile
and its peak RSS. Then it runs every artifact and PyTorch eager on the same weights, each in
a fresh process, round-robin over the repeats after waiting for a quiet machine: prefill
tok/s over the prompt, greedy decode tok/s, peak RSS, and whether the greedy tokens agree.
The goal is parity between the frontends (a gap is a fusion the imported graph misses);
`--frontends torch-export,onnx` measures a family ember has no definition for, next to
PyTorch eager (`--make gpt2` writes a random GPT-2 of 124M parameters to --model first).

    python scripts/bench_frontends.py --model /tmp/llama110m --quant q0f32,q4f32 --threads 2 --repeats 3
    python scripts/bench_frontends.py --model /tmp/gpt2-124m --make gpt2 --frontends torch-export,onnx
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS.parent / "tests"))  # models.write_onnx: torch.onnx.export of a checkpoint
import bench_cpu  # noqa: E402
import peers  # noqa: E402

FRONTENDS = ("builtin", "torch-export", "onnx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="a checkpoint directory")
    parser.add_argument("--make", choices=("llama", "gpt2"), help="write a random 124M checkpoint to --model first "
                                                                "(llama: bench_cpu's 110m shape)")
    parser.add_argument("--frontends", default=",".join(FRONTENDS), help="comma-separated, of: " + ", ".join(FRONTENDS))
    parser.add_argument("--quant", default="q0f32", help="ember --quant formats, comma-separated")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch eager out")
    peers.add_run_options(parser)
    args = parser.parse_args()
    frontends = args.frontends.split(",")
    if unknown := set(frontends) - set(FRONTENDS):
        parser.error(f"--frontends: unknown {', '.join(sorted(unknown))}; choose from {', '.join(FRONTENDS)}")
    if args.make and not (args.model / "config.json").exists():
        _make(args.make, args.model)
    bandwidth = bench_cpu.read_bandwidth()
    print(f"{args.model}   threads: {args.threads}   prompt {args.prompt_len} + {args.new_tokens} new tokens, "
          f"median of {args.repeats}, round-robin   read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(bench_cpu.host_line())
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 1000, args.prompt_len)]
    with tempfile.TemporaryDirectory(prefix="ember-frontends-") as tmp:
        onnx_file = None
        if "onnx" in frontends:
            import models

            start = time.perf_counter()
            onnx_file = models.write_onnx(args.model, Path(tmp) / "onnx" / "model.onnx")
            print(f"\ntorch.onnx.export of the checkpoint: {time.perf_counter() - start:.1f} s")
        artifacts = {}
        print("\ncompile                        seconds   peak RSS MB")
        for quant in args.quant.split(","):
            for frontend in frontends:
                out = Path(tmp) / f"{quant}-{frontend}"
                source = onnx_file if frontend == "onnx" else args.model
                seconds, rss = _compile_measured(source, args.model, out, quant, frontend)
                artifacts[f"ember {quant} {frontend}"] = out
                print(f"  {quant} {frontend:<18} {seconds:>9.1f} {rss:>13.0f}")
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
    medians = {name: (statistics.median(m.prefill_tokens_per_s for m in measured),
                      statistics.median(m.decode_tokens_per_s for m in measured)) for name, measured in runs.items()}
    print(f"\n{'runtime':<32} {'prefill tok/s':>13} {'decode tok/s':>12} {'peak RSS MB':>11}  greedy tokens")
    first: dict[str, list[int]] = {}
    for name, measured in runs.items():
        quant = name.split()[1] if name.startswith("ember") else None
        tokens = measured[-1].token_ids
        same = "" if quant is None else ("= first" if first.setdefault(quant, tokens) == tokens else "differ")
        print(f"{name:<32} {medians[name][0]:>13.1f} {medians[name][1]:>12.2f} "
              f"{max(m.peak_rss_mb for m in measured):>11.0f}  {same}")
    for quant in args.quant.split(","):
        for frontend in frontends[1:] if frontends[0] == "builtin" else []:
            _ratio(f"{quant} {frontend} / builtin", medians[f"ember {quant} {frontend}"],
                   medians[f"ember {quant} builtin"])
        if "pytorch eager f32" in medians:
            for frontend in frontends:
                _ratio(f"{quant} {frontend} / pytorch eager", medians[f"ember {quant} {frontend}"],
                       medians["pytorch eager f32"])


def _ratio(what: str, numerator: tuple[float, float], denominator: tuple[float, float]) -> None:
    print(f"  {what}: prefill {numerator[0] / denominator[0]:.2f}x, decode {numerator[1] / denominator[1]:.2f}x")


def _make(family: str, out: Path) -> None:
    if family == "llama":
        peers.make_random_llama(out, **bench_cpu.SHAPES["110m"])
        return
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=32000, bos_token_id=1,
                        eos_token_id=2, dtype="float32")
    GPT2LMHeadModel(config).to(torch.float32).eval().save_pretrained(out)


def _compile_measured(source: Path, model_dir: Path, out: Path, quant: str, frontend: str) -> tuple[float, float]:
    """Compile in a grandchild whose own peak RSS its parent reports."""
    code = ("import resource, subprocess, sys, time; s = time.perf_counter(); "
            "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(time.perf_counter() - s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    command = [sys.executable, "-m", "ember", "compile", str(source), "-o", str(out), "--quant", quant,
               "--no-progress"]
    command += ["--tokenizer", str(model_dir)] if frontend == "onnx" else ["--frontend", frontend]
    result = subprocess.run([sys.executable, "-c", code, *command], check=True, capture_output=True, text=True,
                            env={**os.environ})
    seconds, rss = result.stdout.split()
    return float(seconds), float(rss)


if __name__ == "__main__":
    main()
