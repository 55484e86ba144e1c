"""What ember's caches under `~/.cache/ember/` share: the part of their keys that says what this install is (the
versions of the tools that make a cached thing, the sources of ember's packages that make it; a cache keyed by these
starts afresh when either changes), entries written whole or not at all, and their order of last use.

Standard library only: `ember.core` is what the runtime may import, and ships to devices.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import uuid
from collections.abc import Iterable
from pathlib import Path


def installed_versions(*distributions: str) -> str:
    """`name==version` of each installed distribution, NUL-separated."""
    return "".join(f"{name}=={importlib.metadata.version(name)}\0" for name in distributions)


def package_sources_digest(*packages: str) -> str:
    """The sha256 (hex) of every `.py` file of ember's `packages` (`"ir"` is `ember.ir`), with its path. The
    packages are located, not imported: a layer below them may read them as files."""
    digest = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(f"ember.{package}")
        if spec is None or spec.submodule_search_locations is None:
            raise ModuleNotFoundError(f"ember.{package} is not a package of this ember", name=f"ember.{package}")
        (location,) = spec.submodule_search_locations
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def write_entry(path: Path, text: str) -> bool:
    """Write `text` to a staging file beside `path` and rename it into place, so a parallel process reads the whole
    entry or none. False where the disk refused (full, read-only): the entry is then missing, nothing else."""
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    except OSError:
        staging.unlink(missing_ok=True)
        return False
    return True


def newest_first(paths: Iterable[Path]) -> list[Path]:
    """`paths` by time of last use (modification), newest first; one a parallel process removed meanwhile, last."""
    return sorted(paths, key=_modified, reverse=True)


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
