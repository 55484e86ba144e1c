"""Linux's permission for Intel AMX tiles, asked once per process before the first tile instruction.

Linux gives a process the AMX tile state (XTILEDATA, 8 KiB per thread) only after it asks with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; a tile instruction before that dies of
SIGILL. The permission is the process's, so every thread of the kernels' thread pool has it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable

from ember.core.errors import ArtifactError

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
AMX_FLAGS = ("amx_tile", "amx_int8")  # /proc/cpuinfo flags of the extensions AMX int8 kernels use
_granted = False


def needs_amx(cpu_features: list[str] | tuple[str, ...]) -> bool:
    """Whether code for a CPU with `cpu_features` (a manifest's target.cpu_features) may run tile instructions."""
    return "amx_tile" in cpu_features


def _arch_prctl() -> tuple[int, int]:
    """The request's return value and errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    return result, ctypes.get_errno()


def request_amx_permission(what: str, request: Callable[[], tuple[int, int]] | None = None) -> None:
    """Ask Linux for AMX tile state for this process, once; an ArtifactError naming `what` (the artifact) if refused."""
    global _granted
    if _granted:
        return
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        raise ArtifactError(f"{what}: uses Intel AMX tiles, which need Linux on x86_64; recompile it with "
                            f"`--target cpu` for this machine")
    result, error = (request or _arch_prctl)()
    if result != 0:
        reason = os.strerror(error) if error else f"returned {result}"
        hint = " (a kernel older than 5.16 has no AMX support)" if error == errno.EINVAL else ""
        raise ArtifactError(f"{what}: Linux refused this process the AMX tile state (arch_prctl "
                            f"ARCH_REQ_XCOMP_PERM: {reason}){hint}; recompile it without AMX, e.g. `--target cpu`")
    _granted = True
