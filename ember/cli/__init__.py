"""The `ember` command line: a thin shell over ember's Python API.

Every user error is an `EmberError`, caught here once and printed as one line
without a traceback (`--verbose` shows it). Exit codes: 0 success, 1 an error in
the input or the request, 2 bad command-line usage, 70 an internal error (a bug:
one line asking for a report), 130 interrupted, 141 stdout closed by its reader.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ember import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ember.core.errors import EmberError
from ember.core.manifest import KV_QUANTIZATIONS
from ember.core.without_torch import hide_torch_from_tvm
from ember.ir.quant_formats import FORMATS

_EPILOG = """\
examples:
  ember compile demo -o demo-cpu            compile the bundled demo model for this CPU
  ember generate demo-cpu --prompt "And the LORD said"
  ember chat demo-cpu
  ember compile path/to/hf-llama -o llama-cpu --target cpu --memory-budget 8GB
  ember compile path/to/hf-llama -o llama-h100 --target cuda:sm_90a   (no GPU needed here)
  ember compile demo -o demo-pi5 --target raspberry-pi-5   (aarch64, needs g++-aarch64-linux-gnu)
  ember package demo-pi5 -o demo-pi5-board      what to copy to the board (see README)
  ember inspect llama-cpu
  ember compile demo --quant q4f32 -o demo-q4    4-bit weights (see `ember compile --help`)
  ember eval demo-q4 --perplexity ember/demo_model/validation.txt --reference demo-cpu
  ember tune demo --db tuning-db && ember compile demo -o demo-tuned --tuning-db tuning-db
  ember generate demo-cpu --speculate ngram --prompt "..."   guess tokens from the prompt, check them at once
  ember compile demo-draft -o draft-cpu && ember chat demo-cpu --draft draft-cpu   a small model guesses

