"""The artifact manifest: the versioned contract between `ember compile` and the runtime.

An artifact is a directory:

    manifest.json        this contract
    model.so             the compiled library (Relax VM executable + kernels)
    params/              weights as TVM tensor-cache shards
    tokenizer.json ...   the checkpoint's tokenizer files, if it had them

The manifest records what produced the artifact (format, ember and TVM versions),
what it computes (model config, quantization, target, entry functions, weight
order, KV-cache layout and bounds) and the sha256 of every file. The runtime
refuses an artifact whose format or TVM version differs or whose files do not
match their hashes, and says what to recompile.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ember.errors import ArtifactError

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
LIBRARY_NAME = "model.so"
PARAMS_DIR = "params"


@dataclass
class Manifest:
    """Everything the runtime needs to know about an artifact, as plain data."""

    format_version: int
    ember_version: str
    tvm_version: str
    model: dict[str, Any]
    quantization: str
    model_dtype: str
    target: dict[str, Any]
    entry_functions: dict[str, dict[str, Any]]
    kv_cache: dict[str, Any]
    params: list[str]
    memory: dict[str, Any]
    source: str
    files: dict[str, str] = field(default_factory=dict)
    # Weights left in the compute dtype by a quantized format: {"embedding": bool, "lm_head": bool}.
    kept_float: dict[str, bool] = field(default_factory=lambda: {"embedding": False, "lm_head": False})
    # "int8": the quantized projections multiply int8-quantized activations (llama.cpp's
    # Q8_0 rounding, per group of 32); "float": activations stay in the compute dtype.
    activations: str = "float"

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON data."""
        return asdict(self)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(artifact_dir: Path, manifest: Manifest) -> None:
    """Hash every file under `artifact_dir` into `manifest` and write it."""
    artifact_dir = Path(artifact_dir)
    manifest.files = {
        str(path.relative_to(artifact_dir)): sha256_file(path)
        for path in sorted(artifact_dir.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }
    (artifact_dir / MANIFEST_NAME).write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")


def read_manifest(artifact_dir: Path) -> Manifest:
    """Read and structurally validate `artifact_dir/manifest.json`."""
    path = Path(artifact_dir) / MANIFEST_NAME
    if not path.exists():
        raise ArtifactError(f"{artifact_dir}: not an ember artifact ({MANIFEST_NAME} is missing)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path}: malformed manifest: {err}") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {version!r}, this ember reads version {FORMAT_VERSION}; "
            f"recompile the model with this ember (`ember compile`)"
        )
    try:
        return Manifest(**data)
    except TypeError as err:
        raise ArtifactError(f"{path}: manifest fields do not match format version {FORMAT_VERSION}: {err}") from None


def verify_files(artifact_dir: Path, manifest: Manifest) -> None:
    """Check every file against its recorded sha256; name the first that differs."""
    artifact_dir = Path(artifact_dir)
    for relpath, expected in manifest.files.items():
        path = artifact_dir / relpath
        if not path.exists():
            raise ArtifactError(f"{path}: file listed in the manifest is missing; recompile the artifact")
        if sha256_file(path) != expected:
            raise ArtifactError(
                f"{path}: contents do not match the manifest's sha256 (modified or corrupted); "
                f"recompile the artifact with `ember compile`"
            )
