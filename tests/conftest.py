"""Shared fixtures: each tiny model is built and compiled once per session, or taken from the cache.

Compiling is the slow part of the suite, so `tiny_models[name]` compiles the
checkpoint `name` of `models.TINY_MODELS` on first use and every later test
shares the artifact (and its loaded VM, and the transformers reference model).
Tests that modify an artifact or checkpoint copy it first.

Compiled artifacts are kept between sessions (`artifact_cache`: keyed by the
compiler's sources, TVM's version, this CPU, the options and the checkpoint's
bytes; EMBER_TEST_CACHE=0 turns it off). The plain llama is compiled through
the CLI in a subprocess (`ember compile`), the others with `compile_model` in
this process, so every llama test runs an artifact built by another process.
However warm the cache, `cli_compiled_llama` runs `ember compile` on the current
sources every session: test_artifact checks its report, and test_artifact_cache
that it builds the very files the session's cached llama holds.

Markers (registered in pyproject.toml) let slow families be deselected; a test
that needs qemu (`arm64_python`), llama.cpp's files (`demo_gguf`,
`sentencepiece_gguf`), the RPC farm (`farm`) or chromium (`chromium`) is marked by
the fixture it uses, below. Nothing is skipped by default, except `gpu` tests
on a machine without a CUDA GPU.
"""

from __future__ import annotations

import json
import multiprocessing
import os

# Before anything imports transformers or huggingface_hub: the tests never touch a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil
import subprocess
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import artifact_cache
import models
import numpy as np
import pytest
from helpers import q8_0_activations, run_ember

from ember.core.without_torch import hide_torch_from_tvm
from ember.ir.quant_formats import FORMATS
from ember.ir.tvmscript import stacks_from_linecache

PREFILL_CHUNK = 64  # below the 100-token prompts, so prefill runs in chunks
MAX_BATCH = 4
CLI_COMPILED = ("llama",)
LONG_CONTEXT = 1024  # the long-context tiny llama's: serving tests send prompts of up to 400 tokens
LONG_MAX_BATCH = 8


