"""The artifact as a contract: it runs in another process, with the runtime alone,
explains itself (`ember inspect`), and refuses tampering or version skew."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_ember, run_python

from ember.core.errors import ArtifactError
from ember.core.manifest import FORMAT_VERSION, manifest_digest
from ember.runtime import SamplingParams, generate, load_artifact

PROMPT = "hello world, the quick brown fox"

# Loads an artifact and generates greedily, as a device would: torch and transformers
# cannot be imported (ember's runtime must not need them), then reports the tokens
# and the modules that the runtime must never load.
RUNTIME_PROGRAM = """
import json, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NotInstalled())
from ember.runtime import Engine, SamplingParams, generate, load_artifact

engine = Engine(load_artifact(sys.argv[1]))
generation = generate(engine, sys.argv[2], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=()))
text = generation.text()
forbidden = ("ember.frontend", "ember.ir_passes", "ember.schedules", "torch", "transformers", "tvm.relax.frontend")
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
print(json.dumps({"tokens": generation.token_ids, "text": text, "forbidden_loaded": loaded}))
"""


def greedy_in_process(model, prompt: str) -> tuple[list[int], str]:
    """Greedy ids and text for `prompt` in this process (the tokenizer adds <s>)."""
    generation = generate(model.engine(), prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=()))
    return generation.token_ids, generation.text()


def run_runtime_program(artifact_dir: Path, env: dict[str, str] | None = None) -> dict:
    result = run_python("-c", RUNTIME_PROGRAM, str(artifact_dir), PROMPT, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_artifact_runs_in_another_process(tiny_llama):
    """An artifact compiled in the test process generates the same tokens in a fresh one."""
    out = run_runtime_program(tiny_llama.artifact_dir)
    tokens, text = greedy_in_process(tiny_llama, PROMPT)
    assert out["tokens"] == tokens
    assert out["text"] == text
    assert len(tokens) == 12


def test_runtime_loads_nothing_from_the_compiler(tiny_llama):
    """With full TVM: loading and generating imports no ember compiler stage, torch or transformers.

    (`import tvm` itself imports tvm.relax, and with it tvm.relax.frontend, unless
    TVM_USE_RUNTIME_LIB=1; the next test checks that stricter setting.)
    """
    out = run_runtime_program(tiny_llama.artifact_dir)
    assert [m for m in out["forbidden_loaded"] if not m.startswith("tvm.relax.frontend")] == []


def test_runtime_works_with_tvm_runtime_library_only(tiny_llama):
    """With TVM_USE_RUNTIME_LIB=1 (the device setting) the runtime generates, and no module of
    ember.frontend / ir_passes / schedules, torch, transformers or tvm.relax.frontend is loaded."""
    out = run_runtime_program(tiny_llama.artifact_dir, env={"TVM_USE_RUNTIME_LIB": "1"})
    assert out["forbidden_loaded"] == []
    assert out["tokens"] == greedy_in_process(tiny_llama, PROMPT)[0]


# Loads an artifact with TVM_NUM_THREADS as argv[2] ("-": unset) and threads=argv[3] ("-": default);
# reports the thread count TVM's pool will use, and where the weights live.
THREADS_PROGRAM = """
import json, os, sys
import numpy as np
if sys.argv[2] == "-":
    os.environ.pop("TVM_NUM_THREADS", None)
else:
    os.environ["TVM_NUM_THREADS"] = sys.argv[2]
from ember.runtime import load_artifact
from ember.runtime.device import physical_cores
artifact = load_artifact(sys.argv[1], threads=None if sys.argv[3] == "-" else int(sys.argv[3]))
addresses = [np.from_dlpack(param).ctypes.data for param in artifact.params]
print(json.dumps({"threads": os.environ["TVM_NUM_THREADS"], "cores": physical_cores(),
                  "aligned": all(address % 64 == 0 for address in addresses),
                  "span": max(addresses) - min(addresses)}))
"""


@pytest.mark.parametrize("env, threads, expected", [("-", "-", "cores"), ("1", "-", "1"), ("3", "1", "1")])
def test_cpu_thread_count(tiny_llama, env, threads, expected):
    """A CPU artifact runs one thread per physical core unless TVM_NUM_THREADS or `threads` says
    otherwise (TVM alone would take half the logical CPUs on x86: one on a 2-vCPU machine)."""
    result = run_python("-c", THREADS_PROGRAM, str(tiny_llama.artifact_dir), env, threads)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["threads"] == str(out["cores"] if expected == "cores" else expected)
    assert 1 <= out["cores"] <= os.cpu_count()


def test_cpu_weights_share_one_aligned_buffer(tiny_llama):
    """On a CPU the weights are 64-byte aligned views into one arena (one huge-page region), not
    separate allocations: the span of their addresses is about the weights' size."""
    result = run_python("-c", THREADS_PROGRAM, str(tiny_llama.artifact_dir), "-", "-")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    index = json.loads((tiny_llama.artifact_dir / "params" / "tensor-cache.json").read_text())
    records = [record for shard in index["records"] for record in shard["records"]]
    assert out["aligned"]
    assert out["span"] < sum(record["nbytes"] for record in records) + 64 * len(records)


