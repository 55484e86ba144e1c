"""GGUF files next to Hugging Face directories, and ember next to llama.cpp on the same GGUF files: one run.

For each `--shape`, the random-weight Llama checkpoint of `bench_cpu.py` (made by `peers.make_random_llama`
if missing) and its F32 GGUF (`peers.write_gguf`, the placeholder vocabulary of the benchmark) are quantized
by llama.cpp's own quantizer (`llama_model_quantize`, `tests/gguf_files.py`) into each of `--types`. Then:

1. **compile**: `ember compile FILE.gguf` (each tensor in the format closest to its type, kept or converted),
   and `ember compile DIR --quant FORMAT` of the Hugging Face directory in the file's dominant format, each
   in a fresh process: wall seconds and the process's peak RSS (from wait4).
2. **speed**: ember's artifact of each GGUF file next to llama.cpp (the `--isa` level's build of
   `build_llama_cpp.py`) on the same file, each in a fresh process, round-robin over `--repeats` runs
   waiting for a quiet machine before each, median: prefill and decode tok/s of a random prompt, greedy.
3. **quality** (`--perplexity`): the bundled demo model converted by llama.cpp's `convert_hf_to_gguf.py` and
   quantized into each of `--types`: perplexity on its validation.txt through ember and through llama.cpp, the
   same windows of the same token ids (`runtime/evaluate.py`'s scoring: <s> + 255 tokens per window).

    python scripts/bench_gguf.py --shape 110m,1b --types Q8_0,Q4_K_M --isa avx2 --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS.parent / "tests"))  # gguf_files: llama.cpp's converter, quantizer and logits
import bench_cpu  # noqa: E402
import build_llama_cpp  # noqa: E402
import gguf_files  # noqa: E402
import peers  # noqa: E402


def timed_compile(source: Path, out: Path, target: str, quantization: str | None) -> tuple[float, float]:
    """`ember compile source -o out` in a fresh process: (wall seconds, peak RSS in MB)."""
    command = [sys.executable, "-m", "ember", "compile", str(source), "-o", str(out), "--target", target,
               "--no-progress", *(["--quant", quantization] if quantization else [])]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{process.stderr.read().decode(errors='replace')[-3000:]}")
    return seconds, usage.ru_maxrss / 1024


def quantization_of(artifact: Path) -> str:
    """The artifact's --quant (for a GGUF file's own per-tensor types: that of its dominant type)."""
    return json.loads((artifact / "manifest.json").read_text())["quantization"]


def formats_of(artifact: Path) -> str:
    """The formats the artifact's weights are stored in: its --quant, or a GGUF file's mix ("q4f32_zp+q8f32")."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    stored = {entry["stored_as"] for entry in manifest["source_weights"].get("conversion", {}).values()}
    return "+".join(sorted(stored - {"float"})) or manifest["quantization"]


def compile_table(model: Path, files: dict[str, Path], level: build_llama_cpp.Level) -> dict[str, Path]:
    """Compile every GGUF file and the HF directory in each format they became, for the ISA `level`; print the
    table; the artifacts."""
    target = level.ember_target
    print(f"{'source':<28} {'ember formats':<16} {'compile s':>9} {'peak RSS MB':>11} {'input MB':>9}")
    artifacts = {}
    for type_name, path in files.items():
        artifact = path.with_name(f"{path.stem}-ember-{level.name}")
        seconds, rss = timed_compile(path, artifact, target, None)
        fmt = quantization_of(artifact)
        print(f"{'GGUF ' + type_name:<28} {formats_of(artifact):<16} {seconds:>9.1f} {rss:>11.0f} "
              f"{path.stat().st_size / 1e6:>9.0f}")
        hf_artifact = model.with_name(f"{model.name}-ember-{fmt}-{level.name}-hf")
        seconds, rss = timed_compile(model, hf_artifact, target, fmt)
        size = (model / "model.safetensors").stat().st_size
        print(f"{'HF directory --quant ' + fmt:<28} {fmt:<16} {seconds:>9.1f} {rss:>11.0f} {size / 1e6:>9.0f}")
        artifacts[type_name] = artifact
    return artifacts


