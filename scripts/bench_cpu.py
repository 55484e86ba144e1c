"""ember on CPU next to llama.cpp, onnxruntime(-genai) and PyTorch eager: same weights, one run.

Builds (or reuses) a Llama-shaped random checkpoint and, for each `--isa` level this host
can execute, compiles it with ember in each requested `--quant` format for that level's
`--target` and builds llama.cpp for the same level (`build_llama_cpp.py`, cached); the
GGUF files for llama.cpp's requested types are written once from the same weights. Then
every runtime of every level runs in its own fresh process, one after another and
round-robin over the repeats, waiting for a quiet machine before each run: prefill
tok/s over the prompt, decode tok/s over the new tokens (greedy), peak RSS. The header
gives the host's ISA flags and the read bandwidth measured in the same run, and says
which levels were skipped; then one table per level (the float32 peers, which choose
their kernels at run time, in a table of their own) with the median of `--repeats`
runs, decode as a share of the memory-bandwidth roofline (bytes of weights read per
decoded token, every weight but the embedding table of which one row is read, times
tok/s, over the bandwidth), ember/llama.cpp ratios per format (q0f32/F32, q8f32/Q8_0,
q4f32/Q4_0) and each runtime's q4/q8 decode ratio. Greedy tokens are compared with
PyTorch's where it ran.

    python scripts/bench_cpu.py --model /tmp/llama110m --isa avx2,avx512,native --ember q0f32,q8f32,q4f32 \\
        --llama-cpp F32,Q8_0,Q4_0 --peers pytorch,onnxruntime,onnxruntime-genai --threads 2 --repeats 3
    python scripts/bench_cpu.py --model /tmp/llama1b --shape 1b --isa avx2,native --ember q8f32,q4f32 \\
        --llama-cpp Q8_0,Q4_0 --peers ""
    python scripts/bench_cpu.py --isa avx512-vnni,amx --ember q8f32,q4f32 --llama-cpp Q8_0,Q4_0 --peers ""
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ember.targets.hardware import cpu_fingerprint, measure_host

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_llama_cpp  # noqa: E402
import peers  # noqa: E402

# ember's prefill on AMX tiles (`schedules/amx_bf16_matmul.py`) beside llama.cpp's AVX512-VNNI build: llama.cpp's own
# AMX build segfaults on Q8_0/Q4_0 on this Sapphire Rapids host (build_llama_cpp._NO_AMX), so this level's
# llama.cpp is that build, shared with level avx512-vnni (whose ember build is ember's VNNI one).
AMX_LEVEL = dataclasses.replace(build_llama_cpp.LEVELS["avx512-vnni"], name="amx",
                                ember_target='{"kind": "llvm", "mcpu": "sapphirerapids"}',
                                needs=build_llama_cpp.LEVELS["avx512-vnni"].needs + ("amx_tile", "amx_int8",
                                                                                     "amx_bf16"))
ISA_LEVELS = {**build_llama_cpp.LEVELS, "amx": AMX_LEVEL}


def llama_cpp_level(level: build_llama_cpp.Level) -> build_llama_cpp.Level:
    """The llama.cpp build an ISA level's table runs (amx: the AVX512-VNNI build)."""
    return build_llama_cpp.LEVELS["avx512-vnni"] if level is AMX_LEVEL else level


def measure_ember(artifact: Path, prompt_ids: list[int], new_tokens: int, threads: int) -> peers.Measurement:
    """Run ember's runtime in a fresh process (TVM_NUM_THREADS=threads)."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        out = Path(tmp) / "result.json"
        request = json.dumps({"artifact": str(artifact), "prompt": prompt_ids, "new_tokens": new_tokens})
        subprocess.run([sys.executable, __file__, "--worker", request, str(out)], env=env, check=True)
        return peers.Measurement(**json.loads(out.read_text()))


def _ember_worker(request: dict, out: Path) -> None:
    # As on a device: the runtime needs no torch, but tvm_ffi imports it whenever it is
    # installed (~200 MB of RSS). Hide it so the peak RSS is ember's own.
    sys.modules["torch"] = None
    from ember.runtime import Engine, load_artifact

    engine = Engine(load_artifact(Path(request["artifact"])))
    prompt, new_tokens = request["prompt"], request["new_tokens"]
    for _ in range(2):  # one warmup run, then the timed one
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
    result = peers.Measurement(f"ember {engine.artifact.manifest.quantization}", len(prompt) / prefill_s,
                               new_tokens / decode_s, peers._peak_rss_mb(), tokens)
    out.write_text(json.dumps(result.__dict__))


SHAPES = {
    "110m": dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048, vocab=32000),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
}


def ember_bytes_per_token(artifact: Path) -> int:
    """Weight bytes one decode step reads: all parameters but the (untied) embedding table."""
    cache = json.loads((artifact / "params" / "tensor-cache.json").read_text())
    records = [r for shard in cache["records"] for r in shard["records"]]
    untied = any(r["name"].startswith("lm_head.weight") for r in records)
    return sum(r["nbytes"] for r in records if not (untied and r["name"].startswith("model.embed_tokens.weight")))


def gguf_bytes_per_token(path: Path) -> int:
    """The same for a GGUF file: every tensor but `token_embd` when `output` exists."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def read_bandwidth() -> float:
    """Best of five measurements of this machine's read bandwidth, bytes/s: each the faster of numpy's threaded dot
    and a read TVM compiles for this CPU (`targets.hardware.BANDWIDTH_METHOD`), so that the roofline's bandwidth is
    what a kernel can stream here."""
    return max(measure_host(matmul_size=64).hardware.memory_bandwidth for _ in range(5))


