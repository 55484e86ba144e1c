"""A mixture of experts on CPU next to llama.cpp: Qwen3-30B-A3B at a quarter of its depth, the same weights, one run.

Writes (or reuses) GGUF files of one seeded random Qwen3-MoE of Qwen3-30B-A3B's width at a quarter of its depth
(hidden 2048, 12 layers, 128 experts of which 8 are active, expert FFN 768, 32 query / 4 KV heads of 128, vocabulary
151936, untied head): one per `--llama-cpp` type, every matrix quantized from the same float weights, the norms and
the routers in F32. ember compiles each file (its GGUF reader keeps Q8_0 and Q4_0 blocks as they are: q8f32 and
q4f32) for the `--isa` level's target, and llama.cpp built for the same level (`build_llama_cpp.py`) runs the same
file. Every runtime runs in its own fresh process, round-robin over the repeats, after waiting for a quiet machine:

- batch 1: prefill of `--prompt-len` tokens, then `--new-tokens` greedy decode steps; decode tok/s and its share of
  the active-bytes roofline: the bytes a decoded token reads (attention, norms, the routers, top-k of each layer's
  experts and the LM head; of the embedding table one row) times tok/s, over the read bandwidth;
- prefill tok/s of a `--long-prompt`-token prompt in one call;
- ember's batch-8 decode: 8 sequences with different prompts, each step decoding all 8; its tokens/s over batch 1's.

The read bandwidth (`bench_cpu.read_bandwidth`, the faster of numpy's dot and a compiled read) is measured before
the first round and after the last: both are printed, and the roofline uses the larger. llama.cpp runs with its
default (float16) KV cache, ember with its float32 one. The first 16 greedy tokens of each runtime on each file are
compared with llama.cpp's: the same weights must give the same tokens up to near ties.

    python scripts/bench_moe.py --dir /tmp/qwen3moe-quarter --isa avx512-vnni --llama-cpp Q8_0,Q4_0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
import build_llama_cpp  # noqa: E402
import peers  # noqa: E402

# Qwen3-30B-A3B's config.json at a quarter of its 48 layers.
SHAPE = dict(hidden=2048, layers=12, experts=128, active=8, expert_ffn=768, heads=32, kv_heads=4, head_dim=128,
             vocab=151936, context=4096, rope_theta=1e6, eps=1e-6)
EMBER_FORMAT = {"Q8_0": "q8f32", "Q4_0": "q4f32"}  # the ember format that holds each GGUF type's blocks as they are
BATCH = 8


@dataclass
class Run:
    """One runtime's figures from one fresh process."""

    prefill_tokens_per_s: float  # at --prompt-len
    decode_tokens_per_s: float  # batch 1
    long_prefill_tokens_per_s: float  # at --long-prompt
    batch_tokens_per_s: float | None  # BATCH sequences decoding together (ember only)
    peak_rss_mb: float
    token_ids: list[int]


def write_gguf(path: Path, qtype: str, seed: int) -> None:
    """The quarter-depth Qwen3-MoE as a GGUF file of `qtype` matrices, streamed tensor by tensor: each tensor's
    float weights come from its own generator (`seed`, its index), so every type's file holds the same model."""
    import gguf

    s = SHAPE
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    writer = gguf.GGUFWriter(str(path), "qwen3moe", use_temp_file=True)
    writer.add_name("ember benchmark: Qwen3-30B-A3B at a quarter of its depth, random weights")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(6144)
    writer.add_expert_feed_forward_length(s["expert_ffn"])
    writer.add_expert_count(s["experts"])
    writer.add_expert_used_count(s["active"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_file_type({"Q8_0": 7, "Q4_0": 2}[qtype])
    vocab = s["vocab"]
    peers.add_placeholder_vocabulary(writer, vocab)

    hidden, q_rows, kv_rows = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (vocab, hidden), True)]
    for layer in range(s["layers"]):
        b = f"blk.{layer}."
        shapes += [(b + "attn_norm.weight", (hidden,), False), (b + "attn_q.weight", (q_rows, hidden), True),
                   (b + "attn_k.weight", (kv_rows, hidden), True), (b + "attn_v.weight", (kv_rows, hidden), True),
                   (b + "attn_q_norm.weight", (s["head_dim"],), False),
                   (b + "attn_k_norm.weight", (s["head_dim"],), False),
                   (b + "attn_output.weight", (hidden, q_rows), True), (b + "ffn_norm.weight", (hidden,), False),
                   (b + "ffn_gate_inp.weight", (s["experts"], hidden), False),
                   (b + "ffn_gate_exps.weight", (s["experts"], s["expert_ffn"], hidden), True),
                   (b + "ffn_up_exps.weight", (s["experts"], s["expert_ffn"], hidden), True),
                   (b + "ffn_down_exps.weight", (s["experts"], hidden, s["expert_ffn"]), True)]
    shapes += [("output_norm.weight", (hidden,), False), ("output.weight", (vocab, hidden), True)]
    for index, (name, shape, quantized) in enumerate(shapes):
        rng = np.random.default_rng([seed, index])
        if len(shape) == 1:  # a norm's scale: near one
            w = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if quantized:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, w)
        print(f"\r  {path.name}: {index + 1}/{len(shapes)} tensors", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def active_bytes(path: Path) -> dict[str, int]:
    """Bytes of `path`'s weights a decoded token reads, by kind: every tensor but the embedding table (one row), the
    stacked experts' tensors at top-k of their experts."""
    import gguf

    parts = {"attention and norms": 0, "routers": 0, "experts": 0, "LM head": 0, "embedding row": 0}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        size = int(tensor.n_bytes)
        if tensor.name == "token_embd.weight":
            parts["embedding row"] += size // SHAPE["vocab"]
        elif tensor.name == "output.weight":
            parts["LM head"] += size
        elif "_exps." in tensor.name:
            parts["experts"] += size * SHAPE["active"] // SHAPE["experts"]
        elif "ffn_gate_inp" in tensor.name:
            parts["routers"] += size
        else:
            parts["attention and norms"] += size
    return parts


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(259, SHAPE["vocab"], length).tolist() for _ in range(count)]


