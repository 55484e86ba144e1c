"""ember on CPU next to llama.cpp, onnxruntime(-genai) and PyTorch eager: same weights, one run.

Builds (or reuses) a Llama-shaped random checkpoint (`--shape`: 110m and 1b in float32; 8b, Llama-3.1-8B's shape,
in bfloat16 shards, as its float32 weights do not fit a 24 GB machine) and, for each `--isa` level this host can
execute, compiles it with ember in each requested `--quant` format for that level's `--target` and builds llama.cpp
for the same level (`build_llama_cpp.py`, cached); the GGUF files for llama.cpp's requested types are written once
from the same weights, tensor by tensor. Then every runtime of every level runs in its own fresh process, one after
another and round-robin over the repeats, waiting for a quiet machine before each run: prefill tok/s over the
prompt, decode tok/s over the new tokens (greedy), peak RSS.

The read bandwidth is measured before the first run and after every run, so that each run is judged against the
bandwidth the host gave beside it (the mean of the two): a shared host's bandwidth moves by half within minutes,
and a weight-streaming decode moves with it. Each run's decode is shown with its share of that bandwidth (bytes of
weights read per decoded token, every weight but the embedding table of which one row is read, times tok/s); a run
whose two measurements differ by more than `STEADY_SPREAD` is marked unsteady, and a runtime with fewer than half
of its runs steady is reported as too unsteady to judge. The header gives the host's ISA flags and the range of the
bandwidths, and says which levels were skipped; then one table per level (the float32 peers, which choose their
kernels at run time, in a table of their own) with the median of `--repeats` runs and the median roofline share,
ember/llama.cpp ratios per format (q0f32/F32, q8f32/Q8_0, q4f32/Q4_0), of the medians and round by round, and
each runtime's q4/q8 decode ratio. Greedy tokens are compared with PyTorch's where it ran.

    python scripts/bench_cpu.py --model /tmp/llama110m --isa avx2,avx512,native --ember q0f32,q8f32,q4f32 \\
        --llama-cpp F32,Q8_0,Q4_0 --peers pytorch,onnxruntime,onnxruntime-genai --threads 2 --repeats 3
    python scripts/bench_cpu.py --model /tmp/llama1b --shape 1b --isa avx2,native --ember q8f32,q4f32 \\
        --llama-cpp Q8_0,Q4_0 --peers ""
    python scripts/bench_cpu.py --model /tmp/llama8b --shape 8b --isa avx512-vnni --ember q8f32,q4f32 \\
        --llama-cpp Q8_0,Q4_0 --peers "" --repeats 5
    python scripts/bench_cpu.py --isa avx512-vnni,amx --ember q8f32,q4f32 --llama-cpp Q8_0,Q4_0 --peers ""
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
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
# Shapes whose float32 weights do not fit a 24 GB machine: written shard by shard in bfloat16
# (`peers.write_random_llama_shards`), measured in the quantized formats only. 8b is Llama-3.1-8B's.
BF16_SHAPES = {
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
}
# A run is judged against the bandwidth measured beside it only when the measurements just before and just after
# it differ by at most this fraction; fewer than half of a runtime's runs so judged: the host was too unsteady.
STEADY_SPREAD = 0.15


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


@dataclasses.dataclass
class JudgedRun:
    """One run and the read bandwidth measured just before and just after it, bytes/s."""

    measurement: peers.Measurement
    bandwidth_before: float
    bandwidth_after: float

    @property
    def bandwidth(self) -> float:
        return (self.bandwidth_before + self.bandwidth_after) / 2

    @property
    def steady(self) -> bool:
        low, high = sorted((self.bandwidth_before, self.bandwidth_after))
        return high <= low * (1 + STEADY_SPREAD)

    def share(self, bytes_per_token: int) -> float:
        """Decode's bytes/s over the bandwidth measured beside this run."""
        return self.measurement.decode_tokens_per_s * bytes_per_token / self.bandwidth


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

