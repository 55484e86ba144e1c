"""`ember compile` on broken checkpoints: one precise line on stderr, exit code 1, no artifact.

Each case copies the tiny llama checkpoint, breaks one thing, and runs the CLI in a
subprocess. The message must name the file (and tensor) at fault, without a
traceback, and neither OUT nor a `.OUT.partial-*` staging directory may remain.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import run_ember
from safetensors.numpy import load_file, save_file

TENSOR = "model.layers.1.mlp.down_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # [2 kv heads x 16, 64]


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_tensors(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size if size >= 0 else path.stat().st_size + size)


def unknown_model_type(model: Path) -> None:
    edit_json(model / "config.json", lambda c: c.update(model_type="gpt_neox"))


def missing_tensor(model: Path) -> None:
    edit_tensors(model / "model.safetensors", lambda t: t.pop(TENSOR))


def wrong_shape(model: Path) -> None:
    edit_tensors(model / "model.safetensors", lambda t: t.update({K_PROJ: np.zeros((48, 64), np.float32)}))


def truncated_data(model: Path) -> None:
    truncate(model / "model.safetensors", -100)


def truncated_header(model: Path) -> None:
    truncate(model / "model.safetensors", 5)


def malformed_config(model: Path) -> None:
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')


def config_not_an_object(model: Path) -> None:
    (model / "config.json").write_text("[1, 2, 3]")


def missing_config(model: Path) -> None:
    (model / "config.json").unlink()


def missing_config_key(model: Path) -> None:
    edit_json(model / "config.json", lambda c: c.pop("intermediate_size"))


def pickle_weights_only(model: Path) -> None:
    (model / "model.safetensors").rename(model / "pytorch_model.bin")


def malformed_tokenizer_config(model: Path) -> None:
    (model / "tokenizer_config.json").write_text("{")


# (how to break the checkpoint, what stderr must contain)
CASES = {
    "unknown_model_type": (unknown_model_type, [
        "config.json: model_type 'gpt_neox' has no builtin definition (those: llama, mistral, qwen2); compile it "
        "with --frontend torch-export"]),
    "missing_tensor": (missing_tensor, [f"tensor '{TENSOR}' is missing from the checkpoint"]),
    "wrong_shape": (wrong_shape, [
        "model.safetensors: tensor", f"'{K_PROJ}' has shape [48, 64], but config.json implies [32, 64]"]),
    "truncated_data": (truncated_data, ["model.safetensors: truncated file: tensor"]),
    "truncated_header": (truncated_header, ["model.safetensors: truncated safetensors file (5 bytes, no header)"]),
    "malformed_config": (malformed_config, ["config.json: malformed JSON"]),
    "config_not_an_object": (config_not_an_object, ["config.json: expected a JSON object, got list"]),
    "missing_config": (missing_config, ["config.json: file not found"]),
    "missing_config_key": (missing_config_key, ["config.json: missing required key 'intermediate_size'"]),
    "pickle_weights_only": (pickle_weights_only, [
        "no model.safetensors", "found pytorch_model.bin; ember reads safetensors only"]),
    "malformed_tokenizer_config": (malformed_tokenizer_config, ["tokenizer_config.json: malformed JSON"]),
}


@pytest.mark.parametrize("case", CASES)
def test_compile_refuses_broken_checkpoint(tiny_models, tmp_path, case):
    """Exit 1, a one-line message naming the file/tensor, no traceback, nothing written."""
    break_checkpoint, expected = CASES[case]
    model = Path(shutil.copytree(tiny_models.checkpoint("llama"), tmp_path / "model"))
    break_checkpoint(model)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    out = out_parent / "artifact"

    result = run_ember("compile", str(model), "-o", str(out), "--no-progress")

    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("ember: error: "), result.stderr
    assert result.stderr.count("\n") == 1, f"expected one line:\n{result.stderr}"
    assert str(model) in result.stderr
    for text in expected:
        assert text in result.stderr
    assert not out.exists()
    assert list(out_parent.iterdir()) == [], "a staging directory was left behind"


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_torch_export_without_torch_or_transformers_is_one_line(tiny_models, tmp_path, missing):
    """`--frontend torch-export` on a Python without torch or transformers (the runtime's install): exit 1, one
    line naming what is missing and how to install it, nothing written."""
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    out = out_parent / "artifact"
    code = f"import sys; sys.modules[{missing!r}] = None; from ember.cli import main; sys.exit(main(sys.argv[1:]))"
    command = ["compile", str(tiny_models.checkpoint("gpt2")), "-o", str(out), "--frontend", "torch-export",
               "--no-progress"]
    result = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr == (f"ember: error: --frontend torch-export needs torch and transformers, and this Python "
                             f"has no {missing}: pip install torch==2.13.0 transformers\n")
    assert list(out_parent.iterdir()) == []


def test_compile_refuses_bad_options(tiny_models, tmp_path):
    """An unsupported --quant is refused before any work, naming the accepted values."""
    out = tmp_path / "artifact"
    result = run_ember("compile", str(tiny_models.checkpoint("llama")), "-o", str(out), "--quant", "q3f16")
    assert result.returncode == 1
    assert "--quant 'q3f16' is not supported; choose one of q0f32, q0f16, q8f32" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"], ["eval", "--perplexity", "text.txt"]])
@pytest.mark.parametrize("threads", ["0", "-1", "two"])
def test_runtime_commands_refuse_a_bad_thread_count(tmp_path, command, threads):
    """--threads must be a positive whole number: one line naming the option, exit 2, before any loading."""
    name, *rest = command
    result = run_ember(name, str(tmp_path / "artifact"), *rest, "--threads", threads)
    assert result.returncode == 2
    assert f"argument --threads: not a positive whole number: '{threads}'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--batch", "1,x"], "--batch 1,x: comma-separated positive integers"),
    (["--steps", "0"], "--steps 0: at least 1"),
    ([], "no such artifact directory"),
])
def test_decode_batch_benchmark_refuses_bad_input(tmp_path, args, message):
    """scripts/bench_decode_batch.py: one line naming the option or the artifact, exit 2, no traceback."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_batch.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "no-artifact"), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--servers", "ember,vllm"], "--servers ember,vllm: a list of ember, ember-api, llama.cpp"),
    (["--stall-prompt", "0"], "--stall-prompt 0: at least 1"),
    (["--prompt-len", "64,16"], "--prompt-len 64,16: MIN,MAX whole numbers, 1 <= MIN <= MAX"),
    (["--output-len", "0,8"], "--output-len 0,8: MIN,MAX whole numbers, 1 <= MIN <= MAX"),
    (["--concurrency", "1,x"], "--concurrency 1,x: comma-separated whole numbers, at least 1"),
    (["--requests", "0"], "--requests 0: at least 1"),
])
def test_serve_benchmark_refuses_bad_options(tmp_path, args, message):
    """scripts/bench_serve.py: a --servers name it does not know (never taken for llama.cpp's server), or
    lengths and counts it cannot draw requests from, are one line and exit 2 before any compile."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"
    # --servers ember first (the last of an option counts): no llama.cpp build is needed to get to the check
    result = subprocess.run([sys.executable, str(script), "--servers", "ember", *args, "--work-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


ATTENTION_KERNELS = Path(__file__).resolve().parents[1] / "schedules" / "prefill_attention.py"


@pytest.mark.parametrize("args, message", [
    (["--baseline", "missing.py"], "--baseline missing.py: no such Python file"),
    (["--baseline", "README.md"], "--baseline README.md: no such Python file"),
    (["--baseline", "not_python.py"], "--baseline not_python.py: cannot be loaded (SyntaxError"),
    (["--baseline", "other.py"], "--baseline other.py: not a version of schedules/prefill_attention.py"),
    (["--baseline", str(ATTENTION_KERNELS), "--target", "bogus"], "--target 'bogus' is not known"),
    (["--baseline", str(ATTENTION_KERNELS), "--target", "raspberry-pi-5"],
     "--target raspberry-pi-5: the kernels are timed here"),
    (["--baseline", str(ATTENTION_KERNELS), "--threads", "0"], "--threads 0 --repeats 5: each must be at least 1"),
])
def test_attention_benchmark_refuses_bad_options(tmp_path, args, message):
    """scripts/bench_attention.py: a baseline that is no version of the kernel file, a target it cannot time here,
    or a count below 1 is one line and exit 2 before any kernel is built (tracebacks before)."""
    (tmp_path / "README.md").write_text("# not a kernel file\n")
    (tmp_path / "not_python.py").write_text("def (:\n")
    (tmp_path / "other.py").write_text("def unrelated():\n    return 1\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_interrupted_compile_leaves_nothing(tiny_models, tmp_path):
    """Ctrl-C (SIGINT) once the compile has made its staging directory: exit 130, no OUT, no staging directory."""
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    out = out_parent / "artifact"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ember", "compile", str(tiny_models.checkpoint("llama")), "-o", str(out),
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while not list(out_parent.glob(".artifact.partial-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "compile never reached the staging step"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not out.exists()
    assert list(out_parent.iterdir()) == [], "a staging directory was left behind"
