"""Speculative decoding, measured side by side in one run.

1. **Demo model** (`src/ember/demo_model`, trained; its draft `src/ember/demo_draft`), greedy, two tasks of
   `--prompts` prompts each from its held-out `validation.txt`:
   - *repetitive*: a passage of two verses, then its first words again: the continuation largely
     copies the prompt (the case prompt lookup is for);
   - *free*: one verse, continued freely.
   Runners, round-robin over `--repeats` passes of all prompts, each pass after waiting for a quiet
   machine: ember plain, ember `--speculate ngram`, ember `--draft demo_draft`, and llama.cpp (the
   `--isa` build of `build_llama_cpp.py`) on the demo's F32 GGUF (`convert_hf_to_gguf.py`): plain, with
   llama-cpp-python's prompt lookup (`LlamaPromptLookupDecoding`, which needs all logits), and with
   the draft's F32 GGUF guessing 4 tokens greedily through llama-cpp-python's draft-model interface.
   Decode tok/s is the new tokens after the first over the time after the prompt's prefill, summed
   over the prompts; the median pass is shown. ember's speculative tokens are checked equal to its
   plain ones, prompt by prompt, and so are llama.cpp's.
2. **Verify step cost against k** on the ~110M random-weight Llama of `bench_cpu.py` (random weights
   guess nothing, so the end-to-end speed-up is not measured there): the time of one forward of
   k + 1 tokens with logits at every position, through the artifact's `verify` entry (what a verify
   step runs) and through prefill, over one decode step, at a context of `--context` tokens, median of 20.

    python scripts/bench_speculative.py --isa avx2 --threads 2 --repeats 3
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
from collections.abc import Callable
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS.parent / "tests"))  # gguf_files: llama.cpp's converter

import bench_cpu  # noqa: E402
import build_llama_cpp  # noqa: E402
import gguf_files  # noqa: E402
import peers  # noqa: E402

import ember  # noqa: E402

DRAFT_DIR = Path(ember.DEMO_DRAFT_DIR)


def task_prompts(count: int) -> dict[str, list[str]]:
    """`count` repetitive and `count` free prompts from the demo's held-out text."""
    lines = [line for line in (Path(ember.DEMO_MODEL_DIR) / "validation.txt").read_text().splitlines()
             if len(line) > 60]
    repetitive = []
    for i in range(count):
        passage = " ".join(lines[2 * i: 2 * i + 2])
        repetitive.append(f"{passage}\n{' '.join(passage.split()[:5])}")
    return {"repetitive": repetitive, "free": lines[100: 100 + count]}


def ember_pass(engine, prompts: list[list[int]], new_tokens: int, speculation_factory) -> dict:
    """All prompts once: decode seconds and new tokens summed, the token ids, and speculation counts."""
    from ember.runtime import SamplingParams, generate

    decode_s, tokens, outputs, accepted, proposed, steps = 0.0, 0, [], 0, 0, 0
    for prompt in prompts:
        speculation = speculation_factory()
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, stop_token_ids=())
        generation = generate(engine, prompt, params, speculation=speculation)
        outputs.append(list(generation.tokens()))
        engine.remove_sequence(generation.seq_id)
        decode_s += generation.stats.decode_seconds
        tokens += generation.stats.new_tokens - 1
        if speculation is not None:
            accepted += speculation.stats.accepted
            proposed += speculation.stats.proposed
            steps += speculation.stats.verify_steps
    return {"tok_s": tokens / decode_s, "outputs": outputs, "accepted": accepted, "proposed": proposed,
            "steps": steps}