MODEL is a Hugging Face checkpoint directory (config.json, model.safetensors or a
sharded index, tokenizer.json) of a llama, mistral or qwen2 model, a GGUF file, `demo`,
or `demo-draft` (the demo's 2-layer draft for speculative decoding).
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ember` console script."""
    hide_torch_from_tvm()  # before anything imports TVM: compile does directly, option checks through the runtime
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    interrupted = []

    def on_sigint(_signum, _frame):
        interrupted.append(True)
        raise KeyboardInterrupt

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    try:
        return args.run(args)
    except EmberError as err:
        print(f"ember: error: {_one_line(str(err))}", file=sys.stderr)
        if args.verbose:
            raise
        return 1
    except BrokenPipeError:
        # The reader went away (`ember generate ... | head -1`): stop quietly, and let the
        # interpreter's final flush of stdout write nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except BaseException as err:
        # Ctrl-C inside a TVM call reaches Python as a RuntimeError, not KeyboardInterrupt.
        if interrupted or isinstance(err, KeyboardInterrupt):
            print("ember: interrupted", file=sys.stderr)
            return 130
        if args.verbose or not isinstance(err, Exception):
            raise
        if isinstance(err, MemoryError):
            print(f"ember: error: out of memory: this machine's RAM did not hold what `ember {args.command}` "
                  f"needed{': ' + _one_line(str(err)) if str(err) else ''}", file=sys.stderr)
            return 1
        print(f"ember: internal error: {type(err).__name__}: {_one_line(str(err))} (rerun with --verbose for the "
              "traceback, and please report it)", file=sys.stderr)
        return 70
    finally:
        signal.signal(signal.SIGINT, previous_handler)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="Compile large language models for the hardware you own, and run them.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each stage; show tracebacks")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    compile_ = commands.add_parser("compile", help="compile a model into an artifact directory",
                                   description="Compile a Hugging Face checkpoint or a GGUF file (llama.cpp's format) "
                                               "into a deployable artifact.",
                                   epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    compile_.add_argument("model", help="checkpoint directory, a .gguf file (each tensor keeps its type: Q8_0/Q4_0/"
                                        "Q4_1 weights as stored, K-quants re-quantized to the closest format with "
                                        "at least their bits and the error printed), an .onnx file of a decoder's "
                                        "full-sequence forward (logits = f(input_ids), as torch.onnx.export writes "
                                        "it; see --tokenizer), or `demo` for the bundled demo model")
    compile_.add_argument("-o", "--output", required=True, type=Path, help="artifact directory to write")
    compile_.add_argument("--target", default="cpu",
                          help="`cpu` (this machine, default), an aarch64 Linux board (raspberry-pi-5, rk3588, "
                               "jetson-orin-cpu, graviton3, or `aarch64` for any ARMv8.2-A CPU with dotprod; "
                               "cross-linked with aarch64-linux-gnu-g++), a TVM target JSON object or file for another CPU, "
                               'e.g. \'{"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 8}\', '
                               "`cuda:ARCH` (cuda:sm_80, cuda:sm_90a, ...; compiles without a GPU), `cuda:DEVICE` "
                               "(a GPU preset such as cuda:h100, cuda:l4), `cuda` (this machine's GPU) or `opencl`")
    compile_.add_argument("--quant", default=None, metavar="FORMAT",
                          help="weight format of every weight (default: a GGUF file's own per tensor, else q0f32 "
                               "on CPUs, q0f16 on GPUs): "
                               + ", ".join(
                              f"{fmt.name} ({fmt.bits_per_weight:g} bits/weight)" for fmt in FORMATS.values()))
    _add_graph_arguments(compile_)
    compile_.add_argument("--keep-embedding", action="store_true",
                          help="leave the token embedding in the compute dtype (quantized formats only)")
    compile_.add_argument("--keep-lm-head", action="store_true",
                          help="leave the output projection in the compute dtype (quantized formats only); "
                               "a tied embedding is kept if either flag is given")
    compile_.add_argument("--float-activations", action="store_true",
                          help="q8f32/q4f32: keep the projections' activations in float. By default, on CPUs with "
                               "an int8 dot product (AVX512-VNNI, AVX-VNNI, AVX2, ARM dotprod/i8mm), each activation "
                               "row is rounded to int8 per group of 32, as llama.cpp does for Q8_0/Q4_0, and "
                               "multiplied in integers (decode projections 1.2-2x, prefill projections ~4x faster "
                               "than float)")
    compile_.add_argument("--kv-quant", choices=KV_QUANTIZATIONS, default=None,
                          help="float32 models on CPU targets: store the KV cache's keys and values packed, for "
                               "longer contexts in the same memory and less to read per decoded token. q8: int8 "
                               "with a float32 scale per token and head (0.27x the bytes of float32 at a head dim "
                               "of 64); f16: float16 (0.5x, llama.cpp's default cache type, and 20x closer to the "
                               "float cache's logits than q8). Default: the model's dtype")
    compile_.add_argument("--prefill-chunk", type=int, default=256,
                          help="largest number of prompt tokens per prefill call (default 256)")
    compile_.add_argument("--max-batch", type=int, default=8,
                          help="most sequences decoded together (default 8)")
    compile_.add_argument("--memory-budget", type=_parse_bytes,
                          help="memory for weights + workspace + KV cache, e.g. 4GB; sets the longest context "
                               "the artifact allows and the KV cache's size (default on GPUs: 90%% of its memory)")
    compile_.add_argument("--tuning-db", type=Path, metavar="DIR",
                          help="apply the records `ember tune` wrote on this machine; the rules schedule the rest")
    compile_.add_argument("--no-progress", action="store_true", help="no progress bars")
    compile_.set_defaults(run=_run_compile)

    tune = commands.add_parser(
        "tune", help="autotune a model's hottest kernels into a tuning database",
        description="Extract a model's kernels, weight them by how often prefill and decode call them, and "
                    "search the schedules of the hottest with meta_schedule on this machine, or with "
                    "--rpc-tracker on the devices of a key (built here, timed there; the database is keyed by "
                    "the devices' own fingerprint). Rerunning with the same --db continues where a job stopped.",
        epilog="example:\n  ember tune demo --db tuning --trials 64 --budget 5\n"
               "  ember compile demo -o demo-tuned --tuning-db tuning\n"
               "  ember tune demo --target raspberry-pi-5 --rpc-tracker 127.0.0.1:9190 --device-key pi5 --db pi5-db",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_argument("model", help="checkpoint directory, an artifact (tuned as it was compiled), or `demo`")
    tune.add_argument("--db", required=True, type=Path, metavar="DIR", help="tuning database directory")
    tune.add_argument("--target", default="cpu",
                      help="`cpu` (this machine; tuning measures here), or with --rpc-tracker the devices' CPU: a "
                           "board preset (raspberry-pi-5, ...) or a TVM target JSON, as for compile")
    tune.add_argument("--quant", default=None, metavar="FORMAT", help="weight format, as for compile")
    tune.add_argument("--trials", type=int, default=64,
                      help="measured trials in all, shared by the kernels (default 64)")
    tune.add_argument("--budget", type=float, default=10.0, metavar="MINUTES",
                      help="stop starting trials after this many minutes (default 10)")
    tune.add_argument("--kernels", type=int, default=8,
                      help="tune at most this many of the hottest kernels (default 8)")
    tune.add_argument("--prefill-chunk", type=int, default=256, help="as for compile (default 256)")
    tune.add_argument("--max-batch", type=int, default=8,
                      help="as for compile (default 8): int8 decode kernels (q8f32/q4f32) are timed at one "
                           "sequence and at this many, and their records apply to compiles with the same "
                           "--max-batch")
    tune.add_argument("--float-activations", action="store_true",
                      help="as for compile: q8f32/q4f32 projections stay float kernels, which tuning can search")
    _add_graph_arguments(tune)
    _add_farm_arguments(tune)
    tune.set_defaults(run=_run_tune)

    bench = commands.add_parser(
        "bench", help="time an artifact's prefill and decode, here or on a device of an RPC tracker",
        description="Prefill a prompt and decode greedily a few times, on this machine or, with --rpc-tracker, on "
                    "a free device of --device-key (the artifact is uploaded there; the device runs `python -m "
                    "ember.runtime.rpc_device`). Reports tok/s, peak memory, the greedy tokens and decode's share "
                    "of the device's memory-bandwidth roofline.",
        epilog="example:\n  ember bench demo-cpu\n"
               "  python -m tvm.exec.rpc_tracker --host 127.0.0.1 --port 9190 &\n"
               "  python -m ember.runtime.rpc_device --tracker 127.0.0.1:9190 --key pi5 &   (on the device)\n"
               "  ember bench demo-pi5 --rpc-tracker 127.0.0.1:9190 --device-key pi5",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("artifact", type=Path)
    _add_farm_arguments(bench)
    bench.add_argument("--prompt-tokens", type=_positive_int, default=128, metavar="N",
                       help="prompt length (default %(default)s)")
    bench.add_argument("--new-tokens", type=_positive_int, default=128, metavar="N",
                       help="decode steps after the prompt (default %(default)s)")
    bench.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                       help="timed runs after a warm-up; the median is reported (default %(default)s)")
    bench.add_argument("--hardware", metavar="PRESET",
                       help="the device's hardware preset for the roofline (default: the artifact's board preset, "
                            "else this machine, measured, when the device has this machine's CPU)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_threads_argument(bench)
    bench.set_defaults(run=_run_bench)

    from ember.driver.analyze import cli as analyze_cli

    analyze = commands.add_parser("analyze", help="roofline analysis of a model on a hardware preset")
    analyze_cli.add_arguments(analyze)
    analyze.set_defaults(run=analyze_cli.run)

    eval_ = commands.add_parser(
        "eval", help="measure an artifact's quality on a text",
        description="Perplexity of an artifact on a text file, and optionally how far its next-token "
                    "distributions are from a reference artifact of the same model (mean KL, top-1 agreement).",
        epilog="example:\n  ember compile demo --quant q4f32 -o demo-q4 && ember compile demo -o demo-f32\n"
               "  ember eval demo-q4 --perplexity ember/demo_model/validation.txt --reference demo-f32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    eval_.add_argument("artifact", type=Path)
    eval_.add_argument("--perplexity", required=True, type=Path, metavar="TEXTFILE", help="UTF-8 text to score")
    eval_.add_argument("--reference", type=Path, metavar="ARTIFACT",
                       help="an artifact of the same model (e.g. q0f32) to compare logits with")
    eval_.add_argument("--window", type=_whole_number(2),
                       help="tokens per scoring window, <s> included (default: the artifact's context, at most 1024)")
    eval_.add_argument("--max-tokens", type=_positive_int, help="score only the first N tokens of the text")
    eval_.add_argument("--json", action="store_true", help="print the results as JSON")
    eval_.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_threads_argument(eval_)
    eval_.set_defaults(run=_run_eval)

    inspect = commands.add_parser("inspect", help="describe an artifact")
    inspect.add_argument("artifact", type=Path)
    inspect.add_argument("--json", action="store_true", help="print the raw manifest")
    inspect.set_defaults(run=_run_inspect)

    package = commands.add_parser(
        "package", help="gather an artifact and the runtime to copy to a device",
        description="Write DIR with the artifact (DIR/artifact), ember's runtime package (DIR/ember) and "
                    "requirements-runtime.txt: on the device, pip install -r DIR/requirements-runtime.txt and run "
                    "with PYTHONPATH=DIR TVM_USE_RUNTIME_LIB=1 (no compiler, torch or transformers needed).")
    package.add_argument("artifact", type=Path)
    package.add_argument("-o", "--output", required=True, type=Path, help="new directory to write")
    package.set_defaults(run=_run_package)

    for name, helptext in (("generate", "generate text from a prompt"), ("chat", "chat in the terminal")):
        sub = commands.add_parser(name, help=helptext)
        sub.add_argument("artifact", type=Path)
        if name == "generate":
            sub.add_argument("--prompt", required=True, type=_text, help="text to continue")
        else:
            sub.add_argument("--system", type=_text, help="system message, if the chat template accepts one")
        sub.add_argument("--max-new-tokens", type=_sampling_option("max_new_tokens", int), default=128, metavar="N",
                         help="most tokens to generate (default %(default)s; less if the context window fills)")
        sub.add_argument("--temperature", type=_sampling_option("temperature", float), default=0.7, metavar="T",
                         help="0 means greedy (default %(default)s)")
        sub.add_argument("--top-k", type=_sampling_option("top_k", int), default=0, metavar="K",
                         help="sample among the K likeliest tokens; 0 disables (default %(default)s)")
        sub.add_argument("--top-p", type=_sampling_option("top_p", float), default=0.95, metavar="P",
                         help="sample among the likeliest tokens whose probabilities sum to P (default %(default)s)")
        sub.add_argument("--repetition-penalty", type=_sampling_option("repetition_penalty", float), default=1.0,
                         metavar="R", help="above 1, tokens already seen become less likely (default %(default)s)")
        sub.add_argument("--seed", type=_sampling_option("seed", int), metavar="N",
                         help="random seed, -2**63 <= N < 2**63 (default: a fresh one each run)")
        sub.add_argument("--stop", action="append", default=[], type=_stop_string, metavar="TEXT",
                         help="stop string (repeatable)")
        _add_speculation_arguments(sub)
        _add_threads_argument(sub)
        sub.set_defaults(run=_run_generate if name == "generate" else _run_chat)
    serve = commands.add_parser(
        "serve", help="serve an artifact over an OpenAI-compatible HTTP API",
        description="Serve an artifact over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, "
                    "/health, /metrics), batching concurrent requests. Needs the serve extra: "
                    "pip install 'ember[serve]'.",
        epilog="example:\n  ember serve demo-cpu --port 8000\n"
               "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
               "    -d '{\"model\": \"demo-cpu\", \"prompt\": \"And the LORD said\", \"max_tokens\": 32}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("artifact", type=Path, help="artifact directory; its name is the model name clients send")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default %(default)s: this machine only; 0.0.0.0 for all)")
    serve.add_argument("--port", type=_whole_number(0), default=8000, help="TCP port (default %(default)s)")
    key = serve.add_mutually_exclusive_group()
    key.add_argument("--api-key", type=_text, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/ requests")
    key.add_argument("--api-key-file", type=Path, metavar="FILE",
                     help="as --api-key, the key read from the first line of FILE (not shown in `ps`)")
    serve.add_argument("--allow-origin", type=_web_origin, action="append", default=[], metavar="ORIGIN",
                       help="a web page's origin (scheme://host[:port], e.g. http://localhost:3000) whose scripts may "
                            "call the API from a browser (CORS); repeat for more, or * for any page the browser "
                            "opens, the internet's included, so pair it with --api-key. Default: none but the "
                            "server's own chat page at /")
    serve.add_argument("--max-queue", type=_positive_int, default=256, metavar="N",
                       help="requests that may wait for a free sequence; more are answered 429 (default %(default)s)")
    serve.add_argument("--max-decode-stall", type=_seconds, metavar="SECONDS",
                       help="how long reading an arriving prompt may hold back the running streams' next token: "
                            "prompts are read, while others stream, in chunks of what the engine prefills in that "
                            "time. Shorter keeps streams smoother, longer reads prompts in fewer chunks (each "
                            "streams every weight once more) and serves more tokens a second under load; 0: a KV "
                            "page at a time, inf: whole prompts (default 0.1)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="free each request's KV pages when it ends instead of reusing them for later prompts "
                            "that start the same way (outputs then never depend on other requests, not even "
                            "in the last float bits)")
    _add_speculation_arguments(serve, serving=True)
    _add_threads_argument(serve)
    serve.set_defaults(run=_run_serve)
    for sub in commands.choices.values():
        # Also after the command (`ember generate -v ...`); SUPPRESS keeps a -v given before it.
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log each stage; show tracebacks")
    return parser


def _add_farm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rpc-tracker", metavar="HOST:PORT",
                        help="a TVM RPC tracker (`python -m tvm.exec.rpc_tracker`): run on its devices of --device-key")
    parser.add_argument("--device-key", metavar="KEY", help="the kind of device to use, as registered with the tracker")
    parser.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                        help="with --rpc-tracker: how long to wait for a device of the key to register or be free "
                             "(default %(default)g)")


def _farm(args: argparse.Namespace):
    """The `Farm` of --rpc-tracker/--device-key, or None without a tracker."""
    if args.rpc_tracker is None:
        if args.device_key is not None:
            raise EmberError("--device-key needs --rpc-tracker HOST:PORT (the tracker the device registered with)")
        return None
    from ember.driver.farm import Farm

    return Farm.parse(args.rpc_tracker, args.device_key, args.wait)


def _run_bench(args: argparse.Namespace) -> int:
    from ember.driver.bench import bench, format_report
    from ember.runtime.bench import BenchOptions

    options = BenchOptions(args.prompt_tokens, args.new_tokens, args.repeats, args.threads)
    report = bench(args.artifact, options, _farm(args), args.hardware)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0


def _add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=_positive_int, metavar="N",
                        help="CPU artifacts: threads for the kernels (default: TVM_NUM_THREADS if set, "
                             "else one per physical core)")


