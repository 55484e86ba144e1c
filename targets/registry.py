"""Resolve a user's `--target` string into a `TargetSpec`.

    cpu | host | llvm               this machine's CPU (LLVM's name for it, and every extension its
                                     /proc/cpuinfo lists)
    raspberry-pi-5 | rk3588 | ...    an aarch64 Linux board's CPU (a preset in targets/hardware/ with an
                                     `llvm_target`); `aarch64` is any ARMv8.2-A CPU with dotprod.
                                     Cross-compiled: the library is linked by aarch64-linux-gnu-g++
    '{"kind": "llvm", ...}' | F.json another CPU, as a TVM target JSON (inline or a file)
    cuda                             this machine's CUDA GPU, its architecture detected
    cuda:sm_80 | cuda:sm_90a | ...   a CUDA architecture; compiles without a GPU (needs nvcc)
    cuda:h100 | cuda:nvidia-l4 | ... a GPU hardware preset (targets/hardware/), for its
                                     architecture and memory
    opencl                           any OpenCL device; kernels ship as OpenCL C source

ROCm, Metal, WebGPU and Vulkan are refused with what is missing to build or run them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm.target import Target, codegen

from ember.core.errors import TargetError
from ember.core.machine import host_cpu_flags
from ember.targets.hardware import Hardware, board_preset, board_presets, hardware_presets, host_cores, load_hardware
from ember.targets.int8_dot import Int8Dot, int8_dot_of

# The rest of a GPU's memory is left to the driver context, the KV cache's page
# tables and allocator fragmentation.
GPU_MEMORY_FRACTION = 0.9
_CUDA_ARCH = re.compile(r"sm_(\d+)([af]?)")
# Limits every CUDA GPU ember can compile for (sm_75 and newer) shares; 48 KiB is
# the static shared memory one block may declare.
_CUDA_LIMITS = {"max_num_threads": 1024, "max_threads_per_block": 1024, "thread_warp_size": 32,
                "max_shared_memory_per_block": 48 * 1024, "registers_per_block": 65536}
# Generic host code: the machine driving the GPU is not this one.
_HOST = {"kind": "llvm"}
# `--target aarch64`: the oldest ARM CPUs with an int8 dot product (Cortex-A55/A75 and later), sized for 4 cores.
GENERIC_AARCH64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic",
                   "mattr": ["+v8.2a", "+neon", "+dotprod"], "num-cores": 4}
TVM_FROM_SOURCE = "https://tvm.apache.org/docs/install/from_source.html"
# LLVM's names of the instruction-set extensions generated code may use, as Linux's /proc/cpuinfo spells them (the
# flags x86 lists, the Features aarch64 lists): what a CPU library needs of the machine that runs it. Tuning hints
# ("prefer-256-bit", "fast-gather") and features codegen does not emit on its own are left out; Linux lists AMX and
# APX only where the kernel enabled their register state, which their code needs too.
_CPUINFO_FLAGS = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2",
    "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avxvnni": "avx_vnni", "avxifma": "avx_ifma",
    "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "amx-tile": "amx_tile", "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16", "amx-fp16": "amx_fp16", "egpr": "apx",
    "fp-armv8": "fp", "neon": "asimd", "fullfp16": "asimdhp", "rdm": "asimdrdm", "dotprod": "asimddp",
    "fp16fml": "asimdfhm", "i8mm": "i8mm", "bf16": "bf16", "sve": "sve", "sve2": "sve2", "sme": "sme",
}


@dataclass(frozen=True)
class TargetSpec:
    """A compilation target: the TVM target and the facts passes and schedules choose by."""

    name: str  # "cpu", "cuda" or "opencl": also the TVM device type the runtime opens
    tvm_target: dict[str, Any]
    num_cores: int  # CPU cores, or the GPU's SMs / compute units (0: unknown)
    vector_bits: int  # CPU SIMD width; 0 for GPUs
    arch: str = ""  # GPU architecture, e.g. "sm_90a"; a CPU's machine name ("x86_64", "aarch64")
    hardware: str = ""  # the device the target is sized for: a preset name or the detected GPU
    memory_bytes: int = 0  # that GPU's memory (0: unknown)
    cpu_features: tuple[str, ...] = ()  # a CPU target's instruction-set extensions, as /proc/cpuinfo names them

    @property
    def target(self) -> Target:
        """The TVM `Target` object."""
        return Target(self.tvm_target)

    @property
    def is_gpu(self) -> bool:
        """Whether kernels run on a GPU (thread-block schedules, device memory)."""
        return self.name != "cpu"

    @property
    def default_quantization(self) -> str:
        """`--quant` when none is given: float16 on GPUs (half the bytes, tensor cores), float32 on CPUs."""
        return "q0f16" if self.is_gpu else "q0f32"

    @property
    def default_memory_budget(self) -> int | None:
        """`--memory-budget` when none is given: most of a GPU's memory, which the KV cache is sized to."""
        return int(self.memory_bytes * GPU_MEMORY_FRACTION) if self.is_gpu and self.memory_bytes else None

    @property
    def int8_dot(self) -> Int8Dot | None:
        """The CPU's integer dot product that quantized projections use (`targets/int8_dot.py`), if any."""
        return None if self.is_gpu else int8_dot_of(self.target)

    @property
    def foreign_architecture(self) -> str | None:
        """The target triple of a CPU target for another architecture than this machine's (whose
        library the host linker cannot link), or None."""
        triple = self.tvm_target.get("mtriple") if not self.is_gpu else None
        host = codegen.llvm_get_system_triple()
        return triple if triple and str(triple).split("-")[0] != host.split("-")[0] else None

    @property
    def cuda_graph(self) -> bool:
        """Whether decode is captured as CUDA graphs."""
        return self.name == "cuda"

    def describe(self) -> str:
        """One line for humans: kind, architecture (a CPU's name and the extensions added to it) and the device it
        is sized for."""
        if not self.is_gpu:
            cpu = " ".join([self.tvm_target.get("mcpu", "generic"), *self.tvm_target.get("mattr", [])])
            return f"cpu {cpu}, {self.num_cores} cores"
        sized = f" ({self.hardware}, {self.memory_bytes / 2**30:.0f} GiB)" if self.hardware else ""
        return f"{self.name} {self.arch}".rstrip() + sized

    def to_json(self) -> dict[str, Any]:
        """Plain data for the artifact manifest."""
        return {"name": self.name, "tvm_target": self.tvm_target, "num_cores": self.num_cores,
                "vector_bits": self.vector_bits, "arch": self.arch, "hardware": self.hardware,
                "memory_bytes": self.memory_bytes,
                **({"cpu_features": list(self.cpu_features)} if not self.is_gpu else {})}


