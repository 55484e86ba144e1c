"""ember's CUDA artifacts checked on a GPU machine that has no compiler and no network, in one upload.

Two halves:

    python scripts/gpu_check.py prepare [--out build/gpu-bundle] [--skip-1b]     # here, no GPU needed
    python scripts/gpu_check.py run --bundle build/gpu-bundle [--out DIR]         # there, on the GPU
    python scripts/gpu_check.py run --bundle build/gpu-bundle --dry-run           # here: all but the CUDA calls

`prepare` compiles the artifacts for `cuda:sm_90a` (tiny random Llama and Qwen2 through the HF frontend, GPT-2
and a Gemma 3 of local and global layers, prompts past its window, through `--frontend torch-export`, at every
quantization that compiles for CUDA; the Llama 3.2 1B shape
at q0f16 and q4f16 for the benchmark), computes reference outputs with transformers on this CPU, and packs ONE
bundle (< 64 MiB): TVM's runtime without `libtvm_compiler.so`, the cp312 `apache-tvm-ffi` wheel, ember's
runtime packages plus its weight conversion (`ember.driver.convert`, which imports no compiler), each
artifact's library, manifest and weight recipes, and the references. Weights never travel: `write_checkpoint`
draws every tensor from a Philox stream keyed by the seed and the tensor's name with exact float32 arithmetic,
so both machines write bit-identical `model.safetensors` files; the bundle records their sha256 and `run`
refuses to go on when a regenerated checkpoint hashes differently. `run` then converts each checkpoint into
its artifact's weight shards with the recipes, and the runtime checks every shard against the sha256 the
manifest recorded when the artifact was compiled here: the shards too are bit for bit the compiled ones.

`run` checks correctness on the GPU against transformers on the same GPU, serves one artifact with
`ember serve` to the openai client (if installed), and benchmarks the 1B shape against PyTorch eager and
torch.compile (`scripts/gpu_check_device.py` holds those workers); it writes `gpu-check.json` and
`gpu-check.log` to `--out` (default `$OUT`) and exits 1 when any check fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BUNDLE_FORMAT = 1
PLAN_NAME = "plan.json"
RECIPES_NAME = "weight-recipes.json"  # [params, recipes] of the compile, a file listed in the manifest
TVM_ARCHIVE = "tvm-runtime.tar.xz"
TARGET = "cuda:sm_90a"
SEED = 20261128
TINY_CHUNK, TINY_BATCH = 64, 4
BENCH_CHUNK, BENCH_BATCH = 2048, 32
BENCH_MEMORY_BUDGET = 24 * 2**30  # the KV cache of 32 x 4096 tokens and the weights; torch shares the GPU
UPLOAD_LIMIT = 64 * 2**20
# The GPU half stops starting workers past this (the device allows 10 minutes a command; aim well under 8).
RUN_BUDGET_S, MIN_WORKER_S = 420, 20
DECODE_CONTEXT = 512 + 128 // 2  # batch-1 decode's mean context in gpu_check_device: 512-token prompt, 128 steps
FFI_WHEEL_CACHE = Path.home() / ".cache" / "ember" / "tvm-ffi-wheels"
# Every --quant that compiles for CUDA (checked with this ember: all of ir/quant_formats.FORMATS).
TINY_LLAMA_QUANTS = ("q0f16", "q0f32", "q4f16", "q8f16", "q4f16_zp", "q4f32", "q8f32")
# checkpoint -> (frontend, quantizations); each artifact of them is checked for correctness
TINY_ARTIFACTS = {
    "llama": ("builtin", TINY_LLAMA_QUANTS),
    "qwen2": ("builtin", ("q0f16", "q0f32")),
    # --frontend torch-export builds float32 graphs only (float16 is refused at import).
    "gpt2": ("torch-export", ("q0f32", "q8f32")),
    # Gemma 3's local (sliding-window) and global layers: TVM's CUDA sliding-window kernels, prompts past the window.
    "gemma3": ("torch-export", ("q0f32",)),
}
BENCH_QUANTS = ("q0f16", "q4f16")
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0,
                initializer_range=0.02, tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2)
# Reference workload: one prompt, 32 greedy tokens, 16 teacher-forced decode steps, a batch of 4 prompts.
PROMPT_LEN, GREEDY_TOKENS, DECODE_STEPS, BATCH_LENS, BATCH_TOKENS = 24, 32, 16, (5, 17, 24, 40), 16
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16"}


# ---- deterministic weights: the same bytes on every machine ------------------------------------------

def tensor_values(seed: int, name: str, shape: tuple[int, ...], kind: str, scale: float) -> np.ndarray:
    """float32 values of tensor `name`: a PCG64 stream seeded by sha256(seed/name), each 64-bit draw two 32-bit
    words, their top 24 bits mapped with exact float32 steps to an odd multiple of 2^-24 in (-1, 1), then one
    rounded product: every machine with IEEE float32 gets the same bits. `kind`: "norm" (1 + 0.2 u), "bias"
    (0.5 u) or "weight" (uniform with standard deviation `scale`)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:16], "little")
    count = int(np.prod(shape, dtype=np.int64))
    words = np.random.PCG64(key).random_raw((count + 1) // 2).astype("<u8").view("<u4")[:count]
    values = (words >> np.uint32(8)).astype(np.float32)
    values *= np.float32(2)
    values += np.float32(1)
    values *= np.float32(2**-24)
    values -= np.float32(1)  # exact: both terms are multiples of 2^-24 below 2
    if kind == "norm":
        values *= np.float32(0.2)
        values += np.float32(1)
    else:
        values *= np.float32(0.5 if kind == "bias" else scale * 3**0.5)  # uniform(-a, a) has std a / sqrt(3)
    return values.reshape(shape)


def write_checkpoint(spec: dict, out_dir: Path) -> str:
    """Write `spec`'s model.safetensors (tensors in name order, a header of sorted keys) plus its small files
    into `out_dir`; the sha256 of model.safetensors. Independent of the safetensors library's version."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in spec["files"].items():
        (out_dir / name).write_text(text, encoding="utf-8")
    tensors, header, offset = sorted(spec["tensors"]), {"__metadata__": {"format": "pt"}}, 0
    itemsize = {"float32": 4, "float16": 2}
    for name, shape, _kind in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize[spec["dtype"]]
        header[name] = {"dtype": SAFETENSORS_DTYPES[spec["dtype"]], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with (out_dir / "model.safetensors").open("wb") as file:
        for chunk in (struct.pack("<Q", len(head)), head):
            file.write(chunk)
            digest.update(chunk)
        for name, shape, kind in tensors:
            data = tensor_values(spec["seed"], name, tuple(shape), kind, spec["scale"]).astype(spec["dtype"])
            file.write(data.tobytes())
            digest.update(data.tobytes())
    return digest.hexdigest()


# ---- prepare (here): checkpoints, artifacts, references, the bundle ------------------------------------

def checkpoint_spec(name: str, config, seed: int, dtype: str, scale: float, tokenizer: bool) -> dict:
    """The recipe of a random checkpoint: config files, and each parameter's name, shape and kind."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = [(n, list(p.shape), _kind(n)) for n, p in model.named_parameters()]  # tied ones once
    files = {"config.json": config.to_json_string(use_diff=False),
             "generation_config.json": GenerationConfig(bos_token_id=1, eos_token_id=2).to_json_string()}
    if tokenizer:
        sys.path.insert(0, str(REPO / "tests"))
        import models

        with tempfile.TemporaryDirectory() as tmp:
            models.write_tokenizer(Path(tmp), config.vocab_size)
            files.update({p.name: p.read_text(encoding="utf-8") for p in Path(tmp).iterdir()})
    return {"name": name, "seed": seed, "dtype": dtype, "scale": scale, "tensors": tensors, "files": files}


def _kind(name: str) -> str:
    if name.endswith("bias"):
        return "bias"
    return "norm" if "norm" in name or ".ln_" in name else "weight"


def model_specs(with_1b: bool) -> dict[str, dict]:
    """The checkpoints: the tests' tiny Llama, Qwen2, GPT-2 and Gemma 3 (windowed) shapes (float32), and the 1B
    shape (float16)."""
    sys.path.insert(0, str(REPO / "tests"))
    import models
    from transformers import AutoConfig, LlamaConfig

    specs = {
        "llama": checkpoint_spec("llama", models.make_config("llama", tie_word_embeddings=False), SEED, "float32",
                                 0.1, True),
        "qwen2": checkpoint_spec("qwen2", models.make_config("qwen2", tie_word_embeddings=True), SEED, "float32",
                                 0.1, True),
        "gpt2": checkpoint_spec("gpt2", AutoConfig.for_model("gpt2", vocab_size=models.VOCAB_SIZE, bos_token_id=1,
                                                             eos_token_id=2, **models.EXPORTED_MODELS["gpt2"]),
                                SEED, "float32", 0.1, True),
        "gemma3": checkpoint_spec("gemma3", AutoConfig.for_model(
            "gemma3_text", vocab_size=models.VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            **models.FAMILIES["gemma3"][1]), SEED, "float32", 0.1, True),
    }
    if with_1b:
        specs["llama1b"] = checkpoint_spec("llama1b", LlamaConfig(**LLAMA_1B), SEED, "float16", 0.02, False)
    return specs


def artifact_plan(with_1b: bool) -> dict[str, dict]:
    """{artifact id: its checkpoint, --quant, frontend, role and compile sizes}."""
    plan = {f"{model}-{quant}": {"checkpoint": model, "quant": quant, "frontend": frontend, "role": "check",
                                 "prefill_chunk": TINY_CHUNK, "max_batch": TINY_BATCH, "memory_budget": None}
            for model, (frontend, quants) in TINY_ARTIFACTS.items() for quant in quants}
    if with_1b:
        plan.update({f"llama1b-{quant}": {"checkpoint": "llama1b", "quant": quant, "frontend": "builtin",
                                          "role": "bench", "prefill_chunk": BENCH_CHUNK, "max_batch": BENCH_BATCH,
                                          "memory_budget": BENCH_MEMORY_BUDGET} for quant in BENCH_QUANTS})
    return plan


def compile_artifact(checkpoint_dir: Path, dest: Path, entry: dict) -> None:
    """Compile one artifact, then add its weight recipes as a file the resealed manifest lists."""
    from ember.core.manifest import read_manifest, write_manifest
    from ember.driver.compiler import compile_model

    result = compile_model(checkpoint_dir, dest, compile_options(entry))
    (dest / RECIPES_NAME).write_text(json.dumps([result.params, result.recipes]), encoding="utf-8")
    write_manifest(dest, read_manifest(dest))


def compile_options(entry: dict):
    """The CompileOptions of an artifact-plan entry."""
    from ember.driver.compiler import CompileOptions

    return CompileOptions(target=TARGET, quantization=entry["quant"], frontend=entry["frontend"],
                          prefill_chunk=entry["prefill_chunk"], max_batch=entry["max_batch"],
                          memory_budget=entry["memory_budget"], show_progress=False)


def reference_prompts(vocab: int) -> dict[str, list]:
    """The prompts every check uses: one of PROMPT_LEN tokens and a batch of BATCH_LENS lengths."""
    rng = np.random.default_rng(SEED)
    return {"prompt": rng.integers(3, vocab, PROMPT_LEN).tolist(),
            "batch": [rng.integers(3, vocab, n).tolist() for n in BATCH_LENS]}


def greedy(model, prompt: list[int], steps: int, torch) -> list[int]:
    """`steps` greedy tokens after `prompt`, one forward per token on transformers' KV cache (no stop token)."""
    out = model(torch.tensor([prompt], device=model.device), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]], device=model.device), past_key_values=out.past_key_values,
                    use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def reference_outputs(model, vocab: int, torch) -> dict[str, np.ndarray]:
    """transformers' outputs on the reference workload: prefill logits of the prompt, GREEDY_TOKENS greedy tokens,
    the logits of DECODE_STEPS teacher-forced steps after the prompt, and each batch prompt's greedy tokens."""
    prompts = reference_prompts(vocab)
    with torch.no_grad():
        tokens = greedy(model, prompts["prompt"], GREEDY_TOKENS, torch)
        full = model(torch.tensor([prompts["prompt"] + tokens[:DECODE_STEPS]], device=model.device)).logits[0]
        batch = [greedy(model, p, BATCH_TOKENS, torch) for p in prompts["batch"]]
    full = full.float().cpu().numpy()
    return {"prefill_logits": full[:PROMPT_LEN], "decode_logits": full[PROMPT_LEN: PROMPT_LEN + DECODE_STEPS],
            "greedy_tokens": np.array(tokens), "batch_tokens": np.array(batch)}


