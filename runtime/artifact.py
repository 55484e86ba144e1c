"""Load a compiled artifact: check its manifest and hashes, load library and weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import runtime as tvm_runtime
from tvm.runtime.vm import VirtualMachine

from ember.errors import ArtifactError
from ember.manifest import LIBRARY_NAME, PARAMS_DIR, Manifest, read_manifest, verify_files
from ember.runtime.device import open_device
from ember.runtime.tokenizer import Tokenizer


@dataclass
class Artifact:
    """A loaded artifact: its manifest, VM, weights (in graph order) and tokenizer."""

    path: Path
    manifest: Manifest
    vm: VirtualMachine
    params: list[tvm_runtime.Tensor]
    tokenizer: Tokenizer | None
    device: tvm_runtime.Device


def load_artifact(path: Path, verify: bool = True) -> Artifact:
    """Open the artifact at `path` on the device it was compiled for, refusing a mismatched or tampered one."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest.tvm_version != tvm.__version__:
        raise ArtifactError(
            f"{path}: compiled with TVM {manifest.tvm_version}, this runtime has TVM {tvm.__version__}; "
            f"recompile with `ember compile {manifest.source} --quant {manifest.quantization} -o {path}`"
        )
    if verify:
        verify_files(path, manifest)
    dev = open_device(manifest.target, path)
    library = tvm_runtime.load_module(str(path / LIBRARY_NAME))
    vm = VirtualMachine(library, dev)
    params = _load_params(path / PARAMS_DIR, manifest.params, dev)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return Artifact(path, manifest, vm, params, tokenizer, dev)


def _load_params(params_dir: Path, names: list[str], dev: tvm_runtime.Device) -> list[tvm_runtime.Tensor]:
    """Read tensor-cache shards one tensor at a time, in the graph's parameter order."""
    index_path = params_dir / "tensor-cache.json"
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{index_path}: unreadable weight index: {err}") from None
    loaded: dict[str, tvm_runtime.Tensor] = {}
    for shard in index["records"]:
        with open(params_dir / shard["dataPath"], "rb") as f:
            for record in shard["records"]:
                # Read into a private buffer (not a memory map), so peak RSS is the
                # weights plus one tensor, not the weights twice.
                buffer = np.empty(record["nbytes"], dtype=np.uint8)
                f.seek(record["byteOffset"])
                if f.readinto(buffer) != record["nbytes"]:
                    raise ArtifactError(f"{params_dir / shard['dataPath']}: truncated weight shard")
                tensor = tvm_runtime.empty(record["shape"], record["dtype"], device=dev)
                tensor.copyfrom(buffer.view(record["dtype"]).reshape(record["shape"]))
                loaded[record["name"]] = tensor
    missing = [name for name in names if name not in loaded]
    if missing:
        raise ArtifactError(f"{index_path}: weights {missing[:3]} are missing; recompile the artifact")
    return [loaded[name] for name in names]
