"""ember on CPU next to llama.cpp, onnxruntime(-genai) and PyTorch eager: same weights, one run.

Builds (or reuses) a Llama-shaped random checkpoint, compiles it with ember in each
requested `--quant` format, writes it as GGUF for llama.cpp in each requested type,
then measures every runtime in its own fresh process, one after another and
round-robin over the repeats, waiting for a quiet machine before each run: prefill
tok/s over the prompt, decode tok/s over the new tokens (greedy), peak RSS. The
table gives the median of `--repeats` runs, the decode ratio to the first ember row,
and decode as a share of this machine's memory-bandwidth roofline: bytes of weights
read per decoded token (every weight but the embedding table, of which one row is
read) times tok/s, over the read bandwidth measured in the same run. Greedy tokens
of the float32 runtimes are compared with PyTorch's.

    python scripts/bench_cpu.py --model /tmp/llama110m --ember q0f32,q8f32,q4f32 \\
        --llama-cpp F32,Q8_0,Q4_0 --peers pytorch,onnxruntime,onnxruntime-genai --threads 2 --repeats 3
    python scripts/bench_cpu.py --model /tmp/llama1b --shape 1b --ember q8f32,q4f32 --llama-cpp Q8_0,Q4_0 --peers ""
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
    # As on a device: the runtime needs no torch, but tvm_ffi imports it whenever it is
    # installed (~200 MB of RSS). Hide it so the peak RSS is ember's own.
    sys.modules["torch"] = None
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
    result = peers.Measurement(f"ember {engine.artifact.manifest.quantization}", len(prompt) / prefill_s, new_tokens / decode_s,
                               peers._peak_rss_mb(), tokens)
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
    """Best of five measurements of this machine's read bandwidth, bytes/s."""
    from ember.targets.hardware import measure_host

    return max(measure_host(matmul_size=64).memory_bandwidth for _ in range(5))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _ember_worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m"),
                        help="checkpoint dir; created with random weights of --shape if missing")
    parser.add_argument("--shape", choices=SHAPES, default="110m")
    parser.add_argument("--ember", default="q0f32,q8f32,q4f32", help="ember --quant formats, comma-separated")
    parser.add_argument("--llama-cpp", default="F32,Q8_0,Q4_0",
                        help=f"llama.cpp GGUF types ({', '.join(peers.LLAMA_CPP_TYPES)}), comma-separated")
    parser.add_argument("--peers", default="pytorch,onnxruntime,onnxruntime-genai",
                        help="float32 peers: pytorch, onnxruntime, onnxruntime-genai")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731

    if not (args.model / "config.json").exists():
        peers.make_random_llama(args.model, **SHAPES[args.shape])
    from ember.compiler import CompileOptions, compile_model

    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt_len).tolist()
    runners, bytes_per_token, compile_s = {}, {}, {}
    for fmt in split(args.ember):
        artifact = args.model.with_name(f"{args.model.name}-ember-{fmt}")
        start = time.perf_counter()
        compile_model(args.model, artifact, CompileOptions(quantization=fmt, show_progress=False))
        compile_s[fmt] = time.perf_counter() - start
        name = f"ember {fmt}"
        runners[name] = lambda artifact=artifact: measure_ember(artifact, prompt, args.new_tokens, args.threads)
        bytes_per_token[name] = ember_bytes_per_token(artifact)
    for qtype in split(args.llama_cpp):
        name = f"llama.cpp {qtype}"
        runners[name] = lambda q=qtype: peers.measure_llama_cpp(args.model, q, prompt, args.new_tokens, args.threads)
    float32_bytes = next((b for n, b in bytes_per_token.items() if n == "ember q0f32"), None)
    if "pytorch" in split(args.peers):
        runners["pytorch-eager"] = lambda: peers.measure_torch_eager(args.model, prompt, args.new_tokens, args.threads)
        bytes_per_token["pytorch-eager"] = float32_bytes
    if "onnxruntime" in split(args.peers):
        runners["onnxruntime"] = lambda: peers.measure_onnxruntime(args.model, prompt, args.new_tokens, args.threads)
        bytes_per_token["onnxruntime"] = float32_bytes
    if "onnxruntime-genai" in split(args.peers):
        runners["onnxruntime-genai"] = lambda: peers.measure_onnxruntime_genai(args.model, prompt, args.new_tokens,
                                                                               args.threads)
        bytes_per_token["onnxruntime-genai"] = float32_bytes

    # Round-robin: every runtime once, then again. A shared machine's memory bandwidth drifts
    # over minutes (decode of one artifact measured 76-111 tok/s within a minute), and the
    # drift then lands on every runtime's median alike instead of on whichever ran last.
    runs: dict[str, list[peers.Measurement]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            peers.wait_for_quiet_machine()
            runs[name].append(run())
    rows = [peers.summarize(measured) for measured in runs.values()]
    for name in runners:
        if name.startswith("llama.cpp"):
            bytes_per_token[name] = gguf_bytes_per_token(args.model / "gguf" / f"model-{name.split()[1]}.gguf")
    peers.wait_for_quiet_machine()
    bandwidth = read_bandwidth()

    first = rows[0]
    reference = next((r.token_ids for r in rows if r.name == "pytorch-eager"), None)
    print(f"\n{args.model} ({args.shape} shape)   threads: {args.threads}   prompt {args.prompt_len} + "
          f"{args.new_tokens} new tokens, median of {args.repeats}   read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("ember compile time (untuned): " + ", ".join(f"{f} {s:.1f} s" for f, s in compile_s.items()) + "\n")
    print(f"{'runtime':<17} {'prefill tok/s':>13} {'decode tok/s':>12} {'decode vs ' + first.name:>22} "
          f"{'MB/token':>9} {'% roofline':>10} {'peak RSS MB':>11} {'tokens = torch':>14}")
    for row in rows:
        per_token = bytes_per_token.get(row.name)
        roofline = f"{row.decode_tokens_per_s * per_token / bandwidth:>10.0%}" if per_token else f"{'-':>10}"
        mb = f"{per_token / 1e6:>9.1f}" if per_token else f"{'-':>9}"
        same = str(row.token_ids[:16] == reference[:16]) if reference else "-"
        print(f"{row.name:<17} {row.prefill_tokens_per_s:>13.1f} {row.decode_tokens_per_s:>12.2f} "
              f"{row.decode_tokens_per_s / first.decode_tokens_per_s:>21.2f}x {mb} {roofline} "
              f"{row.peak_rss_mb:>11.0f} {same:>14}")


if __name__ == "__main__":
    main()
