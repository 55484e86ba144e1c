"""llama.cpp (llama-cpp-python) built for one x86 ISA level, so a benchmark compares like with like.

One AVX-512 host can run the code of several ISA levels. To compare ember with llama.cpp at
the AVX2 level on such a host, both must be compiled for AVX2: ember with an AVX2-only
`--target`, llama.cpp with `GGML_NATIVE=OFF` and only the AVX2 options on (its default
build is `-march=native`, which on this host would use AVX512-VNNI).

Each level is built from the registry's sdist with its own `CMAKE_ARGS` and installed
(`pip install --target`) into its own directory

    ~/.cache/ember/llama-cpp/<version>-<level>-<hash>/

where the hash covers the CMake arguments (and, for `native`, the host CPU's model and
flags, which `-march=native` depends on), so a rerun reuses the build and a changed option
gets a new one. A build is installed under a temporary name, checked, then renamed: an
interrupted build never leaves a directory that looks finished. A benchmark runs the
llama.cpp worker with that directory first on PYTHONPATH.

The check that the library holds only its level's code disassembles the shared libraries
(`objdump -d`) and counts instructions on 512-bit registers (`%zmm`) and the VNNI dot product
(`vpdpbusd`): the avx2 level must have neither, the avx512 level zmm code but no `vpdpbusd`;
the counts of a native build are only reported. (The ggml of llama-cpp-python 0.3.36
compiles one CPU backend with the level's `-m` flags; `GGML_CPU_ALL_VARIANTS`, which builds
several and picks one at run time, is off by default and stays off here.)

    python scripts/build_llama_cpp.py avx2 native      # build (or find) these levels
    python scripts/build_llama_cpp.py --check avx2     # print the instruction counts
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ember.targets.hardware import cpu_fingerprint

VERSION = "0.3.36"
CACHE = Path.home() / ".cache" / "ember" / "llama-cpp"

# Not ISA options: the multimodal library is never loaded by the benchmark and takes a
# quarter of the build.
_COMMON_ARGS = ("-DLLAVA_BUILD=OFF",)
_AVX2 = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
         "-DGGML_BMI2=ON")
_NO_EXTENSIONS = ("-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_BF16=OFF",
                  "-DGGML_AVX_VNNI=OFF")
_AVX2_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2")


@dataclass(frozen=True)
class Level:
    """One ISA level: llama.cpp's CMake options, ember's target, the CPU flags it needs."""

    name: str
    cmake_args: tuple[str, ...]
    ember_target: str
    needs: tuple[str, ...]
    # What objdump must find: (has zmm code, has vpdpbusd); None for native, which holds
    # whatever the host's -march=native gives.
    expect: tuple[bool, bool] | None


LEVELS = {
    # Haswell rather than Zen 3: the oldest CPU with exactly llama.cpp's AVX2 set (AVX2, FMA,
    # F16C, BMI2), so neither side may use anything a 2013 Intel or a Zen 1-3 lacks.
    "avx2": Level("avx2", _AVX2 + ("-DGGML_AVX512=OFF",) + _NO_EXTENSIONS, '{"kind": "llvm", "mcpu": "haswell"}',
                  _AVX2_FLAGS, (False, False)),
    # Skylake-X: AVX512 F/CD/VL/DQ/BW without VNNI, which is what GGML_AVX512 alone enables.
    "avx512": Level("avx512", _AVX2 + ("-DGGML_AVX512=ON",) + _NO_EXTENSIONS,
                    '{"kind": "llvm", "mcpu": "skylake-avx512"}',
                    _AVX2_FLAGS + ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), (True, False)),
    # Everything this host has: llama.cpp's default -march=native, ember's default target.
    "native": Level("native", ("-DGGML_NATIVE=ON",), "cpu", (), None),
}


def host_flags() -> set[str]:
    """The CPU flags of this host, from /proc/cpuinfo (empty where it is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_flags(level: Level) -> list[str]:
    """The CPU flags ``level`` needs that this host lacks (empty: the host can run it)."""
    present = host_flags()
    return [flag for flag in level.needs if flag not in present]


def cmake_args(level: Level) -> str:
    """The CMAKE_ARGS of ``level``'s build."""
    return " ".join(_COMMON_ARGS + level.cmake_args)


def build_dir(level: Level, version: str = VERSION) -> Path:
    """Where ``level``'s build lives: keyed by version, level and a hash of what the code depends on."""
    key = cmake_args(level)
    if level.name == "native":
        key += " " + " ".join(sorted(host_flags())) + " " + cpu_fingerprint()["cpu"]
    return CACHE / f"{version}-{level.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_built(level: Level, version: str = VERSION, log: TextIO = sys.stderr) -> Path:
    """Return the directory holding ``level``'s llama_cpp package, building it first if missing."""
    dest = build_dir(level, version)
    if (dest / "llama_cpp").is_dir():
        return dest
    sdist = _sdist(version, log)
    partial = Path(tempfile.mkdtemp(prefix=f"{dest.name}.partial-", dir=CACHE))
    try:
        print(f"building llama-cpp-python {version} for {level.name} (~10 min on 2 cores): "
              f"CMAKE_ARGS={cmake_args(level)}", file=log, flush=True)
        env = {**os.environ, "CMAKE_ARGS": cmake_args(level),
               "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")}
        # --no-cache-dir: pip's wheel cache is keyed by the sdist alone and would hand one
        # level's wheel to another.
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--quiet",
                        "--target", str(partial), str(sdist)], env=env, check=True)
        check_isa(level, partial)
        os.replace(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def _sdist(version: str, log: TextIO) -> Path:
    """The registry's sdist of llama-cpp-python ``version``, downloaded once into the cache."""
    path = CACHE / f"llama_cpp_python-{version}.tar.gz"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)  # a cold cache: the GGUF tests' converter comes here first
        print(f"downloading the llama-cpp-python {version} sdist", file=log, flush=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            "--quiet", "-d", tmp, f"llama-cpp-python=={version}"], check=True)
            os.replace(Path(tmp) / path.name, path)
    return path