def speed_table(artifacts: dict[str, Path], files: dict[str, Path], package: Path, args: argparse.Namespace) -> None:
    """ember's artifact of each file next to llama.cpp on the same file, round-robin, median of --repeats."""
    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt_len).tolist()
    runners = {}
    for type_name in files:
        runners[f"ember from {type_name}"] = lambda a=artifacts[type_name]: bench_cpu.measure_ember(
            a, prompt, args.new_tokens, args.threads)
        runners[f"llama.cpp {type_name}"] = lambda f=files[type_name]: peers.measure_llama_cpp_file(
            f, prompt, args.new_tokens, args.threads, package)
    runs = {name: [] for name in runners}
    busy = 0
    for _ in range(args.repeats):
        for name, run in runners.items():
            busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
            runs[name].append(run())
    summary = {name: peers.summarize(measured) for name, measured in runs.items()}
    if busy:
        print(f"warning: {busy} of {len(runners) * args.repeats} runs started on a busy machine")
    print(f"{'runtime':<22} {'prefill tok/s':>13} {'decode tok/s':>12} {'peak RSS MB':>11}")
    for name, row in summary.items():
        rss = f"{row.peak_rss_mb:>11.0f}" if row.peak_rss_mb else f"{'-':>11}"
        print(f"{name:<22} {row.prefill_tokens_per_s:>13.1f} {row.decode_tokens_per_s:>12.2f} {rss}")
    for type_name in files:
        ours, theirs = summary[f"ember from {type_name}"], summary[f"llama.cpp {type_name}"]
        same = ours.token_ids[:16] == theirs.token_ids[:16]
        prefill = ours.prefill_tokens_per_s / theirs.prefill_tokens_per_s
        decode = ours.decode_tokens_per_s / theirs.decode_tokens_per_s
        print(f"  {type_name}: ember / llama.cpp prefill {prefill:.2f}x, decode {decode:.2f}x; first 16 greedy tokens "
              f"{'equal' if same else 'differ'}")


def perplexity_table(types: list[str], level: build_llama_cpp.Level, work: Path) -> None:
    """The demo's GGUF files (llama.cpp's converter and quantizer): perplexity through ember and llama.cpp."""
    import ember
    from ember.runtime import Engine, load_artifact
    from ember.runtime.evaluate import perplexity, scoring_windows

    f32 = gguf_files.convert(Path(ember.DEMO_MODEL_DIR), "f32", pre="gpt-2")
    text = (Path(ember.DEMO_MODEL_DIR) / "validation.txt").read_text(encoding="utf-8")
    print(f"{'demo GGUF':<10} {'ember formats':<16} {'ember':>9} {'llama.cpp':>9}  (perplexity on validation.txt)")
    for type_name in ["F32", *types]:
        path = f32 if type_name == "F32" else gguf_files.quantize(f32, type_name)
        artifact = work / f"demo-{type_name}-ember-{level.name}"
        timed_compile(path, artifact, level.ember_target, None)
        loaded = load_artifact(artifact)
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        window = loaded.manifest.kv_cache["max_context"]
        windows = scoring_windows(ids, loaded.tokenizer.bos_token_id, window)
        ours = perplexity(Engine(loaded), windows)
        theirs = gguf_files.perplexity(path, windows)
        print(f"{type_name:<10} {formats_of(artifact):<16} {ours.perplexity:>9.3f} {theirs:>9.3f}  "
              f"({ours.tokens} tokens, {ours.windows} windows of {window})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="110m", help=f"shapes ({', '.join(bench_cpu.SHAPES)}), comma-separated")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp"),
                        help="where the checkpoints (llama<shape>/), GGUF files and artifacts go")
    parser.add_argument("--types", default="Q8_0,Q4_K_M",
                        help=f"llama.cpp quantizer types ({', '.join(gguf_files.FTYPES)}), comma-separated")
    parser.add_argument("--isa", default="native", choices=build_llama_cpp.LEVELS,
                        help="ember's --target and llama.cpp's build for this ISA level")
    parser.add_argument("--perplexity", action=argparse.BooleanOptionalAction, default=True,
                        help="score the demo model's GGUF files (default: on)")
    peers.add_run_options(parser)
    args = parser.parse_args()
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731
    shapes, types = split(args.shape), split(args.types)
    for name, known, option in ((shapes, bench_cpu.SHAPES, "--shape"), (types, gguf_files.FTYPES, "--types")):
        unknown = [item for item in name if item not in known]
        if unknown:
            parser.error(f"{option}: unknown {unknown[0]!r} (known: {', '.join(known)})")
    level = build_llama_cpp.LEVELS[args.isa]
    missing = build_llama_cpp.missing_flags(level)
    if missing:
        parser.error(f"--isa {args.isa}: this host cannot execute it (no {', '.join(missing)})")
    package = build_llama_cpp.ensure_built(level)
    print(f"{bench_cpu.host_line()}; "
          f"read bandwidth {bench_cpu.read_bandwidth() / 1e9:.1f} GB/s; threads {args.threads}; ember --target "
          f"{level.ember_target}; llama.cpp {package.name}")

    for shape in shapes:
        model = args.work_dir / f"llama{shape}"
        if not (model / "config.json").exists():
            peers.make_random_llama(model, **bench_cpu.SHAPES[shape])
        f32 = model / "gguf" / "model-F32.gguf"
        if not f32.exists():
            peers.write_gguf(model, f32, "F32")
        files = {type_name: gguf_files.quantize(f32, type_name) for type_name in types}
        print(f"\n{shape} shape ({model}): compile from GGUF and from the HF directory")
        artifacts = compile_table(model, files, level)
        print(f"\n{shape} shape: prompt {args.prompt_len} + {args.new_tokens} new tokens, median of {args.repeats}, "
              "round-robin")
        speed_table(artifacts, files, package, args)
    if args.perplexity:
        print()
        perplexity_table(types, level, args.work_dir)


if __name__ == "__main__":
    main()
