"""What several `ember` commands share: argument types that check a value as argparse reads it, groups of
options (threads, RPC farm, graph source, sampling, speculation) and the objects built from them."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ember.core.errors import EmberError

EXAMPLES = """\
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
  ember eval demo-q4 --perplexity src/ember/demo_model/validation.txt --reference demo-cpu
  ember tune demo --db tuning-db && ember compile demo -o demo-tuned --tuning-db tuning-db
  ember generate demo-cpu --speculate ngram --prompt "..."   guess tokens from the prompt, check them at once
  ember compile demo-draft -o draft-cpu && ember chat demo-cpu --draft draft-cpu   a small model guesses

MODEL is a Hugging Face checkpoint directory (config.json, model.safetensors or a
sharded index, tokenizer.json) of a llama, mistral or qwen2 model, built from ember's
own definition or, with --frontend torch-export, traced by torch.export from
transformers' code; a GGUF file; an ONNX file of a decoder's full-sequence forward
(as torch.onnx.export writes it, with --tokenizer for its config and tokenizer); `demo`;
or `demo-draft` (the demo's 2-layer draft for speculative decoding).
"""


def one_line(text: str) -> str:
    """`text` with every run of whitespace, newlines included, made one space."""
    return " ".join(text.split())


def plural(count: int, noun: str) -> str:
    """`1 token`, `2 tokens`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def mib(n: int) -> str:
    """Bytes in MiB, one decimal."""
    return f"{n / 2**20:.1f} MiB"


# --- argument types


def parse_bytes(text: str) -> int:
    """An argparse type: a size of at least one byte, e.g. 512MB, 4GB, 2GiB."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if match and match.group(2).upper() in units:
        try:
            size = int(float(match.group(1)) * units[match.group(2).upper()])
        except ValueError:
            size = None
        if size is not None:
            if size < 1:
                raise argparse.ArgumentTypeError(f"{text!r} is less than one byte; leave the option out for none")
            return size
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MB, 4GB, 2GiB)")


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum`."""
    expected = "a positive whole number" if minimum == 1 else f"a whole number >= {minimum}"

    def convert(text: str) -> int:
        if text.strip().isdigit() and int(text) >= minimum:
            return int(text)
        raise argparse.ArgumentTypeError(f"not {expected}: {text!r}")

    return convert


positive_int = whole_number(1)


def seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0, `inf` included."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds >= 0: {text!r}")
    return value