def llama_cpp_pass(gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int, package: Path,
                   guesser: str | None = None, draft_gguf: Path | None = None) -> dict:
    """The same in llama.cpp, in a fresh process; `guesser`: None, "lookup" or "draft" (`draft_gguf`)."""
    with tempfile.TemporaryDirectory(prefix="ember-spec-") as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        request.write_text(json.dumps({"gguf": str(gguf), "prompts": prompts, "new_tokens": new_tokens,
                                       "threads": threads, "guesser": guesser, "package": str(package),
                                       "draft_gguf": str(draft_gguf) if draft_gguf else None}))
        subprocess.run([sys.executable, __file__, "--llama-cpp-worker", str(request), str(out)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        return json.loads(out.read_text())


def _llama_cpp_worker(request: dict) -> dict:
    sys.path.insert(0, request["package"])
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    prompts, new_tokens, threads = request["prompts"], request["new_tokens"], request["threads"]
    context = max(len(p) for p in prompts) + new_tokens + 16

    class GreedyDraft(LlamaDraftModel):
        """llama-cpp-python's draft interface over a second model: its greedy next tokens, its cache
        reused across calls by `generate`'s prefix match."""

        def __init__(self, path: str, guesses: int) -> None:
            self.guesses = guesses
            self.llm = Llama(model_path=path, n_ctx=context, n_batch=context, n_threads=threads,
                             n_threads_batch=threads, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            guessed = []
            for token in self.llm.generate(input_ids.tolist(), temp=0.0, top_k=1):
                guessed.append(int(token))
                if len(guessed) == self.guesses:
                    break
            return np.array(guessed, dtype=np.intc)

    draft = {None: None, "lookup": lambda: LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=8),
             "draft": lambda: GreedyDraft(request["draft_gguf"], 4)}[request["guesser"]]
    llm = Llama(model_path=request["gguf"], n_ctx=context, n_batch=context, n_threads=threads,
                n_threads_batch=threads, draft_model=draft() if draft else None, verbose=False)
    decode_s, tokens, outputs = 0.0, 0, []
    for prompt in prompts:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - start
        llm.reset()
        generated = []
        start = time.perf_counter()
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            generated.append(int(token))
            if len(generated) == new_tokens:
                break
        decode_s += time.perf_counter() - start - prefill_s
        tokens += len(generated) - 1
        outputs.append(generated)
    return {"tok_s": tokens / decode_s, "outputs": outputs}


def demo_table(args: argparse.Namespace, level: build_llama_cpp.Level, package: Path) -> None:
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.runtime import Engine, load_artifact
    from ember.runtime.speculative import DraftModel, PromptLookup, Speculation

    work = args.work_dir / "ember-bench-speculative"
    artifacts = {}
    for name, source in (("demo", Path(ember.DEMO_MODEL_DIR)), ("draft", DRAFT_DIR)):
        artifacts[name] = work / f"{name}-{args.quant}-{level.name}"
        if not artifacts[name].exists():
            compile_model(source, artifacts[name], CompileOptions(target=level.ember_target, quantization=args.quant,
                                                                  max_batch=2, show_progress=False))
    model = load_artifact(artifacts["demo"], threads=args.threads)
    engine = Engine(model)
    draft_model = DraftModel(Engine(load_artifact(artifacts["draft"], threads=args.threads)), engine)
    gguf = gguf_files.convert(Path(ember.DEMO_MODEL_DIR), "f32", pre="gpt-2")
    draft_gguf = gguf_files.convert(DRAFT_DIR, "f32", pre="gpt-2")
    draft_params = sum(int(np.prod(shape)) for shape in _shapes(DRAFT_DIR))
    demo_params = sum(int(np.prod(shape)) for shape in _shapes(Path(ember.DEMO_MODEL_DIR)))
    print(f"\ndemo model ({demo_params / 1e6:.2f}M parameters, ember --quant {args.quant}; draft "
          f"{draft_params / 1e6:.2f}M), greedy, {args.new_tokens} new tokens per prompt, {args.prompts} prompts "
          f"per task, median of {args.repeats} round-robin passes")
    print(f"{'task':<11} {'runner':<28} {'decode tok/s':>12} {'vs plain':>8} {'accepted':>9} {'per step':>8} "
          f"{'same output':>11}")

    def runners_for(prompts: list[list[int]]) -> dict[str, Callable[[], dict]]:
        """Each runner's pass over `prompts`, by name."""
        return {
            "ember": lambda: ember_pass(engine, prompts, args.new_tokens, lambda: None),
            "ember --speculate ngram": lambda: ember_pass(engine, prompts, args.new_tokens,
                                                          lambda: Speculation(PromptLookup())),
            "ember --draft demo_draft": lambda: ember_pass(
                engine, prompts, args.new_tokens, lambda: Speculation(draft_model)),
            "llama.cpp": lambda: llama_cpp_pass(gguf, prompts, args.new_tokens, args.threads, package),
            "llama.cpp prompt lookup": lambda: llama_cpp_pass(gguf, prompts, args.new_tokens, args.threads, package,
                                                              "lookup"),
            "llama.cpp draft demo_draft": lambda: llama_cpp_pass(gguf, prompts, args.new_tokens, args.threads,
                                                                 package, "draft", draft_gguf),
        }

    for task, texts in task_prompts(args.prompts).items():
        runners = runners_for([model.tokenizer.encode(text) for text in texts])
        passes = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)
                passes[name].append(run())
        median = {name: sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2] for name, runs in passes.items()}
        for name, row in median.items():
            plain = median["llama.cpp" if name.startswith("llama.cpp") else "ember"]
            same = "yes" if row["outputs"] == plain["outputs"] else "NO"
            accepted = f"{100 * row['accepted'] / row['proposed']:.0f}%" if row.get("proposed") else "-"
            per_step = f"{row['accepted'] / row['steps']:.2f}" if row.get("steps") else "-"
            print(f"{task:<11} {name:<28} {row['tok_s']:>12.1f} {row['tok_s'] / plain['tok_s']:>7.2f}x "
                  f"{accepted:>9} {per_step:>8} {same:>11}")