def test_thread_count_changes_no_token(tiny_llama):
    """Kernels split rows, not reductions, across threads: one thread generates the same tokens."""
    out = run_runtime_program(tiny_llama.artifact_dir, env={"TVM_NUM_THREADS": "1"})
    assert out["tokens"] == greedy_in_process(tiny_llama, PROMPT)[0]


def test_cli_compile_reports_what_it_built(cli_compiled_llama):
    """`ember compile` (run in a subprocess, never from the test cache) prints a summary and
    writes a complete artifact: manifest, library, weights, tokenizer files."""
    output, artifact = cli_compiled_llama.compile_output, cli_compiled_llama.artifact_dir
    assert output is not None and output.returncode == 0
    assert f"compiled {cli_compiled_llama.model_dir} -> {artifact} in " in output.stdout
    assert "weights 0.4 MiB, KV cache 0.5 KiB/token" in output.stdout
    assert "Traceback" not in output.stderr
    files = {str(p.relative_to(artifact)) for p in artifact.rglob("*") if p.is_file()}
    assert {"manifest.json", "model.so", "params/tensor-cache.json", "params/params_shard_0.bin",
            "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= files
    assert not list(artifact.parent.glob(".*.partial-*"))


def test_inspect_prints_the_model_and_files(tiny_llama, capsys):
    """`ember inspect` names the model family and shapes, the KV layout and every file with its hash."""
    from ember.cli import main

    assert main(["inspect", str(tiny_llama.artifact_dir)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((tiny_llama.artifact_dir / "manifest.json").read_text())
    assert "llama: 2 layers, hidden 64, 4 heads / 2 KV heads, ffn 128, vocab 256" in out
    assert "prefill chunk 64, max batch 4" in out
    assert "q0f32" in out
    for name in ("model.so", "params/params_shard_0.bin", "params/tensor-cache.json", "tokenizer.json"):
        assert name in manifest["files"]
        assert f"{name} ({manifest['files'][name]['sha256'][:12]})" in out

    assert main(["inspect", "--json", str(tiny_llama.artifact_dir)]) == 0
    assert json.loads(capsys.readouterr().out) == manifest


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of `path` (by default one in the middle)."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("relpath", ["params/params_shard_0.bin", "model.so", "tokenizer.json"])
def test_tampered_file_is_refused(tiny_llama, copy_artifact, relpath):
    """A modified file fails the sha256 check, in the API and in the CLI, naming the file."""
    artifact = copy_artifact(tiny_llama)
    flip_byte(artifact / relpath)
    with pytest.raises(ArtifactError, match=rf"{relpath}: contents do not match the manifest's sha256.*recompile"):
        load_artifact(artifact)

    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2")
    assert result.returncode == 1
    assert f"{artifact / relpath}: contents do not match" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_missing_file_is_refused(tiny_llama, copy_artifact):
    """A file listed in the manifest but deleted is named."""
    artifact = copy_artifact(tiny_llama)
    (artifact / "params" / "tensor-cache.json").unlink()
    with pytest.raises(ArtifactError, match=r"params/tensor-cache.json: file listed in the manifest is missing"):
        load_artifact(artifact)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("format_version", 999, rf"artifact format version 999, this ember reads version {FORMAT_VERSION}; recompile"),
    ("tvm_version", "0.19.0", r"compiled with TVM 0.19.0, this runtime has TVM .*; recompile with `ember compile"),
])
def test_version_mismatch_is_refused(tiny_llama, copy_artifact, field, value, message):
    """A manifest from another format or TVM version is refused with a recompile hint (API and CLI)."""
    artifact = copy_artifact(tiny_llama)
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest[field] = value
    manifest["manifest_sha256"] = manifest_digest(manifest)  # as that version's compile would have sealed it
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(artifact)

    result = run_ember("generate", str(artifact), "--prompt", "hi")
    assert result.returncode == 1
    assert "manifest.json" in result.stderr or str(artifact) in result.stderr
    assert "recompile" in result.stderr
    assert "Traceback" not in result.stderr


def test_not_an_artifact_is_refused(tmp_path):
    """A directory without manifest.json is named as not an artifact."""
    result = run_ember("inspect", str(tmp_path))
    assert result.returncode == 1
    assert f"{tmp_path}: not an ember artifact (manifest.json is missing)" in result.stderr
    assert "Traceback" not in result.stderr