@dataclass
class TinyModel:
    """One tiny checkpoint, its compiled artifact, and lazily its runtime and reference."""

    name: str
    model_dir: Path
    artifact_dir: Path
    compile_output: subprocess.CompletedProcess | None = None  # set when compiled by the CLI
    quantization: str = "q0f32"

    @cached_property
    def artifact(self):
        """The artifact loaded with `ember.runtime.load_artifact` (shared: make Engines, do not mutate)."""
        from ember.runtime import load_artifact

        return load_artifact(self.artifact_dir)

    def engine(self):
        """A fresh engine (own KV cache) over the shared loaded artifact."""
        from ember.runtime import Engine

        return Engine(self.artifact)

    @cached_property
    def reference(self):
        """The same checkpoint in transformers, float32, eager attention.

        For a quantized artifact, every 2-D weight (projections, embeddings) but a
        mixture of experts' router is replaced by its quantized-then-unpacked value,
        computed in numpy: the reference is transformers running the same quantized
        weights.
        """
        model = models.load_reference(self.model_dir)
        fmt = FORMATS[self.quantization]
        if fmt.quantizes:
            import torch

            stored_transposed = {id(module.weight) for module in model.modules() if _is_conv1d(module)}
            with torch.no_grad():
                routers = {id(weight) for module in model.modules() if hasattr(module, "experts")
                           for router in (getattr(module, "gate", None), getattr(module, "router", None))
                           if isinstance(router, torch.nn.Module) for weight in router.parameters()}
                for param in model.parameters():
                    if id(param) in routers:  # kept in float
                        continue
                    if param.ndim == 3:  # stacked experts: ember quantizes each expert's rows
                        stacked = param.numpy().reshape(-1, param.shape[-1])
                        unpacked = fmt.dequantize(fmt.quantize(stacked), stacked.shape[1]).astype(np.float32)
                        param.copy_(torch.from_numpy(unpacked.reshape(param.shape)))
                    elif param.ndim == 2:
                        # ember quantizes rows of [out, in]: a Conv1D's [in, out] weight along its columns.
                        weight = param.numpy().T if id(param) in stored_transposed else param.numpy()
                        unpacked = fmt.dequantize(fmt.quantize(weight), weight.shape[1]).astype(np.float32)
                        param.copy_(torch.from_numpy(unpacked.T if id(param) in stored_transposed else unpacked))
        return model

    def reference_logits(self, ids: list[int]) -> np.ndarray:
        """transformers' logits [len(ids), vocab] for one sequence (int8 activations as in `int8_rounding`)."""
        import torch

        with torch.no_grad(), self.int8_rounding():
            out = self.reference(torch.tensor([ids], dtype=torch.long))
        return out.logits[0].float().numpy()

    def reference_decode_logits(self, prompt: list[int], continuation: list[int]) -> np.ndarray:
        """transformers' logits [len(continuation), vocab] for decoding `continuation` after `prompt`.

        The prompt goes through one forward pass and the continuation one token at a time
        on its KV cache, as ember runs them (int8 activations as in `int8_rounding`).
        """
        import torch

        with torch.no_grad(), self.int8_rounding():
            out = self.reference(torch.tensor([prompt], dtype=torch.long), use_cache=True)
            past, rows = out.past_key_values, []
            for token in continuation:
                out = self.reference(torch.tensor([[token]], dtype=torch.long), past_key_values=past, use_cache=True)
                past = out.past_key_values
                rows.append(out.logits[0, -1].float().numpy())
        return np.stack(rows)

    @contextmanager
    def int8_rounding(self):
        """While active, if the artifact quantizes activations (manifest `activations: int8`), every projection
        ember runs with a kernel of quantized activations sees them rounded as that kernel rounds them: the
        reference computes what ember's kernels claim to.

        The int8 kernels (`schedules/int8_matmul.py`, and AMX's int8 tiles, which give the same sums) round each
        input row as llama.cpp's Q8_0 does (`quantize_activations`). On a target with AMX-BF16, prefill's calls of
        `amx_bf16_matmul.VNNI_BELOW_ROWS` rows or more run on bfloat16 tiles instead, which round the input and
        the (dequantized) weight to bfloat16 and sum in float32: the rows of a prefill chunk that long are
        computed so here. A forward over n tokens is read as ember's prefill of them (chunks of the artifact's
        `prefill_chunk`); a forward of one token is a decode step, on the int8 kernel. A mixture of experts'
        stacked expert weights ([experts, N, K], each expert's rows a projection ember's int8 kernel computes:
        `int8_matmul.int8_dot_experts`) see each (token, expert) pair's input rounded the same way: transformers'
        eager experts code, whose `linear` on an expert's slice of the stacked weight rounds its input while
        active."""
        import torch

        from ember.core.manifest import read_manifest
        from ember.schedules import amx_bf16_matmul, int8_matmul
        from ember.targets.registry import resolve_target

        fmt = FORMATS[self.quantization]
        manifest = read_manifest(self.artifact_dir)
        if manifest.activations != "int8":
            yield
            return
        int8_dot = resolve_target(json.dumps(manifest.target["tvm_target"])).int8_dot
        bf16_tiles = int8_dot is not None and int8_dot.tiles == "bf16"
        chunk = int(manifest.kv_cache["prefill_chunk"])

        def on_tiles(tokens: int):
            """Which of a forward's `tokens` rows a bfloat16 tile kernel computes: those of long prefill chunks."""
            lengths = [min(chunk, tokens - begin) for begin in range(0, tokens, chunk)] if tokens > 1 else [1]
            return torch.tensor([length >= amx_bf16_matmul.VNNI_BELOW_ROWS for length in lengths
                                 for _ in range(length)])

        def rounded(module, args, output):
            x = args[0]
            weight = module.weight.T if _is_conv1d(module) else module.weight
            bias = module.bias if module.bias is not None else 0
            int8 = quantize_activations(x) @ weight.T + bias
            if not (bf16_tiles and amx_bf16_matmul.supports_bf16(fmt, *_rows_and_columns(module))):
                return int8
            bf16 = x.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().T + bias
            return torch.where(on_tiles(x.shape[-2])[:, None], bf16, int8)

        hooks = [module.register_forward_hook(rounded) for module in self.reference.modules()
                 if (isinstance(module, torch.nn.Linear) or _is_conv1d(module))
                 and int8_matmul.supports(fmt, *_rows_and_columns(module))]
        experts = {id(param) for param in self.reference.parameters()
                   if param.ndim == 3 and int8_matmul.supports(fmt, param.shape[1], param.shape[2])}
        linear, implementation = torch.nn.functional.linear, self.reference.config._experts_implementation

        def expert_linear(x, weight, bias=None):
            if weight._base is not None and id(weight._base) in experts:
                x = quantize_activations(x)
            return linear(x, weight, bias)

        if experts:
            self.reference.config._experts_implementation = "eager"
            torch.nn.functional.linear = expert_linear
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            torch.nn.functional.linear = linear
            self.reference.config._experts_implementation = implementation

    def reference_greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' `generate` with greedy search and end-of-sequence stopping disabled."""
        import torch

        with torch.no_grad():
            out = self.reference.generate(
                torch.tensor([ids], dtype=torch.long),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(ids):].tolist()


