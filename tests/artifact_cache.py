"""Compiled test artifacts kept between sessions, under ~/.cache/ember/test-artifacts/<key>/.

A key is the sha256 of everything that shapes an artifact: the compiler's sources (every .py, and the
hardware presets, under ember/, frontend/, ir/, ir_passes/, schedules/, targets/), the versions of TVM and
of the libraries that read or convert weights, this CPU (model, instruction-set flags, cores), the compile
options, and the bytes of every input file (the checkpoint). An artifact is reused only when none of
them changed. Entries are written to a staging directory and renamed into place, so parallel sessions
never see half an entry; a session copies an entry into its own directory and checks the copy against
its manifest (sizes and sha256 of every file) before use, and recompiles if that fails.
EMBER_TEST_CACHE=0 turns the cache off: every artifact is compiled, as on a cold cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import platform
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from ember.core.errors import EmberError
from ember.core.machine import cpu_model, host_cores, host_cpu_flags
from ember.core.manifest import read_manifest, verify_files

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path.home() / ".cache" / "ember" / "test-artifacts"
COMPILER_DIRS = ("ember", "frontend", "ir", "ir_passes", "schedules", "targets")
# Libraries whose behaviour reaches an artifact: the compiler, and what reads, converts or exports weights.
LIBRARIES = ("apache-tvm", "apache-tvm-ffi", "numpy", "ml_dtypes", "safetensors", "tokenizers", "gguf", "torch",
             "transformers", "onnx", "onnxscript")
# Entries kept per artifact name (the newest used): one per source tree a developer switches between.
KEEP_PER_NAME = 3
DIGEST_CHARS = 32
# This session's artifacts by outcome ("reused", "compiled", "damaged"), for the run's summary.
TALLY: Counter[str] = Counter()
# key -> the environment digest it was made with: `store` refuses a key whose sources changed since (an edit while
# the artifact compiled, in a tree others edit too).
_KEY_ENVIRONMENTS: dict[str, str] = {}


def enabled() -> bool:
    """Whether compiled artifacts are cached (EMBER_TEST_CACHE=0 turns it off)."""
    return os.environ.get("EMBER_TEST_CACHE", "1") != "0"


def _environment_digest() -> str:
    """sha256 of the compiler's sources, the libraries' versions and this CPU, as they are now (~10 ms)."""
    digest = hashlib.sha256()
    for folder in COMPILER_DIRS:
        for path in sorted((REPO_ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".json") and path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{name}=={version}\0".encode())
    flags = " ".join(sorted(host_cpu_flags() or ()))
    digest.update(f"{platform.machine()}\0{cpu_model()}\0{flags}\0{host_cores()}\0".encode())
    return digest.hexdigest()


def artifact_key(what: str, options: object, inputs: Iterable[Path]) -> str:
    """The cache key of an artifact named `what`, compiled with `options` (a dataclass or any repr-able value)
    from the files `inputs` (files, or directories: every file under them)."""
    environment = _environment_digest()
    digest = hashlib.sha256(environment.encode())
    shown = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else options
    digest.update(f"{what}\0{sorted(shown.items()) if isinstance(shown, dict) else shown!r}\0".encode())
    for root in inputs:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    key = f"{what}-{digest.hexdigest()[:DIGEST_CHARS]}"
    _KEY_ENVIRONMENTS[key] = environment
    return key


def restore(key: str, dest: Path) -> bool:
    """Copy the entry of `key` to `dest` and check the copy against its manifest; False (and `dest` absent)
    when there is no entry or the copy does not match it (the damaged entry is then evicted)."""
    entry = CACHE_ROOT / key
    if not enabled() or not entry.exists():
        return False
    try:
        shutil.copytree(entry, dest)
        verify_files(dest, read_manifest(dest))
    except (EmberError, OSError):
        shutil.rmtree(dest, ignore_errors=True)
        _evict(entry)
        TALLY["damaged"] += 1
        return False
    TALLY["reused"] += 1
    os.utime(entry)  # the newest used are the ones `_prune` keeps
    return True


def store(key: str, artifact: Path) -> None:
    """Keep a copy of the compiled `artifact` as the entry of `key`: staged beside it, then renamed into place
    (a session that lost the race to another leaves that one's entry). Failing to store only costs a later
    compile, so errors writing the cache are ignored. An artifact whose compiler sources changed after its key
    was made is not stored: it may hold some of each."""
    TALLY["compiled"] += 1
    if not enabled() or _KEY_ENVIRONMENTS.get(key, _environment_digest()) != _environment_digest():
        return
    staging = CACHE_ROOT / f".{key}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        shutil.copytree(artifact, staging)
        os.rename(staging, CACHE_ROOT / key)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return
    _prune(key[:-DIGEST_CHARS - 1])


def build(key: str, dest: Path, compile_into: Callable[[Path], object]) -> bool:
    """`dest` holds the artifact of `key`: restored from the cache, else compiled by `compile_into(dest)` and
    stored. True when it came from the cache."""
    if restore(key, dest):
        return True
    compile_into(dest)
    store(key, dest)
    return False


def summary() -> str | None:
    """One line on what the cache did this session, or None if no artifact went through it."""
    if not TALLY:
        return None
    state = f"in {CACHE_ROOT}" if enabled() else "off (EMBER_TEST_CACHE=0)"
    counts = ", ".join(f"{TALLY[outcome]} {outcome}" for outcome in ("reused", "compiled", "damaged") if TALLY[outcome])
    return f"compiled test artifacts: {counts}; cache {state}"


def _prune(name: str) -> None:
    """Keep the KEEP_PER_NAME newest used entries of the artifact `name`: each edit of the compiler's sources
    makes new keys, and the old entries would pile up."""
    try:
        entries = [entry for entry in CACHE_ROOT.iterdir() if entry.name[:-DIGEST_CHARS - 1] == name]
        entries.sort(key=lambda entry: entry.stat().st_mtime, reverse=True)
    except OSError:
        return
    for entry in entries[KEEP_PER_NAME:]:
        _evict(entry)


def _evict(entry: Path) -> None:
    """Take a damaged entry out of the cache: renamed away first, so no session copies it half-removed."""
    trash = entry.with_name(f".{entry.name}.evicted-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