def cpu_references(checkpoint_dir: Path, vocab: int) -> dict[str, np.ndarray]:
    """The reference outputs of transformers on this CPU, float32, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return reference_outputs(model, vocab, torch)


def source_digest() -> str:
    """sha256 of ember's sources (compiler and runtime): an artifact in the work directory compiled from other
    sources is compiled again, so the bundle's libraries and its runtime copy are of one tree."""
    digest = hashlib.sha256()
    for folder in ("ember", "frontend", "ir", "ir_passes", "schedules", "targets", "runtime"):
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def prepare(out: Path, work: Path, with_1b: bool, compile_into=None) -> Path:
    """Build everything here and pack the bundle into `out`; `compile_into(checkpoint_dir, dest, entry)` compiles
    an artifact (default: `compile_artifact`; the tests pass one that goes through their artifact cache)."""
    compile_into = compile_into or compile_artifact
    specs, plan, sources = model_specs(with_1b), artifact_plan(with_1b), source_digest()
    checkpoints = {}
    for name, spec in specs.items():
        start = time.perf_counter()
        checkpoints[name] = {"spec": spec, "sha256": write_checkpoint(spec, work / "checkpoints" / name)}
        print(f"checkpoint {name}: {len(spec['tensors'])} tensors, {time.perf_counter() - start:.1f} s", flush=True)
    for artifact_id, entry in plan.items():
        dest, stamp = work / "artifacts" / artifact_id, work / "artifacts" / f"{artifact_id}.key"
        key = json.dumps([entry, checkpoints[entry["checkpoint"]]["sha256"], sources], sort_keys=True)
        if not (dest / RECIPES_NAME).exists() or not stamp.exists() or stamp.read_text() != key:
            shutil.rmtree(dest, ignore_errors=True)
            start = time.perf_counter()
            compile_into(work / "checkpoints" / entry["checkpoint"], dest, entry)
            stamp.write_text(key)
            print(f"compiled {artifact_id} for {TARGET} in {time.perf_counter() - start:.1f} s", flush=True)
    references = {name: cpu_references(work / "checkpoints" / name, json.loads(spec["files"]["config.json"])
                                       ["vocab_size"]) for name, spec in specs.items() if name in TINY_ARTIFACTS}
    return pack_bundle(out, work, checkpoints, plan, references)


