"""What CPU this process runs on: the fingerprint tuning records and benchmarks are tagged with.

Import-free beyond the standard library, like `errors` and `manifest`: a device that runs
artifacts with only TVM's runtime reports its fingerprint with this module over RPC
(`ember.runtime.rpc_device`), and `ember package` ships it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# ISA extensions that change which code a tuned kernel should be (vector width, FMA, dot products).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
              "asimd", "sve", "sve2", "i8mm", "bf16")


def cpu_fingerprint() -> dict[str, Any]:
    """What a kernel's speed on this CPU depends on: architecture, model, ISA extensions, cores."""
    return {"machine": platform.machine(), "cpu": cpu_model(), "isa": _isa_flags(), "cores": host_cores()}


def host_cores() -> int:
    """Logical CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU's model name as the OS reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _isa_flags() -> list[str]:
    present = host_cpu_flags() or set()
    return [flag for flag in _ISA_FLAGS if flag in present]


def host_cpu_flags() -> set[str] | None:
    """The instruction-set flags this CPU has, as Linux's /proc/cpuinfo lists them (x86's `flags`,
    aarch64's `Features`), or None where the OS does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None