def _add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """compile's and tune's options of where a model's graph comes from."""
    parser.add_argument("--frontend", default="builtin", choices=("builtin", "torch-export"),
                          help="how a checkpoint directory's graph is built: builtin (ember's own definition of "
                               "the llama/mistral/qwen2 family) or torch-export (transformers builds the model, "
                               "torch.export traces it, ember's passes find its attention; needs torch and "
                               "transformers at compile time)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                          help="an .onnx file's Hugging Face directory: its config.json (context length, token ids) "
                               "and tokenizer files (default: the directory the .onnx file is in)")


def _run_compile(args: argparse.Namespace) -> int:
    from ember.driver.artifact_dir import check_output_dir

    model_dir = _checkpoint_dir(args.model)
    check_output_dir(args.output)
    # The compiler takes seconds to import: only now that the paths are known good.
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.schedules.tuning import describe_schedule_sources

    options = CompileOptions(
        target=args.target,
        quantization=args.quant,
        keep_embedding=args.keep_embedding,
        keep_lm_head=args.keep_lm_head,
        frontend=args.frontend,
        tokenizer_dir=args.tokenizer,
        float_activations=args.float_activations,
        kv_quant=args.kv_quant,
        prefill_chunk=args.prefill_chunk,
        max_batch=args.max_batch,
        memory_budget=args.memory_budget,
        tuning_db=args.tuning_db,
        show_progress=not args.no_progress,
    )
    result = compile_model(model_dir, args.output, options)
    memory = result.memory
    print(f"compiled {model_dir} -> {result.output_dir} in {result.seconds:.1f} s")
    if args.tuning_db is not None:
        print(f"  {describe_schedule_sources(result.schedules)}")
    print(f"  weights {_mib(memory.weight_bytes)}, KV cache {memory.kv_bytes_per_token / 1024:.1f} KiB/token, "
          f"planned workspace {_mib(memory.peak_workspace_bytes)}")
    kv = result.manifest.kv_cache
    if kv["memory_budget"]:
        print(f"  in a memory budget of {_mib(kv['memory_budget'])}: KV cache of {kv['max_total_tokens']} tokens, "
              f"longest context {kv['max_context']} tokens")
    return 0


