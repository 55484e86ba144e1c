"""`ember package ARTIFACT -o DIR`: what to copy to a device that runs an artifact without the compiler.

DIR holds the artifact (`DIR/artifact/`), ember's runtime as an importable package (`DIR/ember/`:
the import-free `__init__`, the bottom layer `core/` and `runtime/`, none of which imports the
compiler, torch or transformers; pyproject.toml's import-linter contract keeps it so), the
distribution metadata that gives `ember.__version__`, and `requirements-runtime.txt`. On the
device: `pip install -r DIR/requirements-runtime.txt`, then with `PYTHONPATH=DIR` and
`TVM_USE_RUNTIME_LIB=1` (TVM's runtime library only) `ember.runtime.load_artifact("DIR/artifact")`.
Written into a staging directory and renamed, so DIR is never half-written.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

import ember
from ember import core as ember_core
from ember import runtime as ember_runtime
from ember.core.errors import EmberError
from ember.core.manifest import read_manifest
from ember.driver.artifact_dir import staging_dir

ARTIFACT_SUBDIR = "artifact"
REQUIREMENTS_NAME = "requirements-runtime.txt"


def runtime_requirements() -> str:
    """The runtime's pip requirements (package data of `ember.runtime`)."""
    return resources.files(ember_runtime).joinpath("requirements.txt").read_text(encoding="utf-8")


def package_artifact(artifact: Path, output_dir: Path) -> Path:
    """Gather `artifact` and the runtime into `output_dir` (which must be new or empty); returns it."""
    artifact, output_dir = Path(artifact), Path(output_dir)
    read_manifest(artifact)  # refuses what is not an artifact, naming the file
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise EmberError(f"-o {output_dir}: exists and is not an empty directory; choose a new one")
    with staging_dir(output_dir) as staging:
        shutil.copytree(artifact, staging / ARTIFACT_SUBDIR)
        _copy_runtime(staging)
        staging.chmod(0o755)
        if output_dir.exists():
            output_dir.rmdir()
        staging.rename(output_dir)
    return output_dir


def _copy_runtime(staging: Path) -> None:
    """`ember/__init__.py`, `ember/core/` and `ember/runtime/`, the metadata and the requirements."""
    package = staging / "ember"
    package.mkdir()
    shutil.copyfile(Path(ember.__file__), package / "__init__.py")
    for subpackage in (ember_core, ember_runtime):
        shutil.copytree(Path(subpackage.__file__).parent, package / subpackage.__name__.rsplit(".", 1)[1],
                        ignore=shutil.ignore_patterns("__pycache__"))
    dist_info = staging / f"ember-{ember.__version__}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: ember\nVersion: {ember.__version__}\n", encoding="utf-8")
    (staging / REQUIREMENTS_NAME).write_text(runtime_requirements(), encoding="utf-8")
