"""Compiled test artifacts kept between sessions, under ~/.cache/ember/test-artifacts/<key>/.

A key is the sha256 of everything that shapes an artifact: the compiler's sources (every .py, and the
hardware presets, of COMPILER_SOURCES: not the CLI, nor the runtime beyond the names the compiler takes from
it), the versions of ember, of TVM and of the libraries that read or convert weights, this CPU (model,
instruction-set flags, cores), the compile options, and the bytes of every input file (the checkpoint). An
artifact is reused only when none of them changed. Entries are written to a staging directory and renamed
into place, so parallel sessions never see half an entry; a session copies an entry into its own directory
and checks the copy against its manifest (sizes and sha256 of every file) before use, and recompiles if that
fails. One key is built by one process at a time (a lock file per key, beside the cache): parallel test
workers that need the same artifact compile it once, the others wait and restore it.

A manifest records where its artifact was compiled from (`source`, and an ONNX file's `config_dir`): a
stored entry names its inputs by placeholder instead, and a restored copy names the inputs of the session
that restored it, resealed (`manifest_sha256`), so it reads as compiled from this session's checkpoint.
EMBER_TEST_CACHE=0 turns the cache off: every artifact is compiled, as on a cold cache.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ember.core.errors import EmberError
from ember.core.machine import cpu_model, host_cores, host_cpu_flags
from ember.core.manifest import MANIFEST_NAME, manifest_digest, read_manifest, verify_files

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path.home() / ".cache" / "ember" / "test-artifacts"
# What shapes a compiled artifact: the compile driver and the stages it runs (folders, or single files). The CLI
# only parses options into CompileOptions (part of the key); the runtime gives the compiler one name
# (runtime/artifact.py's PARAM_TYPES_FUNCTION), and its other modules serve tuning's and bench's measurements.
COMPILER_SOURCES = ("src/ember/__init__.py", "src/ember/core", "src/ember/driver", "frontend", "ir", "ir_passes",
                    "schedules", "targets", "runtime/artifact.py")
# Libraries whose behaviour reaches an artifact: ember's version (in every manifest), the compiler, and what reads,
# converts or exports weights.
LIBRARIES = ("ember", "apache-tvm", "apache-tvm-ffi", "numpy", "ml_dtypes", "safetensors", "tokenizers", "gguf",
             "torch", "transformers", "onnx", "onnxscript")
# Entries kept per artifact name (the newest used): one per source tree a developer switches between.
KEEP_PER_NAME = 3
DIGEST_CHARS = 32
# This session's artifacts by outcome ("reused", "compiled", "damaged"), and the seconds spent compiling them, for
# the run's summary.
TALLY: Counter[str] = Counter()
compile_seconds = 0.0
# key -> the environment digest it was made with: `store` refuses a key whose sources changed since (an edit while
# the artifact compiled, in a tree others edit too).
_KEY_ENVIRONMENTS: dict[str, str] = {}
# key -> its input paths, resolved: a stored manifest names them by placeholder, a restored one by these.
_KEY_INPUTS: dict[str, list[str]] = {}
PLACEHOLDER = "<test-artifact input {}>"


def enabled() -> bool:
    """Whether compiled artifacts are cached (EMBER_TEST_CACHE=0 turns it off)."""
    return os.environ.get("EMBER_TEST_CACHE", "1") != "0"


def _environment_digest() -> str:
    """sha256 of the compiler's sources, the libraries' versions and this CPU, as they are now (~10 ms)."""
    digest = hashlib.sha256()
    for source in COMPILER_SOURCES:
        root = REPO_ROOT / source
        for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
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
    inputs = list(inputs)
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
    _KEY_INPUTS[key] = [str(Path(root).resolve()) for root in inputs]
    return key


def restore(key: str, dest: Path) -> bool:
    """Copy the entry of `key` to `dest`, naming this session's inputs, and check the copy against its manifest;
    False (and `dest` absent) when there is no entry or the copy does not match it (the damaged entry is then
    evicted)."""
    entry = CACHE_ROOT / key
    if not enabled() or not entry.exists():
        return False
    try:
        shutil.copytree(entry, dest)
        _relocate(dest, {PLACEHOLDER.format(n): path for n, path in enumerate(_KEY_INPUTS.get(key, []))})
        verify_files(dest, read_manifest(dest))
    except (EmberError, OSError, ValueError):
        shutil.rmtree(dest, ignore_errors=True)
        _evict(entry)
        TALLY["damaged"] += 1
        return False
    TALLY["reused"] += 1
    os.utime(entry)  # the newest used are the ones `_prune` keeps
    return True


def store(key: str, artifact: Path) -> None:
    """Keep a copy of the compiled `artifact` as the entry of `key`, its inputs named by placeholder: staged beside
    it, then renamed into place (a session that lost the race to another leaves that one's entry). Failing to
    store only costs a later compile, so errors writing the cache are ignored. An artifact whose compiler sources
    changed after its key was made is not stored: it may hold some of each."""
    TALLY["compiled"] += 1
    if not enabled() or _KEY_ENVIRONMENTS.get(key, _environment_digest()) != _environment_digest():
        return
    staging = CACHE_ROOT / f".{key}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        shutil.copytree(artifact, staging)
        _relocate(staging, {path: PLACEHOLDER.format(n) for n, path in enumerate(_KEY_INPUTS.get(key, []))})
        os.rename(staging, CACHE_ROOT / key)
    except (OSError, ValueError):
        shutil.rmtree(staging, ignore_errors=True)
        return
    _prune(key[:-DIGEST_CHARS - 1])


def build(key: str, dest: Path, compile_into: Callable[[Path], object]) -> bool:
    """`dest` holds the artifact of `key`: restored from the cache, else compiled by `compile_into(dest)` and
    stored. True when it came from the cache."""
    global compile_seconds
    with locked([key]):
        if restore(key, dest):
            return True
        started = time.monotonic()
        compile_into(dest)
        compile_seconds += time.monotonic() - started
        store(key, dest)
    return False


@contextmanager
def locked(keys: Iterable[str]) -> Iterator[None]:
    """Hold the lock of each key (taken in sorted order, so two holders of several never wait on each other):
    another process building one of them waits until this one stored it. No locks while the cache is off."""
    with ExitStack() as held:
        if enabled():
            _lock_root().mkdir(parents=True, exist_ok=True)
            for key in sorted(set(keys)):
                lock = held.enter_context(open(_lock_root() / key, "a"))
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _lock_root() -> Path:
    """The lock files' folder: beside the cache, so listing the cache shows entries only."""
    return CACHE_ROOT.with_name(CACHE_ROOT.name + ".locks")


def _relocate(artifact: Path, renames: dict[str, str]) -> None:
    """Rewrite every path in the manifest of `artifact` that is, or lies under, a key of `renames` to lie under
    its value instead, and reseal the manifest (`manifest_sha256`) when anything changed."""
    path = artifact / MANIFEST_NAME
    data = json.loads(path.read_text(encoding="utf-8"))

    def renamed(value: Any) -> Any:
        if isinstance(value, dict):
            return {name: renamed(item) for name, item in value.items()}
        if isinstance(value, list):
            return [renamed(item) for item in value]
        if isinstance(value, str):
            for old, new in renames.items():
                if value == old or value.startswith(old + "/"):
                    return new + value[len(old):]
        return value

    relocated = renamed(data)
    if relocated != data:
        relocated["manifest_sha256"] = manifest_digest(relocated)
        path.write_text(json.dumps(relocated, indent=2) + "\n", encoding="utf-8")


def summary() -> str | None:
    """One line on what the cache did this session, or None if no artifact went through it."""
    if not TALLY:
        return None
    state = f"in {CACHE_ROOT}" if enabled() else "off (EMBER_TEST_CACHE=0)"
    counts = ", ".join(f"{TALLY[outcome]} {outcome}" for outcome in ("reused", "compiled", "damaged") if TALLY[outcome])
    compiling = f" in {compile_seconds:.0f} s (all workers)" if TALLY["compiled"] else ""
    return f"compiled test artifacts: {counts}{compiling}; cache {state}"


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
        # Its lock goes too: an outdated key's, which no session builds any more.
        _lock_root().joinpath(entry.name).unlink(missing_ok=True)


def _evict(entry: Path) -> None:
    """Take a damaged entry out of the cache: renamed away first, so no session copies it half-removed."""
    trash = entry.with_name(f".{entry.name}.evicted-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
