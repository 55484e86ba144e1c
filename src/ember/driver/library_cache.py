"""Built libraries kept between compiles, under `~/.cache/ember/libraries/<digest>/`.

Generating code is most of a compile: TVM's TIR lowering and LLVM (nvcc for CUDA) took 5.0 s of the tiny test
llama's 5.9 s (q4f32, this host's target). What it builds depends on the lowered module and the target, not on
the weights' values: a checkpoint fine-tuned from another, the same model compiled again into another directory,
or the middle stages of a `--pipeline-stages` split build the same library.

- An entry is a library and the module it was built from (TVM's JSON); `codegen` keeps the objects of its
  families of kernels the same way, each with the module of that family's kernels. Its directory is named by the
  digest of the module's structural hash and everything else that shapes the library: the code generator's recipe
  (target, linker, nvcc's version) and the versions of ember, TVM and tvm-ffi.
- A hash is not proof: an entry is used only for a module structurally equal to the one it stores, and its
  library only with the sha256 recorded beside it; an entry that does not load, holds another module or a changed
  library is built again and replaced.
- Entries are staged beside the others and renamed into place, so a parallel compile never reads half of one.
  The most recently used are kept, up to `KEPT_BYTES` in all.
- `EMBER_LIBRARY_CACHE=0` turns it off; where the directory cannot be made or written, libraries are built as
  without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import tvm
import tvm_ffi
from tvm_ffi.serialization import from_json_graph_str, to_json_graph_str

from ember.core.machine import cache_dir
from ember.ir import kernel_store

log = logging.getLogger(__name__)

# Bytes of entries kept, the most recently used first (the tiny test llama's entry, q4f32 for this host, is 3.7 MB).
KEPT_BYTES = 2 * 2**30
LIBRARY_FILE = "library"
MODULE_FILE = "module.json"
DIGEST_FILE = "library.sha256"


def enabled() -> bool:
    return os.environ.get("EMBER_LIBRARY_CACHE", "1") != "0"


def build_once(mod: tvm.IRModule, recipe: str, path: Path, build: Callable[[Path], None]) -> bool:
    """Write the library of `mod` to `path`: copied from the cache when it holds one built from an equal module
    with the same `recipe`, else `build(path)` and stored. True when it was copied."""
    entry = _entry(mod, recipe) if enabled() else None
    if entry is not None and _matches(entry, mod) and _copied(entry, path):
        log.info("library reused from %s (built before from an equal module)", entry)
        return True
    build(path)
    if entry is not None:
        _store(entry, mod, path)
    return False


def _entry(mod: tvm.IRModule, recipe: str) -> Path:
    digest = hashlib.sha256(f"{tvm_ffi.structural_hash(mod)}\0{recipe}\0{kernel_store.tool_versions()}".encode())
    return cache_dir() / "libraries" / digest.hexdigest()[:32]


def _matches(entry: Path, mod: tvm.IRModule) -> bool:
    try:
        stored = from_json_graph_str((entry / MODULE_FILE).read_text(encoding="utf-8"))
    except Exception:  # absent, damaged or of another TVM: built (again) and stored
        return False
    return (entry / DIGEST_FILE).is_file() and tvm_ffi.structural_equal(stored, mod)


def _copied(entry: Path, path: Path) -> bool:
    """Whether the library of `entry` was copied to `path`, its digest the one recorded beside it."""
    # A new file renamed over `path`, never `path` rewritten: a process may have it loaded.
    copied = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        shutil.copyfile(entry / LIBRARY_FILE, copied)
        if _sha256(copied) != (entry / DIGEST_FILE).read_text(encoding="ascii"):
            raise OSError(f"{entry / LIBRARY_FILE} is not the library stored")
        os.replace(copied, path)
        os.utime(entry)
    except OSError:  # changed, or replaced by a parallel compile meanwhile: built again
        copied.unlink(missing_ok=True)
        return False
    return True


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _store(entry: Path, mod: tvm.IRModule, library: Path) -> None:
    staging = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}")
    try:
        staging.mkdir(parents=True)
        (staging / MODULE_FILE).write_text(to_json_graph_str(mod), encoding="utf-8")
        shutil.copyfile(library, staging / LIBRARY_FILE)
        (staging / DIGEST_FILE).write_text(_sha256(library), encoding="ascii")
        shutil.rmtree(entry, ignore_errors=True)  # a damaged entry, or another module of the same hash
        os.rename(staging, entry)
    except OSError:  # a full or read-only disk, or a parallel compile that stored it first: built next time
        shutil.rmtree(staging, ignore_errors=True)
        return
    _prune(entry.parent)


def _prune(root: Path) -> None:
    """Remove the least recently used entries beyond KEPT_BYTES in all (and staging left by a killed compile)."""
    entries = []
    for entry in root.iterdir():
        try:
            entries.append((entry.stat().st_mtime, sum(f.stat().st_size for f in entry.iterdir()), entry))
        except OSError:  # removed by a parallel compile
            continue
    kept = 0
    for _, size, entry in sorted(entries, reverse=True):
        kept += size
        if kept > KEPT_BYTES:
            shutil.rmtree(entry, ignore_errors=True)
