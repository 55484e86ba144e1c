"""A model split into pipeline stages (`ember compile --pipeline-stages K`) served from a Ray cluster: one actor per
stage, on a two-node cluster on loopback started here (helpers.local_ray_cluster), stopped by its processes.

The model is test_pipeline_stages' tiny llama with three layers (its artifacts, from the same compiles), so it splits
three ways. Its split artifacts must give the unsplit artifact's logits, through the chain of actors (in this process:
`PipelineEngine`) and through `ember serve --ray` (the official `openai` client's greedy answers equal the unsplit
server's). The logits check also runs on test_pipeline_stages' three-layer GPT-2 through the torch.export frontend, and
(marked slow) on a random Llama of the ~110M shape scripts/bench_cpu.py benchmarks, at a context of 512.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import models
import numpy as np
import pytest
from helpers import (
    RAY_ENV,
    RAY_START_TIMEOUT,
    REPO_ROOT,
    compile_cached,
    compile_pipeline_cached,
    ember_serve,
    free_port,
    local_ray_cluster,
    prompt_ids,
    run_ember,
    write_pipeline_checkpoint,
)

pytestmark = pytest.mark.cluster
openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
pytest.importorskip("psutil")

from ember.cluster.pipeline import (  # noqa: E402  (after the skip: it needs Ray)
    NodeOffer,
    PipelineEngine,
    StageSpec,
    plan_placement,
    split_costs,
)
from ember.core.errors import EmberError  # noqa: E402
from ember.runtime import Engine, load_artifact  # noqa: E402

COMPILE_ARGS = ("--no-progress", "--prefill-chunk", "64", "--max-batch", "4")
DECODE_STEPS = 32
TOLERANCE = 1e-5
NO_EOS = {str(models.EOS_ID): -100}  # greedy answers run to max_tokens


def _compile_whole_and_split(checkpoint: Path, root: Path, name: str, cache_key: str) -> dict[int, Path]:
    """`checkpoint` compiled whole (key 1) and split into 2 and 3 stages, under `root`, through the artifact cache."""
    artifacts = {}
    for stages in (1, 2, 3):
        artifacts[stages] = root / f"{name}-{stages}"
        extra = () if stages == 1 else ("--pipeline-stages", str(stages))
        compile_cached(f"{cache_key}-{stages}", checkpoint, artifacts[stages], *COMPILE_ARGS, *extra)
    return artifacts


def _pipeline_artifacts(name: str, root: Path) -> dict[int, Path]:
    """test_pipeline_stages' three-layer checkpoint of `name` compiled whole (key 1) and split into 2 and 3 stages,
    with its compile calls, so the artifact cache serves both files the same entries."""
    checkpoint = write_pipeline_checkpoint(name, root / "checkpoint")
    return {stages: compile_pipeline_cached(name, checkpoint, root / f"{name}-{stages}", stages if stages > 1 else None)
            for stages in (1, 2, 3)}


@pytest.fixture(scope="module")
def split_llama(tmp_path_factory) -> dict[int, Path]:
    """The three-layer tiny llama, whole and split."""
    return _pipeline_artifacts("llama", tmp_path_factory.mktemp("split-llama"))


@pytest.fixture(scope="module")
def split_gpt2(tmp_path_factory) -> dict[int, Path]:
    """The three-layer GPT-2 (torch.export frontend), whole and split."""
    return _pipeline_artifacts("gpt2", tmp_path_factory.mktemp("split-gpt2"))


# scripts/bench_cpu.py's SHAPES["110m"] as transformers names it; the context cut to 512 to keep the KV cache small.
LLAMA_110M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=512)


@pytest.fixture(scope="module")
def split_llama_110m(tmp_path_factory) -> dict[int, Path]:
    """A random Llama of the ~110M shape compiled whole (key 1) and split into 2 and 3 stages; its checkpoint stored
    in bfloat16 (half float32's ~500 MB), which the default q0f32 compile widens to float32 for every artifact."""
    import torch

    root = tmp_path_factory.mktemp("split-llama-110m")
    # initializer_range 0.02 (transformers' default) keeps 768-wide hidden states and logits at trained-model scale
    config = models.make_config("llama", **LLAMA_110M, tie_word_embeddings=False, initializer_range=0.02)
    checkpoint = root / "checkpoint"
    # no tokenizer (the tiny one has too few tokens for 32000): the test feeds token ids, as the benchmark does
    models.random_model(config).to(torch.bfloat16).save_pretrained(checkpoint, safe_serialization=True)
    return _compile_whole_and_split(checkpoint, root, "llama-110m", "llama-110m")


@pytest.fixture(scope="module")
def ray_cluster():
    """Two two-CPU nodes on loopback: room for three one-CPU stages."""
    with local_ray_cluster(nodes=2, cpus=2) as address:
        yield address


@pytest.fixture(scope="module")
def joined(ray_cluster):
    """This process joined to the cluster."""
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address=ray_cluster, log_to_driver=False, configure_logging=False)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()
        if previous is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = previous