def _is_conv1d(module) -> bool:
    """transformers' Conv1D (GPT-2's projections): a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and module.weight.ndim == 2


def _rows_and_columns(module) -> tuple[int, int]:
    """(out, in) features of a linear layer or a Conv1D."""
    out_features, in_features = module.weight.shape
    return (in_features, out_features) if _is_conv1d(module) else (out_features, in_features)


def quantize_activations(x):
    """The torch tensor x rounded as llama.cpp's Q8_0 rounds activations (`helpers.q8_0_activations`)."""
    import torch

    return torch.from_numpy(q8_0_activations(x.numpy())).to(x.dtype)


class TinyModels:
    """Builds and compiles tiny models on demand, once each."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, TinyModel] = {}

    def checkpoint(self, name: str) -> Path:
        """The checkpoint directory of `name` (written once; copy it before modifying)."""
        model_dir = self.root / "checkpoints" / name
        if not model_dir.exists():
            write = models.write_checkpoint if name in models.TINY_MODELS else models.write_exported_checkpoint
            write(name, model_dir)
        return model_dir

    def quantized(self, name: str, quantization: str, float_activations: bool = False) -> TinyModel:
        """The tiny model `name` compiled with `--quant quantization` (and `--float-activations`), once per
        session."""
        return self._compiled(name, quantization, float_activations, "builtin")

    def exported(self, name: str, quantization: str = "q0f32", float_activations: bool = False) -> TinyModel:
        """The tiny model `name` compiled through `--frontend torch-export` with `--quant quantization` (and
        `--float-activations`), once per session."""
        return self._compiled(name, quantization, float_activations, "torch-export")

    def kv_quantized(self, name: str, frontend: str = "builtin", kv_quant: str = "q8") -> TinyModel:
        """The tiny model `name` compiled (q0f32, through `frontend`) with `--kv-quant kv_quant`, once per session."""
        return self._compiled(name, "q0f32", False, frontend, kv_quant=kv_quant)

    def _compiled(self, name: str, quantization: str, float_activations: bool, frontend: str,
                  kv_quant: str | None = None) -> TinyModel:
        """The tiny model `name` compiled in-process with these options, once per session."""
        key = (f"{name}-{quantization}" if frontend == "builtin" else f"{name}-{frontend}-{quantization}") + (
            "-float-activations" * float_activations) + (f"-kv-{kv_quant}" if kv_quant else "")
        if key not in self._models:
            from ember.driver.compiler import CompileOptions, compile_model

            model_dir, artifact_dir = self.checkpoint(name), self.root / "artifacts" / key
            options = CompileOptions(quantization=quantization, prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH,
                                     frontend=frontend, float_activations=float_activations, kv_quant=kv_quant,
                                     show_progress=False)
            artifact_cache.build(artifact_cache.artifact_key(f"tiny-{key}", options, [model_dir]), artifact_dir,
                                 lambda dest: compile_model(model_dir, dest, options))
            self._models[key] = TinyModel(name, model_dir, artifact_dir, quantization=quantization)
        return self._models[key]

    def onnx(self, name: str) -> TinyModel:
        """The tiny model `name` exported by `torch.onnx.export` and compiled from the .onnx file (through the
        CLI, its tokenizer and config.json from the checkpoint directory), once per session."""
        key = f"{name}-onnx"
        if key not in self._models:
            model_dir, artifact_dir = self.checkpoint(name), self.root / "artifacts" / key
            onnx_path = models.write_onnx(model_dir, self.root / "onnx" / name / f"{name}.onnx")
            args = ("--no-progress", "--prefill-chunk", str(PREFILL_CHUNK), "--max-batch", str(MAX_BATCH))
            outputs = []

            def compile_onnx(dest: Path) -> None:
                outputs.append(run_ember("compile", str(onnx_path), "--tokenizer", str(model_dir), "-o", str(dest),
                                         *args))
                assert outputs[0].returncode == 0, outputs[0].stderr

            # The .onnx file's directory: its weights are beside it (name.onnx.data).
            artifact_cache.build(artifact_cache.artifact_key(f"tiny-{key}", args, [onnx_path.parent, model_dir]),
                                 artifact_dir, compile_onnx)
            self._models[key] = TinyModel(name, model_dir, artifact_dir, outputs[0] if outputs else None)
        return self._models[key]

    def onnx_file(self, name: str) -> Path:
        """The .onnx file `onnx(name)` compiled."""
        self.onnx(name)
        return self.root / "onnx" / name / f"{name}.onnx"

    def __getitem__(self, name: str) -> TinyModel:
        if name not in self._models:
            from ember.driver.compiler import CompileOptions, compile_model

            model_dir, artifact_dir = self.checkpoint(name), self.root / "artifacts" / name
            options = CompileOptions(prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH, show_progress=False)
            outputs = []

            def compile_into(dest: Path) -> None:
                if name in CLI_COMPILED:
                    outputs.append(compile_through_cli(model_dir, dest))
                else:
                    compile_model(model_dir, dest, options)

            artifact_cache.build(artifact_cache.artifact_key(f"tiny-{name}", options, [model_dir]), artifact_dir,
                                 compile_into)
            self._models[name] = TinyModel(name, model_dir, artifact_dir, outputs[0] if outputs else None)
        return self._models[name]


def compile_through_cli(model_dir: Path, artifact_dir: Path) -> subprocess.CompletedProcess:
    """`ember compile MODEL_DIR -o ARTIFACT_DIR` in a subprocess with the session's sizes; it must succeed."""
    output = run_ember("compile", str(model_dir), "-o", str(artifact_dir), "--no-progress",
                       "--prefill-chunk", str(PREFILL_CHUNK), "--max-batch", str(MAX_BATCH))
    assert output.returncode == 0, output.stderr
    return output


