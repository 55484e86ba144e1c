"""Open the device an artifact was compiled for, or say precisely why it cannot run here.

The manifest's target names the device kind (`cpu`, `cuda`, `opencl`) and, for
CUDA, the architecture its kernels were built for. TVM's device support beyond
the CPU lives in separate runtime libraries (`libtvm_runtime_cuda.so`), which
`import tvm` does not load when only the runtime is installed
(`TVM_USE_RUNTIME_LIB=1`), so they are loaded here on demand.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import runtime as tvm_runtime
from tvm_ffi.libinfo import load_lib_ctypes

from ember.errors import ArtifactError

_DEVICE_NAMES = {"cuda": "CUDA", "opencl": "OpenCL"}
_CUDA_ARCH = re.compile(r"sm_(\d+)([af]?)")


def open_device(target: dict[str, Any], artifact: Path) -> tvm_runtime.Device:
    """The first device of the manifest target's kind, checked to exist and to run its code."""
    kind = target.get("name", "cpu")
    if kind == "cpu":
        return tvm_runtime.cpu(0)
    arch = target.get("arch", "")
    compiled_for = f"{artifact}: artifact was compiled for {kind} {arch}".rstrip()
    name = _DEVICE_NAMES.get(kind, kind)
    problem = _load_device_runtime(kind, name)
    if problem:
        raise ArtifactError(f"{compiled_for}; no {name} device found ({problem})")
    dev = tvm_runtime.device(kind, 0)
    if not dev.exist:
        raise ArtifactError(f"{compiled_for}; no {name} device found")
    if kind == "cuda" and not cuda_arch_runs_on(arch, dev.compute_version):
        have = "sm_" + dev.compute_version.replace(".", "")
        raise ArtifactError(f"{compiled_for}; this GPU ({dev.device_name}, compute capability "
                            f"{dev.compute_version}) cannot run it: recompile with --target cuda:{have}")
    return dev


def cuda_arch_runs_on(arch: str, compute_version: str) -> bool:
    """Whether a fatbin built for `arch` (SASS + PTX) loads on a GPU of `compute_version` ("8.6")."""
    match = _CUDA_ARCH.fullmatch(arch)
    if match is None:
        return False
    built, suffix = int(match.group(1)), match.group(2)
    major, minor = (int(part) for part in compute_version.split("."))
    have = major * 10 + minor
    if suffix == "a":  # architecture-specific features: that exact GPU generation only
        return have == built
    if suffix == "f":  # family-specific: the same major version, this minor or newer
        return major == built // 10 and have >= built
    return have >= built  # SASS for the same major version, PTX JIT-compiled on newer ones


def _load_device_runtime(kind: str, name: str) -> str:
    """Load TVM's runtime library for `kind` unless loaded; why it cannot be, or "" once it is."""
    if tvm_ffi.get_global_func(f"device_api.{kind}", allow_missing=True) is not None:
        return ""
    try:
        load_lib_ctypes(package="tvm", target_name=f"tvm_runtime_{kind}", mode="RTLD_LOCAL",
                        extra_lib_paths=tvm.libinfo.package_lib_paths())
    except RuntimeError:  # the library is not there at all
        return (f"this TVM has no {name} runtime (libtvm_runtime_{kind}.so); "
                f"install a TVM built with USE_{kind.upper()}=ON")
    except OSError as err:  # there, but what it links against is not (no driver)
        return f"TVM's {name} runtime library does not load: {err}"
    if tvm_ffi.get_global_func(f"device_api.{kind}", allow_missing=True) is None:
        return f"libtvm_runtime_{kind}.so registered no {name} device API"
    return ""
