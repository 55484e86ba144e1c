"""Machinery of the hostile-input corpus (`test_hostile_corpus.py`): how a case ended, the tally
printed at the end of the run, and the worker process that runs cases.

Every case ends in exactly one outcome:

    refused    a non-zero exit with one `ember: error:` line (argparse's usage line allowed, exit 2)
    accepted   exit 0, and the case's own check of the result passed
    traceback  a Python traceback, or ember's "internal error" line
    crash      the process died (abort, segfault, killed for memory)
    hang       no answer within the case's bound
    messy      any other failure: several lines, a wrong exit code, a wrong result
    leftover   the case left files behind, or changed its inputs
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helpers import tree_snapshot
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

from ember.core.errors import EmberError

GOOD = ("refused", "accepted")
HANG_SECONDS = 30.0
WORKER_SCRIPT = Path(__file__).with_name("hostile_worker.py")
_ERROR_LINE = re.compile(r"^ember(?: [\w-]+)?: error: ")


class Tally:
    """Outcomes per parser, over the whole run."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def record(self, parser: str, outcome: str) -> None:
        self.counts[parser, outcome] += 1

    def report(self) -> list[str]:
        """Lines for the end of the test run: per parser, then the totals."""
        parsers = sorted({parser for parser, _ in self.counts})
        outcomes = ("refused", "accepted", "traceback", "crash", "hang", "messy", "leftover")
        lines = []
        for parser in parsers:
            counts = {outcome: self.counts[parser, outcome] for outcome in outcomes}
            lines.append(f"  {parser:<22} {sum(counts.values()):>4} cases: "
                         + ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n))
        total = Counter()
        for (_, outcome), n in self.counts.items():
            total[outcome] += n
        lines.append(f"  {'all':<22} {sum(total.values()):>4} cases: "
                     + ", ".join(f"{total[outcome]} {outcome}" for outcome in outcomes))
        return lines


TALLY = Tally()

SETTINGS = dict(deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=list(HealthCheck))

# JSON values of every type, small enough to write thousands of.
JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2**31, 2**63]),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6),
                        st.sampled_from(["false", "true", "2", "16", "4k", "big", "tiny", "</s>", "linear", ""]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
# Option values at their edges, as a user might type them.
NUMBERS = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "2", "3", "0.5", "1e309", "1e-320", "256",
                           "99999999999999999999", "two", "", " 1", "0x10", "1_000", "-0", "1.0", "1e3"])
TEXTS = st.sampled_from(["hello", "", " ", "\udcff\udcfe", "a\x00b", "x" * 5000, "\n\n", "日本語", "</s>",
                         "{{ 7 * 7 }}", "\udce9t\udce9"])


def outcome(parser: str, result: Result, check: Callable[[], None] | None = None) -> None:
    """Record how the case ended (running its check of an accepted result) and fail unless it ended well."""
    ended = result.outcome
    if ended == "accepted" and check is not None:
        try:
            check()
        except AssertionError as err:
            TALLY.record(parser, "messy")
            raise AssertionError(f"{parser}: accepted with a wrong result: {err}") from None
    TALLY.record(parser, ended)
    assert ended in ("refused", "accepted"), f"{parser}: {ended} (exit {result.code}):\n{result.stderr[-3000:]}"


def in_process(function: Callable[[], object]) -> tuple[Result, object]:
    """Run a parser here: an ember error is a refusal, anything else a traceback; bounded in time
    (a thread that outlives the bound is reported as a hang)."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = function()
            box["result"] = Result(0, "", "")
        except EmberError as err:
            message = str(err)
            box["result"] = Result(1, "", f"ember: error: {message}\n" if "\n" not in message else message)
        except BaseException as err:  # noqa: BLE001 - exactly what the corpus hunts
            box["result"] = Result("traceback", "", f"Traceback (most recent call last): {type(err).__name__}: {err}")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_SECONDS)
    return box.get("result", Result("hang", "", "no answer")), box.get("value")


def unchanged(before: dict, root: Path, parser: str) -> None:
    """The case's inputs are as they were and nothing was added (else a `leftover`)."""
    if tree_snapshot(root) != before:
        TALLY.record(parser, "leftover")
        raise AssertionError(f"{parser}: the case changed or left files under {root}")


@dataclass
class Result:
    """What one case printed, and how it ended."""

    code: object  # the exit code, "traceback", "crash" or "hang"
    stdout: str
    stderr: str

    @property
    def outcome(self) -> str:
        if self.code in ("crash", "hang", "traceback"):
            return str(self.code)
        if "Traceback (most recent call last)" in self.stderr or "ember: internal error" in self.stderr:
            return "traceback"
        if self.code == 0:
            return "accepted"
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if _ERROR_LINE.match(line)]
        if self.code == 2:  # argparse: usage lines, then the one error line
            return "refused" if len(errors) == 1 and lines[-1] == errors[0] else "messy"
        return "refused" if self.code == 1 and lines == errors and len(errors) == 1 else "messy"


class Worker:
    """A `hostile_worker.py` process, restarted after a crash or a hang."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self.restarts = 0

    def run(self, argv: list[str], stdin: str = "", timeout: float = HANG_SECONDS) -> Result:
        """`ember ARGV` (stdin as text; surrogate escapes for bytes that are not UTF-8)."""
        return self._request({"argv": argv, "stdin": stdin}, timeout)

    def call(self, target: str, *args: object, timeout: float = HANG_SECONDS) -> Result:
        """`module:attr`(*args) in the worker: code 0 returned, 1 an ember error, else a traceback."""
        return self._request({"call": target, "args": list(args)}, timeout)

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def _request(self, request: dict, timeout: float) -> Result:
        process = self._started()
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = self._read_line(process, timeout)
        if line is None:
            code = "hang" if process.poll() is None else "crash"
            self.close()
            self.restarts += 1
            return Result(code, "", f"worker {code} (exit {process.returncode})")
        reply = json.loads(line)
        return Result(reply["code"], reply["stdout"], reply["stderr"])

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
            self._process = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, env=env, cwd=Path(__file__).parent.parent)
        return self._process

    @staticmethod
    def _read_line(process: subprocess.Popen, timeout: float) -> str | None:
        """The next line of the worker's stdout, or None on EOF or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        data = b""
        fd = process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return None
                data += chunk
        return data.decode()