@pytest.fixture(scope="session")
def cli_compiled_llama(tiny_models, tmp_path_factory) -> TinyModel:
    """The plain tiny llama compiled by `ember compile` in a subprocess every session, never from the cache: the
    CLI's compile runs on the current sources however warm the cache is."""
    model_dir = tiny_models.checkpoint("llama")
    artifact_dir = tmp_path_factory.mktemp("cli-compiled") / "llama"
    return TinyModel("llama", model_dir, artifact_dir, compile_through_cli(model_dir, artifact_dir))


@pytest.fixture(scope="session", autouse=True)
def stacks_read_from_linecache():
    """Kernels parsed outside `ember compile` (a test building one kernel, or lowering a module itself) read the
    stack as the compiler does (`ember.ir.tvmscript`): a test process holds torch and transformers, ~4,000 modules
    for `inspect` to scan per frame otherwise."""
    with stacks_from_linecache():
        yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    """`tiny_models[name]`: the compiled tiny model `name` of `models.TINY_MODELS`."""
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> TinyModel:
    """The plain tiny llama (GQA, untied embeddings), for tests that need any model."""
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_llama_long(tmp_path_factory) -> TinyModel:
    """The plain tiny llama's shapes with a context of LONG_CONTEXT tokens, compiled with max_batch
    LONG_MAX_BATCH, for serving tests whose prompts and outputs need more than 256 tokens."""
    from ember.driver.compiler import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("tiny-long")
    model_type, overrides = models.TINY_MODELS["llama"]
    config = models.make_config(model_type, **overrides, max_position_embeddings=LONG_CONTEXT)
    model_dir = models.write_model(models.random_model(config), root / "checkpoint")
    artifact_dir = root / "llama-long"
    options = CompileOptions(prefill_chunk=PREFILL_CHUNK, max_batch=LONG_MAX_BATCH, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key("tiny-llama-long", options, [model_dir]), artifact_dir,
                         lambda dest: compile_model(model_dir, dest, options))
    return TinyModel("llama-long", model_dir, artifact_dir)