def pack_bundle(out: Path, work: Path, checkpoints: dict, plan: dict, references: dict) -> Path:
    """Write the bundle into a staging directory beside `out`, then rename it into place; print its size."""
    import tvm
    import tvm_ffi

    staging = out.with_name(f".{out.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "runtime").mkdir(parents=True)
    shutil.copyfile(tvm_runtime_archive(tvm.__version__), staging / "runtime" / TVM_ARCHIVE)
    wheel = tvm_ffi_wheel(tvm_ffi.__version__)
    shutil.copyfile(wheel, staging / "runtime" / wheel.name)
    copy_ember_runtime(staging / "site")
    for name, checkpoint in checkpoints.items():
        (staging / "checkpoints").mkdir(exist_ok=True)
        (staging / "checkpoints" / f"{name}.json").write_text(json.dumps(checkpoint), encoding="utf-8")
    for artifact_id in plan:
        source = work / "artifacts" / artifact_id
        shutil.copytree(source, staging / "artifacts" / artifact_id, ignore=shutil.ignore_patterns("params"))
    (staging / "references").mkdir()
    for name, outputs in references.items():
        np.savez(staging / "references" / f"{name}.npz", **outputs)
    plan_doc = {"format": BUNDLE_FORMAT, "target": TARGET, "tvm_version": tvm.__version__,
                "tvm_ffi_version": tvm_ffi.__version__, "tvm_ffi_wheel": wheel.name, "artifacts": plan,
                "checkpoints": {name: c["sha256"] for name, c in checkpoints.items()}}
    (staging / PLAN_NAME).write_text(json.dumps(plan_doc, indent=2), encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(staging, out)
    size = bundle_size(out)
    print(f"bundle {out}: {size / 2**20:.1f} MiB in {sum(1 for p in out.rglob('*') if p.is_file())} files "
          f"(the upload limit is {UPLOAD_LIMIT / 2**20:.0f} MiB)", flush=True)
    if size >= UPLOAD_LIMIT:
        raise SystemExit(f"bundle {out} is {size / 2**20:.1f} MiB, over the {UPLOAD_LIMIT / 2**20:.0f} MiB upload")
    return out


def bundle_size(bundle: Path) -> int:
    """Bytes of every file under `bundle`."""
    return sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())


def tvm_runtime_archive(version: str) -> Path:
    """The installed TVM package without its compiler library, headers and sources, as .tar.xz (cached by
    version under ~/.cache/ember/tvm-runtime/: xz over ~17 MB takes a while on two cores)."""
    import tvm

    cached = Path.home() / ".cache" / "ember" / "tvm-runtime" / f"tvm-{version}-runtime.tar.xz"
    if cached.exists():
        return cached
    package = Path(tvm.__file__).parent
    skipped = {"3rdparty", "include", "src", "__pycache__", "libtvm_compiler.so"}
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}")
    with tarfile.open(partial, "w:xz") as archive:
        archive.add(package, arcname="tvm", filter=lambda info: None if skipped & set(info.name.split("/"))
                    else info)
    os.rename(partial, cached)
    return cached


