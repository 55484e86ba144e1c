"""GPU artifacts built on a machine without a GPU: CUDA for two architectures, and OpenCL.

What can be checked here: the manifest, the VM's entry functions (the library is
loaded through TVM's own loader, with the CUDA module's bytes captured instead of
handed to a CUDA runtime this machine does not have), that the device code is a
real fatbin for the requested architecture (SASS and PTX, no CUDA source left),
and that the runtime refuses to run without the device. Running the kernels needs
a GPU (`scripts/bench_gpu.py`).
"""

from __future__ import annotations

import json
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import artifact_cache
import pytest
import tvm
import tvm_ffi
from conftest import MAX_BATCH, PREFILL_CHUNK
from helpers import run_ember
from tvm import relax

from ember.core.errors import ArtifactError
from ember.runtime import load_artifact
from ember.runtime.device import cuda_arch_runs_on

ARCHS = {"sm_80": "nvidia-a100-80gb-sxm", "sm_90a": "nvidia-h100-sxm"}
FATBIN_MAGIC = 0xBA55ED50
ENTRY_FUNCTIONS = {"prefill", "decode", "verify", "create_paged_kv_cache"}


@pytest.fixture(scope="module")
def cuda_artifacts(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama compiled for each of `ARCHS`: sm_90a by the CLI while sm_80 compiles by the API."""
    from ember.driver.compiler import CompileOptions, compile_model

    model_dir, root = tiny_models.checkpoint("llama"), tmp_path_factory.mktemp("cuda")
    options = {arch: CompileOptions(target=f"cuda:{arch}", prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH,
                                    show_progress=False) for arch in ARCHS}
    keys = {arch: artifact_cache.artifact_key(f"tiny-llama-cuda-{arch}", options[arch], [model_dir]) for arch in ARCHS}

    def compile_through_cli(dest: Path) -> None:
        result = run_ember("compile", str(model_dir), "-o", str(dest), "--target", "cuda:sm_90a", "--no-progress",
                           "--prefill-chunk", str(PREFILL_CHUNK), "--max-batch", str(MAX_BATCH))
        assert result.returncode == 0, result.stderr

    with ThreadPoolExecutor(1) as side:  # the CLI's process runs beside this one's compile
        cli = side.submit(artifact_cache.build, keys["sm_90a"], root / "sm_90a", compile_through_cli)
        artifact_cache.build(keys["sm_80"], root / "sm_80",
                             lambda dest: compile_model(model_dir, dest, options["sm_80"]))
        cli.result()
    return {arch: root / arch for arch in ARCHS}


def load_without_device(library: Path) -> tuple[tvm.runtime.Module, list[bytes]]:
    """Load `library` with TVM's loader; the bytes of each CUDA module are captured, not loaded."""
    captured: list[bytes] = []

    def capture(data: bytes) -> tvm.runtime.Module:
        captured.append(bytes(data))
        return tvm.get_global_func("runtime.SourceModuleCreate")("", "cu")

    name = "ffi.Module.load_from_bytes.cuda"
    assert tvm_ffi.get_global_func(name, allow_missing=True) is None, "a CUDA runtime is loaded: run on the GPU"
    tvm_ffi.register_global_func(name, capture)
    try:
        return tvm.runtime.load_module(str(library)), captured
    finally:
        tvm_ffi.registry.remove_global_func(name)


def fatbin_entries(fatbin: bytes) -> list[tuple[str, int, bytes]]:
    """(kind, SM version, payload) of each entry of a CUDA fatbin: "sass" (an ELF cubin) or "ptx"."""
    magic, _version, header_size, size = struct.unpack_from("<IHHQ", fatbin)
    assert magic == FATBIN_MAGIC
    entries, offset = [], header_size
    while offset < header_size + size:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", fatbin, offset)
        sm_version = struct.unpack_from("<I", fatbin, offset + 28)[0]
        start = offset + entry_header
        entries.append(({1: "ptx", 2: "sass"}[kind], sm_version, fatbin[start: start + payload]))
        offset = start + payload
    return entries


@pytest.mark.parametrize("arch", ARCHS)
def test_manifest_records_the_cuda_target(cuda_artifacts, arch):
    """The target, its architecture and sizing preset, the GPU default quantization and the KV budget."""
    manifest = json.loads((cuda_artifacts[arch] / "manifest.json").read_text())
    target, kv = manifest["target"], manifest["kv_cache"]
    assert (target["name"], target["arch"], target["hardware"]) == ("cuda", arch, ARCHS[arch])
    assert target["tvm_target"]["kind"] == "cuda" and target["tvm_target"]["arch"] == arch.rstrip("a")
    assert target["memory_bytes"] == 80 * 2**30 and target["num_cores"] in (108, 132)
    assert (manifest["quantization"], manifest["model_dtype"], kv["dtype"]) == ("q0f16", "float16", "float16")
    assert kv["memory_budget"] == int(0.9 * 80 * 2**30)
    assert kv["max_total_tokens"] == MAX_BATCH * kv["max_context"] == MAX_BATCH * 256
    assert set(manifest["entry_functions"]) == ENTRY_FUNCTIONS


@pytest.mark.parametrize("arch", ARCHS)
def test_library_has_the_entry_functions_and_decode_graphs(cuda_artifacts, arch):
    """TVM's loader reads the library: the VM has the entry functions and decode's CUDA-graph captures."""
    library, captured = load_without_device(cuda_artifacts[arch] / "model.so")
    assert library.kind == "relax.VMExecutable" and len(captured) == 1
    functions = set(re.findall(r"^@(\w+):$", relax.VMExecutable(library).as_text(), re.MULTILINE))
    assert ENTRY_FUNCTIONS <= functions
    assert "cuda_graph_alloc" in functions and "decode_cuda_graph_capture" in functions
    assert not any(name.startswith("prefill_cuda_graph") for name in functions)


@pytest.mark.parametrize("arch", ARCHS)
def test_device_code_is_a_fatbin_for_the_arch(cuda_artifacts, arch):
    """The CUDA module holds a fatbin with SASS (an ELF cubin built by ptxas for `arch`) and PTX for
    the same SM version; no CUDA source is left in the library."""
    library = cuda_artifacts[arch] / "model.so"
    _, (module_bytes,) = load_without_device(library)
    (fmt_size,) = struct.unpack_from("<Q", module_bytes)
    assert module_bytes[8: 8 + fmt_size] == b"cubin"
    start = module_bytes.index(struct.pack("<I", FATBIN_MAGIC))
    fatbin = module_bytes[start:]
    assert struct.unpack_from("<Q", module_bytes, start - 8)[0] == len(fatbin)  # the code field, last

    version = int(re.fullmatch(r"sm_(\d+)a?", arch).group(1))
    entries = fatbin_entries(fatbin)
    assert sorted((kind, sm) for kind, sm, _ in entries) == [("ptx", version), ("sass", version)]
    cubin = next(payload for kind, _, payload in entries if kind == "sass")
    assert cubin[:4] == b"\x7fELF" and struct.unpack_from("<H", cubin, 18)[0] == 190  # EM_CUDA
    assert f"-arch {arch} ".encode() in cubin
    assert b'extern "C" __global__' not in library.read_bytes()


def test_runtime_refuses_without_the_gpu(cuda_artifacts):
    """No GPU here: the API and the runtime-only CLI say what the artifact needs, without a traceback."""
    if tvm.cuda(0).exist:
        pytest.skip("this machine has a CUDA GPU")
    artifact = cuda_artifacts["sm_90a"]
    message = "artifact was compiled for cuda sm_90a; no CUDA device found"
    with pytest.raises(ArtifactError, match=message):
        load_artifact(artifact)
    result = run_ember("generate", str(artifact), "--prompt", "hi", env={"TVM_USE_RUNTIME_LIB": "1"})
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("arch", "compute_version", "runs"), [
    ("sm_80", "8.0", True), ("sm_80", "8.6", True), ("sm_80", "9.0", True), ("sm_80", "7.5", False),
    ("sm_89", "8.6", False), ("sm_90a", "9.0", True), ("sm_90a", "10.0", False), ("sm_90", "12.0", True),
    ("sm_100f", "10.3", True), ("sm_100f", "12.0", False),
])
def test_which_gpus_run_an_arch(arch, compute_version, runs):
    """SASS + PTX runs on its own and newer GPUs; 'a' builds on one generation, 'f' on one major version."""
    assert cuda_arch_runs_on(arch, compute_version) is runs


def test_opencl_artifact_ships_opencl_source(tiny_models, tmp_path):
    """OpenCL: the kernels are generated as OpenCL C inside the library (compiled by the device's driver
    at load); this TVM has no OpenCL runtime, so the runtime refuses and says what to install."""
    from ember.driver.compiler import CompileOptions, compile_model

    model_dir, artifact = tiny_models.checkpoint("llama"), tmp_path / "ocl"
    options = CompileOptions(target="opencl", prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key("tiny-llama-opencl", options, [model_dir]), artifact,
                         lambda dest: compile_model(model_dir, dest, options))
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert (manifest["target"]["name"], manifest["quantization"]) == ("opencl", "q0f16")
    library = (artifact / "model.so").read_bytes()
    assert b"__kernel void" in library and b"batch_decode_paged_kv_kernel" in library
    with pytest.raises(ArtifactError, match="compiled for opencl; no OpenCL device found .*USE_OPENCL=ON"):
        load_artifact(artifact)
