"""Parsed kernels kept between processes, under `~/.cache/ember/kernels/<sources>/`.

A kernel template's TVMScript parses in 0.3-1 s; the same PrimFunc loads from TVM's JSON
in 2-3 ms and compares structurally equal. A compile parses tens of kernels, and
`parsed_once` shares them only within one process: each `ember compile`, `ember tune`
or test worker parsed them again. Measured on the demo model (q4f32, this host's
target, a fresh process): parsing was 4.6 s of a 12.7 s compile.

- An entry is one PrimFunc as TVM's JSON, named by the sha256 of its builder's qualified
  name and its arguments' values (`tvmscript._value_key`).
- Its directory is named by the digest of everything else that shapes a kernel: the
  sources of the packages that build kernels (ember's `ir`, `schedules`, `targets` and
  `core`) and the versions of ember, TVM and tvm-ffi. Any edit starts a new directory;
  the `KEPT_SOURCE_TREES` used last are kept, older ones removed.
- Only builders of ember's packages and TVM's are kept (their code is in the digest);
  another builder, such as a test's, is parsed in every process.
- Entries are written to a staging file and renamed into place, so a parallel process
  never reads half of one; one that does not load is parsed again and replaced.
- `EMBER_KERNEL_CACHE=0` turns it off; where the directory cannot be made, kernels are parsed as without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm_ffi.serialization import from_json_graph_str

from ember.core.caches import installed_versions, newest_first, package_sources_digest, write_entry
from ember.core.machine import cache_dir

# Source trees (kernel directories) kept: a developer switching between branches keeps each one's kernels.
KEPT_SOURCE_TREES = 4
# Packages whose code a kernel builder runs; their sources are part of every entry's directory name.
KERNEL_PACKAGES = ("ir", "schedules", "targets", "core")
# Builders from these modules are kept: ember's own (their sources are in the digest) and TVM's (its version is).
KEPT_BUILDER_MODULES = ("ember.", "tvm.")
_VERSIONS = ("ember", "apache-tvm", "apache-tvm-ffi")


def tool_versions() -> str:
    """The installed versions of ember, TVM and tvm-ffi, for a cache key: what they build changes with them."""
    return installed_versions(*_VERSIONS)


def enabled() -> bool:
    return os.environ.get("EMBER_KERNEL_CACHE", "1") != "0"


def load_or_build(builder: Callable, key: object, build: Callable[[], object]) -> object:
    """The kernel `builder` makes for the arguments keyed `key`: loaded from the store, else `build()`, stored when it
    is a PrimFunc. Anything the store cannot hold (another module's builder, a key naming an object by its address)
    is built."""
    path = _entry_path(builder, key)
    if path is None:
        return build()
    try:
        # Not `tvm.ir.load_json`: its upgrade from older TVMs' JSON, in Python, takes 20 times the load itself; the
        # entry was written by this TVM (its version is in the directory's digest).
        return from_json_graph_str(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    except Exception:  # damaged or written by another TVM: parse it again and replace it
        with contextlib.suppress(OSError):  # a store this user may not write: parsed, as without it
            path.unlink(missing_ok=True)
    kernel = build()
    if isinstance(kernel, tvm.tirx.PrimFunc):
        write_entry(path, tvm.ir.save_json(kernel))  # a full or read-only disk costs the next process a parse
    return kernel


def _entry_path(builder: Callable, key: object) -> Path | None:
    if not enabled() or not builder.__module__.startswith(KEPT_BUILDER_MODULES):
        return None
    described = repr(key)
    if " at 0x" in described:  # an object without a value representation: not the same in another process
        return None
    tree = _source_tree()
    if tree is None:
        return None
    name = f"{builder.__module__}.{builder.__qualname__}\0{described}"
    return tree / f"{hashlib.sha256(name.encode()).hexdigest()}.json"


@functools.cache
def _source_tree() -> Path | None:
    """This process's kernel directory, created and marked as the newest used; older ones beyond the kept count go.
    None where it cannot be made (a read-only home, a file in its place): kernels are then parsed, as without it."""
    root = cache_dir() / "kernels"
    tree = root / _sources_digest()
    try:
        tree.mkdir(parents=True, exist_ok=True)
        os.utime(tree)
    except OSError:
        return None
    others = newest_first(p for p in root.iterdir() if p.is_dir() and p != tree)
    for old in others[KEPT_SOURCE_TREES - 1:]:
        shutil.rmtree(old, ignore_errors=True)
    return tree


def _sources_digest() -> str:
    return hashlib.sha256((package_sources_digest(*KERNEL_PACKAGES) + tool_versions()).encode()).hexdigest()[:32]
