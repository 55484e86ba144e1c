"""Load TVM without the torch it would load beside it.

When torch is installed, `import tvm` imports it too: `tvm_ffi` (apache-tvm-ffi 0.1.14) for an
optional fast exchange of torch tensors, and `tvm.relax.base_py_module` for modules that call
torch functions; ember uses neither. On a machine that has torch (an ML developer's, or ember's
test extra) that made `import tvm` take 2.45 s and 397 MB instead of 0.70 s and 195 MB, so every
`ember` command started 1.8 s late and `ember serve` held 200 MB more (2 cores of an AMD EPYC,
torch 2.13.0). Both try the import and go on without torch when it fails, so the CLI and the
runtime package (`ember.runtime`, which a device server or a script imports) install a finder
that fails it for them, and only while TVM itself is being imported: torch stays importable
afterwards, and TVM takes torch tensors through DLPack like any other (`ember compile
--frontend torch-export` works the same). A process that imported torch or TVM first is left
as it is.
"""

from __future__ import annotations

import importlib.abc
import sys


class _TorchHiddenFromTVM(importlib.abc.MetaPathFinder):
    """Refuses `import torch` made while `tvm_ffi` or `tvm` is being imported; passes on every other import."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" and any(_being_imported(package) for package in ("tvm_ffi", "tvm")):
            raise ModuleNotFoundError("torch is not loaded for TVM's optional torch interop", name="torch")
        return None


def _being_imported(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def hide_torch_from_tvm() -> None:
    """From now on, TVM's own import loads no torch (no effect on a TVM already imported)."""
    if not any(isinstance(finder, _TorchHiddenFromTVM) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchHiddenFromTVM())