class DemoBuilds:
    """The bundled demo model compiled for a target, once per session: test_edge and test_farm share them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, target: str, quantization: str, float_activations: bool = False,
            kv_quant: str | None = None) -> Path:
        """The artifact of the demo for `target` in `quantization` (float activations: q0f32 has no others), with
        `--kv-quant kv_quant` if given."""
        return self.get_many([(target, quantization, float_activations, kv_quant)])[0]

    def get_many(self, builds: list[tuple[str, str, bool, str | None]]) -> list[Path]:
        """`get` of each (target, quantization, float_activations, kv_quant), the missing ones compiled side by
        side, one worker process per core: a compile is single-threaded (the edge tests' nine: 84 s in turn)."""
        import ember
        from ember.driver.compiler import CompileOptions

        artifacts, wanted, keys = [], {}, {}
        for target, quantization, float_activations, kv_quant in builds:
            float_activations = float_activations or quantization == "q0f32"
            artifact = self.root / (f"{target}-{quantization}-{'float' if float_activations else 'int8'}"
                                    + (f"-kv-{kv_quant}" if kv_quant else ""))
            artifacts.append(artifact)
            if not artifact.exists():
                wanted[artifact] = CompileOptions(target=target, quantization=quantization,
                                                  float_activations=float_activations, kv_quant=kv_quant,
                                                  show_progress=False)
                keys[artifact] = artifact_cache.artifact_key(f"demo-{artifact.name}", wanted[artifact],
                                                             [Path(ember.DEMO_MODEL_DIR)])
        with artifact_cache.locked(keys.values()):  # another test worker building one of them: wait, then restore
            missing = {artifact: options for artifact, options in wanted.items()
                       if not artifact_cache.restore(keys[artifact], artifact)}
            self._compile(missing)
            for artifact in missing:
                artifact_cache.store(keys[artifact], artifact)
        return artifacts

    @staticmethod
    def _compile(missing: dict[Path, object]) -> None:
        """Compile the demo into each artifact with its options, side by side in worker processes."""
        import ember
        from ember.driver.compiler import compile_model

        if len(missing) == 1:
            (artifact, options), = missing.items()
            compile_model(ember.DEMO_MODEL_DIR, artifact, options)
        elif missing:
            spawn = multiprocessing.get_context("spawn")  # TVM's threads do not survive a fork
            # A worker loads TVM without torch, as the CLI does: 1.8 s less to start each.
            with ProcessPoolExecutor(min(len(missing), os.cpu_count() or 1), mp_context=spawn,
                                     initializer=hide_torch_from_tvm) as pool:
                for done in [pool.submit(compile_model, ember.DEMO_MODEL_DIR, artifact, options)
                             for artifact, options in missing.items()]:
                    done.result()


@pytest.fixture(scope="session")
def demo_builds(tmp_path_factory) -> DemoBuilds:
    return DemoBuilds(tmp_path_factory.mktemp("demo-builds"))


@pytest.fixture(scope="session")
def arm64_python() -> list[str]:
    """The command prefix that runs an emulated aarch64 Python with the runtime's wheels
    (scripts/setup_arm64.sh, once, cached); skips where it cannot be set up (exit 3) or off x86_64."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("cross-compiles from x86_64")
    setup = subprocess.run(["bash", str(Path(__file__).resolve().parent.parent / "scripts" / "setup_arm64.sh")],
                           capture_output=True, text=True)
    if setup.returncode == 3:
        pytest.skip(setup.stderr.strip())
    assert setup.returncode == 0, setup.stderr
    return setup.stdout.split()


@pytest.fixture
def copy_artifact(tmp_path):
    """Copy an artifact directory into this test's tmp dir, to tamper with."""

    def copy(model: TinyModel) -> Path:
        return Path(shutil.copytree(model.artifact_dir, tmp_path / "artifact"))

    return copy


# The slow families, by the fixture that sets each up: a test using it (directly or through another fixture) gets
# the marker, so `-m "not emulated"` and the like deselect it.
FIXTURE_MARKERS = {"arm64_python": "emulated", "demo_gguf": "llama_cpp", "sentencepiece_gguf": "llama_cpp",
                   "farm": "farm", "chromium": "browser"}
# Families whose first test sets up a toolchain (qemu's Python, a llama.cpp build, chromium) or that run long:
# pyproject's per-test timeout is raised for them unless the test sets its own.
LONG_FAMILIES = ("slow", "emulated", "llama_cpp", "browser")
# Families that bring up a Ray cluster or an RPC tracker with its devices (seconds before a test's first check) are
# `slow` as well: the quick loop runs the engine, pipeline stages and server in process.
SLOW_FAMILIES = ("cluster", "farm")
LONG_TIMEOUT = 3600


def pytest_configure(config) -> None:
    """Under pytest-xdist, files go to the workers in the order of collection, which `pytest_collection_modifyitems`
    makes longest first (xdist's own order is by number of tests).

    A test worker's TVM thread pool takes its share of the cores (TVM_NUM_THREADS, unless set): two workers on
    two cores, each with TVM's default of one thread per core, run four threads on two CPUs, and every parallel
    kernel launch waits for a thread the other worker keeps off its CPU (a 16-token prefill step of the tiny llama
    took 36 ms against 0.4 ms of kernels). Subprocesses (the CLI, servers, workers) inherit it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's controller: hand out files in collection order
        config.option.loadscopereorder = False
    if workers > 1 and "TVM_NUM_THREADS" not in os.environ:
        from ember.runtime.device import physical_cores

        os.environ["TVM_NUM_THREADS"] = str(max(1, physical_cores() // workers))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test by the slow fixtures it uses (and the SLOW_FAMILIES slow), give the long families LONG_TIMEOUT
    seconds, skip `gpu` tests on a machine without a CUDA GPU, and in a pytest-xdist worker order the files longest
    first (`longest_files_first`)."""
    has_gpu = None
    for item in items:
        for fixture in set(item.fixturenames) & FIXTURE_MARKERS.keys():
            item.add_marker(FIXTURE_MARKERS[fixture])
        if any(item.get_closest_marker(family) for family in SLOW_FAMILIES):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("timeout") is None and any(item.get_closest_marker(m) for m in LONG_FAMILIES):
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT))
        if item.get_closest_marker("gpu"):
            if has_gpu is None:
                import tvm

                has_gpu = bool(tvm.cuda(0).exist)
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    if "PYTEST_XDIST_WORKER" in os.environ:
        longest_files_first(items)