def resolve_target(spec: str) -> TargetSpec:
    """Turn a `--target` string (see the module docstring) into a `TargetSpec`."""
    spec = spec.strip()
    if spec in ("cpu", "host", "llvm"):
        return _cpu_target(host_llvm_target())
    if spec == "aarch64":
        return _cpu_target(GENERIC_AARCH64)
    if (board := board_preset(spec)) is not None:
        return dataclasses.replace(_cpu_target(board.llvm_target), hardware=board.name)
    if spec.startswith("{"):
        return _from_dict(_parse_json(spec, "--target"), "--target")
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.exists():
            raise TargetError(f"target file {path} does not exist")
        return _from_dict(_parse_json(path.read_text(encoding="utf-8"), str(path)), str(path))
    kind, _, detail = spec.partition(":")
    if kind == "cuda":
        return _cuda_target(detail) if detail else _detected_cuda_target()
    if spec == "opencl":
        return TargetSpec("opencl", {"kind": "opencl", "host": _HOST}, 0, 0)
    if kind in _REFUSALS:
        raise TargetError(f"--target {spec}: {_REFUSALS[kind]()}")
    boards = ", ".join([*board_presets(), "aarch64"])
    raise TargetError(
        f"--target {spec!r} is not known; use 'cpu' (this machine), an aarch64 board ({boards}; vendor prefix "
        "optional), 'cuda:ARCH' (e.g. cuda:sm_90a), 'cuda' (this machine's GPU), 'opencl', or a TVM target JSON "
        "such as "
        '\'{"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 8}\''
    )


def host_llvm_target() -> dict[str, Any]:
    """This machine's CPU as LLVM names it, with `mattr` adding the extensions its /proc/cpuinfo lists that the
    name lacks. A virtual machine often hides the CPU's model, and LLVM then names an older CPU: a Sapphire Rapids
    VM is "rocketlake" (no AMX, no AVX512-BF16/FP16, no AVX-VNNI), and by the name alone its AMX would go unused."""
    data = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}
    flags = host_cpu_flags()
    if flags:
        named = codegen.llvm_get_cpu_features(Target(data))
        missing = [f"+{feature}" for feature, flag in sorted(_CPUINFO_FLAGS.items())
                   if flag in flags and feature not in named]
        if missing:
            data["mattr"] = missing
    return data


