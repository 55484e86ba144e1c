"""scripts/bench_serve.py's peer, llama.cpp's llama-server: how it is built and started.

The pure parts run everywhere: the CMake arguments of the build (each one an option the pinned
llama.cpp tree declares, since CMake ignores a misspelled one), the cache key, the server's
command line and the per-slot context. The `llama_cpp` test runs the cached llama-server on the
demo model's Q8_0 file (llama.cpp's converter and quantizer, as tests/test_gguf.py makes it)
with the benchmark's own client, then stops it by its process group; it is skipped where
`python scripts/build_llama_cpp.py --server avx512-vnni` has not been run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import bench_serve  # noqa: E402
import build_llama_cpp  # noqa: E402

LEVEL = build_llama_cpp.LEVELS["avx512-vnni"]


def declared_options(sdist: Path) -> set[str]:
    """The CMake options (option() and deprecated llama_option_depr()) of the sdist's vendored llama.cpp tree."""
    names = set()
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if "/vendor/llama.cpp/" in member.name and member.name.endswith(("CMakeLists.txt", ".cmake")):
                text = archive.extractfile(member).read().decode(errors="replace")
                names |= set(re.findall(r"\b(?:option|llama_option_depr)\s*\(\s*(?:\w+\s+)?([A-Z][A-Z0-9_]+)", text))
    return names


def test_server_build_is_the_server_alone_without_network_or_amx() -> None:
    """The build configures llama-server's target with curl, OpenSSL and the downloaded web UI off, AVX-512 with
    VNNI and BF16 on, native tuning and every AMX option off; configure then build that one target."""
    args = build_llama_cpp.server_cmake_args(LEVEL)
    for wanted in ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                   "-DLLAMA_BUILD_UI=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON",
                   "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                   "-DGGML_AMX_BF16=OFF"):
        assert wanted in args
    configure, build = build_llama_cpp.server_build_commands(Path("/src"), Path("/build"), LEVEL, 2)
    assert configure[:6] == ["cmake", "-S", "/src", "-B", "/build", "-G"] and configure[7:] == args
    assert build == ["cmake", "--build", "/build", "--target", "llama-server", "-j", "2"]


def test_every_server_cmake_option_is_declared_by_the_pinned_llama_cpp() -> None:
    """Each -D the server build passes names an option of the sdist's llama.cpp tree (CMake would take a typo
    silently, and the build would quietly be another one)."""
    sdist = build_llama_cpp.CACHE / f"llama_cpp_python-{build_llama_cpp.VERSION}.tar.gz"
    if not sdist.exists():
        pytest.skip(f"{sdist} not downloaded (scripts/build_llama_cpp.py fetches it)")
    declared = declared_options(sdist) | {"CMAKE_BUILD_TYPE"}
    names = [arg[2:].split("=")[0] for arg in build_llama_cpp.server_cmake_args(LEVEL)]
    assert [name for name in names if name not in declared] == []


def test_server_cache_is_keyed_by_version_level_and_arguments() -> None:
    """A changed CMake argument, level or version gets a directory of its own under ~/.cache/ember/llama-server;
    the same ones find the same binary."""
    binary = build_llama_cpp.server_binary(LEVEL)
    assert binary == build_llama_cpp.server_binary(LEVEL)
    assert binary.name == "llama-server" and binary.parent.name == "bin"
    assert binary.parent.parent.parent == build_llama_cpp.SERVER_CACHE
    assert binary.parent.parent.name.startswith(f"{build_llama_cpp.VERSION}-avx512-vnni-")
    changed = dataclasses.replace(LEVEL, cmake_args=LEVEL.cmake_args + ("-DGGML_AVX512_VBMI=ON",))
    others = {build_llama_cpp.server_binary(changed), build_llama_cpp.server_binary(LEVEL, "0.3.35"),
              build_llama_cpp.server_binary(build_llama_cpp.LEVELS["avx2"])}
    assert binary not in others and len(others) == 3