def sampling_option(field: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
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


def web_origin(text: str) -> str:
    """An argparse type: `*` or a web origin, scheme://host[:port] (what a browser sends as `Origin`)."""
    if text == "*" or re.fullmatch(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?", text):
        return text
    raise argparse.ArgumentTypeError(
        f"not a web origin (scheme://host[:port], no path or trailing slash) or *: {text!r}")


def text(value: str) -> str:
    """An argparse type: text that was valid UTF-8 on the command line."""
    from ember.runtime.tokenizer import check_text

    try:
        check_text(value, "the text")
    except EmberError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value


def name_list(value: str) -> list[str]:
    """A comma-separated list of names (`--lora-targets q_proj,v_proj`), none empty."""
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated list of names, none empty")
    return names


def lora_adapter(value: str) -> tuple[str, Path]:
    """`NAME=PATH`: a LoRA adapter's directory and the model name requests pick it by (`ember serve --lora`)."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: give NAME=PATH, a model name for the adapter and its PEFT "
                                         "directory")
    return name.strip(), Path(path)


def stop_string(value: str) -> str:
    """An argparse type: a non-empty stop string of valid UTF-8."""
    if not value:
        raise argparse.ArgumentTypeError("an empty stop string would end every generation at once")
    return text(value)


def checkpoint_dir(argument: str) -> Path:
    """MODEL as given to compile or tune: `demo`, a checkpoint directory, a GGUF or an ONNX file; a hub id is told
    what to do."""
    from ember.core.files import is_onnx_file
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


# --- groups of options


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """--threads, for the commands that run an artifact."""
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="CPU artifacts: threads for the kernels (default: TVM_NUM_THREADS if set, "
                             "else one per physical core)")


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """compile's and tune's options of where a model's graph comes from."""
    parser.add_argument("--frontend", default="builtin", choices=("builtin", "torch-export"),
                        help="how a checkpoint directory's graph is built: builtin (ember's own llama/mistral/qwen2 "
                             "definition, the default) or torch-export (torch.export traces transformers' model; "
                             "needs torch and transformers)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="an .onnx file's Hugging Face directory: its config.json (context length, token ids) "
                             "and tokenizer files (default: the directory the .onnx file is in)")


def add_farm_arguments(parser: argparse.ArgumentParser) -> None:
    """--rpc-tracker, --device-key and --wait: run on the devices of a TVM RPC tracker."""
    parser.add_argument("--rpc-tracker", metavar="HOST:PORT",
                        help="a TVM RPC tracker (`python -m tvm.exec.rpc_tracker`): run on its devices of --device-key")
    parser.add_argument("--device-key", metavar="KEY", help="the kind of device to use, as registered with the tracker")
    parser.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                        help="with --rpc-tracker: how long to wait for a device of the key to register or be free "
                             "(default %(default)g)")


def farm(args: argparse.Namespace):
    """The `Farm` of --rpc-tracker/--device-key, or None without a tracker."""
    if args.rpc_tracker is None:
        if args.device_key is not None:
            raise EmberError("--device-key needs --rpc-tracker HOST:PORT (the tracker the device registered with)")
        return None
    from ember.driver.farm import Farm

    return Farm.parse(args.rpc_tracker, args.device_key, args.wait)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """generate's and chat's sampling options, each checked as `SamplingParams` checks it."""
    parser.add_argument("--max-new-tokens", type=sampling_option("max_new_tokens", int), default=128, metavar="N",
                        help="most tokens to generate (default %(default)s; less if the context window fills)")
    parser.add_argument("--temperature", type=sampling_option("temperature", float), default=0.7, metavar="T",
                        help="0 means greedy (default %(default)s)")
    parser.add_argument("--top-k", type=sampling_option("top_k", int), default=0, metavar="K",
                        help="sample among the K likeliest tokens; 0 disables (default %(default)s)")
    parser.add_argument("--top-p", type=sampling_option("top_p", float), default=0.95, metavar="P",
                        help="sample among the likeliest tokens whose probabilities sum to P (default %(default)s)")
    parser.add_argument("--repetition-penalty", type=sampling_option("repetition_penalty", float), default=1.0,
                        metavar="R", help="above 1, tokens already seen become less likely (default %(default)s)")
    parser.add_argument("--seed", type=sampling_option("seed", int), metavar="N",
                        help="random seed, -2**63 <= N < 2**63 (default: a fresh one each run)")
    parser.add_argument("--stop", action="append", default=[], type=stop_string, metavar="TEXT",
                        help="stop string (repeatable)")


def sampling(args: argparse.Namespace):
    """The `SamplingParams` of generate's and chat's options."""
    from ember.runtime import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens,
                          seed=args.seed, stop_strings=tuple(args.stop))


def add_speculation_arguments(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    """--speculate / --draft and --guesses."""
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


def speculation(args: argparse.Namespace, engine):
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


def report_speculation(speculation) -> None:
    """One stderr line on how many guessed tokens were accepted."""
    stats = speculation.stats
    print(f"[speculation: {stats.accepted} of {stats.proposed} guessed tokens accepted "
          f"({100 * stats.acceptance_rate:.0f}%), {stats.mean_accepted:.2f} per verify step]", file=sys.stderr)


def report_context_full(generation, context_window: int) -> None:
    """One line on stderr when the context window, not --max-new-tokens, ended `generation`."""
    if generation.stats.context_full:
        print(f"ember: the context window ({context_window} tokens) is full: stopped after "
              f"{generation.stats.new_tokens} of --max-new-tokens {generation.params.max_new_tokens}", file=sys.stderr)
