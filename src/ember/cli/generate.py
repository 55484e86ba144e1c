"""`ember generate`: continue a prompt, streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ember.cli.options import (
    add_sampling_arguments,
    add_speculation_arguments,
    add_threads_argument,
    plural,
    report_context_full,
    report_speculation,
    sampling,
    speculation,
    text,
)
from ember.core.errors import EmberError


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
    if len(generation.prompt_ids) > engine.context_window:  # refused before anything is printed
        raise EmberError(f"--prompt: the prompt has {len(generation.prompt_ids)} tokens and {args.artifact}'s "
                         f"context window is {engine.context_window}; shorten the prompt")
    print(args.prompt, end="", flush=True)
    for piece in generation:
        print(piece, end="", flush=True)
    print()
    print(f"\n[{speeds(generation.stats)}]", file=sys.stderr)
    if guesses is not None:
        report_speculation(guesses)
    report_context_full(generation, engine.context_window)
    return 0


def speeds(stats) -> str:
    """`prefill N tokens at X tok/s, decode M tokens at Y tok/s`; no decode speed without a decode step."""
    decoded = plural(stats.new_tokens, "token")
    if stats.new_tokens > 1 and stats.decode_seconds > 0:
        decoded += f" at {stats.decode_tokens_per_s:.1f} tok/s"
    return f"prefill {plural(stats.prompt_tokens, 'token')} at {stats.prefill_tokens_per_s:.1f} tok/s, decode {decoded}"