def _run_tune(args: argparse.Namespace) -> int:
    model = _checkpoint_dir(args.model)
    from ember.driver.tune import TuneOptions, tune_model

    options = TuneOptions(db=args.db, target=args.target, quantization=args.quant, trials=args.trials,
                          budget_minutes=args.budget, kernels=args.kernels, prefill_chunk=args.prefill_chunk,
                          max_batch=args.max_batch, float_activations=args.float_activations, farm=_farm(args),
                          frontend=args.frontend, tokenizer_dir=args.tokenizer)
    report = tune_model(model, options)
    print(f"tuned {len(report)} kernels into {args.db}")
    return 0


def _run_package(args: argparse.Namespace) -> int:
    from ember.driver.package import package_artifact

    print(f"packaged {args.artifact} -> {package_artifact(args.artifact, args.output)}")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from ember.core.manifest import read_manifest

    manifest = read_manifest(args.artifact)
    if args.json:
        print(json.dumps(manifest.to_json(), indent=2))
        return 0
    model, kv, memory = manifest.model, manifest.kv_cache, manifest.memory
    rows = [
        ("artifact", f"{args.artifact} (format {manifest.format_version}, ember {manifest.ember_version}, "
                     f"TVM {manifest.tvm_version})"),
        ("source", manifest.source),
        *_source_weight_rows(manifest.source_weights),
        ("model", f"{model['model_type']}: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
                  f"{model['num_attention_heads']} heads / {model['num_key_value_heads']} KV heads, "
                  f"ffn {model['intermediate_size']}, vocab {model['vocab_size']}"),
        ("context", f"window {model['context_window']}, artifact allows {kv['max_context']}"
                    + (f", sliding window {kv['sliding_window']}" if kv["sliding_window"] else "")),
        ("quantization", f"{manifest.quantization} ({FORMATS[manifest.quantization].bits_per_weight:g} bits/weight, "
                         f"{manifest.model_dtype} compute){_mixed_formats(manifest)}"),
        ("target", _describe_target(manifest.target)),
        ("entry functions", ", ".join(manifest.entry_functions)),
        ("KV cache", f"paged, {kv['page_size']} tokens/page, {kv['num_layers']} layers x {kv['num_kv_heads']} "
                     f"heads x {kv['head_dim']} ({_kv_storage(kv)}); prefill chunk {kv['prefill_chunk']}, "
                     f"max batch {kv['max_batch']}, {kv['max_total_tokens']} tokens in all"),
        ("memory", f"weights {_mib(memory['weight_bytes'])}, KV {memory['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
                   f"workspace {_mib(memory['peak_workspace_bytes'])}"),
        ("weights", f"{len(manifest.params)} tensors"),
        ("files", ", ".join(f"{name} ({entry['sha256'][:12]})" for name, entry in manifest.files.items())),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:>{width}}  {value}")
    return 0


