"""`--target` resolution: the host, explicit LLVM CPUs, CUDA architectures and GPU presets,
OpenCL, and clear refusals."""

from __future__ import annotations

import pytest
import tvm
from tvm.target import codegen

from ember.core.errors import TargetError
from ember.targets import registry
from ember.targets.hardware import hardware_presets, load_hardware
from ember.targets.registry import resolve_target

GIB = 2**30


def test_cpu_detects_the_host() -> None:
    spec = resolve_target("cpu")
    assert spec.tvm_target["kind"] == "llvm" and spec.tvm_target["mcpu"] not in ("", "generic")
    assert spec.num_cores >= 1 and spec.vector_bits >= 128


def test_cpu_adds_the_extensions_its_name_lacks(monkeypatch) -> None:
    """A VM that hides its CPU's model gets an older CPU's name from LLVM ("rocketlake" on Sapphire Rapids); the
    extensions /proc/cpuinfo lists beyond that name's are added, so AMX is used where the machine has it."""
    monkeypatch.setattr(codegen, "llvm_get_system_cpu", lambda: "rocketlake")
    named = set(resolve_target('{"kind": "llvm", "mcpu": "rocketlake"}').cpu_features)
    monkeypatch.setattr(registry, "host_cpu_flags", lambda: named | {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"})
    spec = resolve_target("cpu")
    assert spec.tvm_target["mcpu"] == "rocketlake"
    assert spec.tvm_target["mattr"] == ["+amx-bf16", "+amx-int8", "+amx-tile", "+avx512bf16"]
    assert spec.int8_dot.level == "amx" and {"amx_int8", "amx_tile", "avx512_bf16"} <= set(spec.cpu_features)
    assert spec.describe() == f"cpu rocketlake +amx-bf16 +amx-int8 +amx-tile +avx512bf16, {spec.num_cores} cores"
    monkeypatch.setattr(registry, "host_cpu_flags", lambda: named)  # the name says it all
    assert "mattr" not in resolve_target("cpu").tvm_target and resolve_target("cpu").int8_dot.level == "avx512vnni"
    monkeypatch.setattr(registry, "host_cpu_flags", lambda: None)  # no /proc/cpuinfo to read
    assert "mattr" not in resolve_target("cpu").tvm_target


def test_explicit_arm_cpu_has_neon_width() -> None:
    spec = resolve_target('{"kind": "llvm", "mcpu": "cortex-a76", "mtriple": "aarch64-linux-gnu", "num-cores": 4}')
    assert spec.vector_bits == 128 and spec.num_cores == 4


@pytest.mark.parametrize(("mcpu", "bits"), [("haswell", 256), ("alderlake", 256), ("icelake-server", 512),
                                            ("znver4", 512), ("x86-64", 128)])
def test_explicit_x86_cpu_has_its_own_width(mcpu, bits) -> None:
    """The width comes from the target's features, not from the machine compiling for it."""
    assert resolve_target(f'{{"kind": "llvm", "mcpu": "{mcpu}", "mtriple": "x86_64-linux-gnu"}}').vector_bits == bits


@pytest.mark.parametrize(("spec", "arch", "tvm_arch", "hardware", "memory_gib", "sms"), [
    ("cuda:sm_80", "sm_80", "sm_80", "nvidia-a100-80gb-sxm", 80, 108),
    ("cuda:sm_86", "sm_86", "sm_86", "nvidia-rtx-3090", 24, 82),        # the smaller of its two presets
    ("cuda:sm_90a", "sm_90a", "sm_90", "nvidia-h100-sxm", 80, 132),     # TVM schedules for the base arch
    ("cuda:sm_90", "sm_90", "sm_90", "nvidia-h100-sxm", 80, 132),
    ("cuda:h200", "sm_90a", "sm_90", "nvidia-h200-sxm", 141, 132),      # a preset names arch and memory
    ("cuda:L40S", "sm_89", "sm_89", "nvidia-l40s", 48, 142),
    ("cuda:sm_120", "sm_120", "sm_120", "", 0, 0),                       # no preset: size unknown
])
def test_cuda_architectures_and_presets(spec, arch, tvm_arch, hardware, memory_gib, sms):
    target = resolve_target(spec)
    assert (target.name, target.arch, target.hardware, target.num_cores) == ("cuda", arch, hardware, sms)
    assert target.tvm_target["arch"] == tvm_arch and target.target.kind.name == "cuda"
    assert target.target.host.kind.name == "llvm" and "mcpu" not in target.tvm_target["host"]  # portable host code
    assert target.is_gpu and target.cuda_graph and target.default_quantization == "q0f16"
    assert target.memory_bytes == memory_gib * GIB
    assert target.default_memory_budget == (int(0.9 * memory_gib * GIB) if memory_gib else None)


def test_cpu_and_opencl_defaults():
    cpu, opencl = resolve_target("cpu"), resolve_target("opencl")
    assert (cpu.is_gpu, cpu.cuda_graph, cpu.default_quantization, cpu.default_memory_budget) == \
        (False, False, "q0f32", None)
    assert (opencl.name, opencl.is_gpu, opencl.cuda_graph, opencl.default_quantization) == \
        ("opencl", True, False, "q0f16")
    assert opencl.target.kind.name == "opencl" and opencl.default_memory_budget is None


def test_every_nvidia_preset_has_an_arch_and_sm_count():
    for name in hardware_presets():
        hardware = load_hardware(name)
        if name.startswith("nvidia-") and hardware.kind == "gpu":
            assert hardware.arch.startswith("sm_") and hardware.compute_units > 0, name
            assert load_hardware(name).to_json()["arch"] == hardware.arch


@pytest.mark.skipif(tvm.cuda(0).exist, reason="this machine has a CUDA GPU to detect")
def test_plain_cuda_without_a_gpu_asks_for_an_arch():
    with pytest.raises(TargetError, match=r"no CUDA GPU on this machine.*cuda:sm_90a \(h100-sxm, h200-sxm\)") as err:
        resolve_target("cuda")
    assert "sm_70" not in str(err.value)  # nvcc 13 cannot build for Volta: not suggested


def test_cuda_needs_nvcc(monkeypatch):
    registry._nvcc_architectures.cache_clear()
    monkeypatch.setenv("PATH", "")
    try:
        with pytest.raises(TargetError, match="compiling for CUDA needs nvcc"):
            resolve_target("cuda:sm_80")
    finally:
        registry._nvcc_architectures.cache_clear()


@pytest.mark.parametrize("spec, message", [
    ("cuda:sm_70", "this nvcc cannot compile for sm_70; it supports sm_75, sm_80"),
    ("cuda:sm_80a", "'a' variants exist from sm_90"),
    ("cuda:sm_90f", "'f' variants from sm_100"),
    ("cuda:sm_8", "this nvcc cannot compile for sm_8;"),
    ("cuda:ampere", "not a CUDA architecture .* nor a CUDA GPU preset"),
    ("cuda:m2-max", "not a CUDA architecture"),                        # a preset, but not a CUDA GPU
    ('{"kind": "cuda", "arch": "sm_80"}', "GPUs are named as --target cuda:sm_XX"),
    ("rocm:gfx942", "ld.lld.*device bitcode.*USE_ROCM=ON"),
    ("metal", "USE_METAL=ON.*run `ember compile` on a Mac"),
    ("webgpu", "Emscripten (emcc.*cannot drive WebGPU"),
    ("vulkan", "USE_VULKAN=ON.*from_source"),
    ("tpu", "is not known"),
    ('{"kind": "llvm", "mcpu": "bogus"}', "LLVM does not know the CPU 'bogus'"),
    ('{"kind": "llvm", "mcpu": ', "malformed target JSON"),
    ('{"mcpu": "znver4"}', "with a 'kind' key"),
    ("missing-target.json", "does not exist"),
])
def test_bad_targets_are_refused_with_the_reason(spec: str, message: str) -> None:
    with pytest.raises(TargetError, match=message.replace("(", r"\(")):
        resolve_target(spec)


def test_cross_compile_without_the_toolchain_names_the_package(tmp_path, monkeypatch) -> None:
    """An aarch64 target links with aarch64-linux-gnu-g++; without it on PATH, compile says which Debian
    package to install, before the model is read (the path is bogus) and without writing anything."""
    from ember.driver.compiler import CompileOptions, compile_model

    monkeypatch.setenv("PATH", str(tmp_path))
    target = '{"kind": "llvm", "mcpu": "cortex-a76", "mtriple": "aarch64-linux-gnu"}'
    with pytest.raises(TargetError, match=r"aarch64-linux-gnu-g\+\+ on PATH; install Debian's g\+\+-aarch64-linux-gnu"):
        compile_model(tmp_path / "no-model", tmp_path / "out", CompileOptions(target=target))
    assert list(tmp_path.iterdir()) == []
    assert resolve_target(target).foreign_architecture == "aarch64-linux-gnu"
    assert resolve_target("cpu").foreign_architecture is None


BOARDS = {"raspberry-pi-5": ("cortex-a76", {"+neon", "+dotprod"}, 4),
          "rk3588": ("cortex-a76", {"+neon", "+dotprod"}, 4),
          "jetson-orin-cpu": ("cortex-a78ae", {"+neon", "+dotprod"}, 12),
          "graviton3": ("neoverse-v1", {"+neon", "+dotprod", "+sve", "+i8mm", "+bf16"}, 64),
          "aarch64": ("generic", {"+v8.2a", "+neon", "+dotprod"}, 4)}


@pytest.mark.parametrize("name", BOARDS)
def test_board_presets_target_their_aarch64_cpu(name) -> None:
    mcpu, mattr, cores = BOARDS[name]
    spec = resolve_target(name)
    assert spec.tvm_target["mtriple"] == "aarch64-linux-gnu" and spec.tvm_target["mcpu"] == mcpu
    assert set(spec.tvm_target["mattr"]) == mattr and spec.num_cores == cores
    assert spec.arch == "aarch64" and spec.vector_bits == 128  # NEON width: TVM emits fixed-width vectors
    assert codegen.target_has_features(["dotprod"], spec.target)


@pytest.mark.parametrize("name", [n for n in BOARDS if n != "aarch64"])
def test_board_presets_feed_analyze(name) -> None:
    hardware = load_hardware(name)
    assert hardware.kind == "cpu" and hardware.source.startswith("https://")
    assert hardware.peak("int8") == 4 * hardware.peak("fp32")  # SDOT: four int8 products per fp32 lane
    assert resolve_target(name).hardware == hardware.name


def test_unknown_board_lists_the_presets() -> None:
    with pytest.raises(TargetError, match=r"'raspberry-pi-9' is not known.*raspberry-pi-5.*rockchip-rk3588.*aarch64"):
        resolve_target("raspberry-pi-9")
