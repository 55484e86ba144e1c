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

llama.cpp's own HTTP server (`llama-server`: continuous batching over `--parallel` slots) is
built with `--server` from the same sdist's vendored llama.cpp tree, by CMake directly (the
Python package does not ship it), as one static binary under

    ~/.cache/ember/llama-server/<version>-<level>-<hash>/bin/llama-server

keyed the same way; the build fetches nothing (no curl, no OpenSSL, no prebuilt web UI).

    python scripts/build_llama_cpp.py avx2 native              # build (or find) these levels
    python scripts/build_llama_cpp.py --server avx512-vnni     # llama-server for that level
    python scripts/build_llama_cpp.py --check avx2             # print the instruction counts
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ember.targets.hardware import cpu_fingerprint

VERSION = "0.3.36"
CACHE = Path.home() / ".cache" / "ember" / "llama-cpp"
SERVER_CACHE = Path.home() / ".cache" / "ember" / "llama-server"

# Not ISA options: the multimodal library is never loaded by the benchmark and takes a
# quarter of the build.
_COMMON_ARGS = ("-DLLAVA_BUILD=OFF",)
_AVX2 = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
         "-DGGML_BMI2=ON")
_NO_EXTENSIONS = ("-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_BF16=OFF",
                  "-DGGML_AVX_VNNI=OFF")
_AVX2_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2")
_AVX512_FLAGS = _AVX2_FLAGS + ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
# Off (as GGML_NATIVE=OFF leaves them) and said so: llama.cpp's AMX path (the CPU "extra buffer" that repacks
# Q4_0/Q8_0 weights for AMX tiles) segfaults on Q8_0/Q4_0 on this Sapphire Rapids host.
_NO_AMX = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
# The server alone: no tests, examples or unified app; nothing fetched at build time (no curl,
# no OpenSSL, no web UI from the Hugging Face bucket); one static binary that needs no rpath.
_SERVER_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_COMMON=ON",
                "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")


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
                    '{"kind": "llvm", "mcpu": "skylake-avx512"}', _AVX512_FLAGS, (True, False)),
    # Cooper Lake: AVX512 with VNNI and BF16 but no AMX, the most of this host llama.cpp runs
    # Q8_0/Q4_0 with (see _NO_AMX).
    "avx512-vnni": Level("avx512-vnni", _AVX2 + ("-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
                                                 "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=OFF",
                                                 "-DGGML_AVX_VNNI=OFF") + _NO_AMX,
                         '{"kind": "llvm", "mcpu": "cooperlake"}', _AVX512_FLAGS + ("avx512_vnni", "avx512_bf16"),
                         (True, True)),
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
        check_isa(level, package_libraries(partial))
        os.replace(partial, dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def server_cmake_args(level: Level) -> list[str]:
    """The CMake arguments of ``level``'s llama-server build."""
    return list(_SERVER_ARGS + level.cmake_args)


def server_binary(level: Level, version: str = VERSION) -> Path:
    """Where ``level``'s llama-server lives: keyed like build_dir, by version, level and a hash of its arguments."""
    key = " ".join(server_cmake_args(level))
    if level.name == "native":
        key += " " + " ".join(sorted(host_flags())) + " " + cpu_fingerprint()["cpu"]
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return SERVER_CACHE / f"{version}-{level.name}-{digest}" / "bin" / "llama-server"


def server_build_commands(source: Path, build: Path, level: Level, jobs: int) -> list[list[str]]:
    """The configure and build commands of ``level``'s llama-server from the llama.cpp tree ``source``."""
    return [["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *server_cmake_args(level)],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]]


def ensure_server_built(level: Level, version: str = VERSION, log: TextIO = sys.stderr) -> Path:
    """Return ``level``'s llama-server binary, building it first from the sdist's llama.cpp if missing."""
    binary = server_binary(level, version)
    if binary.is_file():
        return binary
    sdist = _sdist(version, log)
    SERVER_CACHE.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{binary.parent.parent.name}.partial-", dir=SERVER_CACHE))
    try:
        with tarfile.open(sdist) as archive:
            archive.extractall(partial / "src", filter="data")
        source = partial / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        jobs = int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2"))
        print(f"building llama-server {version} for {level.name} (~20 min on 2 cores): "
              f"{' '.join(server_cmake_args(level))}", file=log, flush=True)
        for command in server_build_commands(source, partial / "build", level, jobs):
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
        (partial / "bin").mkdir()
        shutil.copy2(partial / "build" / "bin" / "llama-server", partial / "bin" / "llama-server")
        check_isa(level, [partial / "bin" / "llama-server"])
        shutil.rmtree(partial / "src")
        shutil.rmtree(partial / "build")
        os.replace(partial, binary.parent.parent)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return binary


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


def package_libraries(package_dir: Path) -> list[Path]:
    """The shared libraries of the llama_cpp package installed under ``package_dir``."""
    return sorted((package_dir / "llama_cpp" / "lib").glob("*.so*"))


def instruction_counts(binaries: list[Path]) -> dict[str, int]:
    """Count zmm-register instructions, vpdpbusd and AMX tile instructions in ``binaries``."""
    counts = {"zmm": 0, "vpdpbusd": 0, "amx": 0}
    seen = set()
    for lib in binaries:
        # The wheel holds each library three times (libx.so, .so.0, .so.0.y.z) as copies, not links.
        digest = hashlib.sha256(lib.read_bytes()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], check=True,
                                     capture_output=True, text=True).stdout
        counts["zmm"] += len(re.findall(r"^\s+[0-9a-f]+:\s+\S+.*%zmm", disassembly, re.MULTILINE))
        counts["vpdpbusd"] += len(re.findall(r"\bvpdpbusds?\b", disassembly))
        counts["amx"] += len(re.findall(r"\b(?:tdpb\w+|tileloadd\w*)\b", disassembly))
    return counts


def check_isa(level: Level, binaries: list[Path]) -> dict[str, int]:
    """Raise if ``binaries`` hold code of another ISA level than ``level``'s (or AMX code); return the counts."""
    counts = instruction_counts(binaries)
    found = (counts["zmm"] > 0, counts["vpdpbusd"] > 0)
    if level.expect is not None and (found != level.expect or counts["amx"]):
        raise RuntimeError(f"llama.cpp build for {level.name} in {binaries[0].parent}: expected "
                           f"zmm={level.expect[0]}, vpdpbusd={level.expect[1]}, no AMX; objdump found {counts}")
    return counts


def main() -> None:
    """Build the named levels (or, with --check, count their instructions)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("levels", nargs="+", choices=LEVELS)
    parser.add_argument("--check", action="store_true", help="only disassemble existing builds")
    parser.add_argument("--server", action="store_true", help="llama.cpp's llama-server instead of the package")
    args = parser.parse_args()
    for name in args.levels:
        level = LEVELS[name]
        if args.server:
            binary = server_binary(level) if args.check else ensure_server_built(level)
            print(f"{name}: {binary}: {instruction_counts([binary])}")
        elif args.check:
            print(f"{name}: {build_dir(level)}: {instruction_counts(package_libraries(build_dir(level)))}")
        else:
            path = ensure_built(level)
            print(f"{name}: {path}: {check_isa(level, package_libraries(path))}")


if __name__ == "__main__":
    main()
