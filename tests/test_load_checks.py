"""What `ember compile` and the artifact loader refuse before anything crashes: a library built for CPU features this
machine lacks (it would die of SIGILL), weights that are not finite, a KV cache beyond the memory limits this process
runs under, and a manifest resealed over another artifact's library or weights. Each is one error line."""

from __future__ import annotations

import json
import platform

import pytest
from helpers import assert_one_line_error, run_ember
from test_artifact_integrity import edit_manifest

from ember.core.machine import host_cpu_flags
from ember.runtime import load_artifact

NEWER_CPU = "diamondrapids"  # Intel's APX, AMX-FP16 and AVX-IFMA: beyond every CPU this suite runs on so far


def manifest_of(artifact) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


@pytest.fixture(scope="module")
def newer_cpu_artifact(tiny_models, tmp_path_factory):
    """The tiny llama compiled by the CLI for a CPU newer than this one, and the features this CPU lacks."""
    host = host_cpu_flags()
    if platform.machine() != "x86_64" or host is None:
        pytest.skip("compares x86 CPU flags from /proc/cpuinfo")
    artifact = tmp_path_factory.mktemp("newer-cpu") / "artifact"
    result = run_ember("compile", str(tiny_models.checkpoint("llama")), "-o", str(artifact), "--no-progress",
                       "--max-batch", "1", "--prefill-chunk", "16",
                       "--target", json.dumps({"kind": "llvm", "mcpu": NEWER_CPU}))
    assert result.returncode == 0, result.stderr
    missing = sorted(set(manifest_of(artifact)["target"]["cpu_features"]) - host)
    if not missing:
        pytest.skip(f"this CPU has every feature of {NEWER_CPU}")
    return artifact, missing


def test_library_for_a_newer_cpu_is_refused_by_generate(newer_cpu_artifact):
    """`ember generate` on an artifact whose code uses extensions this CPU lacks exits 1 with one line naming each
    missing feature and the --target to recompile with, instead of dying of an illegal instruction (exit 132)."""
    artifact, missing = newer_cpu_artifact
    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2", timeout=120)
    assert_one_line_error(result, f"{artifact}: compiled for a CPU with {', '.join(missing)}, which this machine "
                                  "lacks", "--target cpu")
    assert result.stdout == ""


def test_host_compile_records_features_this_cpu_has(tiny_llama):
    """A compile for this machine records the instruction-set extensions its code may use, by /proc/cpuinfo's
    names (AVX2 at least on any x86 CPU ember targets), all of which this CPU has; it loads."""
    features = manifest_of(tiny_llama.artifact_dir)["target"]["cpu_features"]
    host = host_cpu_flags()
    assert host is not None and set(features) <= host
    if platform.machine() == "x86_64" and "avx2" in host:
        assert {"avx", "avx2", "fma"} <= set(features)
    assert tiny_llama.artifact.manifest.target["cpu_features"] == features


def test_manifest_without_cpu_features_still_loads(tiny_llama, copy_artifact):
    """A manifest written before target.cpu_features (the field absent, the seal intact) loads: its needs are
    unknown, not refused; a malformed list is refused in one line."""
    artifact = copy_artifact(tiny_llama)
    edit_manifest(artifact, lambda data: data["target"].pop("cpu_features"), seal=True)
    load_artifact(artifact)
    edit_manifest(artifact, lambda data: data["target"].__setitem__("cpu_features", "avx2"), seal=True)
    result = run_ember("inspect", str(artifact))
    assert_one_line_error(result, "manifest field target.cpu_features must be a list of CPU flag names")
