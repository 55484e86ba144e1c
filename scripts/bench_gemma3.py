"""A Gemma-3-1B-shaped model on CPU next to llama.cpp on the same weights: decode at two contexts, a long prefill.

Builds (or reuses) a random-weight Gemma 3 checkpoint of `--shape` (1b: Gemma-3-1B's shape, hidden 1152, 26
layers, 4 query heads on 1 KV head of dim 256, MLP 6912, vocabulary 262,144, tied embeddings; five local layers
over a 512-token window, then one global layer, as Gemma 3 alternates them; RoPE theta 10,000 local, 1e6
global), float32 safetensors from a seed, and from the same weights one GGUF file per format (`write_gguf`:
llama.cpp's gemma3 tensors and metadata, every matrix in Q8_0 or Q4_0 by the `gguf` package's quantizers,
as `llama-quantize --pure` writes them). ember compiles the checkpoint (`--frontend torch-export`, the
`--isa` level's `--target`, `--max-batch 1`) in each `--quants` format, next to llama.cpp's build for the
same level (`build_llama_cpp.py`) on the file of the same bits: q8f32 against Q8_0, q4f32 against Q4_0.

For each context c of `--contexts`, every runtime runs in a fresh process, round-robin over `--repeats`
(median): a warm-up (a 16-token prompt and 4 decode steps), then a timed greedy generation from a c-token
prompt, so prefill tok/s is over c tokens and decode tok/s over the `--new-tokens` that follow, decoded with c
to c + new tokens in the cache. Each run waits for a quiet machine, and is run again (`--retries`) while other
processes kept more than `--max-others` cores busy during its timed phases; the header says how busy they kept
the machine, the table how busy during each runtime's worst kept run (`--json FILE`: every kept run).
llama.cpp runs as its own tools run it (llama-cli, llama-server): the windowed layers in a cache of their
window (`swa_full` off; its Python binding's default is the full-size one), flash attention as
`--llama-flash-attn` says (default on: what its `auto` picks on CPUs), its default float16 KV cache. ember's
KV cache is float32 (its default for a float32 model), or what `--kv-quant` names (`f16`: llama.cpp's).

`--sweep` shows the windowed layers' decode cost against the context: one process per artifact prefills the
prompt up to each context in turn and times `--sweep-tokens` decode steps there, for ember's `--sweep-quant`
artifact of the model and of the same weights with every layer global (`layer_types` all `full_attention`).
Past the window the windowed model's step should grow only by its global layers' keys, the all-global one's by
all of them.

    python scripts/bench_gemma3.py --model /tmp/gemma3-1b --isa avx2 --quants q8f32,q4f32 --contexts 128,4096 \\
        --new-tokens 128 --sweep 128,512,1024,2048,4096 --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
import build_llama_cpp  # noqa: E402
import peers  # noqa: E402

LOCAL, GLOBAL = "sliding_attention", "full_attention"
PATTERN = 6  # Gemma 3: five local layers, then a global one
SHAPES = {
    "1b": dict(hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256, ffn=6912, vocab=262144, window=512,
               context=8192),
    "tiny": dict(hidden=256, layers=6, heads=4, kv_heads=1, head_dim=64, ffn=512, vocab=4096, window=64,
                 context=1024),
}
LLAMA_CPP_TYPE = {"q8f32": "Q8_0", "q4f32": "Q4_0"}  # ember --quant -> llama.cpp GGUF type of the same bits


def make_random_gemma3(out_dir: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                       vocab: int, window: int, context: int, seed: int = 0) -> dict:
    """Write a random Gemma 3 text checkpoint (float32 safetensors, transformers' initialiser, `seed`).

    Layer i is global when (i + 1) % PATTERN == 0, local otherwise (Gemma 3's layout). No tokenizer: the
    benchmark feeds token ids. `context` is the config's context length (Gemma-3-1B's is 32,768; it sizes
    ember's KV cache, nothing else)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab, sliding_window=window,
        layer_types=[GLOBAL if (i + 1) % PATTERN == 0 else LOCAL for i in range(layers)],
        rope_parameters={GLOBAL: {"rope_type": "default", "rope_theta": 1e6},
                         LOCAL: {"rope_type": "default", "rope_theta": 10000.0}},
        query_pre_attn_scalar=head_dim, max_position_embeddings=context, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="float32")
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    return {}


def all_global(model_dir: Path) -> Path:
    """The same weights with every layer global (`model_dir`-global: its config, the weights hard-linked)."""
    out = model_dir.with_name(f"{model_dir.name}-global")
    if not (out / "config.json").exists():
        out.mkdir(exist_ok=True)
        config = json.loads((model_dir / "config.json").read_text())
        config["layer_types"] = [GLOBAL] * config["num_hidden_layers"]
        for path in model_dir.glob("*.safetensors"):
            (out / path.name).unlink(missing_ok=True)
            os.link(path, out / path.name)  # ember refuses a symlink out of the directory
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_gguf(model_dir: str, out_path: str, qtype: str) -> dict:
    """Write the Gemma 3 checkpoint as a llama.cpp gemma3 GGUF file, every matrix in `qtype`, norms in F32.

    As llama.cpp's `convert_hf_to_gguf.py` writes Gemma 3 (its `Gemma3Model`): tensor names from the gguf
    package's map for the architecture, 1 added to every RMSNorm scale (llama.cpp's norm multiplies by the
    weight, Gemma's by 1 + weight), no `output` tensor (tied to `token_embd`), the global layers' RoPE base as
    `rope.freq_base` and the window as `attention.sliding_window` (llama.cpp's gemma3 takes every sixth layer
    as global, its local RoPE base 10,000 by default). The vocabulary is placeholder text, as in
    `peers.write_gguf`."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config["layer_types"] != [GLOBAL if (i + 1) % PATTERN == 0 else LOCAL
                                 for i in range(config["num_hidden_layers"])]:
        raise ValueError("llama.cpp's gemma3 takes every sixth layer as global; this checkpoint differs")
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    writer = gguf.GGUFWriter(str(out_path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GEMMA3])
    writer.add_name("ember benchmark gemma3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"][GLOBAL]["rope_theta"])
    writer.add_rope_freq_base_swa(config["rope_parameters"][LOCAL]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_file_type({"Q8_0": 7, "Q4_0": 2}[qtype])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "</s>", "<s>"] + [f"tok{i}" for i in range(vocab - 3)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, layers)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    for name, w in weights.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"no llama.cpp gemma3 tensor for {name}")
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 1:
            writer.add_tensor(gguf_name, w + np.float32(1.0) if name.endswith("norm.weight") else w)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {}


def compile_ember(model_dir: Path, out: Path, quant: str, target: str, kv_quant: str | None) -> float:
    """`ember compile` in a fresh process (torch-export frontend, one sequence, `--kv-quant kv_quant` if given); its
    wall seconds (0 if reused)."""
    if (out / "manifest.json").exists():
        return 0.0
    command = [sys.executable, "-m", "ember", "compile", str(model_dir), "-o", str(out), "--quant", quant,
               "--target", target, "--frontend", "torch-export", "--max-batch", "1", "--no-progress",
               *(["--kv-quant", kv_quant] if kv_quant else [])]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


class _Meter:
    """Wall seconds between laps, and how many cores other processes kept busy meanwhile: the machine's busy CPU
    time (/proc/stat, time stolen by the hypervisor included) less this process's own, over the wall time."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
        own = resource.getrusage(resource.RUSAGE_SELF)
        return (time.perf_counter(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
                own.ru_utime + own.ru_stime)

    def lap(self) -> tuple[float, float]:
        (wall, busy, own), (wall1, busy1, own1) = self._last, self._read()
        self._last = (wall1, busy1, own1)
        return wall1 - wall, max(0.0, (busy1 - busy) - (own1 - own)) / (wall1 - wall)


def _timed_generation(prefill: Callable[[list[int]], int], decode: Callable[[int], int], prompt: list[int],
                      new_tokens: int) -> dict:
    """Warm up (a 16-token prompt, 4 decode steps: every kernel and weight once), then time a greedy generation:
    tok/s of the prefill over `prompt` and of the `new_tokens` decode steps after it, the other processes' load
    during each, the tokens. `prefill` starts a fresh sequence."""
    token = prefill(prompt[:16])
    for _ in range(4):
        token = decode(token)
    meter = _Meter()
    tokens = [prefill(prompt)]
    prefill_s, prefill_others = meter.lap()
    for _ in range(new_tokens):
        tokens.append(decode(tokens[-1]))
    decode_s, decode_others = meter.lap()
    return {"prefill_tokens_per_s": len(prompt) / prefill_s, "decode_tokens_per_s": new_tokens / decode_s,
            "peak_rss_mb": 0.0, "token_ids": tokens, "others": max(prefill_others, decode_others)}


def _ember_engine(artifact: str, threads: int):
    os.environ["TVM_NUM_THREADS"] = str(threads)  # before TVM's thread pool starts
    sys.modules["torch"] = None  # as on a device: the runtime alone, without the torch tvm_ffi would load
    from ember.runtime import Engine, load_artifact

    return Engine(load_artifact(Path(artifact)))


def _ember_worker(artifact: str, prompt_ids: list[int], new_tokens: int, threads: int) -> dict:
    engine = _ember_engine(artifact, threads)
    seq = None

    def prefill(ids: list[int]) -> int:
        nonlocal seq
        if seq is not None:
            engine.remove_sequence(seq)
        seq = engine.add_sequence()
        return int(np.argmax(engine.prefill(seq, ids)))

    return _timed_generation(prefill, lambda token: int(np.argmax(engine.decode([seq], [token])[0])), prompt_ids,
                             new_tokens)


def _llama_cpp_worker(gguf_path: str, prompt_ids: list[int], new_tokens: int, threads: int, package_dir: str,
                      options: dict) -> dict:
    sys.path.insert(0, package_dir)
    import llama_cpp
    from llama_cpp import Llama

    if not Path(llama_cpp.__file__).resolve().is_relative_to(Path(package_dir).resolve()):
        raise RuntimeError(f"llama_cpp was imported from {llama_cpp.__file__}, not from {package_dir}")
    llm = Llama(model_path=gguf_path, n_ctx=len(prompt_ids) + new_tokens + 8, n_batch=len(prompt_ids),
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False, **options)

    def step(ids: list[int]) -> int:
        llm.eval(ids)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    def prefill(ids: list[int]) -> int:
        llm.reset()
        return step(ids)

    return _timed_generation(prefill, lambda token: step([token]), prompt_ids, new_tokens)


def _sweep_worker(artifact: str, prompt_ids: list[int], contexts: list[int], tokens: int, threads: int) -> dict:
    """Seconds per decode step at each of `contexts` (ascending) on one sequence: the prompt prefilled up to each
    context in turn (the tokens decoded before count), then `tokens` steps timed."""
    engine = _ember_engine(artifact, threads)
    warm = engine.add_sequence()
    token = int(np.argmax(engine.prefill(warm, prompt_ids[:16])))
    for _ in range(4):
        token = int(np.argmax(engine.decode([warm], [token])[0]))
    engine.remove_sequence(warm)
    seq, length, used, seconds, others = engine.add_sequence(), 0, 0, [], 0.0
    for context in contexts:
        fill = context - length
        token = int(np.argmax(engine.prefill(seq, prompt_ids[used:used + fill])))
        used, length = used + fill, context + tokens
        meter = _Meter()
        for _ in range(tokens):
            token = int(np.argmax(engine.decode([seq], [token])[0]))
        wall, load = meter.lap()
        seconds.append(wall / tokens)
        others = max(others, load)
    return {"seconds": seconds, "others": others}


def run_alone(run: Callable[[], dict], max_others: float, retries: int, quiet_wait: float) -> dict:
    """`run()` (a worker's result) after waiting for a quiet machine; run again, up to `retries` times, while
    other processes kept more than `max_others` cores busy on average during its timed phases (the last try is
    kept). On a shared machine this matters more than noise: a decode step is a chain of barriers between the
    threads, and one thread descheduled by a stranger stalls them all (in trial runs beside a test suite,
    llama.cpp's decode of the 1b shape measured 0.4 to 9.5 tok/s)."""
    for attempt in range(retries + 1):
        peers.wait_for_quiet_machine(timeout_s=quiet_wait)
        result = run()
        if result["others"] <= max_others:
            break
        print(f"  run disturbed: other processes kept {result['others']:.2f} cores busy"
              + (", again" if attempt < retries else ", kept"), file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/gemma3-1b"),
                        help="checkpoint dir; created with random weights of --shape if missing")
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--isa", choices=build_llama_cpp.LEVELS, default="avx2",
                        help="ISA level: ember's --target and llama.cpp's build for it")
    parser.add_argument("--quants", default="q8f32,q4f32",
                        help=f"ember --quant formats ({', '.join(LLAMA_CPP_TYPE)}), each against llama.cpp's "
                             "GGUF type of the same bits")
    parser.add_argument("--contexts", default="128,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--llama-flash-attn", choices=("on", "off"), default="on")
    parser.add_argument("--kv-quant", choices=("f16", "q8"),
                        help="ember's KV cache format (default: float32; f16 is llama.cpp's default cache type)")
    parser.add_argument("--sweep", default="128,512,1024,2048,4096",
                        help="contexts of the decode sweep, comma-separated (empty: no sweep)")
    parser.add_argument("--sweep-quant", default="q4f32")
    parser.add_argument("--sweep-tokens", type=int, default=32, help="decode steps timed at each sweep context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=600,
                        help="seconds to wait for an idle machine before each run (then it runs anyway)")
    parser.add_argument("--max-others", type=float, default=0.2,
                        help="cores other processes may keep busy on average during a run's timed phases before "
                             "it is run again")
    parser.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run (the last one is kept)")
    parser.add_argument("--json", type=Path, help="also write every kept run's result to this file")
    args = parser.parse_args()
    split = lambda text: [int(x) if x.isdigit() else x for x in text.split(",") if x]  # noqa: E731
    quants, contexts, sweep = split(args.quants), split(args.contexts), split(args.sweep)
    if unknown := [q for q in quants + [args.sweep_quant] if q not in LLAMA_CPP_TYPE]:
        parser.error(f"unknown format {unknown[0]!r} (known: {', '.join(LLAMA_CPP_TYPE)})")
    shape = SHAPES[args.shape]
    if max(contexts + sweep) + args.new_tokens > shape["context"]:
        parser.error(f"contexts up to {max(contexts + sweep)} + {args.new_tokens} new tokens exceed the "
                     f"{args.shape} shape's context of {shape['context']}")
    if sweep and any(b - a <= args.sweep_tokens for a, b in zip(sweep, sweep[1:])):
        parser.error(f"--sweep: each context must exceed the one before by more than --sweep-tokens "
                     f"{args.sweep_tokens}")
    level = build_llama_cpp.LEVELS[args.isa]
    if missing := build_llama_cpp.missing_flags(level):
        parser.error(f"--isa {args.isa}: this host cannot execute it (no {', '.join(missing)})")

    if not (args.model / "config.json").exists():
        print(f"writing a random {args.shape} checkpoint to {args.model}", file=sys.stderr)
        peers._run_isolated("bench_gemma3.make_random_gemma3", out_dir=str(args.model), **shape)
    ggufs = {}
    for quant in quants:
        ggufs[quant] = args.model / "gguf" / f"model-{LLAMA_CPP_TYPE[quant]}.gguf"
        if not ggufs[quant].exists():
            ggufs[quant].parent.mkdir(exist_ok=True)
            partial = ggufs[quant].with_suffix(".partial")
            peers._run_isolated("bench_gemma3.write_gguf", model_dir=str(args.model), out_path=str(partial),
                                qtype=LLAMA_CPP_TYPE[quant])
            os.replace(partial, ggufs[quant])
    artifacts, compile_s = {}, {}
    variants = [(quant, args.model) for quant in quants]
    if sweep:
        variants.append((f"{args.sweep_quant}-global", all_global(args.model)))
    for name, model_dir in variants:
        kv = f"-kv-{args.kv_quant}" if args.kv_quant else ""
        artifacts[name] = args.model.with_name(f"{args.model.name}-ember-{name}-{level.name}{kv}")
        compile_s[name] = compile_ember(model_dir, artifacts[name], name.split("-")[0], level.ember_target,
                                        args.kv_quant)
    package = build_llama_cpp.ensure_built(level)
    counts = build_llama_cpp.check_isa(level, build_llama_cpp.package_libraries(package))
    llama_options = {"swa_full": False, "flash_attn": args.llama_flash_attn == "on"}

    prompt = np.random.default_rng(0).integers(3, shape["vocab"], max(contexts + sweep)).tolist()
    runners = {}
    for context in contexts:
        for quant in quants:
            runners[context, f"ember {quant}"] = lambda a=artifacts[quant], c=context: peers._run_isolated(
                "bench_gemma3._ember_worker", artifact=str(a), prompt_ids=prompt[:c], new_tokens=args.new_tokens,
                threads=args.threads)
            runners[context, f"llama.cpp {LLAMA_CPP_TYPE[quant]}"] = lambda g=ggufs[quant], c=context: (
                peers._run_isolated("bench_gemma3._llama_cpp_worker", gguf_path=str(g), prompt_ids=prompt[:c],
                                    new_tokens=args.new_tokens, threads=args.threads, package_dir=str(package),
                                    options=llama_options))
    for name in (args.sweep_quant, f"{args.sweep_quant}-global") if sweep else ():
        runners["sweep", name] = lambda a=artifacts[name]: peers._run_isolated(
            "bench_gemma3._sweep_worker", artifact=str(a), prompt_ids=prompt, contexts=sweep,
            tokens=args.sweep_tokens, threads=args.threads)
    runs: dict = {key: [] for key in runners}
    started = time.time()
    for repeat in range(args.repeats):  # round-robin: a drifting machine lands on every runtime alike
        for key, run in runners.items():
            runs[key].append(run_alone(run, args.max_others, args.retries, args.quiet_wait))
            print(f"[{time.strftime('%H:%M:%S')}] round {repeat + 1}, {key}: other processes "
                  f"{runs[key][-1]['others']:.2f} cores", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({" ".join(map(str, key)): results for key, results in runs.items()}))
    peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
    bandwidth = bench_cpu.read_bandwidth()

    print(f"\n{args.model} (gemma3 {args.shape} shape: {json.dumps(shape)})   threads: {args.threads}   "
          f"{args.new_tokens} new tokens after each prompt, median of {args.repeats}, round-robin; "
          f"{(time.time() - started) / 60:.0f} min")
    print(f"{bench_cpu.host_line()}; read bandwidth {bandwidth / 1e9:.1f} GB/s (measured after the runs)")
    others = {key: [result["others"] for result in results] for key, results in runs.items()}
    loads = sum(others.values(), [])
    print(f"other processes during the timed phases: {np.median(loads):.2f} cores median, {max(loads):.2f} most; "
          f"{sum(load > args.max_others for load in loads)} of {len(loads)} runs kept above --max-others "
          f"{args.max_others} after {args.retries} reruns")
    compiled = ", ".join(f"{name} {s:.0f} s" for name, s in compile_s.items() if s) or "artifacts reused"
    print(f"ember --target {level.ember_target}, --frontend torch-export, --max-batch 1, "
          f"{args.kv_quant or 'float32'} KV cache; "
          f"compile: {compiled}")
    print(f"llama.cpp {package.name}: CMAKE_ARGS {build_llama_cpp.cmake_args(level)}; objdump: {counts['zmm']} zmm, "
          f"{counts['vpdpbusd']} vpdpbusd; Llama(swa_full=False, flash_attn={llama_options['flash_attn']}), "
          f"float16 KV cache, n_batch = prompt, n_ubatch 512")
    summary = {key: peers.summarize([peers.Measurement(key[1], **{k: v for k, v in result.items() if k != "others"})
                                     for result in results]) for key, results in runs.items() if key[0] != "sweep"}
    per_token = {f"ember {q}": bench_cpu.ember_bytes_per_token(artifacts[q]) for q in quants}
    per_token.update({f"llama.cpp {LLAMA_CPP_TYPE[q]}": bench_cpu.gguf_bytes_per_token(ggufs[q]) for q in quants})
    print(f"\n{'runtime':<17} {'context':>7} {'prefill tok/s':>13} {'decode tok/s':>12} {'MB/token':>9} "
          f"{'% roofline':>10} {'peak RSS MB':>11} {'others, cores':>13}")
    for (context, name), row in summary.items():
        print(f"{name:<17} {context:>7} {row.prefill_tokens_per_s:>13.1f} {row.decode_tokens_per_s:>12.2f} "
              f"{per_token[name] / 1e6:>9.1f} {row.decode_tokens_per_s * per_token[name] / bandwidth:>10.0%} "
              f"{row.peak_rss_mb:>11.0f} {max(others[context, name]):>13.2f}")
    for quant in quants:
        ours, theirs = f"ember {quant}", f"llama.cpp {LLAMA_CPP_TYPE[quant]}"
        for context in contexts:
            a, b = summary[context, ours], summary[context, theirs]
            print(f"  {ours} / {theirs} at {context}: prefill {a.prefill_tokens_per_s / b.prefill_tokens_per_s:.2f}x"
                  f", decode {a.decode_tokens_per_s / b.decode_tokens_per_s:.2f}x")
        for name in (ours, theirs):
            first, last = summary[contexts[0], name], summary[contexts[-1], name]
            print(f"  {name} decode at {contexts[-1]} / at {contexts[0]}: "
                  f"{last.decode_tokens_per_s / first.decode_tokens_per_s:.2f}x")
    if sweep:
        windowed, whole = args.sweep_quant, f"{args.sweep_quant}-global"
        median = {name: np.median([result["seconds"] for result in runs["sweep", name]], axis=0)
                  for name in (windowed, whole)}
        print(f"\nember {args.sweep_quant} decode ms/token at each context ({args.sweep_tokens} steps, median of "
              f"{args.repeats}): windowed as Gemma 3 against the same weights with every layer global")
        print(f"{'context':>7} {'windowed':>9} {'all global':>10} {'windowed - at ' + str(sweep[0]):>16} "
              f"{'global - at ' + str(sweep[0]):>16}")
        for i, context in enumerate(sweep):
            print(f"{context:>7} {median[windowed][i] * 1e3:>9.2f} {median[whole][i] * 1e3:>10.2f} "
                  f"{(median[windowed][i] - median[windowed][0]) * 1e3:>16.2f} "
                  f"{(median[whole][i] - median[whole][0]) * 1e3:>16.2f}")


if __name__ == "__main__":
    main()
