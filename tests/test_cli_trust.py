"""What the command line does with inputs it cannot trust and with a Ctrl-C at any moment: --api-key-file
is read only from a regular file and only so far, a Ctrl-C while options are still being checked is one
line and exit 130, and a memory budget of nothing is refused like any other too-small budget."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, assert_one_line_error, run_main, run_python


def serve_with_key_file(tmp_path: Path, key_file: Path) -> subprocess.CompletedProcess:
    """`ember serve MISSING --api-key-file KEY_FILE` in a subprocess of at most 2 GiB of address space and
    60 s: the key is read before the artifact, so a key file that blocks or is endless fails the test, not the
    machine."""
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    return subprocess.run([sys.executable, "-m", "ember", "serve", str(tmp_path / "no-artifact"), "--api-key-file",
                           str(key_file)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          preexec_fn=limit_memory)


def test_api_key_file_refuses_a_fifo(tmp_path):
    """A FIFO nobody writes to would block `serve` forever: refused at once, naming --api-key-file."""
    fifo = tmp_path / "key-fifo"
    os.mkfifo(fifo)
    assert_one_line_error(serve_with_key_file(tmp_path, fifo), f"--api-key-file {fifo}: not a regular file")


def test_api_key_file_refuses_an_endless_device(tmp_path):
    """/dev/zero would be read until memory runs out: refused, naming --api-key-file."""
    assert_one_line_error(serve_with_key_file(tmp_path, Path("/dev/zero")),
                          "--api-key-file /dev/zero: not a regular file")


@pytest.mark.parametrize("size, accepted", [(4096, True), (4097, False), (10**7, False)])
def test_api_key_file_is_read_up_to_4_kib(tmp_path, size, accepted):
    """A key file of up to 4 KiB is read (the artifact is the next thing missing); a larger one is refused."""
    key_file = tmp_path / "key"
    key_file.write_bytes(b"secret-key\n" + b"#" * (size - 11))
    result = serve_with_key_file(tmp_path, key_file)
    if accepted:
        assert_one_line_error(result, str(tmp_path / "no-artifact"))
        assert "--api-key-file" not in result.stderr
    else:
        assert_one_line_error(result, f"--api-key-file {key_file}: larger than 4 KiB")


def test_api_key_file_refuses_bytes_that_are_not_utf8(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"caf\xe9\n")
    assert_one_line_error(serve_with_key_file(tmp_path, key_file), f"--api-key-file {key_file}: not UTF-8 text")


# A Ctrl-C that lands while TVM is being imported to check the sampling options, before any command runs.
SIGINT_DURING_TVM_IMPORT = """
import builtins, os, signal, sys
from ember.cli import main

real_import = builtins.__import__

def import_(name, *args, **kwargs):
    if name == "tvm" or name.startswith("tvm."):
        builtins.__import__ = real_import
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)

builtins.__import__ = import_
sys.exit(main(["generate", "no-artifact", "--prompt", "hi", "--temperature", "0.5"]))
"""


def test_ctrl_c_while_options_are_checked_is_one_line():
    """No KeyboardInterrupt traceback: `ember: interrupted`, exit 130."""
    result = run_python("-c", SIGINT_DURING_TVM_IMPORT)
    assert (result.returncode, result.stderr) == (130, "ember: interrupted\n")


@pytest.mark.parametrize("budget", ["0", "0GB", "0.4"])
def test_memory_budget_of_nothing_is_refused(capsys, tmp_path, budget):
    """--memory-budget 0 is not "no budget": exit 2, one line naming the option (1 byte fails in compile)."""
    result = run_main(capsys, "compile", "demo", "-o", str(tmp_path / "out"), "--memory-budget", budget)
    assert_one_line_error(result, "argument --memory-budget:", "less than one byte", returncode=2)
    assert not (tmp_path / "out").exists()
