"""`--target` resolution: the host, explicit LLVM CPUs, and clear refusals."""

from __future__ import annotations

import pytest

from ember.errors import TargetError
from ember.targets.registry import resolve_target


def test_cpu_detects_the_host() -> None:
    spec = resolve_target("cpu")
    assert spec.tvm_target["kind"] == "llvm" and spec.tvm_target["mcpu"] not in ("", "generic")
    assert spec.num_cores >= 1 and spec.vector_bits >= 128


def test_explicit_arm_cpu_has_neon_width() -> None:
    spec = resolve_target('{"kind": "llvm", "mcpu": "cortex-a76", "mtriple": "aarch64-linux-gnu", "num-cores": 4}')
    assert spec.vector_bits == 128 and spec.num_cores == 4


@pytest.mark.parametrize("spec, message", [
    ("cuda", "CUDA pipeline is not built yet"),
    ("vulkan", "USE_VULKAN=ON"),
    ("tpu", "is not known"),
    ('{"kind": "llvm", "mcpu": "bogus"}', "LLVM does not know the CPU 'bogus'"),
    ('{"kind": "llvm", "mcpu": ', "malformed target JSON"),
    ('{"mcpu": "znver4"}', "with a 'kind' key"),
    ("missing-target.json", "does not exist"),
])
def test_bad_targets_are_refused_with_the_reason(spec: str, message: str) -> None:
    with pytest.raises(TargetError, match=message.replace("(", r"\(")):
        resolve_target(spec)