def instruction_counts(package_dir: Path) -> dict[str, int]:
    """Count zmm-register instructions and vpdpbusd in the shared libraries under ``package_dir``."""
    counts = {"zmm": 0, "vpdpbusd": 0}
    seen = set()
    for lib in sorted((package_dir / "llama_cpp" / "lib").glob("*.so*")):
        # The wheel holds each library three times (libx.so, .so.0, .so.0.y.z) as copies, not links.
        digest = hashlib.sha256(lib.read_bytes()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], check=True,
                                     capture_output=True, text=True).stdout
        counts["zmm"] += len(re.findall(r"^\s+[0-9a-f]+:\s+\S+.*%zmm", disassembly, re.MULTILINE))
        counts["vpdpbusd"] += len(re.findall(r"\bvpdpbusds?\b", disassembly))
    return counts


def check_isa(level: Level, package_dir: Path) -> dict[str, int]:
    """Raise if the built libraries hold code of another ISA level than ``level``'s; return the counts."""
    counts = instruction_counts(package_dir)
    found = (counts["zmm"] > 0, counts["vpdpbusd"] > 0)
    if level.expect is not None and found != level.expect:
        raise RuntimeError(f"llama.cpp build for {level.name} in {package_dir}: expected zmm={level.expect[0]}, "
                           f"vpdpbusd={level.expect[1]}, objdump found {counts}")
    return counts


def main() -> None:
    """Build the named levels (or, with --check, count their instructions)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("levels", nargs="+", choices=LEVELS)
    parser.add_argument("--check", action="store_true", help="only disassemble existing builds")
    args = parser.parse_args()
    for name in args.levels:
        level = LEVELS[name]
        if args.check:
            print(f"{name}: {build_dir(level)}: {instruction_counts(build_dir(level))}")
        else:
            path = ensure_built(level)
            print(f"{name}: {path}: {check_isa(level, path)}")


if __name__ == "__main__":
    main()