def _mixed_formats(manifest) -> str:
    """For an artifact whose weights keep a GGUF file's mixed types: the formats they are stored in."""
    from ember.frontend.source import recorded_formats

    formats = sorted(set(recorded_formats(manifest.source_weights, manifest.model_dtype).values()))
    quantized = [name for name in formats if FORMATS[name].quantizes]
    return f"; per tensor as the file stores them: {', '.join(quantized)}" if len(quantized) > 1 else ""


def _source_weight_rows(record: dict) -> list[tuple[str, str]]:
    """`inspect` rows for where the graph and weights came from beyond the source path: an imported graph's
    importer; for a GGUF source its hash and what each group of its tensors became."""
    if record["format"] == "onnx":
        return [("graph", "the ONNX file's (weights from its initializers)"),
                ("config, tokenizer", str(record.get("config_dir")))]
    if record.get("frontend") == "torch-export":
        return [("graph", "traced by torch.export from transformers' code (--frontend torch-export)")]
    if record["format"] != "gguf":
        return []
    from ember.frontend.gguf import conversion_summary

    lines = conversion_summary(record.get("conversion", {}))
    return [("GGUF file", f"{record.get('file')} (sha256 {str(record.get('sha256'))[:12]})"),
            *(("GGUF weights" if i == 0 else "", line) for i, line in enumerate(lines))]


