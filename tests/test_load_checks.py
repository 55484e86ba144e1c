"""What `ember compile` and the artifact loader refuse before anything crashes: a library built for CPU features this
machine lacks (it would die of SIGILL), weights that are not finite, a KV cache beyond the memory limits this process
runs under, and a manifest resealed over another artifact's library or weights. Each is one error line."""

from __future__ import annotations

import json
import platform
import resource
import shutil
import subprocess
import sys

import models
import numpy as np
import pytest
from helpers import REPO_ROOT, assert_one_line_error, compile_cached, prompt_ids, run_ember
from safetensors.numpy import load_file, save_file
from test_artifact_integrity import INDEX, SHARD, edit_manifest

from ember.core.errors import ArtifactError, GenerationError
from ember.core.machine import host_cpu_flags
from ember.core.manifest import read_manifest, write_manifest
from ember.runtime import load_artifact
from ember.runtime.sampling import SamplingParams, sample_token

NEWER_CPU = "diamondrapids"  # Intel's APX, AMX-FP16 and AVX-IFMA: beyond every CPU this suite runs on so far


def manifest_of(artifact) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


@pytest.fixture(scope="module")
def newer_cpu_artifact(tiny_models, tmp_path_factory):
    """The tiny llama compiled by the CLI for a CPU newer than this one, and the features this CPU lacks."""
    host = host_cpu_flags()
    if platform.machine() != "x86_64" or host is None:
        pytest.skip("compares x86 CPU flags from /proc/cpuinfo")
    artifact = tmp_path_factory.mktemp("newer-cpu") / "artifact"
    compile_cached("tiny-llama-newer-cpu", tiny_models.checkpoint("llama"), artifact, "--no-progress", "--max-batch",
                   "1", "--prefill-chunk", "16", "--target", json.dumps({"kind": "llvm", "mcpu": NEWER_CPU}))
    missing = sorted(set(manifest_of(artifact)["target"]["cpu_features"]) - host)
    if not missing:
        pytest.skip(f"this CPU has every feature of {NEWER_CPU}")
    return artifact, missing


def test_library_for_a_newer_cpu_is_refused_by_generate(newer_cpu_artifact):
    """`ember generate` on an artifact whose code uses extensions this CPU lacks exits 1 with one line naming each
    missing feature and the --target to recompile with, instead of dying of an illegal instruction (exit 132)."""
    artifact, missing = newer_cpu_artifact
    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2", timeout=120)
    assert_one_line_error(result, f"{artifact}: compiled for a CPU with {', '.join(missing)}, which this machine "
                                  "lacks", "--target cpu")
    assert result.stdout == ""


def test_host_compile_records_features_this_cpu_has(tiny_llama):
    """A compile for this machine records the instruction-set extensions its code may use, by /proc/cpuinfo's
    names (AVX2 at least on any x86 CPU ember targets), all of which this CPU has; it loads."""
    features = manifest_of(tiny_llama.artifact_dir)["target"]["cpu_features"]
    host = host_cpu_flags()
    assert host is not None and set(features) <= host
    if platform.machine() == "x86_64" and "avx2" in host:
        assert {"avx", "avx2", "fma"} <= set(features)
    assert tiny_llama.artifact.manifest.target["cpu_features"] == features


def test_manifest_without_cpu_features_still_loads(tiny_llama, copy_artifact):
    """A manifest written before target.cpu_features (the field absent, the seal intact) loads: its needs are
    unknown, not refused; a malformed list is refused in one line."""
    artifact = copy_artifact(tiny_llama)
    edit_manifest(artifact, lambda data: data["target"].pop("cpu_features"), seal=True)
    load_artifact(artifact)
    edit_manifest(artifact, lambda data: data["target"].__setitem__("cpu_features", "avx2"), seal=True)
    result = run_ember("inspect", str(artifact))
    assert_one_line_error(result, "manifest field target.cpu_features must be a list of CPU flag names")


