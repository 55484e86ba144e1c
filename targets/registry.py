"""Resolve a user's `--target` string into a `TargetSpec`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvm.target import Target, codegen

from ember.errors import TargetError

# Backends ember knows of but cannot compile for yet, with what is missing.
_NOT_YET_BUILT = {
    "cuda": "the CUDA pipeline is not built yet in ember (tracked in the GPU targets issue)",
    "rocm": "the ROCm pipeline is not built yet in ember",
    "metal": "the Metal pipeline is not built yet in ember",
    "webgpu": "the WebGPU pipeline is not built yet in ember",
    "opencl": "the OpenCL pipeline is not built yet in ember",
    "vulkan": "Vulkan needs a TVM built from source with USE_VULKAN=ON; the pip wheel has no SPIR-V codegen",
}


@dataclass(frozen=True)
class TargetSpec:
    """A compilation target: the TVM target and the facts schedules choose by."""

    name: str
    tvm_target: dict[str, Any]
    num_cores: int
    vector_bits: int

    @property
    def target(self) -> Target:
        """The TVM `Target` object."""
        return Target(self.tvm_target)

    def to_json(self) -> dict[str, Any]:
        """Plain data for the artifact manifest."""
        return {"name": self.name, "tvm_target": self.tvm_target, "num_cores": self.num_cores,
                "vector_bits": self.vector_bits}


def resolve_target(spec: str) -> TargetSpec:
    """Turn "cpu", a JSON target dict, or a path to one into a `TargetSpec`."""
    spec = spec.strip()
    if spec in ("cpu", "host", "llvm"):
        return _cpu_target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
    if spec.startswith("{"):
        return _from_dict(_parse_json(spec, "--target"), "--target")
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.exists():
            raise TargetError(f"target file {path} does not exist")
        return _from_dict(_parse_json(path.read_text(encoding="utf-8"), str(path)), str(path))
    kind = spec.split(":", 1)[0]
    if kind in _NOT_YET_BUILT:
        raise TargetError(f"--target {spec}: {_NOT_YET_BUILT[kind]}")
    raise TargetError(
        f"--target {spec!r} is not known; use 'cpu' (this machine) or a TVM target "
        'JSON such as \'{"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 8}\''
    )


def _from_dict(data: Any, origin: str) -> TargetSpec:
    if not isinstance(data, dict) or "kind" not in data:
        raise TargetError(f"{origin}: a target must be a JSON object with a 'kind' key")
    kind = data["kind"]
    if kind in _NOT_YET_BUILT:
        raise TargetError(f"{origin}: {_NOT_YET_BUILT[kind]}")
    if kind != "llvm":
        raise TargetError(f"{origin}: target kind {kind!r} is not supported (use 'llvm' for CPUs)")
    triple = data.get("mtriple") or codegen.llvm_get_system_triple()
    if "mcpu" in data and not codegen.llvm_is_valid_cpu(data["mcpu"], triple):
        raise TargetError(f"{origin}: LLVM does not know the CPU {data['mcpu']!r}")
    return _cpu_target(data)


def _cpu_target(data: dict[str, Any]) -> TargetSpec:
    data = dict(data)
    data.setdefault("num-cores", _host_cores())
    try:
        target = Target(data)
    except Exception as err:  # TVM raises several internal types for a bad dict
        raise TargetError(f"invalid TVM target {json.dumps(data)}: {err}") from None
    vector_bits = int(codegen.llvm_get_vector_width(target))
    return TargetSpec("cpu", data, int(data["num-cores"]), vector_bits)


def _host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _parse_json(text: str, origin: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TargetError(f"{origin}: malformed target JSON: {err}") from None

