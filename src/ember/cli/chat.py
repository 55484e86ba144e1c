"""`ember chat`: a conversation in the terminal, the model's chat template applied to each turn."""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

from ember.cli.options import (
    add_sampling_arguments,
    add_speculation_arguments,
    add_threads_argument,
    one_line,
    plural,
    report_context_full,
    sampling,
    speculation,
    text,
)
from ember.core.errors import EmberError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember chat` and its options."""
    parser = subparsers.add_parser(
        "chat", help="chat in the terminal",
        description="Chat with an artifact: each line read from stdin is a message, the model's chat template "
                    "turns the conversation into its prompt, and the reply streams to stdout. The conversation "
                    "stays in the KV cache between turns; when it outgrows the context window its earliest turns "
                    "are dropped. Type /reset to forget the conversation and start over, /exit (or Ctrl-D) to quit.",
        epilog="examples:\n"
               "  ember chat demo-cpu\n"
               '  ember chat demo-cpu --system "Answer in one sentence." --temperature 0\n'
               "  printf 'hello\\n/reset\\nhi again\\n' | ember chat demo-cpu   messages from a pipe\n"
               "  ember chat demo-cpu --draft draft-cpu   a smaller artifact guesses tokens",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="artifact directory written by `ember compile`")
    parser.add_argument("--system", type=text, help="system message, if the chat template accepts one")
    add_sampling_arguments(parser)
    add_speculation_arguments(parser)
    add_threads_argument(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Read messages from stdin until /exit or end of input; stream each reply to stdout."""
    from ember.runtime import Engine, load_artifact
    from ember.runtime.chat import ChatSession

    engine = Engine(load_artifact(args.artifact, threads=args.threads))
    session = ChatSession(engine, system=args.system, speculation=speculation(args, engine))
    params = sampling(args)
    # Bytes that are not UTF-8 arrive as surrogates, which `send` refuses, instead of ending input().
    if isinstance(sys.stdin, io.TextIOWrapper):  # as it is, unless something replaced it
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
        _reply(session, message, params)


def _reply(session, message: str, params) -> None:
    """Send `message` and stream the reply; a refused message is one line and the conversation goes on."""
    engine = session.engine
    start = time.perf_counter()
    try:
        reply = session.send(message, params)
    except EmberError as err:  # the message was not added: the conversation goes on
        print(f"ember: {one_line(str(err))}", file=sys.stderr)
        return
    if session.dropped_turns:
        dropped = "earliest turn" if session.dropped_turns == 1 else f"{session.dropped_turns} earliest turns"
        print(f"ember: the conversation outgrew the context window ({engine.context_window} tokens): "
              f"dropped its {dropped}", file=sys.stderr)
    last = ""
    for piece in reply:
        print(piece, end="", flush=True)
        last = piece
    if not last.endswith("\n"):  # the next `> ` prompt starts a line of its own, on a terminal or in a pipe
        print(flush=True)
    stats = reply.stats
    rate = f", {stats.decode_tokens_per_s:.1f} tok/s" if stats.new_tokens > 1 and stats.decode_seconds > 0 else ""
    print(f"[{plural(stats.new_tokens, 'token')}, {time.perf_counter() - start:.1f} s{rate}]", file=sys.stderr)
    report_context_full(reply, engine.context_window)