def _from_dict(data: Any, origin: str) -> TargetSpec:
    if not isinstance(data, dict) or "kind" not in data:
        raise TargetError(f"{origin}: a target must be a JSON object with a 'kind' key")
    kind = data["kind"]
    if kind in _REFUSALS:
        raise TargetError(f"{origin}: {_REFUSALS[kind]()}")
    if kind != "llvm":
        raise TargetError(f"{origin}: target kind {kind!r} is not supported in JSON (use 'llvm' for CPUs; "
                          "GPUs are named as --target cuda:sm_XX or --target opencl)")
    triple = data.get("mtriple") or codegen.llvm_get_system_triple()
    if "mcpu" in data and not codegen.llvm_is_valid_cpu(data["mcpu"], triple):
        raise TargetError(f"{origin}: LLVM does not know the CPU {data['mcpu']!r}")
    return _cpu_target(data)


def _cpu_target(data: dict[str, Any]) -> TargetSpec:
    data = dict(data)
    data.setdefault("num-cores", host_cores())
    try:
        target = Target(data)
    except Exception as err:  # TVM raises several internal types for a bad dict
        raise TargetError(f"invalid TVM target {json.dumps(data)}: {err}") from None
    machine = str(target.attrs.get("mtriple") or codegen.llvm_get_system_triple()).split("-")[0]
    return TargetSpec("cpu", data, int(data["num-cores"]), _vector_bits(target), arch=machine,
                      cpu_features=required_cpu_features(target))


def required_cpu_features(target: Target) -> tuple[str, ...]:
    """The instruction-set extensions code for CPU `target` may use (its mcpu's and mattr's, as LLVM resolves them),
    by their /proc/cpuinfo names: the machine that runs the library must list them all."""
    llvm_features = codegen.llvm_get_cpu_features(target)
    return tuple(sorted({flag for feature, flag in _CPUINFO_FLAGS.items() if feature in llvm_features}))


def _vector_bits(target: Target) -> int:
    """The SIMD register width of a CPU target, from its ISA features.

    (`codegen.llvm_get_vector_width` answers for the host on x86: 512 for a Haswell
    target compiled on an AVX-512 machine.)"""
    for features, bits in ((["avx512f"], 512), (["avx"], 256), (["sse2"], 128), (["neon"], 128)):
        if codegen.target_has_features(features, target):
            return bits
    return int(codegen.llvm_get_vector_width(target))


def _cuda_target(detail: str) -> TargetSpec:
    """`cuda:sm_XX` (sized by the smallest preset of that architecture) or `cuda:PRESET`."""
    if _CUDA_ARCH.fullmatch(detail):
        arch = detail
        presets = _cuda_presets(arch)
        hardware = min(presets, key=lambda hw: hw.memory_capacity) if presets else None
    else:
        hardware = _cuda_preset_named(detail)
        arch = hardware.arch
    _check_nvcc(arch)
    if hardware is None:
        return _cuda_spec(arch, "", 0, 0)
    return _cuda_spec(arch, hardware.name, int(hardware.memory_capacity), hardware.compute_units)


def _detected_cuda_target() -> TargetSpec:
    dev = tvm.cuda(0)
    if not dev.exist:
        examples = ", ".join(f"cuda:{arch} ({', '.join(names)})" for arch, names in _archs_of_presets().items()
                             if _nvcc_compiles(arch))
        raise TargetError(f"--target cuda: no CUDA GPU on this machine to detect the architecture from; "
                          f"name it, e.g. {examples}, or a GPU preset such as cuda:h100")
    arch = "sm_" + dev.compute_version.replace(".", "")
    _check_nvcc(arch)
    return _cuda_spec(arch, dev.device_name, int(dev.total_global_memory), int(dev.multi_processor_count))


def _cuda_spec(arch: str, hardware: str, memory_bytes: int, compute_units: int) -> TargetSpec:
    # TVM sees the base architecture: dlight's Matmul reads the arch as a number and
    # would leave tensor cores unused for "sm_90a". nvcc builds for `arch` itself.
    base = "sm_" + _CUDA_ARCH.fullmatch(arch).group(1)
    data = {"kind": "cuda", "arch": base, **_CUDA_LIMITS, "host": _HOST}
    return TargetSpec("cuda", data, compute_units, 0, arch, hardware, memory_bytes)


def _cuda_presets(arch: str) -> list[Hardware]:
    """The GPU presets whose architecture has `arch`'s compute capability (sm_90 matches sm_90a)."""
    version = _CUDA_ARCH.fullmatch(arch).group(1)
    return [hw for hw in _gpu_presets() if (m := _CUDA_ARCH.fullmatch(hw.arch)) and m.group(1) == version]


