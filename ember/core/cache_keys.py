"""What an install of ember is, as part of a cache key: the versions of the tools that make a cached thing and the
sources of ember's packages that make it. A cache keyed by these starts afresh when either changes.

Standard library only: `ember.core` is what the runtime may import, and ships to devices.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path


def installed_versions(*distributions: str) -> str:
    """`name==version` of each installed distribution, NUL-separated."""
    return "".join(f"{name}=={importlib.metadata.version(name)}\0" for name in distributions)


def package_sources_digest(*packages: str) -> str:
    """The sha256 (hex) of every `.py` file of ember's `packages` (`"ir"` is `ember.ir`), with its path. The
    packages are located, not imported: a layer below them may read them as files."""
    digest = hashlib.sha256()
    for package in packages:
        (location,) = importlib.util.find_spec(f"ember.{package}").submodule_search_locations
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()