def checkpoint_with(tiny_models, tmp_path, name: str, change) -> str:
    """A copy of the tiny llama's checkpoint with `change(array)` applied to its tensor `name`."""
    model_dir = tmp_path / "checkpoint"
    shutil.copytree(tiny_models.checkpoint("llama"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors[name])
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return str(model_dir)


@pytest.mark.slow
def test_non_finite_weights_are_refused_at_compile(tiny_models, tmp_path):
    """A checkpoint tensor holding NaN or infinite values is refused by `ember compile`, in one line naming it and
    how many of its values are not finite, and no artifact is written."""
    def poison(array):
        array.reshape(-1)[[3, 17, 40]] = [np.nan, np.inf, -np.inf]

    model_dir = checkpoint_with(tiny_models, tmp_path, "model.layers.1.mlp.up_proj.weight", poison)
    result = run_ember("compile", model_dir, "-o", str(tmp_path / "out"), "--no-progress", "--max-batch", "1")
    assert_one_line_error(result, "checkpoint tensor 'model.layers.1.mlp.up_proj.weight': 3 of ",
                          "values are NaN or infinite")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_weights_overflowing_float16_are_refused_at_compile(tiny_models, tmp_path):
    """Finite float32 weights beyond float16's range would turn to inf in a q0f16 artifact: refused naming the
    weight and the dtype."""
    def enlarge(array):
        array.reshape(-1)[5] = 1e6

    model_dir = checkpoint_with(tiny_models, tmp_path, "model.layers.0.self_attn.o_proj.weight", enlarge)
    result = run_ember("compile", model_dir, "-o", str(tmp_path / "out"), "--no-progress", "--max-batch", "1",
                       "--quant", "q0f16")
    assert_one_line_error(result, "model.layers.0.self_attn.o_proj.weight", "as float16: 1 of ",
                          "values are NaN or infinite")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_a_generation_error(temperature, bad):
    """Logits holding NaN or +inf raise a one-line GenerationError, greedy or sampled, not numpy's ValueError or a
    silently chosen token; -inf logits (banned tokens) are fine."""
    logits = np.linspace(-1, 1, 64, dtype=np.float32)
    logits[10] = -np.inf
    rng = np.random.default_rng(0)
    assert sample_token(logits, SamplingParams(temperature=temperature), rng, [1]) != 10
    logits[20] = bad
    with pytest.raises(GenerationError, match="the model computed a logit of (nan|inf)"):
        sample_token(logits, SamplingParams(temperature=temperature), rng, [1])


@pytest.mark.parametrize("sampled", [False, True])
def test_generate_on_nan_weights_ends_in_one_error_line(tiny_llama, copy_artifact, sampled):
    """An artifact whose weights were made NaN after compile (the shard rewritten and resealed) ends `ember
    generate` with exit 1 and one line, not an internal error."""
    artifact = copy_artifact(tiny_llama)
    shard = np.fromfile(artifact / SHARD, dtype=np.uint8)
    index = json.loads((artifact / INDEX).read_text())
    record = next(r for r in index["records"][0]["records"] if r["name"] == "lm_head.weight")
    begin = record["byteOffset"]
    shard[begin:begin + record["nbytes"]].view(np.float32)[:] = np.nan
    shard.tofile(artifact / SHARD)
    write_manifest(artifact, read_manifest(artifact))
    options = ("--temperature", "0.8", "--seed", "1") if sampled else ("--temperature", "0")
    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2", *options)
    assert_one_line_error(result, "the model computed a logit of nan")


ADDRESS_SPACE = 4 * 2**30  # RLIMIT_AS for the processes below: ember's own mappings take ~0.6 GiB of it


def ember_under_rlimit(*args: str) -> subprocess.CompletedProcess:
    """`python -m ember ARGS` with its address space limited to ADDRESS_SPACE (as `ulimit -v` would)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run([sys.executable, "-m", "ember", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)


@pytest.fixture(scope="module")
def long_context_checkpoint(tiny_models, tmp_path_factory):
    """The tiny llama's checkpoint claiming 2**24 positions: one sequence's whole KV cache is 8 GiB."""
    model_dir = tmp_path_factory.mktemp("long-context") / "checkpoint"
    shutil.copytree(tiny_models.checkpoint("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 2**24
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.slow
def test_kv_cache_beyond_the_address_space_rlimit_is_refused_at_load(long_context_checkpoint, tmp_path):
    """An artifact whose KV cache (8 GiB, compiled without limits) exceeds what RLIMIT_AS leaves this process is
    refused by `ember generate` in one line naming the size needed and the limit, not `std::bad_alloc`."""
    artifact = tmp_path / "artifact"
    result = run_ember("compile", str(long_context_checkpoint), "-o", str(artifact), "--no-progress",
                       "--max-batch", "1", "--prefill-chunk", "16")
    assert result.returncode == 0, result.stderr
    assert manifest_of(artifact)["kv_cache"]["max_total_tokens"] == 2**24
    result = ember_under_rlimit("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(result, f"{artifact}: needs 8192.4 MiB of memory", "KV cache of 16777216 tokens",
                          f"(limited by RLIMIT_AS = {ADDRESS_SPACE} bytes, `ulimit -v`)", "--memory-budget")


@pytest.mark.slow
def test_compile_under_an_rlimit_sizes_the_kv_cache_to_it(long_context_checkpoint, tmp_path):
    """`ember compile` under RLIMIT_AS sizes the KV cache to half the room the limit leaves (not half the
    machine's memory), and the artifact generates under that same limit."""
    artifact = tmp_path / "artifact"
    result = ember_under_rlimit("compile", str(long_context_checkpoint), "-o", str(artifact), "--no-progress",
                                "--max-batch", "1", "--prefill-chunk", "16")
    assert result.returncode == 0, result.stderr
    kv_bytes = manifest_of(artifact)["kv_cache"]["max_total_tokens"] * 512
    assert 0 < kv_bytes < ADDRESS_SPACE // 2
    result = ember_under_rlimit("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2",
                                "--temperature", "0")
    assert result.returncode == 0, result.stderr


def resealed_with(artifact, donor, relpath: str) -> None:
    """`relpath` of `artifact` replaced by `donor`'s and every file's hash re-recorded in the manifest: what an
    attacker editing the hashes (or a copy mixing two artifacts, then resealed) leaves."""
    target = artifact / relpath
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    (shutil.copytree if (donor / relpath).is_dir() else shutil.copyfile)(donor / relpath, target)
    write_manifest(artifact, read_manifest(artifact))


@pytest.fixture(scope="module")
def wider_llama(tmp_path_factory):
    """The tiny llama's architecture, weight names and tokenizer with a wider MLP (intermediate 96, not 128)."""
    root = tmp_path_factory.mktemp("wider-llama")
    model_dir = models.write_model(models.random_model(models.make_config(
        "llama", tie_word_embeddings=False, intermediate_size=96)), root / "checkpoint")
    compile_cached("tiny-llama-wider", model_dir, root / "artifact", "--no-progress", "--max-batch", "1")
    return root / "artifact"


def test_compile_records_each_weights_shape_and_dtype(tiny_llama):
    """The manifest's param_types hold, for every weight in graph order, the shape and dtype the weight index
    holds for it."""
    manifest = manifest_of(tiny_llama.artifact_dir)
    index = json.loads((tiny_llama.artifact_dir / INDEX).read_text())
    stored = {r["name"]: {"shape": r["shape"], "dtype": r["dtype"]} for s in index["records"] for r in s["records"]}
    assert list(manifest["param_types"]) == manifest["params"]
    assert manifest["param_types"] == {name: stored[name] for name in manifest["params"]}


def test_swapped_weights_are_refused_at_load(tiny_llama, copy_artifact, wider_llama):
    """Another artifact's weights (same names, other shapes), resealed into the manifest, are refused by `ember
    generate` in one line naming the first tensor and both shapes, before any kernel reads them."""
    artifact = copy_artifact(tiny_llama)
    resealed_with(artifact, wider_llama, "params")
    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(result, f"{artifact}/params/params_shard_0.bin: tensor 'model.layers.0.mlp.",
                          "the compiled model takes float32 [", "the weights are not this artifact's")


@pytest.mark.parametrize(("donor", "expected"), [
    ("qwen2", "its prefill function takes 'model.layers.0.self_attn.q_proj.bias' as argument 6 where the manifest "
              "has 'model.layers.0.self_attn.o_proj.weight'"),
    ("llama-q8f32", "its prefill function takes 'model.embed_tokens.weight.packed' as argument 3"),
    ("wider", "built for weight 'model.layers.0.mlp.gate_up_proj.weight' of float32 {donor}, the manifest has "
              "float32 {own}"),
])
def test_swapped_library_is_refused_at_load(request, tiny_models, tiny_llama, copy_artifact, donor, expected):
    """Another model's library, resealed into the manifest, is refused by `ember generate` in one line naming
    model.so and what differs: qwen2's (biases, tied embeddings) and the q8f32 llama's (packed weights) take other
    weights; a wider llama's takes the same weight names in other shapes (blocked by the target's vector width, so
    read from both manifests: [8, 64, 32] against [6, 64, 32] with AVX-512, [16, 64, 16] against [12, 64, 16] with
    AVX2)."""
    artifact = copy_artifact(tiny_llama)
    other = {"qwen2": lambda: tiny_models["qwen2"].artifact_dir,
             "llama-q8f32": lambda: tiny_models.quantized("llama", "q8f32").artifact_dir,
             "wider": lambda: request.getfixturevalue("wider_llama")}[donor]()
    if donor == "wider":
        weight = "model.layers.0.mlp.gate_up_proj.weight"
        expected = expected.format(donor=read_manifest(other).param_types[weight]["shape"],
                                   own=read_manifest(artifact).param_types[weight]["shape"])
    resealed_with(artifact, other, "model.so")
    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(result, f"{artifact}/model.so: {expected}", "the library is not this artifact's")


@pytest.mark.parametrize(("field", "change", "message"), [
    ("kv_cache.max_context", lambda data: data["kv_cache"].__setitem__("max_context", 4096),
     "built for kv_cache.max_context 256, the manifest has 4096"),
    ("quantization", lambda data: data.__setitem__("quantization", "q8f32"),
     "built for quantization 'q0f32', the manifest has 'q8f32'"),
    ("kv_cache.prefill_chunk", lambda data: data["kv_cache"].__setitem__("prefill_chunk", 128),
     "built for kv_cache.prefill_chunk 64, the manifest has 128"),
    ("kv_cache.quantization", lambda data: data["kv_cache"].__setitem__("quantization", "q8"),
     "built for kv_cache.quantization None, the manifest has 'q8'"),
])
def test_a_resealed_manifest_cannot_lie_about_what_the_library_was_built_for(tiny_llama, copy_artifact, field,
                                                                             change, message):
    """The library records the formats and sizes its kernels were built for; a manifest edited past them and
    resealed (a longer context, another weight format, a larger prefill chunk, a quantized KV cache) is refused by
    `ember generate` in one line naming the field, and a shorter context than the library's still loads."""
    artifact = copy_artifact(tiny_llama)
    edit_manifest(artifact, change, seal=True)
    result = run_ember("generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(result, f"{artifact}/model.so: {message}", "recompile the artifact")


def test_a_shorter_context_than_the_library_was_built_for_loads(tiny_llama, copy_artifact):
    artifact = copy_artifact(tiny_llama)
    edit_manifest(artifact, lambda data: data["kv_cache"].__setitem__("max_context", 64), seal=True)
    assert load_artifact(artifact).manifest.kv_cache["max_context"] == 64


def test_library_without_an_entry_function_is_refused(tiny_llama, copy_artifact):
    """A manifest listing an entry function its library lacks is refused naming it (load_artifact)."""
    artifact = copy_artifact(tiny_llama)
    embed = {"inputs": [{"name": "ids"}]}
    edit_manifest(artifact, lambda data: data["entry_functions"].__setitem__("embed", embed), seal=True)
    with pytest.raises(ArtifactError, match=r"model.so: has no function 'embed', which the manifest lists"):
        load_artifact(artifact)


def test_artifact_replaced_at_a_path_loaded_before_runs_its_own_library(tiny_models, tmp_path):
    """An artifact removed and another copied to the same path, both loaded by one process: the second runs its own
    library, as loaded from where it was compiled (the dynamic loader would hand back the first library under that
    path, whose weights differ: the q8f32 llama's are packed)."""
    from ember.runtime import Engine

    first, second = tiny_models["llama"], tiny_models.quantized("llama", "q8f32")
    path = tmp_path / "artifact"
    shutil.copytree(first.artifact_dir, path)
    loaded_first = load_artifact(path)
    shutil.rmtree(path)
    shutil.copytree(second.artifact_dir, path)
    replaced = load_artifact(path)
    assert replaced.manifest.quantization == "q8f32" and loaded_first.manifest.quantization == "q0f32"
    ids = prompt_ids(12, seed=3)
    outputs = []
    for artifact in (replaced, second.artifact):
        engine = Engine(artifact)
        outputs.append(engine.prefill(engine.add_sequence(), ids, all_logits=True))
    np.testing.assert_array_equal(outputs[0], outputs[1])