def _greedy_run(engine, prompts: list[list[int]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Prefill logits of each prompt, then the logits of DECODE_STEPS batched greedy decode steps."""
    seq_ids = [engine.add_sequence() for _ in prompts]
    first = np.stack([engine.prefill(seq_id, prompt) for seq_id, prompt in zip(seq_ids, prompts)])
    steps, logits = [], first
    for _ in range(DECODE_STEPS):
        logits = engine.decode(seq_ids, [int(token) for token in logits.argmax(axis=-1)])
        steps.append(np.array(logits))
    for seq_id in seq_ids:
        engine.remove_sequence(seq_id)
    return first, steps


@pytest.mark.parametrize("model", [pytest.param("split_llama", id="tiny"), pytest.param("split_gpt2", id="gpt2"),
                                   pytest.param("split_llama_110m", id="110m", marks=pytest.mark.slow)])
@pytest.mark.parametrize("stages", [2, 3])
def test_split_logits_equal_the_whole_model(request, joined, model, stages):
    """K stages as actors across the two nodes give the unsplit artifact's logits within 1e-5, at prefill and over
    32 batched greedy decode steps for four prompts of different lengths: for the tiny llama, a GPT-2 through the
    torch.export frontend and the ~110M llama."""
    artifacts = request.getfixturevalue(model)
    prompts = [prompt_ids(length, seed) for seed, length in enumerate((5, 17, 70, 33))]
    whole_first, whole_steps = _greedy_run(Engine(load_artifact(artifacts[1], threads=1)), prompts)
    engine = PipelineEngine(artifacts[stages])
    try:
        nodes = {stage.node.node_id for stage in engine.stages}
        assert len(nodes) == 2  # spread over both nodes
        first, steps = _greedy_run(engine, prompts)
    finally:
        engine.stop()
    assert np.abs(first - whole_first).max() <= TOLERANCE
    for step, (got, want) in enumerate(zip(steps, whole_steps)):
        assert np.abs(got - want).max() <= TOLERANCE, f"decode step {step}"


def test_stages_go_on_nodes_of_their_own_with_room():
    """Stages take a node each while nodes last, never more memory than a node offers; one that fits nowhere is
    one line naming it."""
    stages = [StageSpec(i, f"stage-{i}", (i, i + 1), 100, 90) for i in range(3)]
    nodes = [NodeOffer("a", "10.0.0.1", 250), NodeOffer("b", "10.0.0.2", 150)]
    assert [node.node_id for node in plan_placement(stages, nodes)] == ["a", "b", "a"]
    with pytest.raises(EmberError, match=r"^stage 2 \(layers 2-2\) needs 0.0 MiB .*the most is 0.0 MiB"):
        plan_placement(stages, [NodeOffer("a", "10.0.0.1", 250)])


def test_split_costs_of_a_70b_llama():
    """The on-paper table's figures: 80 layers of a 70B Llama at 4.5 bits a weight, the KV cache in float16."""
    rows = {row["stages"]: row for row in split_costs(stages=(2, 4, 8))}
    layer_weights = (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) * 4.5 / 8
    assert rows[4]["layers_per_stage"] == 20
    assert rows[4]["middle_weight_bytes"] == pytest.approx(20 * layer_weights, rel=1e-3)
    assert rows[2]["kv_bytes_per_token"] == 40 * 2 * 8 * 128 * 2
    assert rows[8]["hop_bytes_per_token"] == 8192 * 4 and rows[8]["hops_per_token"] == 7


def _serve(artifact: Path, address: str, log: Path, *options: str) -> tuple[subprocess.Popen, str]:
    """`ember serve --ray ADDRESS ARTIFACT` on a free loopback port, once it serves: the process and its base URL."""
    port = free_port()
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(artifact), "--ray", address,
                                    "--port", str(port), *options],
                                   cwd=REPO_ROOT, stderr=stderr, stdout=subprocess.DEVNULL, env=RAY_ENV)
    deadline = time.monotonic() + RAY_START_TIMEOUT
    while not re.search(r"serving \S+ at http://", log.read_text()):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(log.read_text())
        time.sleep(0.5)
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served_pipeline(ray_cluster, split_llama, tmp_path_factory):
    """The three-stage artifact behind `ember serve --ray`: its base URL and its log."""
    log = tmp_path_factory.mktemp("pipeline-serve") / "serve.log"
    process, url = _serve(split_llama[3], ray_cluster, log)
    try:
        yield url, log
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _completion(client, prompt: str, max_tokens: int = DECODE_STEPS) -> str:
    return client.completions.create(model=client.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     logit_bias=NO_EOS).choices[0].text


