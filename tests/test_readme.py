"""Every `ember` command the README shows works as written, on the demo model.

The convention: a command is a line that starts with `ember ` inside a ```sh or ```bash block.
Each runs in a temporary directory holding a link to the checkout's `src/` folder, so paths such
as `src/ember/demo_model/validation.txt` resolve as they do from the checkout's root. `ember serve` runs
until stopped: it is started on a free port of 127.0.0.1, answers a completion, and is stopped by
its pid. `ember chat` reads one line from stdin, then end of input.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import REPO_ROOT

pytestmark = pytest.mark.slow  # three demo compiles and a short tuning job: about two minutes on 2 cores

README = REPO_ROOT / "README.md"
SHELL_BLOCK = re.compile(r"^```(?:sh|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)
OUTPUT_OPTIONS = ("-o", "--output", "--db")  # what a command writes, which later commands may read


def readme_commands() -> list[str]:
    """The `ember` lines of the README's shell blocks, in the order they appear."""
    blocks = SHELL_BLOCK.findall(README.read_text(encoding="utf-8"))
    return [line.strip() for block in blocks for line in block.splitlines() if line.startswith("ember ")]


COMMANDS = readme_commands()


def written_path(argv: list[str]) -> str | None:
    """The path a command writes (`-o`, `--db`), if it names one."""
    for option, value in zip(argv, argv[1:]):
        if option in OUTPUT_OPTIONS:
            return value
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(argv: list[str], cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    """Run an `ember ...` command line in `cwd` with this interpreter's ember."""
    return subprocess.run([sys.executable, "-m", "ember", *argv[1:]], cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory where the README's commands run, with the demo compiled once, as the set-up command does."""
    directory = tmp_path_factory.mktemp("readme")
    (directory / "src").symlink_to(REPO_ROOT / "src", target_is_directory=True)  # the paths README's commands read
    result = run(["ember", "compile", "demo", "-o", "demo-cpu"], directory)
    assert result.returncode == 0, result.stderr
    return directory


def ensure_inputs(command: str, workdir: Path) -> None:
    """Run the earlier README commands that write a path `command` reads, if it is not there yet."""
    argv = shlex.split(command)
    for earlier in COMMANDS[:COMMANDS.index(command)]:
        earlier_argv = shlex.split(earlier)
        made = written_path(earlier_argv)
        if made and made in argv[1:] and made != written_path(argv) and not (workdir / made).exists():
            ensure_inputs(earlier, workdir)
            result = run(earlier_argv, workdir)
            assert result.returncode == 0, f"{earlier}\n{result.stderr}"


def serve_briefly(argv: list[str], workdir: Path) -> None:
    """Start `ember serve` on a free port, ask it for a completion, and stop it by its pid."""
    port = free_port()
    argv = [str(port) if previous == "--port" else arg for previous, arg in zip(["", *argv], argv)]
    server = subprocess.Popen([sys.executable, "-m", "ember", *argv[1:]], cwd=workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "ember serve did not answer /health"
                time.sleep(0.5)
        body = json.dumps({"model": "demo-cpu", "prompt": "And the LORD said", "max_tokens": 8}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.load(response)
        assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] > 0, reply
    finally:
        os.kill(server.pid, 15)
        server.communicate(timeout=30)


def test_the_readme_shows_every_subcommand():
    """The README's commands cover every subcommand `ember --help` lists."""
    listing = subprocess.run([sys.executable, "-m", "ember", "--help"], capture_output=True, text=True,
                             check=True).stdout
    subcommands = set(re.findall(r"^    (\w+) ", listing, re.MULTILINE))
    assert len(subcommands) >= 10, listing
    shown = {shlex.split(command)[1] for command in COMMANDS}
    assert subcommands <= shown, f"not shown in the README: {sorted(subcommands - shown)}"


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_works_as_written(command, workdir):
    argv = shlex.split(command)
    ensure_inputs(command, workdir)
    if argv[1] == "serve":
        serve_briefly(argv, workdir)
        return
    result = run(argv, workdir, stdin="Who was Moses?\n" if argv[1] == "chat" else "")
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    assert result.stdout.strip(), f"{command} printed nothing"
    made = written_path(argv)
    if made:
        assert (workdir / made).is_dir(), f"{command} did not write {made}"
