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

try:
    import resource
except ImportError:  # not on Windows: no rlimits there
    _HAVE_RLIMITS = False
else:
    _HAVE_RLIMITS = True

# ISA extensions that change which code a tuned kernel should be (vector width, FMA, dot products).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
              "asimd", "sve", "sve2", "i8mm", "bf16")


def cache_dir() -> Path:
    """ember's cache on this machine: `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"


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
    """The instruction-set flags this CPU has, named as Linux's /proc/cpuinfo names them (x86's `flags`,
    aarch64's `Features`), or None where the OS does not say."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        flags = _aarch64_hwcaps()
        if flags is not None:
            return flags
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


# Linux's arm64 hwcap bits (arch/arm64/include/uapi/asm/hwcap.h), by their /proc/cpuinfo names.
_HWCAP_NAMES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc "
                "dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg").split()
_HWCAP2_NAMES = ("dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm "
                 "svebf16 i8mm bf16 dgh rng bti mte").split()
_AT_HWCAP, _AT_HWCAP2 = 16, 26


def _aarch64_hwcaps() -> set[str] | None:
    """The CPU's features from the auxiliary vector, which /proc/cpuinfo's `Features` line is printed from; unlike
    that file, it is also right for a process under qemu-user, which shows the host's /proc/cpuinfo."""
    import ctypes

    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return None
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    hwcap, hwcap2 = getauxval(_AT_HWCAP), getauxval(_AT_HWCAP2)
    if not hwcap:
        return None
    return ({name for bit, name in enumerate(_HWCAP_NAMES) if hwcap >> bit & 1}
            | {name for bit, name in enumerate(_HWCAP2_NAMES) if hwcap2 >> bit & 1})


def available_memory() -> tuple[int, str] | None:
    """Bytes this process can still allocate, and what bounds them: the least of what the kernel can give without
    swapping (MemAvailable) and the headroom under this process's rlimits and its cgroup's memory limit."""
    figures = [_mem_available(), *memory_limits()]
    known = [figure for figure in figures if figure is not None]
    return min(known, key=lambda figure: figure[0]) if known else None


def memory_limits() -> list[tuple[int, str]]:
    """The headroom under each memory limit set on this process (its address-space and data rlimits, what is
    already mapped subtracted, and its cgroup's limits, what the cgroup uses subtracted), each with its name."""
    limits = []
    if _HAVE_RLIMITS:
        status = _proc_status_bytes()
        for name, used, hint in (("RLIMIT_AS", "VmSize", "ulimit -v"), ("RLIMIT_DATA", "VmData", "ulimit -d")):
            soft, _ = resource.getrlimit(getattr(resource, name))
            if soft != resource.RLIM_INFINITY:
                limits.append((max(soft - status.get(used, 0), 0), f"{name} = {soft} bytes, `{hint}`"))
    return limits + _cgroup_headroom()


def _mem_available() -> tuple[int, str] | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"
    except (OSError, ValueError, AttributeError):
        return None


def _proc_status_bytes() -> dict[str, int]:
    """/proc/self/status's memory figures (VmSize, VmData, ...) in bytes; empty where there is none."""
    figures = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith(" kB"):
                figures[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return figures


# Per cgroup version: the controller's mount, the limit and usage files, and /proc/self/cgroup's line prefix.
_CGROUPS = (("/sys/fs/cgroup", "memory.max", "memory.current", "0::"),
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", ""))


def _cgroup_headroom() -> list[tuple[int, str]]:
    """The headroom under the memory limit of this process's cgroup and of each cgroup above it (v2, else v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    for mount, limit_file, usage_file, prefix in _CGROUPS:
        own = next((line.split(":", 2)[2] for line in lines if line.startswith(prefix) and
                    (prefix or "memory" in line.split(":", 2)[1].split(","))), None)
        if own is None or not os.path.exists(os.path.join(mount, limit_file)):
            continue
        # Inside a container the mount is often the container's own cgroup, not the host's root.
        directory = Path(mount, own.lstrip("/"))
        directories = [directory, *directory.parents] if directory.is_dir() else [Path(mount)]
        headroom = []
        for path in directories:
            if not str(path).startswith(mount):
                break
            try:
                limit = (path / limit_file).read_text().strip()
                if limit != "max" and int(limit) < 2**62:  # v1 writes "no limit" as a page-rounded 2**63
                    used = int((path / usage_file).read_text())
                    headroom.append((max(int(limit) - used, 0), f"the cgroup memory limit {path / limit_file}"))
            except (OSError, ValueError):
                continue
        return headroom
    return []