def print_table(title: str, rows: dict[str, list[JudgedRun]], bytes_per_token: dict[str, int | None],
                reference: list[int] | None) -> None:
    """One ISA level's table (medians of the runs; decode's share of the bandwidth measured beside each run, their
    median), then each runtime's runs, ember/llama.cpp ratios per format and q4/q8 decode ratios."""
    print(f"\n{title}")
    print(f"{'runtime':<17} {'prefill tok/s':>13} {'decode tok/s':>12} {'MB/token':>9} {'% roofline':>10} "
          f"{'peak RSS MB':>11} {'tokens = torch':>14}")
    summary = {name: peers.summarize([run.measurement for run in runs]) for name, runs in rows.items()}
    for name, row in summary.items():
        per_token = bytes_per_token.get(name)
        shares = [run.share(per_token) for run in rows[name]] if per_token else []
        roofline = f"{statistics.median(shares):>10.0%}" if shares else f"{'-':>10}"
        mb = f"{per_token / 1e6:>9.1f}" if per_token else f"{'-':>9}"
        same = str(row.token_ids[:16] == reference[:16]) if reference else "-"
        print(f"{name:<17} {row.prefill_tokens_per_s:>13.1f} {row.decode_tokens_per_s:>12.2f} {mb} {roofline} "
              f"{row.peak_rss_mb:>11.0f} {same:>14}")
    for name, runs in rows.items():
        per_token = bytes_per_token.get(name)
        print(f"  {name} decode runs: " + ", ".join(
            f"{run.measurement.decode_tokens_per_s:.2f}" + (f" ({run.share(per_token):.0%} of "
                                                            f"{run.bandwidth / 1e9:.1f} GB/s)" if per_token else "")
            + ("" if run.steady else " unsteady") for run in runs))
        steady = sum(run.steady for run in runs)
        if per_token and steady * 2 < len(runs):
            print(f"  {name}: host too unsteady to judge: {len(runs) - steady} of {len(runs)} runs had bandwidths "
                  f"before and after differing by more than {STEADY_SPREAD:.0%}")
        elif per_token:
            shares = [run.share(per_token) for run in runs if run.steady]
            print(f"  {name}: {statistics.median(shares):.0%} of the bandwidth beside it, median of its {steady} "
                  f"steady runs")
    for ours, theirs in FORMAT_PAIRS:
        a, b = rows.get(f"ember {ours}"), rows.get(f"llama.cpp {theirs}")
        if a and b:
            x, y = summary[f"ember {ours}"], summary[f"llama.cpp {theirs}"]
            per_round = [p.measurement.decode_tokens_per_s / q.measurement.decode_tokens_per_s for p, q in zip(a, b)]
            print(f"  ember {ours} / llama.cpp {theirs}: prefill "
                  f"{x.prefill_tokens_per_s / y.prefill_tokens_per_s:.2f}x, decode "
                  f"{x.decode_tokens_per_s / y.decode_tokens_per_s:.2f}x (each round's: "
                  f"{', '.join(f'{r:.2f}' for r in per_round)}; their median {statistics.median(per_round):.2f}x)")
    for runtime, q4, q8 in (("ember", "q4f32", "q8f32"), ("llama.cpp", "Q4_0", "Q8_0")):
        a, b = summary.get(f"{runtime} {q4}"), summary.get(f"{runtime} {q8}")
        if a and b:
            print(f"  {runtime} decode {q4} / {q8}: {a.decode_tokens_per_s / b.decode_tokens_per_s:.2f}x")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _ember_worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m"),
                        help="checkpoint dir; created with random weights of --shape if missing")
    parser.add_argument("--shape", choices={**SHAPES, **BF16_SHAPES}, default="110m",
                        help="the random checkpoint's shape: 110m, 1b (float32), 8b (Llama-3.1-8B's, bfloat16 "
                             "shards: quantized formats only)")
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

    if args.shape in BF16_SHAPES:
        floats = [f for f in split(args.ember) if f == "q0f32"] + [t for t in split(args.llama_cpp) if t in
                                                                   ("F32", "F16")] + split(args.peers)
        if floats:
            parser.error(f"--shape {args.shape}: its float weights do not fit this benchmark's machines; measure "
                         f"quantized formats only (drop {', '.join(floats)}: --ember q8f32,q4f32 --llama-cpp "
                         "Q8_0,Q4_0 --peers '')")
    if not (args.model / "config.json").exists():
        if args.shape in BF16_SHAPES:
            peers.write_random_llama_shards(args.model, **BF16_SHAPES[args.shape])
        else:
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
    # The read bandwidth is measured between consecutive runs, so that each run is judged
    # against the bandwidth the host gave just before and just after it.
    runs: dict[tuple[str, str], list[JudgedRun]] = {key: [] for key in runners}
    busy = 0
    peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
    bandwidths = [read_bandwidth()]
    for _ in range(args.repeats):
        for key, run in runners.items():
            busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
            measurement = run()
            bandwidths.append(read_bandwidth())
            runs[key].append(JudgedRun(measurement, bandwidths[-2], bandwidths[-1]))
    for qtype in split(args.llama_cpp):
        gguf_bytes = gguf_bytes_per_token(args.model / "gguf" / f"model-{qtype}.gguf")
        bytes_per_token.update({(level.name, f"llama.cpp {qtype}"): gguf_bytes for level in levels})

    def table_of(table: str) -> tuple[dict[str, list[JudgedRun]], dict[str, int | None]]:
        keys = [key for key in runs if key[0] == table]
        return {key[1]: runs[key] for key in keys}, {key[1]: bytes_per_token.get(key) for key in keys}

    torch_runs = runs.get(("peers", "pytorch-eager"))
    reference = torch_runs[0].measurement.token_ids if torch_runs else None
    flags = build_llama_cpp.host_flags()
    print(f"\n{args.model} ({args.shape} shape)   threads: {args.threads}   prompt {args.prompt_len} + "
          f"{args.new_tokens} new tokens, median of {args.repeats}, round-robin")
    print(f"read bandwidth measured before the first run and after every run (the best of numpy's dot and a "
          f"compiled read): {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s, median "
          f"{statistics.median(bandwidths) / 1e9:.1f}; a run's roofline share is over the mean of the two beside it, "
          f"and a run whose two differ by more than {STEADY_SPREAD:.0%} is unsteady")
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
        print_table(title, *table_of(level.name), reference)
    if any(table == "peers" for table, _ in runs):
        print_table("float32 peers (each dispatches to this host's ISA at run time)", *table_of("peers"), reference)


if __name__ == "__main__":
    main()
