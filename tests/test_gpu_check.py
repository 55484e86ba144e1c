"""scripts/gpu_check.py's CPU half: the bundle for the GPU machine, its weight generator, and the dry run.

The bundle holds everything the GPU half needs but the weights: TVM's runtime without its compiler library,
tvm_ffi's cp312 wheel, ember's runtime and weight conversion, each artifact's library, manifest and recipes,
and transformers' reference outputs. The checkpoints are regenerated from a seeded stream on each machine, and
must hash as they did here. The dry run does all of the GPU half up to the first CUDA call: unpack, import TVM's
runtime without the compiler in a fresh process, regenerate and hash the checkpoints, convert the weights and
check every shard against the sha256 the manifest recorded at compile time.

The default path builds the tiny-model bundle (its compiles go through the test-artifact cache); the 1B
benchmark artifacts (a 3 GB checkpoint and two compiles) are built only with EMBER_GPU_CHECK_1B=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import artifact_cache
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

SCRIPT = REPO / "scripts" / "gpu_check.py"


def cached_compile(checkpoint_dir: Path, dest: Path, entry: dict) -> None:
    """gpu_check's compile of one artifact, reused from the test-artifact cache when nothing it depends on
    changed (the recipes file is part of the cached artifact: its manifest lists it)."""
    options = gpu_check.compile_options(entry)
    key = artifact_cache.artifact_key(f"gpu-check-{dest.name}", options, [checkpoint_dir])
    artifact_cache.build(key, dest, lambda into: gpu_check.compile_artifact(checkpoint_dir, into, entry))


def build_bundle(root: Path, with_1b: bool) -> tuple[Path, Path]:
    """The bundle and the work directory (checkpoints, artifacts) it was packed from."""
    work = root / "work"
    return gpu_check.prepare(root / "bundle", work, with_1b, compile_into=cached_compile), work


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny-model bundle and its work directory."""
    return build_bundle(tmp_path_factory.mktemp("gpu-check"), with_1b=False)