def _ember_worker(request: dict, out: Path) -> None:
    sys.modules["torch"] = None  # as on a device: no torch in the runtime's process (see bench_cpu)
    from ember.runtime import Engine, load_artifact

    engine = Engine(load_artifact(Path(request["artifact"])))
    prompt, new_tokens, long_prompt = request["prompt"], request["new_tokens"], request["long_prompt"]
    prompts = request["batch_prompts"]

    def greedy(seq: int, token: int, steps: int) -> tuple[list[int], float]:
        tokens, start = [token], time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(engine.decode([seq], [token])[0]))
            tokens.append(token)
        return tokens, time.perf_counter() - start

    seq = engine.add_sequence()  # warm-up: every entry once
    greedy(seq, int(np.argmax(engine.prefill(seq, prompt[:16]))), 4)
    engine.remove_sequence(seq)

    seq = engine.add_sequence()
    start = time.perf_counter()
    first = int(np.argmax(engine.prefill(seq, prompt)))
    prefill_s = time.perf_counter() - start
    tokens, decode_s = greedy(seq, first, new_tokens)
    engine.remove_sequence(seq)

    seq = engine.add_sequence()
    start = time.perf_counter()
    engine.prefill(seq, long_prompt)
    long_s = time.perf_counter() - start
    engine.remove_sequence(seq)

    seqs = [engine.add_sequence() for _ in prompts]
    pending = [int(np.argmax(engine.prefill(s, p))) for s, p in zip(seqs, prompts)]
    start = time.perf_counter()
    for _ in range(new_tokens):
        rows = engine.decode(seqs, pending)
        pending = [int(np.argmax(row)) for row in rows]
    batch_s = time.perf_counter() - start
    run = Run(len(prompt) / prefill_s, new_tokens / decode_s, len(long_prompt) / long_s,
              len(seqs) * new_tokens / batch_s, peers._peak_rss_mb(), tokens)
    out.write_text(json.dumps(asdict(run)))