def test_server_command_line_holds_every_slot_on_loopback() -> None:
    """llama-server listens on 127.0.0.1 with `slots` slots over one unified KV cache of slots x per-slot tokens, on
    the given threads, and leaves flash attention and the KV cache type at its defaults."""
    argv = bench_serve.llama_server_argv(Path("/bin/llama-server"), Path("/m/110m-Q8_0.gguf"), 8123, 16, 2048, 2)
    value = {flag: argv[argv.index(flag) + 1] for flag in ("--host", "--port", "--parallel", "--ctx-size",
                                                           "--threads", "--threads-batch", "--model", "--alias")}
    assert argv[0] == "/bin/llama-server"
    assert value == {"--host": "127.0.0.1", "--port": "8123", "--parallel": "16", "--ctx-size": str(16 * 2048),
                     "--threads": "2", "--threads-batch": "2", "--model": "/m/110m-Q8_0.gguf", "--alias": "110m-Q8_0"}
    assert "--kv-unified" in argv
    assert not {"-fa", "--flash-attn", "-ctk", "--cache-type-k", "-ctv", "--cache-type-v"} & set(argv)


@pytest.mark.parametrize("longest, model_context, expected", [
    ([144, 2001, 1064], 4096, 2048),  # the stall prompt and its one token, rounded up to 256
    ([144], 4096, 256),
    ([256], 4096, 256),
    ([144, 3000], 2048, 2048),  # never beyond the model's context
])
def test_slot_context_holds_the_longest_request(longest, model_context, expected) -> None:
    """A slot holds the longest request sent (prompt plus max_tokens), in whole 256-token steps, at most the model's
    context."""
    assert bench_serve.slot_context(longest, model_context) == expected


def test_slots_cover_the_highest_concurrency_and_the_stall_streams_with_their_long_prompt() -> None:
    """llama-server gets a slot per client of the highest level, and per stall stream plus one for the long prompt
    (which would otherwise queue and show no stall)."""
    settings = bench_serve.Settings(None, [1, 4, 8, 16], [1, 8], {}, (), ["ember", "llama.cpp"], None, None)
    assert settings.slots == 16
    assert dataclasses.replace(settings, stall_streams=[16]).slots == 17


@pytest.fixture(scope="module")
def demo_q8_0() -> Path:
    """The demo model as llama.cpp's converter and quantizer write it at Q8_0 (cached by tests/gguf_files.py)."""
    import gguf_files

    from ember import DEMO_MODEL_DIR

    return gguf_files.quantize(gguf_files.convert(Path(DEMO_MODEL_DIR), "f32", pre="gpt-2"), "Q8_0")


@pytest.mark.llama_cpp
@pytest.mark.timeout(600)
def test_llama_server_serves_concurrent_streams_and_stops_by_its_process_group(demo_q8_0, tmp_path) -> None:
    """The cached llama-server loads the demo Q8_0 file, answers /health, tokenizes with BOS as a completion
    reads, streams three greedy completions, two at a time, to the benchmark's client with usage counts, and is
    gone, with its process group, once stopped."""
    binary = build_llama_cpp.server_binary(LEVEL)
    if not binary.is_file():
        pytest.skip(f"no llama-server in the cache ({binary}): python scripts/build_llama_cpp.py --server avx512-vnni")
    assert bench_serve.llama_server_defaults(binary) == {"flash attention": "auto", "K cache": "f16",
                                                         "V cache": "f16"}
    served = bench_serve.start_llama_server(demo_q8_0, binary, 2, 256, 1, tmp_path)
    try:
        ids = bench_serve.tokenize(served, "hello world")
        assert len(ids) > 1 and ids == bench_serve.tokenize(served, "hello world")
        # Three requests over two clients: the third goes on a kept-alive connection, which llama-server closes
        # after each stream (the client opens a new one).
        replies, wall = asyncio.run(bench_serve.run_level(served, [("hello world", 8), ("the cat", 8), ("a dog", 8)],
                                                          2))
    finally:
        served.stop()
    assert served.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(served.process.pid, 0)
    assert len(replies) == 3 and wall > 0
    for reply in replies:
        assert 1 <= reply.tokens <= 8 and reply.token_times and reply.ttft > 0
    assert "n_slots = 2" in (tmp_path / f"llama-server-{demo_q8_0.stem}.log").read_text()