# Seconds each test file took in a recorded cold run on two workers (`scripts/suite_durations.py` writes it).
SUITE_DURATIONS = Path(__file__).with_name("suite_durations.json")


def longest_files_first(items: list) -> None:
    """Sort `items` by their file's SUITE_DURATIONS, longest first, files it does not list (new ones) before them
    all, tests of one file in their order. Every worker sorts alike and xdist's controller takes the order as
    collected, so `--dist loadfile` hands out the long files first and the run ends on short ones, not on one
    worker running a long file alone (by xdist's own order, a file of six tests and an 11-compile fixture came
    last)."""
    seconds = json.loads(SUITE_DURATIONS.read_text(encoding="utf-8"))
    items.sort(key=lambda item: -seconds.get(item.path.name, float("inf")))


def pytest_sessionfinish(session) -> None:
    """In a pytest-xdist worker: hand this worker's tallies to the controller, which prints the summary."""
    import hostile

    if (output := getattr(session.config, "workeroutput", None)) is not None:
        output["artifact_cache"] = dict(artifact_cache.TALLY)
        output["artifact_compile_seconds"] = artifact_cache.compile_seconds
        output["hostile"] = [[parser, outcome, count] for (parser, outcome), count in hostile.TALLY.counts.items()]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: runs in the controller as each worker finishes
def pytest_testnodedown(node, error) -> None:
    """Add a finished worker's tallies to the controller's."""
    import hostile

    output = getattr(node, "workeroutput", {})
    artifact_cache.TALLY.update(output.get("artifact_cache", {}))
    artifact_cache.compile_seconds += output.get("artifact_compile_seconds", 0.0)
    for parser, outcome, count in output.get("hostile", []):
        hostile.TALLY.counts[parser, outcome] += count


def pytest_terminal_summary(terminalreporter) -> None:
    """The artifact cache's tally, and the hostile-input corpus's (`test_hostile_corpus.py`) when it ran."""
    import hostile

    if line := artifact_cache.summary():
        terminalreporter.write_line(line)
    if hostile.TALLY.counts:
        terminalreporter.write_line("hostile-input corpus (outcome of every generated case):")
        for line in hostile.TALLY.report():
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def worker():
    """A hostile-corpus worker process (tests/hostile.py) for a test module's cases, closed after them."""
    from hostile import Worker

    running = Worker()
    yield running
    running.close()