def _shapes(model_dir: Path) -> list[tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        return [tuple(f.get_slice(name).get_shape()) for name in f.keys()]


def verify_cost_table(args: argparse.Namespace, level: build_llama_cpp.Level) -> None:
    formats = [quant for quant in args.verify_quant.split(",") if quant]
    if not formats:
        return
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.runtime import Engine, load_artifact

    model_dir = args.work_dir / "llama110m"
    if not (model_dir / "config.json").exists():
        peers.make_random_llama(model_dir, **bench_cpu.SHAPES["110m"])
    print(f"\n~110M Llama (random weights), context {args.context}: one forward of k + 1 tokens with all logits, "
          "through the verify entry and through prefill, over one decode step, median of 20")
    print(f"{'--quant':<9} {'forward':<8} {'decode ms':>9} " + " ".join(f"{f'k={k}':>6}" for k in range(1, 8)))
    for quant in formats:
        artifact = args.work_dir / "ember-bench-speculative" / f"llama110m-{quant}-{level.name}"
        if not artifact.exists():
            compile_model(model_dir, artifact, CompileOptions(target=level.ember_target, quantization=quant,
                                                              max_batch=2, show_progress=False))
        _print_verify_costs(Engine(load_artifact(artifact, threads=args.threads)), quant, args)


def _print_verify_costs(engine, quant: str, args: argparse.Namespace) -> None:
    """One --quant's rows: a forward of k + 1 tokens through verify and through prefill, over one decode step."""
    seq = engine.add_sequence()
    rng = np.random.default_rng(0)
    engine.prefill(seq, rng.integers(0, 32000, args.context).tolist())
    peers.wait_for_quiet_machine(timeout_s=args.quiet_wait)

    forwards = {"decode": lambda tokens: engine.decode([seq], tokens),
                "verify": lambda tokens: engine.verify(seq, tokens),
                "prefill": lambda tokens: engine.prefill(seq, tokens, all_logits=True)}

    def timed(forward: str, k: int) -> float:
        times = []
        for _ in range(20):
            tokens = rng.integers(0, 32000, k + 1).tolist()
            start = time.perf_counter()
            forwards[forward](tokens)
            times.append(time.perf_counter() - start)
            engine.truncate(seq, args.context)
        return statistics.median(times)

    decode = timed("decode", 0)
    for forward in ("verify", "prefill"):
        print(f"{quant:<9} {forward:<8} {1e3 * decode:>9.2f} "
              + " ".join(f"{timed(forward, k) / decode:>5.2f}x" for k in range(1, 8)))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--llama-cpp-worker":
        result = _llama_cpp_worker(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp"), help="where models and artifacts go")
    parser.add_argument("--isa", default="native", choices=build_llama_cpp.LEVELS,
                        help="ember's --target and llama.cpp's build for this ISA level")
    parser.add_argument("--quant", default="q0f32", help="the demo's ember format (its GGUF peer is F32)")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per task")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="cached tokens before the timed verify steps")
    parser.add_argument("--verify-quant", default="q0f32,q4f32",
                        help="formats of the 110M verify-cost table (empty: no table)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=60,
                        help="seconds to wait for an idle machine before each pass (then it runs anyway)")
    args = parser.parse_args()
    if not (DRAFT_DIR / "config.json").exists():
        parser.error(f"{DRAFT_DIR} is missing: train it with scripts/train_demo_model.py --draft")
    level = build_llama_cpp.LEVELS[args.isa]
    missing = build_llama_cpp.missing_flags(level)
    if missing:
        parser.error(f"--isa {args.isa}: this host cannot execute it (no {', '.join(missing)})")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    package = build_llama_cpp.ensure_built(level)
    print(f"{bench_cpu.host_line()}; "
          f"read bandwidth {bench_cpu.read_bandwidth() / 1e9:.1f} GB/s; threads {args.threads}; ember --target "
          f"{level.ember_target}; llama.cpp {package.name}")
    demo_table(args, level, package)
    verify_cost_table(args, level)


if __name__ == "__main__":
    main()