def _run_eval(args: argparse.Namespace) -> int:
    import itertools
    from dataclasses import asdict

    from tqdm import tqdm

    from ember.runtime import Engine, load_artifact
    from ember.runtime.evaluate import compare, iter_scoring_windows, perplexity, stream_token_ids

    text = _open_text(args.perplexity)
    artifact = load_artifact(args.artifact, threads=args.threads)
    if artifact.tokenizer is None:
        raise EmberError(f"{args.artifact}: the artifact has no tokenizer, so it cannot score text")
    engine = Engine(artifact)
    max_context = artifact.manifest.kv_cache["max_context"]
    window = args.window or min(max_context, 1024)
    if window > max_context:
        raise EmberError(f"--window {window}: {args.artifact} holds at most {max_context} tokens per sequence")
    # Read, tokenized and cut into windows as scoring goes: a long text never sits in memory whole.
    windows = iter_scoring_windows(stream_token_ids(artifact.tokenizer, text, args.max_tokens),
                                   artifact.tokenizer.bos_token_id, window)
    first = next(windows, None)
    if first is None:
        raise EmberError(f"--perplexity {args.perplexity}: the text has too few tokens to score (at least 2)")
    windows = itertools.chain([first], windows)

    def progress(desc: str):
        return tqdm(windows, desc=desc, unit="window", disable=args.no_progress)

    results = {"artifact": str(args.artifact), "quantization": artifact.manifest.quantization, "window": window}
    if args.reference:
        reference = load_artifact(args.reference, threads=args.threads)
        if reference.manifest.model != artifact.manifest.model:
            raise EmberError(f"--reference {args.reference} was compiled from a different model than {args.artifact}")
        comparison = compare(engine, Engine(reference), progress("Comparing"))
        results.update(asdict(comparison.candidate))
        results["reference"] = {"artifact": str(args.reference), "quantization": reference.manifest.quantization,
                                "perplexity": comparison.reference.perplexity, **asdict(comparison.divergence)}
    else:
        results.update(asdict(perplexity(engine, progress("Perplexity"))))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{args.artifact} ({results['quantization']}): perplexity {results['perplexity']:.3f} over "
          f"{results['tokens']} tokens ({results['windows']} windows of {window})")
    if args.reference:
        ref = results["reference"]
        print(f"{args.reference} ({ref['quantization']}): perplexity {ref['perplexity']:.3f}")
        print(f"divergence from the reference: mean KL {ref['mean_kl']:.5f} nats/token (max {ref['max_kl']:.4f}), "
              f"top-1 agreement {ref['top1_agreement']:.2%}")
    return 0


