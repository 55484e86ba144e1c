"""Open the device an artifact was compiled for, or say precisely why it cannot run here.

The manifest's target names the device kind (`cpu`, `cuda`, `opencl`) and, for
CUDA, the architecture its kernels were built for. TVM's device support beyond
the CPU lives in separate runtime libraries (`libtvm_runtime_cuda.so`), which
`import tvm` does not load when only the runtime is installed
(`TVM_USE_RUNTIME_LIB=1`), so they are loaded here on demand.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import tvm
import tvm_ffi
from tvm import runtime as tvm_runtime
from tvm_ffi.libinfo import load_lib_ctypes

from ember.core.errors import ArtifactError
from ember.core.manifest import TargetRecord

_DEVICE_NAMES = {"cuda": "CUDA", "opencl": "OpenCL"}
_CUDA_ARCH = re.compile(r"sm_(\d+)([af]?)")


def open_device(target: TargetRecord, artifact: Path, threads: int | None = None) -> tvm_runtime.Device:
    """The first device of the manifest target's kind, checked to exist and to run its code;
    a CPU with its kernels set to run on `threads` threads (`use_cpu_threads`)."""
    kind = target.get("name", "cpu")
    if kind == "cpu":
        use_cpu_threads(threads)
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


def use_cpu_threads(threads: int | None = None) -> int:
    """Make TVM's CPU kernels run on `threads` threads; by default `TVM_NUM_THREADS` if set,
    else one per physical core this process may run on. Returns the count.

    TVM's thread pool reads `TVM_NUM_THREADS` at every parallel launch. Unset, it takes half
    of the logical CPUs on x86 (assuming two hyperthreads per core), re-reading
    /sys/devices/system/cpu/online at each of the ~130 kernel launches of a decode step, and
    runs one thread on a 2-vCPU machine. One thread per physical core is what decode
    (memory-bound) and prefill (FMA-bound) can use. The count is fixed when a thread first
    runs a parallel kernel, so set it before that.

    More threads than the CPUs this process may run on are refused: every kernel launch
    then waits for threads that are not running (64 on 2 CPUs decode very slowly), and
    TVM's pool aborts the process from 256 threads on.
    """
    setting = f"--threads {threads}"
    if threads is None:
        configured = os.environ.get("TVM_NUM_THREADS", "").strip()
        setting = f"TVM_NUM_THREADS={configured}"
        if not configured:
            threads = physical_cores()
        elif configured.isdigit() and int(configured) > 0:
            threads = int(configured)
        else:
            raise ArtifactError(f"{setting}: not a positive whole number")
    if threads < 1:
        raise ArtifactError(f"{setting}: the thread count must be at least 1")
    cpus = len(_usable_cpus())
    if threads > cpus:
        raise ArtifactError(f"{setting}: this process may run on only {cpus} CPUs; use at most {cpus} threads")
    cores = physical_cores()
    if threads > cores:
        logging.getLogger(__name__).warning(
            "ember: warning: %s is more than the %d physical cores: hyperthreads of one core share its units, "
            "so the kernels may run slower than on %d threads", setting, cores, cores)
    os.environ["TVM_NUM_THREADS"] = str(threads)
    return threads


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthreads of one core count once)."""
    cores = set()
    for cpu in _usable_cpus():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:  # no sysfs topology (macOS, some containers): count logical CPUs
            cores.add((str(cpu), ""))
    return max(len(cores), 1)


def _usable_cpus() -> set[int] | range:
    """The logical CPUs this process may run on (its affinity mask where the OS has one)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)


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
