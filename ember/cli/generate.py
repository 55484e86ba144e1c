"""`ember generate`: continue a prompt, streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ember.cli.options import (
    add_sampling_arguments,
    add_speculation_arguments,
    add_threads_argument,
    report_context_full,
    report_speculation,
    sampling,
    speculation,
    text,
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember generate` and its options."""
    parser = subparsers.add_parser(
        "generate", help="generate text from a prompt",
        description="Continue --prompt with an artifact: the prompt and its continuation are printed to stdout as "
                    "they are decoded, then the prefill and decode speeds to stderr. Generation stops at a stop "
                    "token or string, at --max-new-tokens, or when the context window is full.",
        epilog="examples:\n"
               '  ember generate demo-cpu --prompt "And the LORD said"\n'
               '  ember generate demo-cpu --prompt "In the beginning" --temperature 0 --max-new-tokens 64   greedy\n'
               '  ember generate demo-cpu --prompt "And God said" --seed 1 --stop "."   the same text each run\n'
               '  ember generate demo-cpu --prompt "..." --speculate ngram   faster where it copies the prompt',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="artifact directory written by `ember compile`")
    parser.add_argument("--prompt", required=True, type=text, help="text to continue")
    add_sampling_arguments(parser)
    add_speculation_arguments(parser)
    add_threads_argument(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation; speeds on stderr."""
    from ember.runtime import Engine, generate, load_artifact

    engine = Engine(load_artifact(args.artifact, threads=args.threads))
    guesses = speculation(args, engine)
    generation = generate(engine, args.prompt, sampling(args), speculation=guesses)
    print(args.prompt, end="", flush=True)
    for piece in generation:
        print(piece, end="", flush=True)
    print()
    stats = generation.stats
    print(f"\n[prefill {stats.prompt_tokens} tokens at {stats.prefill_tokens_per_s:.1f} tok/s, "
          f"decode {stats.new_tokens} tokens at {stats.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    if guesses is not None:
        report_speculation(guesses)
    report_context_full(generation, engine.context_window)
    return 0
