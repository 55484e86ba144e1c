"""The hostile-input corpus's worker: runs requests in one long-lived process, so that TVM's start-up
is paid once, while a crash or a hang still takes down only this process (`hostile.Worker` restarts it).

Requests and replies are one JSON line each, on stdin and stdout:

    {"argv": [...], "stdin": "..."}        `ember ARGV` through `ember.cli.main`, stdin given as text
                                           (surrogate escapes stand for bytes that are not UTF-8)
    {"call": "module:attr.attr", "args": [...]}   a parser of ember's called directly
    -> {"code": exit code, "stdout": ..., "stderr": ...}

A call's code is 0 when it returns, 1 when it raises one of ember's errors (the message is its
stderr), and "traceback" for any other exception (the traceback is its stderr).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import traceback


def _run_cli(argv: list[str], stdin: str) -> tuple[object, str, str]:
    from ember.cli import main

    out, err = io.StringIO(), io.StringIO()
    terminal = io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8", "surrogateescape")), encoding="utf-8",
                                errors="surrogateescape")
    saved_stdin, sys.stdin = sys.stdin, terminal
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
            except BaseException:  # noqa: BLE001 - main let it through: that is a traceback for the user
                code = "traceback"
                err.write(traceback.format_exc())
    finally:
        sys.stdin = saved_stdin
    return code, out.getvalue(), err.getvalue()


def _call(target: str, args: list) -> tuple[object, str, str]:
    from ember.core.errors import EmberError

    module_name, _, attrs = target.partition(":")
    function = importlib.import_module(module_name)
    for attr in attrs.split("."):
        function = getattr(function, attr)
    try:
        result = function(*args)
    except EmberError as err:
        return 1, "", f"ember: error: {err}\n"
    except BaseException:  # noqa: BLE001
        return "traceback", "", traceback.format_exc()
    return 0, repr(result)[:2000], ""


def main() -> None:
    replies = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        if "argv" in request:
            code, out, err = _run_cli(request["argv"], request.get("stdin", ""))
        else:
            code, out, err = _call(request["call"], request.get("args", []))
        replies.write(json.dumps({"code": code, "stdout": out[-20000:], "stderr": err[-20000:]}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