def tvm_ffi_wheel(version: str) -> Path:
    """apache-tvm-ffi's cp312 manylinux wheel of `version` (the GPU machine's Python), downloaded once with pip."""
    folder = FFI_WHEEL_CACHE / version
    found = sorted(folder.glob("apache_tvm_ffi-*-cp312-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        f"apache-tvm-ffi=={version}", "-d", str(folder)], check=True)
        found = sorted(folder.glob("apache_tvm_ffi-*-cp312-*.whl"))
    return found[-1]


def copy_ember_runtime(site: Path) -> None:
    """ember's runtime packages (`ember/__init__`, core, runtime), serving (the served check) and the weight
    conversion and the quant formats it reads (neither imports the compiler), with the metadata that gives
    `ember.__version__`."""
    import ember
    from ember import core, runtime, serving
    from ember.driver import convert
    from ember.ir import quant_formats

    package = site / "ember"
    package.mkdir(parents=True)
    shutil.copyfile(ember.__file__, package / "__init__.py")
    for module in (core, runtime, serving):
        shutil.copytree(Path(module.__file__).parent, package / module.__name__.rsplit(".", 1)[1],
                        ignore=shutil.ignore_patterns("__pycache__"))
    for module in (convert, quant_formats):
        folder = package / module.__name__.split(".")[1]
        folder.mkdir(exist_ok=True)
        shutil.copyfile(Path(module.__file__).parent / "__init__.py", folder / "__init__.py")
        shutil.copyfile(module.__file__, folder / Path(module.__file__).name)
    dist_info = site / f"ember-{ember.__version__}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ember\nVersion: {ember.__version__}\n",
                                        encoding="utf-8")


# ---- run (there): unpack, regenerate, convert, check ----------------------------------------------------

def unpack(bundle: Path, workdir: Path) -> dict:
    """Unpack `bundle` into `workdir` (site/ for TVM's runtime, tvm_ffi and ember; artifacts/ without weights);
    installs nothing from a network. Returns the plan."""
    plan = json.loads((bundle / PLAN_NAME).read_text(encoding="utf-8"))
    if plan["format"] != BUNDLE_FORMAT:
        raise SystemExit(f"{bundle}: bundle format {plan['format']}, this script reads {BUNDLE_FORMAT}")
    site = workdir / "site"
    shutil.copytree(bundle / "site", site)
    with tarfile.open(bundle / "runtime" / TVM_ARCHIVE) as archive:
        archive.extractall(site, filter="data")
    wheel = bundle / "runtime" / plan["tvm_ffi_wheel"]
    if sys.version_info[:2] == (3, 12):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), str(wheel)], check=True)
    else:  # a dry run on another Python: the installed tvm_ffi of the same version stands in for the cp312 wheel
        import tvm_ffi

        if tvm_ffi.__version__ != plan["tvm_ffi_version"]:
            raise SystemExit(f"dry run: tvm_ffi {tvm_ffi.__version__} installed, the bundle has "
                             f"{plan['tvm_ffi_version']}")
        shutil.copytree(Path(tvm_ffi.__file__).parent, site / "tvm_ffi", ignore=shutil.ignore_patterns("__pycache__"))
        plan["tvm_ffi_stand_in"] = f"Python {sys.version_info[0]}.{sys.version_info[1]}: the installed tvm_ffi"
    shutil.copytree(bundle / "artifacts", workdir / "artifacts")
    shutil.copytree(bundle / "checkpoints", workdir / "checkpoint-specs")
    shutil.copytree(bundle / "references", workdir / "references")
    (workdir / PLAN_NAME).write_text(json.dumps(plan), encoding="utf-8")
    return plan


