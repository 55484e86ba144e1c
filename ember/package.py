"""`ember package ARTIFACT -o DIR`: what to copy to a device that runs an artifact without the compiler.

DIR holds the artifact (`DIR/artifact/`), ember's runtime as an importable package
(`DIR/ember/`: the import-free `__init__`, `errors`, `manifest`, `machine`, `without_torch` and
`runtime/`, none of which imports the compiler, torch or transformers) and `requirements-runtime.txt`. On the
device: `pip install -r DIR/requirements-runtime.txt`, then with `PYTHONPATH=DIR` and
`TVM_USE_RUNTIME_LIB=1` (TVM's runtime library only) `ember.runtime.load_artifact("DIR/artifact")`.
Written into a staging directory and renamed, so DIR is never half-written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ember
from ember import runtime as ember_runtime
from ember.artifact_dir import staging_dir
from ember.errors import EmberError
from ember.manifest import read_manifest

# The modules of the `ember` package the runtime imports (it needs nothing else from it).
RUNTIME_MODULES = ("__init__.py", "errors.py", "manifest.py", "machine.py", "without_torch.py")
REQUIREMENTS = Path(ember.__file__).parent.parent / "requirements-runtime.txt"
ARTIFACT_SUBDIR = "artifact"


def package_artifact(artifact: Path, output_dir: Path) -> Path:
    """Gather `artifact` and the runtime into `output_dir` (which must be new or empty); returns it."""
    artifact, output_dir = Path(artifact), Path(output_dir)
    read_manifest(artifact)  # refuses what is not an artifact, naming the file
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise EmberError(f"-o {output_dir}: exists and is not an empty directory; choose a new one")
    with staging_dir(output_dir) as staging:
        shutil.copytree(artifact, staging / ARTIFACT_SUBDIR)
        package = staging / "ember"
        package.mkdir()
        for name in RUNTIME_MODULES:
            shutil.copyfile(Path(ember.__file__).parent / name, package / name)
        shutil.copytree(Path(ember_runtime.__file__).parent, package / "runtime",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copyfile(REQUIREMENTS, staging / REQUIREMENTS.name)
        staging.chmod(0o755)
        if output_dir.exists():
            output_dir.rmdir()
        staging.rename(output_dir)
    return output_dir
