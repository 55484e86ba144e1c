"""`ember package ARTIFACT -o DIR`: what to copy to a device that runs an artifact without the compiler.

DIR holds the artifact (`DIR/artifact/`), ember's runtime as an importable package (`DIR/ember/`:
the import-free `__init__`, the bottom layer `core/` and `runtime/`, none of which imports the
compiler, torch or transformers; pyproject.toml's import-linter contract keeps it so), the
distribution metadata that gives `ember.__version__`, and `requirements-runtime.txt`. On the
device: `pip install -r DIR/requirements-runtime.txt`, then with `PYTHONPATH=DIR` and
`TVM_USE_RUNTIME_LIB=1` (TVM's runtime library only) `ember.runtime.load_artifact("DIR/artifact")`.
Written into a staging directory and renamed, so DIR is never half-written.

The artifact is verified first, as the runtime verifies it (`verify_files`: exactly the listed files,
regular, of their sizes and hashes), and only the listed files and the manifest are copied, each opened
without following a link and hashed again as it is copied: a link, device, FIFO, extra or truncated
file, and a DIR inside the artifact, are refused in one line naming the path, and nothing outside
the artifact is ever read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import ember
from ember.core.errors import ArtifactError, EmberError
from ember.core.manifest import (
    MANIFEST_NAME,
    Manifest,
    check_whole_model,
    open_regular,
    read_manifest,
    verify_files,
    verify_pipeline_stages,
)
from ember.driver.artifact_dir import check_new_dir, replace_dir, staging_dir

ARTIFACT_SUBDIR = "artifact"
REQUIREMENTS_NAME = "requirements-runtime.txt"
# The packages a packaged artifact runs with, below ember's import-free `__init__`.
RUNTIME_PACKAGES = ("ember.core", "ember.runtime")


def runtime_requirements() -> str:
    """The runtime's pip requirements (package data of `ember.runtime`)."""
    return (_package_dir("ember.runtime") / "requirements.txt").read_text(encoding="utf-8")


def _package_dir(name: str) -> Path:
    """The directory package `name` is imported from, found without importing it: importing `ember.runtime` loads
    TVM, which packaging does not use."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmberError(f"ember's package {name} is not installed with this ember; reinstall ember")
    return Path(next(iter(spec.submodule_search_locations)))


def package_artifact(artifact: Path, output_dir: Path) -> Path:
    """Gather `artifact` and the runtime into `output_dir` (which must be new or empty); returns it."""
    artifact, output_dir = Path(artifact), Path(output_dir)
    where = Path(os.path.realpath(artifact))
    if where == Path(os.path.realpath(output_dir)) or where in Path(os.path.realpath(output_dir)).parents:
        raise EmberError(f"-o {output_dir}: is inside the artifact {artifact}; choose a directory outside it")
    manifest = read_manifest(artifact)  # refuses what is not an artifact, naming the file
    check_whole_model(artifact, manifest)
    if manifest.pipeline is not None:
        verify_pipeline_stages(artifact, manifest)
    else:
        verify_files(artifact, manifest)
    check_new_dir(output_dir)
    with staging_dir(output_dir) as staging:
        _copy_artifact(artifact, manifest, staging / ARTIFACT_SUBDIR)
        _copy_runtime(staging)
        replace_dir(staging, output_dir, check=check_new_dir)
    return output_dir


def _copy_artifact(artifact: Path, manifest: Manifest, copy: Path) -> None:
    """The manifest's files and the manifest itself, each checked against the manifest as it is copied
    (the artifact may change after `verify_files`); nothing else under `artifact` is opened."""
    copy.mkdir()
    for relpath, entry in sorted(manifest.files.items()):
        (copy / relpath).parent.mkdir(parents=True, exist_ok=True)
        if _copy_file(artifact / relpath, copy / relpath, entry["size"]) != entry["sha256"]:
            raise ArtifactError(f"{artifact / relpath}: changed while it was packaged (its contents no longer "
                                f"match the manifest's sha256)")
    _copy_file(artifact / MANIFEST_NAME, copy / MANIFEST_NAME, None)
    if read_manifest(copy).to_json() != manifest.to_json():
        raise ArtifactError(f"{artifact / MANIFEST_NAME}: changed while the artifact was packaged")


def _copy_file(source: Path, destination: Path, size: int | None) -> str:
    """Copy the regular file `source` (never a link's target) to a new `destination`, at most `size` bytes
    (refusing a longer one); returns the copy's sha256."""
    digest = hashlib.sha256()
    with open_regular(source) as reader, open(destination, "xb") as writer:
        left = os.fstat(reader.fileno()).st_size if size is None else size
        while left > 0:
            chunk = reader.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            writer.write(chunk)
            left -= len(chunk)
        if left != 0 or reader.read(1):
            raise ArtifactError(f"{source}: changed size while it was packaged; package the artifact again")
    return digest.hexdigest()


def _copy_runtime(staging: Path) -> None:
    """`ember/__init__.py`, `ember/core/` and `ember/runtime/`, the metadata and the requirements."""
    package = staging / "ember"
    package.mkdir()
    shutil.copyfile(Path(ember.__file__), package / "__init__.py")
    for name in RUNTIME_PACKAGES:
        shutil.copytree(_package_dir(name), package / name.rsplit(".", 1)[1],
                        ignore=shutil.ignore_patterns("__pycache__"))
    dist_info = staging / f"ember-{ember.__version__}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: ember\nVersion: {ember.__version__}\n", encoding="utf-8")
    (staging / REQUIREMENTS_NAME).write_text(runtime_requirements(), encoding="utf-8")