def test_served_split_answers_equal_the_whole_model(served_pipeline, split_llama, tmp_path):
    """Four concurrent greedy completions through the official client from the three-stage pipeline equal the
    unsplit artifact's from plain `ember serve`, and so do both choices of a request for two."""
    prompts = [f"Once upon a time number {i}" for i in range(4)]
    client = _client(served_pipeline[0])
    client.model_name = split_llama[3].name
    with ThreadPoolExecutor(4) as pool:
        split = list(pool.map(lambda prompt: _completion(client, prompt), prompts))
    key = tmp_path / "key"
    key.write_text("k")
    with ember_serve(split_llama[1], key, 60) as url:
        whole_client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        whole_client.model_name = split_llama[1].name
        whole = [_completion(whole_client, prompt) for prompt in prompts]
    assert split == whole
    assert all(len(text) > 0 for text in split)
    choices = client.completions.create(model=client.model_name, prompt=prompts[0], max_tokens=DECODE_STEPS,
                                        temperature=0, logit_bias=NO_EOS, n=2).choices
    assert [choice.text for choice in choices] == [whole[0]] * 2  # n > 1: forked on every stage


def _stage_pids(log: Path) -> dict[int, int]:
    """Each stage's latest pid, as the server's log names it."""
    return {int(stage): int(pid) for stage, pid in
            re.findall(r"stage (\d+) \(layers [\d-]+\) serving on node \S+, pid (\d+)", log.read_text())}


def test_a_killed_stage_ends_its_streams_with_an_error_and_is_restarted(served_pipeline, split_llama):
    """SIGKILL to the middle stage mid-stream: the stream ends with one OpenAI error event naming the stage (what
    it streamed a prefix of its solo run), the server keeps answering, and once the stage is restarted a request
    is answered as before; a stage killed while nothing runs is restarted under the next request, which is served
    whole."""
    url, log = served_pipeline
    client = _client(url)
    client.model_name = split_llama[3].name
    prompt = "A long tale:"
    solo = _completion(client, prompt, 200)
    before = _stage_pids(log)
    pieces, error = [], None
    stream = client.completions.create(model=client.model_name, prompt=prompt, max_tokens=200, temperature=0,
                                       logit_bias=NO_EOS, stream=True)
    try:
        for count, chunk in enumerate(stream):
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            if count == 2:
                os.kill(before[1], signal.SIGKILL)
    except openai.APIError as err:
        error = err
    assert error is not None and "stage 1 (layers 1-1) stopped mid-answer" in str(error), error
    assert solo.startswith("".join(pieces)) and len("".join(pieces)) < len(solo)
    assert _completion(client, prompt, 200) == solo  # waits for the restarted stage, then served whole
    after = _stage_pids(log)
    assert after[1] != before[1] and after[0] == before[0] and after[2] == before[2]
    assert "stage 1 (pid %d) died; restarting it" % before[1] in log.read_text()
    os.kill(after[0], signal.SIGKILL)  # while nothing runs: the next request finds it dead and is served whole
    time.sleep(1)
    assert _completion(client, prompt, 200) == solo
    assert _stage_pids(log)[0] != after[0]


def test_bad_cluster_input_is_one_line(ray_cluster, split_llama):
    """An address where no cluster answers, nodes offering less memory than a stage needs, stages wanting more CPUs
    than the cluster has, and --replicas with a pipeline artifact each fail with one line, before any stage
    starts."""
    artifact = str(split_llama[2])
    closed = run_ember("serve", artifact, "--ray", f"127.0.0.1:{free_port()}", timeout=60)
    assert closed.returncode == 1 and closed.stderr.strip().count("\n") == 0, closed.stderr
    assert "no Ray cluster answers there" in closed.stderr
    small = run_ember("serve", artifact, "--ray", ray_cluster, timeout=120,
                      env={**RAY_ENV, "EMBER_RAY_NODE_MEMORY": "100000"})
    assert small.returncode == 1 and small.stderr.strip().count("\n") == 0, small.stderr
    last = small.stderr.strip()
    assert re.match(r"ember: error: stage 0 \(layers 0-1\) needs [\d.]+ MiB of memory \(weights [\d.]+ MiB\), and "
                    r"no node of the Ray cluster has that much left: the most is 0.1 MiB \(EMBER_RAY_NODE_MEMORY", last)
    threads = run_ember("serve", artifact, "--ray", ray_cluster, "--threads", "3", timeout=120, env=RAY_ENV)
    assert threads.returncode == 1 and threads.stderr.strip().count("\n") == 0, threads.stderr
    assert threads.stderr.strip().endswith("its 2 stages take 3 CPU(s) each (--threads) and the Ray "
                                                            "cluster has 4")
    replicas = run_ember("serve", artifact, "--ray", ray_cluster, "--replicas", "2", timeout=60)
    assert replicas.returncode == 1 and "is a pipeline artifact" in replicas.stderr
    assert replicas.stderr.strip().count("\n") == 0