def _cuda_preset_named(name: str) -> Hardware:
    known = ", ".join(hw.name for hw in _gpu_presets() if _CUDA_ARCH.fullmatch(hw.arch))
    try:
        hardware = load_hardware(name)
    except TargetError:
        hardware = None
    if hardware is None or not _CUDA_ARCH.fullmatch(hardware.arch):
        raise TargetError(f"--target cuda:{name}: not a CUDA architecture (sm_80, sm_86, sm_89, sm_90a, ...) "
                          f"nor a CUDA GPU preset ({known})")
    return hardware


def _gpu_presets() -> list[Hardware]:
    return [hw for hw in map(load_hardware, hardware_presets()) if hw.kind == "gpu" and hw.arch]


def _archs_of_presets() -> dict[str, list[str]]:
    archs: dict[str, list[str]] = {}
    for hw in _gpu_presets():
        if _CUDA_ARCH.fullmatch(hw.arch):
            archs.setdefault(hw.arch, []).append(hw.name.removeprefix("nvidia-"))
    return dict(sorted(archs.items(), key=lambda item: -int(_CUDA_ARCH.fullmatch(item[0]).group(1))))


def _nvcc_compiles(arch: str) -> bool:
    try:
        _check_nvcc(arch)
    except TargetError:
        return False
    return True


def _check_nvcc(arch: str) -> None:
    """Refuse an architecture the CUDA compiler on this machine cannot build for."""
    version, suffix = _CUDA_ARCH.fullmatch(arch).groups()
    if suffix and int(version) < (90 if suffix == "a" else 100):
        raise TargetError(f"--target cuda:{arch}: architecture-specific 'a' variants exist from sm_90 "
                          f"and family 'f' variants from sm_100; use cuda:sm_{version}")
    supported = _nvcc_architectures()
    if f"sm_{version}" not in supported:
        raise TargetError(f"--target cuda:{arch}: this nvcc cannot compile for sm_{version}; "
                          f"it supports {', '.join(supported)}")


@functools.cache
def _nvcc_architectures() -> tuple[str, ...]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise TargetError("compiling for CUDA needs nvcc (the CUDA toolkit) on PATH: ember compiles the "
                          "kernels to SASS and PTX on this machine, so the GPU machine needs only TVM's runtime")
    listed = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, check=True).stdout.split()
    return tuple(sorted(set(listed), key=lambda code: int(_CUDA_ARCH.fullmatch(code).group(1))))


def _rocm_refusal() -> str:
    rocm = Path(os.environ.get("ROCM_PATH", "/opt/rocm"))
    bitcode = rocm / "amdgcn" / "bitcode"
    missing = [what for what, present in (
        ("ld.lld on PATH", shutil.which("ld.lld")),
        (f"ROCm device bitcode in {bitcode} (set ROCM_PATH)", bitcode.is_dir()),
    ) if not present]
    here = (f"missing on this machine: {'; '.join(missing)}" if missing
            else "ember does not package HSA code objects yet")
    return ("ember cannot build ROCm artifacts: TVM's ROCm codegen links each kernel with ld.lld against ROCm's "
            f"device bitcode ({here}), and running needs a TVM built with USE_ROCM=ON on the device "
            f"(the pip wheel has no ROCm runtime; {TVM_FROM_SOURCE})")


def _metal_refusal() -> str:
    return ("ember cannot build Metal artifacts here: the artifact's host library must be linked for macOS by "
            f"Apple's toolchain (xcrun{' is not on PATH' if not shutil.which('xcrun') else ''}) and run by a TVM "
            f"built with USE_METAL=ON (the pip wheel for Linux has no Metal runtime); run `ember compile` on a Mac "
            f"with such a TVM ({TVM_FROM_SOURCE})")


def _webgpu_refusal() -> str:
    return ("ember cannot build WebGPU artifacts: WebGPU kernels run in a browser under TVM's web runtime, whose "
            f"wasm32 host module is linked by Emscripten (emcc{' is not on PATH' if not shutil.which('emcc') else ''}) "
            "against TVM's wasm runtime built from source (web/ in the TVM repository); ember's runtime is Python "
            "and cannot drive WebGPU")


def _vulkan_refusal() -> str:
    return ("Vulkan needs a TVM built from source with USE_VULKAN=ON: the pip wheel has neither the SPIR-V "
            f"codegen nor the Vulkan runtime ({TVM_FROM_SOURCE})")


_REFUSALS = {"rocm": _rocm_refusal, "metal": _metal_refusal, "webgpu": _webgpu_refusal, "vulkan": _vulkan_refusal}



def _parse_json(text: str, origin: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TargetError(f"{origin}: malformed target JSON: {err}") from None
