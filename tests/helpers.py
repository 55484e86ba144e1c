"""Helpers shared by the tests: prompts, logit comparison, running the CLI, serving in this process."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import artifact_cache
import models
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    """<s> followed by `length - 1` random non-special token ids."""
    rng = np.random.default_rng(seed)
    return [models.BOS_ID] + rng.integers(len(models.SPECIAL_TOKENS), models.VOCAB_SIZE, length - 1).tolist()


def q8_0_activations(x: np.ndarray) -> np.ndarray:
    """x rounded to int8 per group of 32 along its last axis, as llama.cpp's quantize_row_q8_0 does
    (exact halves to nearest even), in float64: d = max|x| / 127, q = round(x * 127 / max|x|), x' = q * d."""
    groups = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    top = np.abs(groups).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    return (np.rint(groups * inverse) * (top / np.float32(127)).astype(np.float64)).reshape(x.shape)


def call_matmul_kernel(lib, fmt, parts: dict[str, np.ndarray], x: np.ndarray, n: int, batch: int = 1) -> np.ndarray:
    """y [rows, n] from a compiled quantized-matmul kernel (`main(x, *fmt.parts, y)`), with x [rows, k] as `batch`
    sequences."""
    import tvm

    rows, k = x.shape
    y = tvm.runtime.tensor(np.zeros((batch, rows // batch, n), np.float32))
    lib["main"](tvm.runtime.tensor(x.reshape(batch, rows // batch, k)),
                *(tvm.runtime.tensor(parts[p]) for p in fmt.parts), y)
    return y.numpy().reshape(rows, n)


def llama_cpp_matmul_reference(fmt, parts: dict, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's x @ W.T (Q8_0-rounded activations times the dequantized interleaved weight) and the exact one,
    in float64."""
    from ember.ir.quant_formats import INTERLEAVED

    dequantized = fmt.dequantize(parts, k, INTERLEAVED).astype(np.float64)
    return q8_0_activations(x) @ dequantized.T, x.astype(np.float64) @ dequantized.T


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str, tol: float = 1e-4) -> None:
    """Max abs difference <= tol, scaled by max |logit| when logits exceed 1."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(1.0, float(np.abs(expected).max()))
    diff = float(np.abs(actual - expected).max())
    assert diff <= tol * scale, f"{what}: max abs diff {diff:.3g} > {tol} x {scale:.3g}"


def assert_batched_equals_solo(model, prompts: list[list[int]], steps: list[list[int]], what: str = "") -> None:
    """Sequences prefilled and decoded together in one batch give each the logits it gets alone: `prompts`, then the
    tokens of `steps` decoded one a step (`model`: a compiled tiny model, whose `engine()` is fresh)."""
    solo = []
    for prompt, tokens in zip(prompts, steps):
        engine = model.engine()
        seq = engine.add_sequence()
        engine.prefill(seq, prompt)
        solo.append([engine.decode([seq], [token])[0] for token in tokens])
    engine = model.engine()
    seqs = [engine.add_sequence() for _ in prompts]
    for seq, prompt in zip(seqs, prompts):
        engine.prefill(seq, prompt)
    for step in range(len(steps[0])):
        rows = engine.decode(seqs, [tokens[step] for tokens in steps])
        for which in range(len(prompts)):
            assert_logits_close(rows[which], solo[which][step], f"{what}sequence {which}, step {step} in a batch")


def run_ember(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ember ARGS` in a subprocess; text output captured."""
    return run_python("-m", "ember", *args, env=env, timeout=timeout)


def compile_cached(what: str, model: Path, dest: Path, *args: str) -> None:
    """`ember compile MODEL -o DEST ARGS` in a subprocess (it must succeed), or its artifact from the test-artifact
    cache: for tests whose artifact is an input, not what they check. Not for a model whose KV cache the CLI would
    size to this machine's free memory (the key does not cover it)."""
    def compile_into(into: Path) -> None:
        result = run_ember("compile", str(model), "-o", str(into), *args)
        assert result.returncode == 0, result.stderr

    key = artifact_cache.artifact_key(what, args, [model])
    artifact_cache.build(key, dest, compile_into)


# Three-layer checkpoints for `--pipeline-stages` (the shared tiny models have two): K = 3 splits each layer apart,
# K = 2 splits them unevenly. test_pipeline_stages and test_cluster_pipeline compile them alike, so one cache entry
# serves both.
PIPELINE_LAYERS = 3
PIPELINE_FRONTENDS = {"llama": "builtin", "gpt2": "torch-export"}
PIPELINE_PREFILL_CHUNK = 16  # below the longest prompts, so prefill runs in chunks through every stage
PIPELINE_MAX_BATCH = 4


def write_pipeline_checkpoint(name: str, out_dir: Path) -> Path:
    """A random checkpoint of `name` (a key of PIPELINE_FRONTENDS) with PIPELINE_LAYERS layers."""
    from transformers import AutoConfig

    if name == "llama":
        config = models.make_config("llama", num_hidden_layers=PIPELINE_LAYERS, tie_word_embeddings=False)
    else:
        shape = {**models.EXPORTED_MODELS["gpt2"], "n_layer": PIPELINE_LAYERS}
        config = AutoConfig.for_model("gpt2", **models._EXPORTED_COMMON, **shape)
    return models.write_model(models.random_model(config), out_dir)


def compile_pipeline_cached(name: str, checkpoint: Path, dest: Path, stages: int | None) -> Path:
    """The checkpoint of `name` compiled in this process, whole (`stages` None) or split into `stages`, into `dest`
    (or restored from the test-artifact cache); returns `dest`."""
    from ember.driver.compiler import CompileOptions, compile_model

    options = CompileOptions(frontend=PIPELINE_FRONTENDS[name], prefill_chunk=PIPELINE_PREFILL_CHUNK,
                             max_batch=PIPELINE_MAX_BATCH, pipeline_stages=stages, show_progress=False)
    key = artifact_cache.artifact_key(f"pipeline-{name}-{stages or 'whole'}", options, [checkpoint])
    artifact_cache.build(key, dest, lambda into: compile_model(checkpoint, into, options))
    return dest


def run_python(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` in a subprocess from the repository root."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *expected: str, returncode: int = 1) -> None:
    """The CLI failed as users should see it fail: `returncode`, no traceback, and stderr one
    `ember: error:` line (argparse's usage lines allowed before it for exit 2) containing each of `expected`."""
    assert result.returncode == returncode, f"exit {result.returncode}:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if returncode == 2:  # argparse: "usage: ..." lines, then "ember ...: error: ..."
        lines = [line for line in lines if ": error: " in line]
    else:
        assert len(lines) == 1 and lines[0].startswith("ember: error: "), f"expected one error line:\n{result.stderr}"
    assert len(lines) == 1, f"expected one error line:\n{result.stderr}"
    for text in expected:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


def tree_snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under `root` (itself excluded) with its bytes, a link's target, or "dir":
    compare two snapshots to show nothing on disk changed."""
    snapshot: dict[str, bytes | str] = {}
    for path in sorted(Path(root).rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            snapshot[key] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            snapshot[key] = "dir"
        elif path.is_file():
            snapshot[key] = path.read_bytes()
        else:
            snapshot[key] = "special"
    return snapshot


@contextmanager
def ember_serve(artifact: Path, api_key_file: Path, timeout: float, *options: str) -> Iterator[str]:
    """`ember serve ARTIFACT [options]` in a subprocess on a free loopback port, one thread: its base URL
    (http://127.0.0.1:PORT), once it listens; stopped by its own process handle at the end."""
    process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(artifact), "--port", "0",
                                "--api-key-file", str(api_key_file), "--threads", "1", *options],
                               cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()  # blocks until the server listens, or the process ends
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line + process.stderr.read() if process.poll() is not None else line
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=timeout)


def assert_declared_fields_only(model) -> None:
    """No field of `model`, a client library's pydantic type validated from what ember sent (nested ones included),
    is outside the fields the type declares: every field ember sends is one of theirs."""
    from pydantic import BaseModel

    assert not model.model_extra, f"{type(model).__name__} has fields its type does not know: {model.model_extra}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                assert_declared_fields_only(item)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`ember ARGS` in this process, as a CompletedProcess (argparse's exit becomes the return code)."""
    from ember import cli

    try:
        code = cli.main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@contextmanager
def deadline(seconds: int = 60):
    """Fail instead of hanging if the body runs longer than `seconds` (reading /dev/zero, opening a FIFO)."""
    def expire(_signum, _frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


SERVE_TIMEOUT = 60  # seconds a served request may take; catches a hang, never a speed


class Served:
    """A server (a thread on a free loopback port, stopped by `close`) over its own load of an artifact, and an
    `openai` client for it. Needs the serve extra and the `openai` client: skip on them before using it."""

    def __init__(self, artifact_dir: Path, api_key: str | None = None, max_queue: int = 256,
                 kv_capacity: int | None = None, speculation=None, pooling: str = "mean",
                 adapters: dict[str, Path] | None = None) -> None:
        import openai

        from ember.runtime import Engine, load_artifact
        from ember.serving import Scheduler
        from ember.serving.server import Server

        engine = Engine(load_artifact(artifact_dir))
        for name, path in (adapters or {}).items():  # LoRA adapters, as `ember serve --lora NAME=PATH` loads them
            engine.load_adapter(name, path)
        if kv_capacity is not None:  # the scheduler admits by this figure: a smaller cache, as far as it knows
            engine.kv_capacity = kv_capacity
        self.scheduler = Scheduler(engine, max_queue=max_queue, speculation=speculation)
        self.name = artifact_dir.name
        self.server = Server(self.scheduler, self.name, port=0, api_key=api_key, pooling=pooling)
        self.server.start()
        self.api_key = api_key or "unused"
        self.client = openai.OpenAI(base_url=self.server.url, api_key=self.api_key, max_retries=0,
                                    timeout=SERVE_TIMEOUT)

    def async_client(self):
        """An `openai.AsyncOpenAI` client for the server."""
        import openai

        return openai.AsyncOpenAI(base_url=self.server.url, api_key=self.api_key, max_retries=0,
                                  timeout=SERVE_TIMEOUT)

    def concurrently(self, one, jobs) -> list:
        """`one(client, ids, max_tokens)` for every (ids, max_tokens, _) of `jobs` at once on one async
        client, all done within SERVE_TIMEOUT; their results in the order of `jobs`."""

        async def run_all():
            client = self.async_client()
            try:
                return await asyncio.wait_for(asyncio.gather(*(one(client, ids, m) for ids, m, _ in jobs)),
                                              SERVE_TIMEOUT)
            finally:
                await client.close()

        return asyncio.run(run_all())

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, parsed JSON or text) of one raw HTTP request."""
        connection = http.client.HTTPConnection(self.server.host, self.server.port, timeout=SERVE_TIMEOUT)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read().decode("utf-8")
        finally:
            connection.close()
        try:
            return response.status, json.loads(data)
        except json.JSONDecodeError:
            return response.status, data

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        status, text = self.request("GET", "/metrics")
        assert status == 200
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def close(self) -> None:
        """Stop the server and its scheduler."""
        self.server.stop()
        self.scheduler.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


# A local Ray cluster on loopback for the `cluster` tests. Its nodes and clients agree on no token (Ray's default
# mode would ask each for one).
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
RAY_START_TIMEOUT = 240  # seconds for a node to come up on a loaded 2-core machine


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def local_ray_cluster(nodes: int = 2, cpus: int = 1, env: dict[str, str] | None = None) -> Iterator[str]:
    """The head's address (127.0.0.1:PORT) of a Ray cluster of `nodes` nodes of `cpus` CPUs each, started by
    `ray start` (in `env`, by default RAY_ENV: no token authentication) in a temporary directory of its own and
    stopped by killing the processes that name it."""
    import shutil
    import tempfile

    temp_dir = tempfile.mkdtemp(prefix="ember-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    # Ray's command line run by this Python: its `ray` script lies beside another Python's in a venv made with
    # --system-site-packages.
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]

    def start(*args: str) -> None:
        # Ports Ray would otherwise take at fixed defaults get free ones: two test workers may each run a cluster.
        result = subprocess.run([*ray_cli, "start", f"--num-cpus={cpus}", "--disable-usage-stats",
                                 f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={free_port()}", *args],
                                capture_output=True, text=True, timeout=RAY_START_TIMEOUT,
                                env=RAY_ENV if env is None else env)
        assert result.returncode == 0, result.stdout + result.stderr

    try:
        start("--head", f"--port={port}", f"--ray-client-server-port={free_port()}", "--include-dashboard=false")
        for _ in range(nodes - 1):
            start(f"--address=127.0.0.1:{port}")
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_processes_under(temp_dir: str) -> None:
    """Kill a local Ray cluster's processes (each one's command line names its temp dir), and only them."""
    import psutil

    ours = []
    for process in psutil.process_iter(["cmdline"]):
        if process.pid != os.getpid() and any(temp_dir in part for part in process.info["cmdline"] or ()):
            ours.append(process)
    for process in ours:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ours, timeout=30)
