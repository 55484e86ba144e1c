"""Import TVM's runtime alone, for a process that runs artifacts and compiles nothing.

`import tvm` loads the compiler library (`libtvm_compiler.so`, 248 MB) and imports `tvm.relax` and
the schedule packages beside the runtime, unless `TVM_USE_RUNTIME_LIB=1` is set while it is imported.
ember's runtime needs none of them: it runs on devices that have only TVM's runtime libraries. The
commands that only run artifacts import TVM this way; on 2 cores of an AMD EPYC (Zen 3) that took
0.65 s instead of 1.35 s of each command's start. The variable is set only while TVM is imported,
so the processes such a command starts (Ray's workers, for one) see the environment it was given.
"""

from __future__ import annotations

import os
import sys

RUNTIME_ONLY_VARIABLE = "TVM_USE_RUNTIME_LIB"


def import_tvm_runtime_only() -> None:
    """Import TVM with its runtime libraries only; no effect where this process has imported TVM already."""
    if "tvm" in sys.modules:
        return
    given = os.environ.get(RUNTIME_ONLY_VARIABLE)
    os.environ[RUNTIME_ONLY_VARIABLE] = "1"
    try:
        import tvm  # noqa: F401
    finally:
        if given is None:
            del os.environ[RUNTIME_ONLY_VARIABLE]
        else:
            os.environ[RUNTIME_ONLY_VARIABLE] = given