def _open_text(path: Path) -> TextIO:
    """`path` opened as UTF-8 text for --perplexity, refusing what is not a regular file
    (/dev/zero, a FIFO: endless or unbounded input)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise EmberError(f"--perplexity {path}: not a regular file")
        return path.open(encoding="utf-8")
    except OSError as err:
        raise EmberError(f"--perplexity {path}: cannot read it ({err.strerror or err})") from None


def _describe_target(target: dict) -> str:
    if target.get("name", "cpu") == "cpu":
        return json.dumps(target["tvm_target"])
    sized = f", sized for {target['hardware']} ({target['memory_bytes'] / 2**30:.0f} GiB)" if target.get("hardware") else ""
    return f"{target['name']} {target.get('arch', '')}".rstrip() + sized


def _sampling(args: argparse.Namespace):
    from ember.runtime import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens,
                          seed=args.seed, stop_strings=tuple(args.stop))


def _run_generate(args: argparse.Namespace) -> int:
    from ember.runtime import Engine, generate, load_artifact

    engine = Engine(load_artifact(args.artifact, threads=args.threads))
    speculation = _speculation(args, engine)
    generation = generate(engine, args.prompt, _sampling(args), speculation=speculation)
    print(args.prompt, end="", flush=True)
    for piece in generation:
        print(piece, end="", flush=True)
    print()
    stats = generation.stats
    print(f"\n[prefill {stats.prompt_tokens} tokens at {stats.prefill_tokens_per_s:.1f} tok/s, "
          f"decode {stats.new_tokens} tokens at {stats.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    if speculation is not None:
        _report_speculation(speculation)
    _report_context_full(generation, engine.context_window)
    return 0


def _add_speculation_arguments(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    guessing = parser.add_mutually_exclusive_group()
    when = " (when one request is decoding)" if serving else ""
    guessing.add_argument("--speculate", choices=["ngram"],
                          help="speculative decoding: guess the next tokens from earlier text (prompt lookup) and "
                               f"check them in one forward{when}; same output, faster where it copies its prompt")
    guessing.add_argument("--draft", type=Path, metavar="ARTIFACT",
                          help="speculative decoding with a smaller artifact (same tokenizer) guessing the next "
                               f"tokens{when}; same output")
    parser.add_argument("--guesses", type=int, metavar="K",
                        help="tokens guessed at the first step, then adapted to how many are accepted, 1 to 7 "
                             "(default 4; with --speculate or --draft)")


def _speculation(args: argparse.Namespace, engine):
    """The `Speculation` that --speculate/--draft ask for, or None."""
    from ember.runtime import load_artifact
    from ember.runtime.speculative import DEFAULT_GUESSES, MAX_GUESSES, DraftModel, PromptLookup, Speculation

    if args.speculate is None and args.draft is None:
        if args.guesses is not None:
            raise EmberError("--guesses: applies only with --speculate or --draft")
        return None
    guesses = DEFAULT_GUESSES if args.guesses is None else args.guesses
    if not 1 <= guesses <= MAX_GUESSES:
        raise EmberError(f"--guesses {guesses}: must be between 1 and {MAX_GUESSES}")
    if args.draft is None:
        return Speculation(PromptLookup(), guesses)
    from ember.runtime import Engine

    draft = Engine(load_artifact(args.draft, threads=args.threads))
    return Speculation(DraftModel(draft, engine), guesses)


def _report_speculation(speculation) -> None:
    stats = speculation.stats
    print(f"[speculation: {stats.accepted} of {stats.proposed} guessed tokens accepted "
          f"({100 * stats.acceptance_rate:.0f}%), {stats.mean_accepted:.2f} per verify step]", file=sys.stderr)


def _report_context_full(generation, context_window: int) -> None:
    """One line on stderr when the context window, not --max-new-tokens, ended `generation`."""
    if generation.stats.context_full:
        print(f"ember: the context window ({context_window} tokens) is full: stopped after "
              f"{generation.stats.new_tokens} of --max-new-tokens {generation.params.max_new_tokens}", file=sys.stderr)


def _run_chat(args: argparse.Namespace) -> int:
    from ember.runtime import Engine, load_artifact
    from ember.runtime.chat import ChatSession

    engine = Engine(load_artifact(args.artifact, threads=args.threads))
    session = ChatSession(engine, system=args.system, speculation=_speculation(args, engine))
    sampling = _sampling(args)
    # Bytes that are not UTF-8 arrive as surrogates, which `send` refuses, instead of ending input().
    sys.stdin.reconfigure(errors="surrogateescape")
    print("ember chat: type a message; /reset starts over, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            message = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if message.strip() == "/exit":
            return 0
        if message.strip() == "/reset":
            session.reset()
            print("ember: the conversation is forgotten; starting over", file=sys.stderr)
            continue
        start = time.perf_counter()
        try:
            reply = session.send(message, sampling)
        except EmberError as err:  # the message was not added: the conversation goes on
            print(f"ember: {_one_line(str(err))}", file=sys.stderr)
            continue
        if session.dropped_turns:
            print(f"ember: the conversation outgrew the context window ({engine.context_window} tokens): "
                  f"dropped its {session.dropped_turns} earliest turns", file=sys.stderr)
        for piece in reply:
            print(piece, end="", flush=True)
        print(f"\n[{reply.stats.new_tokens} tokens, {time.perf_counter() - start:.1f} s, "
              f"{reply.stats.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
        _report_context_full(reply, engine.context_window)


def _run_serve(args: argparse.Namespace) -> int:
    api_key = args.api_key
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text(encoding="utf-8").partition("\n")[0].strip()
        except (OSError, UnicodeDecodeError) as err:
            raise EmberError(f"--api-key-file {args.api_key_file}: cannot read it: "
                             f"{getattr(err, 'strerror', None) or err}") from None
    if api_key is not None and not api_key.strip():
        raise EmberError("--api-key/--api-key-file: the key is empty")
    from ember.runtime import Engine, load_artifact
    from ember.runtime.scheduler import Scheduler
    from ember.runtime.server import Server  # FastAPI is checked for before the artifact is loaded

    engine = Engine(load_artifact(args.artifact, threads=args.threads))
    stall = {} if args.max_decode_stall is None else {"max_decode_stall": args.max_decode_stall}
    with Scheduler(engine, max_queue=args.max_queue, prefix_cache=not args.no_prefix_cache,
                   speculation=_speculation(args, engine), **stall) as scheduler:
        server = Server(scheduler, args.artifact.resolve().name, args.host, args.port, api_key,
                        allowed_origins=args.allow_origin)
        print(f"ember: serving {server.model_name} at {server.url}, chat page at {server.page_url} (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        for warning in _exposure_warnings(args.host, api_key, args.allow_origin):
            print(f"ember: warning: {warning}", file=sys.stderr, flush=True)
        server.run()
    return 0


def _exposure_warnings(host: str, api_key: str | None, origins: list[str]) -> list[str]:
    """What a server without an API key lets strangers do, by its --host and --allow-origin."""
    if api_key is not None:
        return []
    warnings = []
    address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]  # the address Server bound
    if not ipaddress.ip_address(address).is_loopback:
        warnings.append(f"--host {host} without --api-key: anyone who can reach this machine can use the model")
    if "*" in origins:
        warnings.append("--allow-origin '*' without --api-key: any web page opened on this machine can use the model")
    return warnings


def _checkpoint_dir(argument: str) -> Path:
    """MODEL as given to compile or tune: `demo`, a checkpoint directory, a GGUF or an ONNX file; a hub id is told
    what to do."""
    from ember.frontend.files import is_onnx_file
    from ember.frontend.gguf import check_gguf_header, is_gguf_file

    if argument in ("demo", "demo-draft"):
        return DEMO_MODEL_DIR if argument == "demo" else DEMO_DRAFT_DIR
    path = Path(argument)
    if path.is_dir():
        return path
    if is_gguf_file(path):
        check_gguf_header(path)
        return path
    if is_onnx_file(path):
        return path
    if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", argument):
        local = argument.rsplit("/", 1)[1]
        raise EmberError(f"{argument}: no such directory; ember compiles a checkpoint on disk and never downloads: "
                         f"`hf download {argument} --local-dir {local}` (huggingface_hub's CLI; "
                         f"`huggingface-cli download` in older versions), then `ember compile {local} ...`")
    if not path.exists():
        raise EmberError(f"{argument}: no such directory (expected a Hugging Face checkpoint directory, a GGUF "
                         "or ONNX file, or `demo`)")
    raise EmberError(f"{argument}: not a directory, a GGUF or an ONNX file (expected a Hugging Face checkpoint "
                     "directory, a .gguf or an .onnx file)")


def _parse_bytes(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if match and match.group(2).upper() in units:
        try:
            return int(float(match.group(1)) * units[match.group(2).upper()])
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MB, 4GB, 2GiB)")


def _whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum`."""
    expected = "a positive whole number" if minimum == 1 else f"a whole number >= {minimum}"

    def convert(text: str) -> int:
        if text.strip().isdigit() and int(text) >= minimum:
            return int(text)
        raise argparse.ArgumentTypeError(f"not {expected}: {text!r}")

    return convert


