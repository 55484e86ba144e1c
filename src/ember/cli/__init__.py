"""The `ember` command line: a thin shell over ember's Python API.

One module per subcommand (`ember.cli.compile`, ...), each with `add_parser(subparsers)` and
`run(args) -> int`; what several share is in `ember.cli.options`. Every user error is an
`EmberError`, caught here once and printed as one line without a traceback (`--verbose` shows
it). Exit codes: 0 success, 1 an error in the input or the request, 2 bad command-line usage,
70 an internal error (a bug: one line asking for a report), 130 interrupted, 141 stdout closed
by its reader.
"""

from __future__ import annotations

import _thread
import argparse
import difflib
import logging
import os
import signal
import sys
import threading
from types import ModuleType

from ember.cli import analyze, bench, chat, generate, inspect, package, serve, tune
from ember.cli import compile as compile_command
from ember.cli import eval as eval_command
from ember.cli.options import EXAMPLES, one_line
from ember.core.errors import EmberError
from ember.core.tvm_runtime_only import import_tvm_runtime_only
from ember.core.without_torch import hide_torch_from_tvm

# In the order `ember --help` lists them.
COMMANDS: dict[str, ModuleType] = {
    "compile": compile_command,
    "tune": tune,
    "bench": bench,
    "analyze": analyze,
    "eval": eval_command,
    "inspect": inspect,
    "package": package,
    "generate": generate,
    "chat": chat,
    "serve": serve,
}
# The commands that only run artifacts, here or on a device farm's devices through TVM's RPC (bench): they import
# TVM without its compiler (`ember.core.tvm_runtime_only`).
RUNTIME_COMMANDS = frozenset({"generate", "chat", "eval", "serve", "bench"})


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ember` console script and `python -m ember`: run one command.

    With `argv` None the arguments are this process's own, and the process is the `ember` program: for
    `RUNTIME_COMMANDS` it imports TVM without its compiler. A Python program that calls `main` with arguments,
    one command after another, gets the whole of TVM for each."""
    # First of all: Ctrl-C while options are checked (which imports TVM for a second or so) is one line too.
    interrupted = []

    def on_sigint(_signum, _frame):
        interrupted.append(True)
        raise KeyboardInterrupt

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    previous_unraisable_hook = sys.unraisablehook
    resends: list[threading.Timer] = []

    def on_unraisable(unraisable) -> None:
        # A Ctrl-C whose KeyboardInterrupt is raised where Python ignores exceptions (a weakref callback, a
        # `__del__`, as in the import machinery) would be lost and the command run on: it is sent again, to land in
        # the command's own code. From another thread, a moment later: a signal raised now would run its handler
        # in this hook, where Python ignores exceptions too.
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            resend = threading.Timer(0.05, _thread.interrupt_main)
            resend.daemon = True
            resends.append(resend)
            resend.start()
            return
        previous_unraisable_hook(unraisable)

    sys.unraisablehook = on_unraisable
    try:
        hide_torch_from_tvm()  # before anything imports TVM: compile does directly, option checks through the runtime
        if argv is None and _runs_artifacts_only(sys.argv[1:]):
            import_tvm_runtime_only()
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
        return _run(args, interrupted)
    except KeyboardInterrupt:
        print("ember: interrupted", file=sys.stderr)
        return 130
    finally:
        for resend in resends:  # a command that ended meanwhile is not interrupted after it
            resend.cancel()
        signal.signal(signal.SIGINT, previous_handler)
        sys.unraisablehook = previous_unraisable_hook


def _runs_artifacts_only(argv: list[str]) -> bool:
    """Whether `argv` runs one of `RUNTIME_COMMANDS` (its first word not an option: the global options take no
    values), and not for its help, which imports no TVM."""
    command = next((word for word in argv if not word.startswith("-")), None)
    return command in RUNTIME_COMMANDS and not {"-h", "--help"} & set(argv)


def _run(args: argparse.Namespace, interrupted: list[bool]) -> int:
    """Run the command; its errors become one line and an exit code."""
    try:
        return COMMANDS[args.command].run(args)
    except EmberError as err:
        print(f"ember: error: {one_line(str(err))}", file=sys.stderr)
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
                  f"needed{': ' + one_line(str(err)) if str(err) else ''}", file=sys.stderr)
            return 1
        print(f"ember: internal error: {type(err).__name__}: {one_line(str(err))} (rerun with --verbose for the "
              "traceback, and please report it)", file=sys.stderr)
        return 70


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subparsers are of its class), whose error for a mistyped option names the option
    nearest to it: `--promt` -> "did you mean --prompt?"."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        given = getattr(self, "_given", [])
        known = self._options(given)
        for token in given:
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in known:
                nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
                if nearest:
                    message = f"{message} ({name}: did you mean {nearest[0]}?)"
                    break
        super().error(message)

    def _options(self, given: list[str]) -> list[str]:
        """The options of this parser and of the command `given` names (the top parser reports the arguments no
        parser took)."""
        options: list[str] = []
        for action in self._actions:
            options += action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                command = next((token for token in given if token in action.choices), None)
                if command is not None:
                    options += [option for sub in action.choices[command]._actions for option in sub.option_strings]
        return options


def build_parser() -> argparse.ArgumentParser:
    """`ember`'s parser: the global options, and each command's subparser."""
    parser = _Parser(
        prog="ember",
        description="Compile large language models for the hardware you own, and run them.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each stage; show tracebacks")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        sub = command.add_parser(subparsers)
        # Also after the command (`ember generate -v ...`); SUPPRESS keeps a -v given before it.
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log each stage; show tracebacks")
    return parser


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
