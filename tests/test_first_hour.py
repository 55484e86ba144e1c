"""A newcomer's first hour: what `ember compile` shows while it works, TVM's noise kept
out of it, bad model paths refused at once, and `analyze`'s usage saying what it requires."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, run_ember, run_python

from ember.driver.tvm_log import tvm_warnings_hidden

TVM_WARNING = b"[11:47:13] /project/include/tvm/topi/transform.h:1261: Warning: Fast mode segfaults when there are\n"


@pytest.mark.slow
def test_compile_shows_its_stages_without_tvm_warnings(tiny_models, tmp_path):
    """Default output: a line per stage with the seconds since the start, and none of TVM's
    'Fast mode segfaults' warnings (three per compile before)."""
    result = run_ember("compile", str(tiny_models.checkpoint("llama")), "-o", str(tmp_path / "out"),
                       "--prefill-chunk", "64", "--max-batch", "2")
    assert result.returncode == 0, result.stderr
    stages = [re.match(r"\[ *(\d+\.\d) s\] (\w+)", line) for line in result.stderr.splitlines() if line.startswith("[")]
    assert all(stages) and [stage[2] for stage in stages] == ["importing", "lowering", "generating", "converting"], \
        result.stderr
    seconds = [float(stage[1]) for stage in stages]
    assert seconds == sorted(seconds), seconds
    assert "Warning" not in result.stderr and "Fast mode" not in result.stderr


@pytest.mark.parametrize("verbose", [False, True])
def test_analyze_measure_shows_tvm_warnings_only_if_verbose(tiny_llama, verbose):
    """`analyze --measure` rebuilds the artifact's kernels, which made TVM warn as compile did."""
    result = run_ember("analyze", str(tiny_llama.artifact_dir), "--measure", "--prompt-len", "8",
                       *(["-v"] if verbose else []))
    assert result.returncode == 0, result.stderr
    assert ("Fast mode segfaults" in result.stderr) == verbose, result.stderr


@pytest.mark.parametrize("verbose", [False, True])
def test_tvm_warnings_are_held_back_unless_verbose(capfd, verbose):
    """The mechanism: TVM's native warnings (written to fd 2) are dropped, other native output is kept,
    and under -v (ember logging at INFO) the warnings are shown too."""
    logger = logging.getLogger("ember")
    level = logger.level
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        with tvm_warnings_hidden():
            os.write(2, TVM_WARNING + b"a real problem\n")
    finally:
        logger.setLevel(level)
    err = capfd.readouterr().err
    assert "a real problem" in err
    assert ("Fast mode" in err) == verbose


@pytest.mark.parametrize("model, expected", [
    ("meta-llama/Llama-3.2-1B", "`hf download meta-llama/Llama-3.2-1B --local-dir Llama-3.2-1B`"),
    ("no/such/dir/at/all",
     "no such directory (expected a Hugging Face checkpoint directory, a GGUF or ONNX file, or `demo`)"),
    ("model.gguf", "truncated GGUF file (4 bytes, no header)"),
])
def test_a_bad_model_path_is_refused_before_tvm_is_imported(tmp_path, model, expected):
    """A wrong model path is refused before TVM and the compiler are imported (they take seconds). A file
    named *.gguf is read by the GGUF importer, whose header checks need no TVM either."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    code = ("import sys\nfrom ember.cli import main\n"
            f"code = main(['compile', {model!r}, '-o', 'out'])\n"
            "print(code, 'tvm' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.stdout.split() == ["1", "False"], result.stdout + result.stderr
    assert result.stderr.startswith(f"ember: error: {model}: ") and expected in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_analyze_usage_says_hardware_is_required():
    result = run_ember("analyze", "--help")
    usage = result.stdout.split("\n\n")[0]
    assert "ember analyze MODEL --hardware NAME" in usage and "[--hardware" not in usage
    assert "ember analyze ARTIFACT --measure" in usage


def test_the_cli_runs_without_loading_torch_and_torch_still_works_after(tiny_llama):
    """TVM imports torch when it is installed (tvm_ffi's and relax's optional torch interop): 1.8 s and
    200 MB more for every `ember` command. The CLI keeps it out, and torch imported afterwards still works,
    with TVM too (its tensors through DLPack)."""
    code = ("import sys\nfrom ember.cli import main\n"
            f"code = main(['generate', {str(tiny_llama.artifact_dir)!r}, '--prompt', 'Hello', '--max-new-tokens', '4',"
            " '--seed', '1'])\n"
            "print(code, 'torch' in sys.modules)\n"
            "import torch, tvm\n"
            "print(tvm.runtime.from_dlpack(torch.arange(3, dtype=torch.float32)).numpy().tolist())")
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-3:] == ["0 False", "[0.0, 1.0, 2.0]", ""], result.stdout


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hello", "--max-new-tokens", "4", "--seed", "1"],
                                     ["bench", "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1"]],
                         ids=["generate", "bench"])
def test_commands_that_run_artifacts_load_tvm_without_its_compiler(tiny_llama, command):
    """The `ember generate` and `ember bench` programs (as chat, eval and serve) load TVM's runtime library alone,
    not its compiler nor `tvm.relax`, and leave the environment as it was given (`TVM_USE_RUNTIME_LIB` set only
    while TVM loads). A program calling `main` with arguments gets all of TVM: a compile may come next
    (test_hostile_corpus)."""
    argv = [command[0], str(tiny_llama.artifact_dir), *command[1:]]
    report = ("import json, tvm.base\n"
              "print(json.dumps([code, sorted(tvm.base._LOADED_LIBS), 'tvm.relax' in sys.modules,"
              " os.environ.get('TVM_USE_RUNTIME_LIB')]))")
    as_program = run_python("-c", f"import os, sys\nfrom ember.cli import main\nsys.argv = {['ember', *argv]!r}\n"
                                  f"code = main()\n{report}")
    assert as_program.returncode == 0, as_program.stderr
    assert json.loads(as_program.stdout.splitlines()[-1]) == [0, ["tvm_runtime"], False, None], as_program.stdout
    called = run_python("-c", f"import os, sys\nfrom ember.cli import main\ncode = main({argv!r})\n{report}")
    assert called.returncode == 0, called.stderr
    code, libraries, relax, variable = json.loads(called.stdout.splitlines()[-1])
    assert (code, "tvm_compiler" in libraries, relax, variable) == (0, True, True, None), called.stdout


def test_the_runtime_loads_no_torch():
    """`import ember.runtime` (a device server, `ember serve`'s process, a script) loads TVM without torch."""
    result = run_python("-c", "import sys, ember.runtime; print('torch' in sys.modules, 'tvm' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"], result.stdout


@pytest.mark.slow
def test_a_torch_export_compile_loads_torch_after_tvm(tiny_models, tmp_path):
    """`ember compile --frontend torch-export` imports torch itself once TVM is loaded without it, traces (no graph
    kept from before: EMBER_TRACE_CACHE=0) and compiles, and the artifact runs."""
    out = tmp_path / "exported"
    result = run_ember("compile", str(tiny_models.checkpoint("llama")), "-o", str(out), "--frontend", "torch-export",
                       "--prefill-chunk", "32", "--max-batch", "2", "--no-progress", env={"EMBER_TRACE_CACHE": "0"})
    assert result.returncode == 0, result.stderr
    generated = run_ember("generate", str(out), "--prompt", "Hello", "--max-new-tokens", "4", "--temperature", "0")
    assert generated.returncode == 0 and "[prefill" in generated.stderr + generated.stdout, generated.stderr