def runtime_env(workdir: Path) -> dict[str, str]:
    """The environment of a worker: only the unpacked site on the path before the system's packages, TVM's
    runtime library alone, and the CUDA 13 runtime of torch's nvidia-cuda-runtime package on the loader path."""
    env = dict(os.environ, PYTHONPATH=str(workdir / "site"), TVM_USE_RUNTIME_LIB="1", PYTHONUNBUFFERED="1")
    cudart = [str(p.parent) for entry in sys.path if Path(entry, "nvidia").is_dir()
              for p in Path(entry, "nvidia").rglob("libcudart.so.13*")]
    if cudart:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(cudart + [env.get("LD_LIBRARY_PATH", "")]))
    return env


class SafetensorsWeights:
    """A checkpoint's tensors by name, as `ember.driver.convert` reads them (numpy, the stored dtype)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="numpy")

    def load(self, name: str) -> np.ndarray:
        """The tensor `name`."""
        return self._file.get_tensor(name)


def materialize_weights(workdir: Path, names: list[str]) -> dict:
    """In the runtime-only environment: check that TVM's compiler is absent, regenerate each checkpoint and
    refuse a sha256 other than the bundle's, convert each artifact's weights from its recipes, and check every
    file of each artifact against its manifest (the shards against the hashes recorded at compile)."""
    import tvm

    from ember.core.manifest import read_manifest, verify_files
    from ember.driver.convert import write_params

    site, plan = workdir / "site", json.loads((workdir / PLAN_NAME).read_text())
    report = {"tvm": tvm.__file__, "compiler_library": sorted(p.name for p in (site / "tvm" / "lib").iterdir()),
              "relax_imported": "tvm.relax" in sys.modules, "checkpoints": {}, "artifacts": {}}
    if not Path(tvm.__file__).is_relative_to(site) or "libtvm_compiler.so" in report["compiler_library"] \
            or report["relax_imported"]:
        raise SystemExit(f"not the runtime-only TVM: {report}")
    for name in dict.fromkeys(plan["artifacts"][a]["checkpoint"] for a in names):
        spec = json.loads((workdir / "checkpoint-specs" / f"{name}.json").read_text())["spec"]
        start = time.perf_counter()
        digest = write_checkpoint(spec, workdir / "checkpoints" / name)
        if digest != plan["checkpoints"][name]:
            raise SystemExit(f"checkpoint {name}: regenerated model.safetensors has sha256 {digest}, the bundle "
                             f"recorded {plan['checkpoints'][name]}: this machine's weights differ; refusing to run")
        report["checkpoints"][name] = {"sha256": digest, "seconds": round(time.perf_counter() - start, 2)}
        print(f"checkpoint {name}: regenerated, sha256 {digest[:16]}... matches the bundle", flush=True)
    for artifact_id in names:
        start, artifact = time.perf_counter(), workdir / "artifacts" / artifact_id
        params, recipes = json.loads((artifact / RECIPES_NAME).read_text())
        weights = SafetensorsWeights(workdir / "checkpoints" / plan["artifacts"][artifact_id]["checkpoint"] /
                                     "model.safetensors")
        write_params([tuple(p) for p in params], recipes, weights, artifact / "params", show_progress=False)
        verify_files(artifact, read_manifest(artifact))
        report["artifacts"][artifact_id] = {"seconds": round(time.perf_counter() - start, 2)}
        print(f"artifact {artifact_id}: weights converted, every file matches its manifest", flush=True)
    import ember.runtime  # noqa: F401 - the runtime's import, as the GPU workers do it, needs no compiler either

    report["runtime_imported_without_relax"] = "tvm.relax" not in sys.modules
    report["ember_runtime"] = ember.runtime.__file__
    return report


def plan_lines(plan: dict, names: list[str]) -> list[str]:
    """The checks `run` does, one line each, in order."""
    lines = []
    for artifact_id in names:
        entry = plan["artifacts"][artifact_id]
        if entry["role"] == "check":
            exact = ", greedy tokens = transformers GPU = CPU" if entry["quant"] == "q0f32" else ""
            lines.append(f"check {artifact_id}: prefill + {DECODE_STEPS} paged-cache decode logits vs transformers "
                         f"on the GPU (bound {'1e-4' if entry['quant'].endswith('f32') else '1e-2'} of max |logit|)"
                         f"{exact}, batch of {len(BATCH_LENS)} = solo runs")
        else:
            lines.append(f"bench {artifact_id}: prefill {' and '.join(map(str, (512, 2048)))}, decode batch 1/8/32, "
                         f"one decode step's kernels")
    lines.append("serve llama-q0f32 to the openai client (skipped where openai/fastapi/uvicorn are missing)")
    if any(plan["artifacts"][a]["role"] == "bench" for a in names):
        lines.append("peers on llama1b: PyTorch eager float16 (SDPA), torch.compile (static cache); copy bandwidth")
    return lines


class Log:
    """Lines printed and kept in a log file; `deadline` ends the run's time budget (RUN_BUDGET_S)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.deadline = time.perf_counter() + RUN_BUDGET_S

    def __call__(self, line: str) -> None:
        """Print `line` and append it to the log."""
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def worker(log: Log, workdir: Path, name: str, *args: str, timeout: float, device: bool = True) -> dict:
    """Run one worker in a fresh process of the runtime-only environment; its result, {"error": ...}, or
    {"skipped": ...} when the run's time budget has not `MIN_WORKER_S` left for it."""
    timeout = min(timeout, log.deadline - time.perf_counter())
    if timeout < MIN_WORKER_S:
        log(f"--- {name} {' '.join(args)}: skipped, the run's {RUN_BUDGET_S} s budget is spent")
        return {"skipped": f"the run's {RUN_BUDGET_S} s budget is spent"}
    script = Path(__file__).with_name("gpu_check_device.py" if device else "gpu_check.py")
    result_path = workdir / f"result-{name}-{'-'.join(args) or 'all'}.json"
    command = [sys.executable, str(script), *([] if device else ["worker"]), name, str(workdir), str(result_path),
               *args]
    log(f"--- {name} {' '.join(args)}")
    start = time.perf_counter()
    process = subprocess.Popen(command, env=runtime_env(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    timer = threading.Timer(timeout, process.kill)  # a silent hang is ended too, not only a chatty one
    timer.start()
    for line in process.stdout:
        log(line.rstrip("\n"))
    code = process.wait()
    timer.cancel()
    seconds = round(time.perf_counter() - start, 1)
    log(f"--- {name} {' '.join(args)}: exit {code} in {seconds} s")
    if code != 0 or not result_path.exists():
        return {"error": f"exit {code}" + (f" (killed after {timeout} s)" if seconds >= timeout else ""),
                "seconds": seconds}
    return {**json.loads(result_path.read_text()), "seconds": seconds}


def run(bundle: Path, out: Path, dry_run: bool, skip_bench: bool) -> int:
    """The GPU half (or, with `dry_run`, all of it before the first CUDA call); 0 when every check passed."""
    out.mkdir(parents=True, exist_ok=True)
    log, started = Log(out / "gpu-check.log"), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ember-gpu-check-") as tmp:
        workdir = Path(tmp)
        plan = unpack(bundle, workdir)
        names = [a for a, e in plan["artifacts"].items() if not (skip_bench and e["role"] == "bench")]
        log(f"bundle {bundle}: {len(names)} artifacts, TVM {plan['tvm_version']} runtime only, "
            f"unpacked in {time.perf_counter() - started:.1f} s" + (f"; {plan['tvm_ffi_stand_in']}"
                                                                      if "tvm_ffi_stand_in" in plan else ""))
        report = {"plan": plan_lines(plan, names), "dry_run": dry_run,
                  "weights": worker(log, workdir, "weights", *names, timeout=300, device=False)}
        failed = ["weights"] if "error" in report["weights"] else []
        log("plan of checks:\n  " + "\n  ".join(report["plan"]))
        if not dry_run and not failed:
            report.update(device_checks(log, workdir, plan, names))
            failed += [c["name"] for key in ("correctness", "serve") for c in report[key].get("checks", [])
                       if not c["passed"]] + [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
            failed += [f"bench {a}" for a, row in report.get("bench", {}).items()  # ember's; a peer's is noted
                       if a.startswith("llama1b-") and "error" in row]
    report.update(failed=failed, seconds=round(time.perf_counter() - started, 1))
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    log(f"{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'} ({report['seconds']} s); "
        f"{out / 'gpu-check.json'}")
    return 1 if failed else 0


def device_checks(log: Log, workdir: Path, plan: dict, names: list[str]) -> dict:
    """The CUDA workers: correctness, serve, then the benchmark and its peers (torch.compile last: it may be cut
    off by its timeout without costing the rest)."""
    report = {"correctness": worker(log, workdir, "correctness", timeout=240),
              "serve": worker(log, workdir, "serve", timeout=60)}
    bench = [a for a in names if plan["artifacts"][a]["role"] == "bench"]
    if bench:
        report["bench"] = {a: worker(log, workdir, "bench-ember", a, timeout=150) for a in bench}
        report["bench"]["torch-eager-fp16"] = worker(log, workdir, "bench-torch", "llama1b", timeout=150)
        report["bench"]["torch-compile-fp16"] = worker(log, workdir, "bench-compile", "llama1b", timeout=180)
        for line in bench_table(workdir, report["bench"]):
            log(line)
    return report


def bench_table(workdir: Path, rows: dict) -> list[str]:
    """The benchmark as a table of rates and ratios to PyTorch eager, with decode's share of the copy bandwidth."""
    eager = rows.get("torch-eager-fp16", {})
    copy = eager.get("copy_bytes_per_s")
    lines = [f"{eager.get('device', '?')}: copy {copy / 1e9:.0f} GB/s" if copy else "copy bandwidth: not measured",
             f"{'runtime':<22}{'prefill512':>11}{'prefill2048':>12}{'decode b1':>10}{'% copy':>8}{'b8':>8}{'b32':>8}"
             f"{'b1 vs eager':>12}"]
    for name, row in rows.items():
        if "error" in row or "skipped" in row:
            lines.append(f"{name:<22} {row.get('error') or row['skipped']}")
            continue
        share = ""
        if copy and name in ("llama1b-q0f16", "llama1b-q4f16"):
            achieved = row["decode_tokens_per_s"] * decode_bytes(workdir / "artifacts" / name, DECODE_CONTEXT)
            share = f"{100 * achieved / copy:.0f}%"
        prefill, batch = row.get("prefill_tokens_per_s", {}), row.get("decode_batch_tokens_per_s", {})
        ratio = row["decode_tokens_per_s"] / eager["decode_tokens_per_s"] if "decode_tokens_per_s" in eager else 0
        lines.append(f"{name:<22}{prefill.get('512', 0):>11.0f}{prefill.get('2048', 0):>12.0f}"
                     f"{row['decode_tokens_per_s']:>10.1f}{share:>8}{batch.get('8', 0):>8.0f}{batch.get('32', 0):>8.0f}"
                     f"{ratio:>11.2f}x")
    for name, row in rows.items():
        kernels = [k for k in row.get("decode_step_kernels", []) if "us_per_step" in k]
        if kernels:
            lines.append(f"{name}: one batch-1 decode step, {sum(k['us_per_step'] for k in kernels):.0f} us in "
                         f"its {len(kernels)} longest kernels:")
            lines += [f"  {k['us_per_step']:>8.1f} us  x{k['launches_per_step']:<5g} {k['kernel']}"
                      for k in kernels[:10]]
    return lines


def decode_bytes(artifact: Path, context: int) -> float:
    """Bytes a batch-1 decode step reads: every weight but the embedding table, and the KV cache at `context`."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    index = json.loads((artifact / "params" / "tensor-cache.json").read_text())
    weights = sum(record["nbytes"] for shard in index["records"] for record in shard["records"]
                  if "embed_tokens" not in record["name"])
    return weights + manifest["memory"]["kv_bytes_per_token"] * context


def main() -> int:
    """The command line (see the module docstring)."""
    import argparse

    if len(sys.argv) > 2 and sys.argv[1] == "worker":  # `weights` in the runtime-only environment
        _, _, name, workdir, result, *names = sys.argv
        Path(result).write_text(json.dumps(materialize_weights(Path(workdir), names)), encoding="utf-8")
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("prepare", help="compile, compute references and pack the bundle (no GPU)")
    make.add_argument("--out", type=Path, default=REPO / "build" / "gpu-bundle")
    make.add_argument("--work", type=Path, default=REPO / "build" / "gpu-work",
                      help="checkpoints and compiled artifacts (kept: an unchanged artifact is not recompiled)")
    make.add_argument("--skip-1b", action="store_true", help="tiny models only: no 1B benchmark artifacts")
    check = commands.add_parser("run", help="the checks and the benchmark on the GPU machine")
    check.add_argument("--bundle", type=Path, default=REPO / "build" / "gpu-bundle")
    check.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "build" / "gpu-check-out")),
                       help="where gpu-check.json and gpu-check.log go (default: $OUT, else build/gpu-check-out)")
    check.add_argument("--dry-run", action="store_true", help="stop before the first CUDA call (no GPU needed)")
    check.add_argument("--skip-bench", action="store_true", help="leave out the 1B benchmark artifacts")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.work, not args.skip_1b)
        return 0
    return run(args.bundle, args.out, args.dry_run, args.skip_bench)


if __name__ == "__main__":
    sys.exit(main())