def measure_ember(artifact: Path, request: dict, threads: int) -> Run:
    """ember's runtime on `artifact` in a fresh process (TVM_NUM_THREADS=threads)."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--worker", json.dumps({**request, "artifact": str(artifact)}),
                        str(out)], env=env, check=True)
        return Run(**json.loads(out.read_text()))


def llama_cpp_worker(gguf_path: str, prompt: list[int], long_prompt: list[int], new_tokens: int, threads: int,
                     package_dir: str) -> dict:
    """llama.cpp (one ISA level's build, first on the path) on `gguf_path`: the same runs as `_ember_worker` but
    batch 8 (llama-cpp-python's `Llama` decodes one sequence)."""
    sys.path.insert(0, package_dir)
    import llama_cpp
    from llama_cpp import Llama

    if not Path(llama_cpp.__file__).resolve().is_relative_to(Path(package_dir).resolve()):
        raise RuntimeError(f"llama_cpp was imported from {llama_cpp.__file__}, not from {package_dir}")
    llm = Llama(model_path=gguf_path, n_ctx=max(len(prompt) + new_tokens, len(long_prompt)) + 8,
                n_batch=len(long_prompt), n_threads=threads, n_threads_batch=threads, verbose=False)

    def last_token() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    def greedy(token: int, steps: int) -> tuple[list[int], float]:
        tokens, start = [token], time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = last_token()
            tokens.append(token)
        return tokens, time.perf_counter() - start

    llm.reset()  # warm-up
    llm.eval(prompt[:16])
    greedy(last_token(), 4)

    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    first = last_token()
    prefill_s = time.perf_counter() - start
    tokens, decode_s = greedy(first, new_tokens)

    llm.reset()
    start = time.perf_counter()
    llm.eval(long_prompt)
    long_s = time.perf_counter() - start
    run = Run(len(prompt) / prefill_s, new_tokens / decode_s, len(long_prompt) / long_s, None, 0.0, tokens)
    return asdict(run)


def measure_llama_cpp(path: Path, request: dict, threads: int, package_dir: Path) -> Run:
    result = peers._run_isolated("bench_moe.llama_cpp_worker", gguf_path=str(path), prompt=request["prompt"],
                                 long_prompt=request["long_prompt"], new_tokens=request["new_tokens"],
                                 threads=threads, package_dir=str(package_dir))
    return Run(**result)


def _current(artifact: Path) -> bool:
    """Whether `artifact` is one this ember reads (then it is reused; any other is compiled again)."""
    from ember.core.errors import ArtifactError
    from ember.core.manifest import read_manifest

    try:
        read_manifest(artifact)
    except (ArtifactError, OSError):
        return False
    return True


def _same_start(ours: list[int], theirs: list[int], count: int = 16) -> int:
    """How many of the first `count` greedy tokens agree before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(ours[:count], theirs[:count])) if a != b), count)


def _median(runs: list[Run]) -> Run:
    def mid(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    return Run(mid([r.prefill_tokens_per_s for r in runs]), mid([r.decode_tokens_per_s for r in runs]),
               mid([r.long_prefill_tokens_per_s for r in runs]), mid([r.batch_tokens_per_s for r in runs]),
               max(r.peak_rss_mb for r in runs), runs[0].token_ids)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _ember_worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/qwen3moe-quarter"),
                        help="where the GGUF files and ember's artifacts are written (about 30 GB for both types)")
    parser.add_argument("--isa", default="avx512-vnni", choices=bench_cpu.ISA_LEVELS,
                        help="ISA level: ember compiled for its --target, llama.cpp built for it")
    parser.add_argument("--llama-cpp", default="Q8_0,Q4_0", help="GGUF types (Q8_0, Q4_0), comma-separated")
    parser.add_argument("--long-prompt", type=int, default=512, help="tokens of the prefill-only run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    peers.add_run_options(parser)
    args = parser.parse_args()
    qtypes = [q for q in args.llama_cpp.split(",") if q]
    unknown = [q for q in qtypes if q not in EMBER_FORMAT]
    if unknown:
        parser.error(f"--llama-cpp: {unknown[0]!r} is not one of {', '.join(EMBER_FORMAT)}")
    level = bench_cpu.ISA_LEVELS[args.isa]
    missing = build_llama_cpp.missing_flags(level)
    if missing:
        parser.error(f"--isa {args.isa}: this host cannot execute it (no {', '.join(missing)})")
    if args.prompt_len + args.new_tokens > SHAPE["context"] or args.long_prompt > SHAPE["context"]:
        parser.error(f"prompts and new tokens must fit the model's {SHAPE['context']}-token context")

    from ember.driver.compiler import CompileOptions, compile_model

    args.dir.mkdir(parents=True, exist_ok=True)
    files, artifacts, compile_s = {}, {}, {}
    for qtype in qtypes:
        files[qtype] = args.dir / f"qwen3moe-quarter-{args.seed}-{qtype}.gguf"
        if not files[qtype].exists():
            partial = files[qtype].with_suffix(".partial")
            write_gguf(partial, qtype, args.seed)
            partial.rename(files[qtype])
        artifacts[qtype] = args.dir / f"ember-{EMBER_FORMAT[qtype]}-{level.name}"
        if not _current(artifacts[qtype]):
            start = time.perf_counter()
            compile_model(files[qtype], artifacts[qtype], CompileOptions(
                quantization=EMBER_FORMAT[qtype], target=level.ember_target, max_batch=BATCH))
            compile_s[qtype] = f"{time.perf_counter() - start:.0f} s"
        else:
            compile_s[qtype] = "reused"
    package = build_llama_cpp.ensure_built(bench_cpu.llama_cpp_level(level))
    counts = build_llama_cpp.check_isa(bench_cpu.llama_cpp_level(level), build_llama_cpp.package_libraries(package))

    prompt, long_prompt = _prompts(1, args.prompt_len, args.seed)[0], _prompts(1, args.long_prompt, args.seed + 1)[0]
    request = {"prompt": prompt, "long_prompt": long_prompt, "new_tokens": args.new_tokens,
               "batch_prompts": _prompts(BATCH, args.prompt_len, args.seed + 2)}
    runners = {}
    for qtype in qtypes:
        runners[f"ember {EMBER_FORMAT[qtype]}"] = lambda a=artifacts[qtype]: measure_ember(a, request, args.threads)
        runners[f"llama.cpp {qtype}"] = lambda f=files[qtype]: measure_llama_cpp(f, request, args.threads, package)

    peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
    bandwidth_before = bench_cpu.read_bandwidth()
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    busy = 0
    for _ in range(args.repeats):
        for name, run in runners.items():
            busy += not peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
            runs[name].append(run())
    peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
    bandwidth_after = bench_cpu.read_bandwidth()
    bandwidth = max(bandwidth_before, bandwidth_after)

    s = SHAPE
    print(f"\nQwen3-30B-A3B at a quarter of its depth (hidden {s['hidden']}, {s['layers']} layers, {s['experts']} "
          f"experts, {s['active']} active, expert FFN {s['expert_ffn']}, {s['heads']}/{s['kv_heads']} heads of "
          f"{s['head_dim']}, vocab {s['vocab']}; random weights, seed {args.seed})")
    print(f"threads: {args.threads}   prompt {args.prompt_len} + {args.new_tokens} new tokens, prefill-only "
          f"{args.long_prompt}, batch {BATCH}; median of {args.repeats}, round-robin")
    print(f"{bench_cpu.host_line()}")
    print(f"read bandwidth {bandwidth_before / 1e9:.1f} GB/s before the runs, {bandwidth_after / 1e9:.1f} GB/s after "
          f"(the roofline uses {bandwidth / 1e9:.1f})")
    if busy:
        print(f"warning: {busy} of {len(runners) * args.repeats} runs started on a busy machine")
    print(f"ember --target {level.ember_target} (untuned; compile "
          f"{', '.join(f'{EMBER_FORMAT[q]} {compile_s[q]}' for q in qtypes)}); llama.cpp {package.name}: "
          f"CMAKE_ARGS {build_llama_cpp.cmake_args(bench_cpu.llama_cpp_level(level))}; objdump: {counts['zmm']} zmm "
          f"instructions, {counts['vpdpbusd']} vpdpbusd; llama.cpp's KV cache float16, ember's float32")
    summary = {name: _median(measured) for name, measured in runs.items()}
    for qtype in qtypes:
        parts = active_bytes(files[qtype])
        per_token = sum(parts.values())
        print(f"\n{qtype} file {files[qtype].stat().st_size / 1e9:.2f} GB; a decoded token reads "
              f"{per_token / 1e6:.0f} MB: " + ", ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items()))
        print(f"{'runtime':<16} {'prefill tok/s':>13} {'decode tok/s':>12} {'% active roofline':>17} "
              f"{f'prefill@{args.long_prompt}':>12} {f'batch-{BATCH} tok/s':>13} {'b8/b1':>6} {'peak RSS MB':>11} "
              f"{'= llama.cpp':>11}")
        theirs = summary[f"llama.cpp {qtype}"]
        for name in (f"ember {EMBER_FORMAT[qtype]}", f"llama.cpp {qtype}"):
            row = summary[name]
            batch = f"{row.batch_tokens_per_s:>13.1f}" if row.batch_tokens_per_s else f"{'-':>13}"
            ratio = f"{row.batch_tokens_per_s / row.decode_tokens_per_s:>5.2f}x" if row.batch_tokens_per_s else \
                f"{'-':>6}"
            rss = f"{row.peak_rss_mb:>11.0f}" if row.peak_rss_mb else f"{'-':>11}"
            print(f"{name:<16} {row.prefill_tokens_per_s:>13.1f} {row.decode_tokens_per_s:>12.2f} "
                  f"{row.decode_tokens_per_s * per_token / bandwidth:>17.0%} {row.long_prefill_tokens_per_s:>12.1f} "
                  f"{batch} {ratio} {rss} {f'{_same_start(row.token_ids, theirs.token_ids)}/16':>11}")
        ours = summary[f"ember {EMBER_FORMAT[qtype]}"]
        print(f"  ember {EMBER_FORMAT[qtype]} / llama.cpp {qtype}: decode "
              f"{ours.decode_tokens_per_s / theirs.decode_tokens_per_s:.2f}x, prefill@{args.prompt_len} "
              f"{ours.prefill_tokens_per_s / theirs.prefill_tokens_per_s:.2f}x, prefill@{args.long_prompt} "
              f"{ours.long_prefill_tokens_per_s / theirs.long_prefill_tokens_per_s:.2f}x")
        for name in (f"ember {EMBER_FORMAT[qtype]}", f"llama.cpp {qtype}"):
            print(f"  {name} decode runs: " + ", ".join(f"{r.decode_tokens_per_s:.2f}" for r in runs[name]))


if __name__ == "__main__":
    main()
