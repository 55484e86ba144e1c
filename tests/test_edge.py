"""Edge deployment: the demo model cross-compiled on this x86 machine for aarch64 boards runs under
emulation with ember's runtime alone, and computes what the x86 artifact of the same formats computes (weights,
and for one build the q8 KV cache, whose kernels then run with NEON's vector width).

scripts/setup_arm64.sh builds (once, cached) an arm64 Debian Python with the runtime's aarch64 wheels, run by
`qemu-aarch64-static -cpu max` (every ARMv8/v9 feature, dotprod and i8mm included); the tests skip when it
cannot be set up here (exit 3). Each artifact is compiled once, and one emulated process runs all of them
(importing TVM under emulation takes ~20 s), from the directory `ember package` writes, with
TVM_USE_RUNTIME_LIB=1 and no ember compiler, torch or transformers on its path.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import ember
from ember.core.errors import ArtifactError
from ember.core.manifest import LIBRARY_NAME, read_manifest
from ember.driver.package import package_artifact
from ember.runtime import load_artifact
from ember.targets.registry import resolve_target

RUNNER = Path(__file__).with_name("edge_run.py")
PROMPT_TOKENS, NEW_TOKENS = 64, 32
LOGITS_TOLERANCE = 1e-4  # absolute (logits reach ~17): same arithmetic on both machines, only the order of sums differs
# With int8 activations (each row rounded per group of 32, as llama.cpp's Q8_0) the first prompt row matches
# exactly, but attention's float sums, summed in another order, move some activation of a later row across a
# rounding step, and the next layer amplifies that: measured max |logit difference| 0.105 (q8f32) and 0.065
# (q4f32) on logits up to ~17, greedy tokens identical. The bound leaves about 2x margin; tokens must match.
INT8_ACTIVATION_LOGITS_TOLERANCE = 0.25
ELF_MACHINE_AARCH64 = 183
# (name, --target, --quant, --kv-quant): the aarch64 builds, each checked against the x86 build of its formats.
ARM_BUILDS = [("aarch64-q0f32", "aarch64", "q0f32", None), ("pi5-q0f32", "raspberry-pi-5", "q0f32", None),
              ("pi5-q8f32", "raspberry-pi-5", "q8f32", None), ("pi5-q4f32", "raspberry-pi-5", "q4f32", None),
              ("pi5-q4f32-kv-q8", "raspberry-pi-5", "q4f32", "q8")]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="cross-compiles from x86_64")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    """64 tokens of the demo model's validation text, tokenized by Hugging Face's tokenizers."""
    tokenizer = Tokenizer.from_file(str(ember.DEMO_MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode((ember.DEMO_MODEL_DIR / "validation.txt").read_text(encoding="utf-8")).ids
    return ids[:PROMPT_TOKENS]


def _x86_twin(quant: str, activations: str, kv_quant: str | None) -> str:
    return f"x86-{quant}-{activations}" + (f"-kv-{kv_quant}" if kv_quant else "")


@pytest.fixture(scope="module")
def builds(arm64_python, demo_builds) -> dict[str, Path]:
    """Every artifact: the ARM builds, and an x86 build of each of their formats with the same activations
    (int8 where the ARM target has an int8 dot-product kernel, float where it does not). After the aarch64
    setup (`arm64_python`), which installs the cross linker the ARM builds need, or skips."""
    arm = demo_builds.get_many([(target, quant, False, kv_quant) for _, target, quant, kv_quant in ARM_BUILDS])
    built = {name: path for (name, *_), path in zip(ARM_BUILDS, arm)}
    formats = {(quant, read_manifest(built[name]).activations, kv_quant) for name, _, quant, kv_quant in ARM_BUILDS}
    x86 = demo_builds.get_many([("cpu", quant, activations == "float", kv_quant)
                                for quant, activations, kv_quant in formats])
    return {**built, **{_x86_twin(*twin): path for twin, path in zip(formats, x86)}}


def _run(python: list[str], env: dict[str, str], prompt: list[int], artifacts: dict[str, Path], out: Path) -> dict:
    """{name: (logits, run facts)} of each artifact, run by one `python` process."""
    out.mkdir()
    paths = list(artifacts.values())
    subprocess.run([*python, str(RUNNER), json.dumps(prompt), str(NEW_TOKENS), str(out), *map(str, paths)],
                   env={**os.environ, **env}, check=True, timeout=900)
    return {name: (np.load(out / f"{path.name}.npy"), json.loads((out / f"{path.name}.json").read_text()))
            for name, path in artifacts.items()}


@pytest.fixture(scope="module")
def results(arm64_python, builds, prompt, tmp_path_factory) -> dict[str, tuple[np.ndarray, dict]]:
    """Logits and greedy tokens of every build: the ARM ones under qemu from a package, the x86 ones here."""
    root = tmp_path_factory.mktemp("edge-run")
    first, *others = [name for name, *_ in ARM_BUILDS]
    board = package_artifact(builds[first], root / "board")
    arm = _run(arm64_python, {"PYTHONPATH": str(board), "TVM_USE_RUNTIME_LIB": "1"}, prompt,
               {first: board / "artifact", **{name: builds[name] for name in others}}, root / "arm")
    x86 = _run([sys.executable], {}, prompt, {n: p for n, p in builds.items() if n.startswith("x86-")}, root / "x86")
    return {**arm, **x86}


def test_arm_library_is_aarch64_and_recorded(builds) -> None:
    for name, *_ in ARM_BUILDS:
        header = (builds[name] / LIBRARY_NAME).read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == ELF_MACHINE_AARCH64, name
        assert json.loads((builds[name] / "manifest.json").read_text())["target"]["arch"] == "aarch64"


def test_runtime_alone_runs_on_the_emulated_board(results) -> None:
    for name, *_ in ARM_BUILDS:
        ran = results[name][1]
        assert ran["machine"] == "aarch64"
        assert ran["heavy_modules"] == [] and not ran["compiler_library_loaded"], ran


@pytest.mark.parametrize(("name", "target", "quant", "kv_quant"), ARM_BUILDS, ids=[b[0] for b in ARM_BUILDS])
def test_arm_build_matches_x86(builds, results, name, target, quant, kv_quant) -> None:
    activations = read_manifest(builds[name]).activations
    logits, ran = results[name]
    x86_logits, x86 = results[_x86_twin(quant, activations, kv_quant)]
    tolerance = INT8_ACTIVATION_LOGITS_TOLERANCE if activations == "int8" else LOGITS_TOLERANCE
    assert logits.shape == x86_logits.shape == (PROMPT_TOKENS, logits.shape[1])
    difference = float(np.abs(logits - x86_logits).max())
    same_tokens = ran["tokens"] == x86["tokens"]
    assert same_tokens and difference <= tolerance, (
        f"{activations} activations: greedy tokens {'equal' if same_tokens else 'differ'}, "
        f"max |logit difference| {difference:.3g}")


@pytest.mark.parametrize(("name", "target"),
                         [(name, target) for name, target, quant, _ in ARM_BUILDS if quant != "q0f32"])
def test_quantized_arm_builds_use_the_targets_int8_dot(builds, name, target) -> None:
    """q8f32/q4f32 round activations to int8 on an ARM target with an int8 dot product (dotprod, i8mm:
    `targets/int8_dot.py`), and keep them in float on one without."""
    expected = "float" if resolve_target(target).int8_dot is None else "int8"
    assert read_manifest(builds[name]).activations == expected


def test_aarch64_artifact_is_refused_on_x86_before_dlopen(builds) -> None:
    with pytest.raises(ArtifactError, match=r"compiled for aarch64, this machine is x86_64"):
        load_artifact(builds["aarch64-q0f32"])


@pytest.mark.parametrize(("cpu", "has_dotprod"), [("max", True), ("cortex-a53", False)])
def test_the_emulated_cpu_reports_its_own_features(arm64_python, cpu, has_dotprod):
    """Under qemu-user /proc/cpuinfo is the host's; the runtime reads an aarch64 CPU's features from the auxiliary
    vector instead, so a Pi 5 build (dotprod) loads on a CPU that has it and is refused on a Cortex-A53."""
    command = list(arm64_python)
    command[command.index("-cpu") + 1] = cpu
    code = "import machine; flags = machine.host_cpu_flags(); print(sorted(flags))"
    result = subprocess.run([*command, "-c", code], cwd=Path(ember.__file__).parent / "core",
                            capture_output=True, text=True, timeout=120, check=True)
    flags = set(json.loads(result.stdout.replace("'", '"')))
    assert {"fp", "asimd"} <= flags
    assert ("asimddp" in flags) == has_dotprod
    assert not flags & {"sse2", "avx2"}, "the host's x86 flags"
    pi5_needs = set(resolve_target("raspberry-pi-5").cpu_features)
    assert "asimddp" in pi5_needs
    assert (pi5_needs <= flags) == has_dotprod