def dry_run(bundle_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """`gpu_check.py run --dry-run` in a fresh process."""
    return subprocess.run([sys.executable, str(SCRIPT), "run", "--bundle", str(bundle_dir), "--dry-run", "--out",
                           str(out), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bundle_fits_one_upload_and_carries_no_weights(bundle):
    """Under 64 MiB; no checkpoint, no params shard, no TVM compiler library; the runtime libraries are there."""
    bundle_dir, _ = bundle
    files = [p.relative_to(bundle_dir).as_posix() for p in bundle_dir.rglob("*") if p.is_file()]
    assert gpu_check.bundle_size(bundle_dir) < gpu_check.UPLOAD_LIMIT
    assert not [f for f in files if "/params/" in f or f.endswith((".safetensors", ".bin"))]
    with tarfile.open(bundle_dir / "runtime" / gpu_check.TVM_ARCHIVE) as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert "libtvm_compiler.so" not in names
    assert {"libtvm_runtime.so", "libtvm_runtime_cuda.so", "__init__.py"} <= names
    wheels = [f for f in files if f.endswith(".whl")]
    assert len(wheels) == 1 and "-cp312-cp312-manylinux" in wheels[0] and "apache_tvm_ffi" in wheels[0]
    assert {"site/ember/runtime/engine.py", "site/ember/core/manifest.py", "site/ember/driver/convert.py",
            "site/ember/ir/quant_formats.py", "site/ember/serving/server.py"} <= set(files)
    assert not [f for f in files if f.startswith("site/ember/") and f.split("/")[2] in
                ("frontend", "ir_passes", "schedules", "cli", "targets")]


def test_each_artifact_travels_as_library_manifest_and_recipes(bundle):
    """Every planned artifact is a CUDA sm_90a build whose manifest lists the shards the GPU half regenerates."""
    bundle_dir, _ = bundle
    plan = json.loads((bundle_dir / gpu_check.PLAN_NAME).read_text())
    assert set(plan["artifacts"]) == set(gpu_check.artifact_plan(with_1b=False))
    for artifact_id, entry in plan["artifacts"].items():
        artifact = bundle_dir / "artifacts" / artifact_id
        manifest = json.loads((artifact / "manifest.json").read_text())
        assert (manifest["target"]["arch"], manifest["quantization"]) == ("sm_90a", entry["quant"])
        assert (artifact / "model.so").stat().st_size > 0 and gpu_check.RECIPES_NAME in manifest["files"]
        shards = [name for name in manifest["files"] if name.startswith("params/")]
        assert shards and not any((artifact / name).exists() for name in shards)


def test_generator_writes_the_checkpoints_the_references_were_computed_from(bundle, tmp_path):
    """A fresh process regenerates each checkpoint bit for bit (the sha256 the bundle records, which is that of
    the file transformers read for the references); the regenerated file gives the references again."""
    bundle_dir, work = bundle
    plan = json.loads((bundle_dir / gpu_check.PLAN_NAME).read_text())
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import gpu_check; from pathlib import Path; "
            "spec = json.loads(Path(sys.argv[2]).read_text())['spec']; "
            "print(gpu_check.write_checkpoint(spec, Path(sys.argv[3])))")
    for name, recorded in plan["checkpoints"].items():
        assert hashlib.sha256((work / "checkpoints" / name / "model.safetensors").read_bytes()).hexdigest() == recorded
        out = tmp_path / name
        again = subprocess.run([sys.executable, "-c", code, str(REPO / "scripts"),
                                str(bundle_dir / "checkpoints" / f"{name}.json"), str(out)],
                               capture_output=True, text=True, check=True)
        assert again.stdout.strip() == recorded
    references = np.load(bundle_dir / "references" / "llama.npz")
    regenerated = gpu_check.cpu_references(tmp_path / "llama", 256)
    for key in ("prefill_logits", "decode_logits", "greedy_tokens", "batch_tokens"):
        np.testing.assert_array_equal(regenerated[key], references[key])


def test_weight_values_are_exact_float32_steps():
    """Each value is an odd multiple of 2^-24 in (-1, 1) times one constant; names and seeds give their own
    streams, and a tensor does not depend on the ones drawn before it."""
    first = gpu_check.tensor_values(1, "a.weight", (64, 32), "weight", 0.1)
    assert first.dtype == np.float32 and first.shape == (64, 32)
    steps = first.astype(np.float64) / np.float64(np.float32(0.1 * 3**0.5)) * 2**24
    assert np.all(np.abs(steps) < 2**24) and np.all(np.abs(np.round(steps) - steps) < 1e-3 * np.abs(steps) + 1)
    assert abs(float(first.std()) - 0.1) < 0.01
    np.testing.assert_array_equal(first, gpu_check.tensor_values(1, "a.weight", (64, 32), "weight", 0.1))
    assert not np.array_equal(first, gpu_check.tensor_values(1, "b.weight", (64, 32), "weight", 0.1))
    assert not np.array_equal(first, gpu_check.tensor_values(2, "a.weight", (64, 32), "weight", 0.1))
    norm = gpu_check.tensor_values(1, "norm.weight", (64,), "norm", 0.1)
    assert np.all((norm > 0.8) & (norm < 1.2))


@pytest.mark.slow
def test_dry_run_does_the_gpu_half_up_to_the_first_cuda_call(bundle, tmp_path):
    """TVM's runtime without the compiler imports in a fresh process, the weights regenerate and convert, every
    artifact file matches its manifest, and the plan of checks is printed and written."""
    bundle_dir, _ = bundle
    result = dry_run(bundle_dir, tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    weights = report["weights"]
    assert "libtvm_compiler.so" not in weights["compiler_library"] and "libtvm_runtime.so" in weights[
        "compiler_library"]
    assert "/site/tvm/" in weights["tvm"] and "/site/ember/runtime/" in weights["ember_runtime"]
    assert not weights["relax_imported"] and weights["runtime_imported_without_relax"]
    assert set(weights["artifacts"]) == set(gpu_check.artifact_plan(with_1b=False))
    assert len(report["plan"]) == len(weights["artifacts"]) + 1 and report["failed"] == []
    assert "every file matches its manifest" in (tmp_path / "out" / "gpu-check.log").read_text()


@pytest.mark.slow
def test_dry_run_refuses_a_checkpoint_that_hashes_differently(bundle, tmp_path):
    """A generator that draws other values (here, another seed in the spec) is refused before anything runs."""
    bundle_dir, _ = bundle
    copy = Path(shutil.copytree(bundle_dir, tmp_path / "bundle"))
    spec_path = copy / "checkpoints" / "qwen2.json"
    spec = json.loads(spec_path.read_text())
    spec["spec"]["seed"] += 1
    spec_path.write_text(json.dumps(spec))
    result = dry_run(copy, tmp_path / "out")
    assert result.returncode == 1
    assert "checkpoint qwen2: regenerated model.safetensors has sha256" in result.stdout
    assert "refusing to run" in result.stdout
    assert json.loads((tmp_path / "out" / "gpu-check.json").read_text())["failed"] == ["weights"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("EMBER_GPU_CHECK_1B") != "1", reason="the 1B bundle: EMBER_GPU_CHECK_1B=1")
def test_whole_bundle_with_the_1b_benchmark_fits_one_upload(tmp_path):
    """With the Llama 3.2 1B shape at q0f16 and q4f16, the bundle still fits one upload."""
    bundle_dir, _ = build_bundle(tmp_path, with_1b=True)
    assert gpu_check.bundle_size(bundle_dir) < gpu_check.UPLOAD_LIMIT
    plan = json.loads((bundle_dir / gpu_check.PLAN_NAME).read_text())
    assert {"llama1b-q0f16", "llama1b-q4f16"} <= set(plan["artifacts"])