_positive_int = _whole_number(1)


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0, `inf` included."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds >= 0: {text!r}")
    return value


def _sampling_option(field: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `parse` the text, then check it as `SamplingParams` checks `field`."""
    def convert(text: str) -> Any:
        from ember.runtime import SamplingParams

        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'a whole number' if parse is int else 'a number'}: {text!r}") \
                from None
        try:
            SamplingParams(**{field: value})
        except EmberError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    return convert


def _web_origin(text: str) -> str:
    """An argparse type: `*` or a web origin, scheme://host[:port] (what a browser sends as `Origin`)."""
    if text == "*" or re.fullmatch(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?", text):
        return text
    raise argparse.ArgumentTypeError(
        f"not a web origin (scheme://host[:port], no path or trailing slash) or *: {text!r}")


def _text(text: str) -> str:
    """An argparse type: text that was valid UTF-8 on the command line."""
    from ember.runtime.tokenizer import check_text

    try:
        check_text(text, "the text")
    except EmberError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return text


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("an empty stop string would end every generation at once")
    return _text(text)


def _version() -> str:
    """`ember X.Y.Z (TVM A.B.C)`, read from the installed packages' metadata (importing TVM takes seconds)."""
    from importlib import metadata

    from ember import __version__

    for name in ("apache-tvm", "tvm"):
        try:
            return f"ember {__version__} (TVM {metadata.version(name)})"
        except metadata.PackageNotFoundError:
            continue
    return f"ember {__version__} (TVM: not installed as a package)"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _kv_storage(kv: dict) -> str:
    """How an artifact's KV cache stores keys and values, for `inspect`."""
    stored = {"q8": "as int8 rows, a float32 scale per token and head", "f16": "as float16 rows"}
    return f"{kv['dtype']} {stored[kv['quantization']]}" if kv["quantization"] else kv["dtype"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