# Pairs of the same bits per weight: ember's --quant and llama.cpp's GGUF type.
FORMAT_PAIRS = (("q0f32", "F32"), ("q8f32", "Q8_0"), ("q4f32", "Q4_0"))
# The host's flags shown in the header: the ones that decide which kernels either runtime can use.
SHOWN_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
               "avx512_vnni", "avx512_bf16", "amx_int8")



def host_line() -> str:
    """`host: CPU; ISA flags: ...`: the line a benchmark table starts with (`SHOWN_FLAGS` this host has)."""
    flags = build_llama_cpp.host_flags()
    return f"host: {cpu_fingerprint()['cpu']}; ISA flags: {' '.join(f for f in SHOWN_FLAGS if f in flags)}"

def print_table(title: str, rows: dict[str, peers.Measurement], bytes_per_token: dict[str, int | None],
                bandwidth: float, reference: list[int] | None) -> None:
    """One ISA level's table, then its ember/llama.cpp ratios per format and q4/q8 decode ratios."""
    print(f"\n{title}")
    print(f"{'runtime':<17} {'prefill tok/s':>13} {'decode tok/s':>12} {'MB/token':>9} {'% roofline':>10} "
          f"{'peak RSS MB':>11} {'tokens = torch':>14}")
    for name, row in rows.items():
        per_token = bytes_per_token.get(name)
        roofline = f"{row.decode_tokens_per_s * per_token / bandwidth:>10.0%}" if per_token else f"{'-':>10}"
        mb = f"{per_token / 1e6:>9.1f}" if per_token else f"{'-':>9}"
        same = str(row.token_ids[:16] == reference[:16]) if reference else "-"
        print(f"{name:<17} {row.prefill_tokens_per_s:>13.1f} {row.decode_tokens_per_s:>12.2f} {mb} {roofline} "
              f"{row.peak_rss_mb:>11.0f} {same:>14}")
    for ours, theirs in FORMAT_PAIRS:
        a, b = rows.get(f"ember {ours}"), rows.get(f"llama.cpp {theirs}")
        if a and b:
            print(f"  ember {ours} / llama.cpp {theirs}: prefill "
                  f"{a.prefill_tokens_per_s / b.prefill_tokens_per_s:.2f}x, decode "
                  f"{a.decode_tokens_per_s / b.decode_tokens_per_s:.2f}x")
    for runtime, q4, q8 in (("ember", "q4f32", "q8f32"), ("llama.cpp", "Q4_0", "Q8_0")):
        a, b = rows.get(f"{runtime} {q4}"), rows.get(f"{runtime} {q8}")
        if a and b:
            print(f"  {runtime} decode {q4} / {q8}: {a.decode_tokens_per_s / b.decode_tokens_per_s:.2f}x")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _ember_worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m"),
                        help="checkpoint dir; created with random weights of --shape if missing")
    parser.add_argument("--shape", choices=SHAPES, default="110m")
    parser.add_argument("--isa", default="native",
                        help=f"ISA levels ({', '.join(ISA_LEVELS)}), comma-separated: per level, ember compiled "
                             "for that level's --target next to llama.cpp built for it (amx: ember's AMX build next "
                             "to llama.cpp's AVX512-VNNI build, its AMX build segfaulting here)")
    parser.add_argument("--ember", default="q0f32,q8f32,q4f32", help="ember --quant formats, comma-separated")
    parser.add_argument("--llama-cpp", default="F32,Q8_0,Q4_0",
                        help=f"llama.cpp GGUF types ({', '.join(peers.LLAMA_CPP_TYPES)}), comma-separated")
    parser.add_argument("--peers", default="pytorch,onnxruntime,onnxruntime-genai",
                        help="float32 peers: pytorch, onnxruntime, onnxruntime-genai")
    peers.add_run_options(parser)
    args = parser.parse_args()
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731
    unknown = [name for name in split(args.isa) if name not in ISA_LEVELS]
    if unknown:
        parser.error(f"--isa: unknown level {unknown[0]!r} (known: {', '.join(ISA_LEVELS)})")

    levels, skipped = [], []
    for name in split(args.isa):
        missing = build_llama_cpp.missing_flags(ISA_LEVELS[name])
        if missing:
            skipped.append(f"ISA level {name} skipped: this host cannot execute it (no {', '.join(missing)})")
            print(skipped[-1], file=sys.stderr)
        else:
            levels.append(ISA_LEVELS[name])

    if not (args.model / "config.json").exists():
        peers.make_random_llama(args.model, **SHAPES[args.shape])
    from ember.driver.compiler import CompileOptions, compile_model

    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt_len).tolist()
    # Runners and results are keyed by (table, runtime): one table per ISA level, one for the float peers.
    runners: dict[tuple[str, str], Callable[[], peers.Measurement]] = {}
    bytes_per_token: dict[tuple[str, str], int | None] = {}
    compile_s, builds = {}, {}
    for level in levels:
        for fmt in split(args.ember):
            artifact = args.model.with_name(f"{args.model.name}-ember-{fmt}-{level.name}")
            start = time.perf_counter()
            window = compile_model(args.model, artifact, CompileOptions(
                quantization=fmt, target=level.ember_target, show_progress=False)).memory.context_window
            if args.prompt_len + args.new_tokens > window:  # before the other compiles, not at the first run
                parser.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens}: {artifact} holds "
                             f"{window} tokens")
            compile_s[level.name, fmt] = time.perf_counter() - start
            runners[level.name, f"ember {fmt}"] = lambda a=artifact: measure_ember(a, prompt, args.new_tokens,
                                                                                    args.threads)
            bytes_per_token[level.name, f"ember {fmt}"] = ember_bytes_per_token(artifact)
        if split(args.llama_cpp):
            package = build_llama_cpp.ensure_built(llama_cpp_level(level))
            builds[level.name] = (package, build_llama_cpp.check_isa(llama_cpp_level(level),
                                                                    build_llama_cpp.package_libraries(package)))
        for qtype in split(args.llama_cpp):
            runners[level.name, f"llama.cpp {qtype}"] = lambda q=qtype, d=package: peers.measure_llama_cpp(
                args.model, q, prompt, args.new_tokens, args.threads, package_dir=d)
    float32_bytes = next((b for (_, name), b in bytes_per_token.items() if name == "ember q0f32"), None)
    for peer, name, measure in (("pytorch", "pytorch-eager", peers.measure_torch_eager),
                                ("onnxruntime", "onnxruntime", peers.measure_onnxruntime),
                                ("onnxruntime-genai", "onnxruntime-genai", peers.measure_onnxruntime_genai)):
        if peer in split(args.peers):
            runners["peers", name] = lambda m=measure: m(args.model, prompt, args.new_tokens, args.threads)
            bytes_per_token["peers", name] = float32_bytes

    # Round-robin: every runtime once, then again. A shared machine's memory bandwidth drifts
    # over minutes (decode of one artifact measured 76-111 tok/s within a minute), and the
    # drift then lands on every runtime's median alike instead of on whichever ran last.
    runs: dict[tuple[str, str], list[peers.Measurement]] = {key: [] for key in runners}
    busy = 0
    for _ in range(args.repeats):
        for key, run in runners.items():
            busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
            runs[key].append(run())
    for qtype in split(args.llama_cpp):
        gguf_bytes = gguf_bytes_per_token(args.model / "gguf" / f"model-{qtype}.gguf")
        bytes_per_token.update({(level.name, f"llama.cpp {qtype}"): gguf_bytes for level in levels})
    peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
    bandwidth = read_bandwidth()

    summary = {key: peers.summarize(measured) for key, measured in runs.items()}

    def table_of(table: str) -> tuple[dict[str, peers.Measurement], dict[str, int | None]]:
        keys = [key for key in summary if key[0] == table]
        return {key[1]: summary[key] for key in keys}, {key[1]: bytes_per_token.get(key) for key in keys}

    reference = summary.get(("peers", "pytorch-eager"))
    flags = build_llama_cpp.host_flags()
    print(f"\n{args.model} ({args.shape} shape)   threads: {args.threads}   prompt {args.prompt_len} + "
          f"{args.new_tokens} new tokens, median of {args.repeats}, round-robin   "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s (measured in this run: the best of numpy's dot and a "
          "compiled read)")
    print(f"{host_line()}; "
          f"lacks: {' '.join(f for f in SHOWN_FLAGS if f not in flags) or 'none of these'}")
    for line in skipped:
        print(line)
    if busy:
        print(f"warning: {busy} of {len(runners) * args.repeats} runs started on a busy machine")
    for level in levels:
        compiled = ", ".join(f"{fmt} {s:.1f} s" for (name, fmt), s in compile_s.items() if name == level.name)
        title = f"ISA level {level.name}: ember --target {level.ember_target} (compile, untuned: {compiled})"
        if level.name in builds:
            package, counts = builds[level.name]
            title += (f"\n  llama.cpp {package.name}: CMAKE_ARGS {build_llama_cpp.cmake_args(llama_cpp_level(level))}"
                      f"; objdump: {counts['zmm']} zmm instructions, {counts['vpdpbusd']} vpdpbusd")
            if level is AMX_LEVEL:
                title += "\n  llama.cpp without AMX: its AMX build segfaults on Q8_0/Q4_0 on this host"
        print_table(title, *table_of(level.name), bandwidth, reference and reference.token_ids)
    if any(table == "peers" for table, _ in summary):
        print_table("float32 peers (each dispatches to this host's ISA at run time)", *table_of("peers"), bandwidth,
                    reference and reference.token_ids)


if __name__ == "__main__":
    main()
