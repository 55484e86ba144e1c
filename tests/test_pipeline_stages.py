"""`ember compile --pipeline-stages K`: a model split by layers into stage artifacts, chained in one process
(`LocalPipeline`), computes the logits of the whole artifact (`Engine`) at prefill and over greedy decode, for one
sequence and for four decoded together; bad values of the option are refused in one line, nothing written.

Three-layer checkpoints (the shared tiny models have two), so that K = 3 splits each layer apart and K = 2 splits
them unevenly: a Llama through ember's own definition and a GPT-2 through the torch.export frontend.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    PIPELINE_FRONTENDS,
    PIPELINE_LAYERS,
    assert_one_line_error,
    compile_pipeline_cached,
    free_port,
    prompt_ids,
    run_ember,
    run_main,
    write_pipeline_checkpoint,
)

from ember.core.errors import ArtifactError
from ember.core.manifest import read_manifest

LAYERS = PIPELINE_LAYERS
DECODE_STEPS = 32
TOLERANCE = 1e-5
FRONTENDS = PIPELINE_FRONTENDS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline-checkpoints")
    return {name: write_pipeline_checkpoint(name, root / name) for name in FRONTENDS}


@pytest.fixture(scope="module")
def compiled(checkpoints, tmp_path_factory):
    """(model name, stages or None for the whole model) -> its artifact directory, compiled once (or cached)."""
    root = tmp_path_factory.mktemp("pipeline-artifacts")
    done: dict[tuple[str, int | None], Path] = {}

    def get(name: str, stages: int | None) -> Path:
        if (name, stages) not in done:
            dest = root / f"{name}-{stages or 'whole'}"
            done[name, stages] = compile_pipeline_cached(name, checkpoints[name], dest, stages)
        return done[name, stages]

    return get


def _compare(whole, pipeline, prompts: list[list[int]]) -> float:
    """Largest difference between the two engines' logits over prefill and DECODE_STEPS greedy decode steps
    of `prompts` decoded together; the tokens fed are the whole artifact's greedy choices."""
    whole_ids = [whole.add_sequence() for _ in prompts]
    pipe_ids = [pipeline.add_sequence() for _ in prompts]
    worst, tokens = 0.0, []
    for w, p, prompt in zip(whole_ids, pipe_ids, prompts):
        expected, actual = whole.prefill(w, prompt, all_logits=True), pipeline.prefill(p, prompt, all_logits=True)
        assert actual.shape == expected.shape == (len(prompt), whole.vocab_size)
        worst = max(worst, float(np.abs(actual - expected).max()))
        tokens.append(int(expected[-1].argmax()))
    for _ in range(DECODE_STEPS):
        expected, actual = whole.decode(whole_ids, tokens), pipeline.decode(pipe_ids, tokens)
        assert actual.shape == expected.shape == (len(prompts), whole.vocab_size)
        worst = max(worst, float(np.abs(actual - expected).max()))
        tokens = [int(row.argmax()) for row in expected]
    return worst


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", list(FRONTENDS))
@pytest.mark.slow
def test_chained_stages_compute_the_whole_models_logits(compiled, name, stages):
    """One sequence, then four decoded together: the chain's logits equal the whole artifact's within 1e-5."""
    from ember.runtime import Engine, load_artifact
    from ember.runtime.pipeline import LocalPipeline

    whole_artifact = load_artifact(compiled(name, None))
    pipeline_dir = compiled(name, stages)
    single = _compare(Engine(whole_artifact), LocalPipeline(pipeline_dir), [prompt_ids(37, seed=1)])
    batch = [prompt_ids(n, seed=n) for n in (5, 37, 9, 20)]
    together = _compare(Engine(whole_artifact), LocalPipeline(pipeline_dir), batch)
    assert single <= TOLERANCE and together <= TOLERANCE, (single, together)


@pytest.mark.parametrize("name", list(FRONTENDS))
def test_stages_hold_their_own_layers_weights_and_cache(compiled, name):
    """Each stage's manifest names its layers, input and output; its KV cache holds its layers only; the stages'
    weights together are the whole model's, each stored once but for GPT-2's tied embedding, which the first
    (token embedding) and last (output projection) stage both read."""
    pipeline_dir = compiled(name, 2)
    top = read_manifest(pipeline_dir)
    assert top.pipeline == {"stages": ["stage-0", "stage-1"], "layers": [[0, 2], [2, 3]],
                            "hidden_size": top.model["hidden_size"]}
    stages = [read_manifest(pipeline_dir / stage) for stage in top.pipeline["stages"]]
    assert [(s.pipeline_stage["input"], s.pipeline_stage["output"]) for s in stages] == \
        [("token_ids", "hidden"), ("hidden", "logits")]
    assert [s.kv_cache["num_layers"] for s in stages] == [2, 1]
    whole = read_manifest(compiled(name, None))
    names = [param for s in stages for param in s.params]
    shared = {"transformer.wte.weight"} if name == "gpt2" else set()
    assert sorted(set(names)) == sorted(whole.params)
    assert {param for param in names if names.count(param) > 1} == shared
    assert stages[0].memory["weight_bytes"] < whole.memory["weight_bytes"]


def test_load_artifact_refuses_a_pipeline_in_one_line(compiled):
    from ember.runtime import load_artifact

    with pytest.raises(ArtifactError, match="pipeline stages") as caught:
        load_artifact(compiled("llama", 2))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("stages", "extra", "expected"), [
    ("4", [], ["--pipeline-stages 4", f"{LAYERS} layers"]),
    ("0", [], ["--pipeline-stages 0", "at least 1"]),
    ("-2", [], ["--pipeline-stages -2", "at least 1"]),
    ("2", ["--embeddings"], ["--pipeline-stages 2", "--embeddings"]),
    ("2", ["--kv-quant", "q8"], ["--pipeline-stages 2", "--kv-quant"]),
])
def test_bad_pipeline_stages_are_refused_in_one_line(checkpoints, tmp_path, stages, extra, expected):
    """Exit 1, one line naming the option (and the layer count), nothing written at -o nor beside it."""
    out = tmp_path / "out"
    result = run_ember("compile", str(checkpoints["llama"]), "-o", str(out), "--pipeline-stages", stages,
                       "--no-progress", *extra)
    assert_one_line_error(result, *expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_pipeline_artifact_manifest_is_sealed_over_every_stage(compiled, tmp_path):
    """An edit to a stage's file is caught by the pipeline's own manifest."""
    import shutil

    from ember.runtime.pipeline import LocalPipeline

    copy = tmp_path / "copy"
    shutil.copytree(compiled("llama", 2), copy)
    data = json.loads((copy / "stage-1" / "tokenizer_config.json").read_text())
    data["edited"] = True
    (copy / "stage-1" / "tokenizer_config.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="stage-1/tokenizer_config.json"):
        LocalPipeline(copy)


def test_inspect_says_which_stage_an_artifact_is(compiled, capsys):
    """A stage keeps the whole model's source; `ember inspect` names its place in the chain and its layers, and on
    the pipeline artifact lists the stages."""
    pipeline_dir = compiled("llama", 2)
    rows = []
    for path in (pipeline_dir / "stage-0", pipeline_dir / "stage-1", pipeline_dir):
        result = run_main(capsys, "inspect", str(path))
        assert result.returncode == 0, result.stderr
        rows.append({key: value for key, _, value in (line.strip().partition("  ")
                                                      for line in result.stdout.splitlines())})
    assert rows[0]["pipeline stage"].strip() == "1 of 2 (stage-0): layers 0-1, takes token ids, gives hidden states"
    assert rows[1]["pipeline stage"].strip() == "2 of 2 (stage-1): layers 2-2, takes hidden states, gives logits"
    assert rows[2]["pipeline"].strip() == "2 stages: stage-0 (layers 0-1), stage-1 (layers 2-2)"
    assert "pipeline stage" not in rows[2] and "pipeline" not in rows[0]


def test_serve_refuses_prefix_routing_for_a_pipeline_artifact(compiled):
    """A pipeline artifact is served as one chain, no replicas to route among: --no-prefix-routing is refused in
    one line naming it, before any Ray cluster is reached (the address given has none)."""
    result = run_ember("serve", str(compiled("llama", 2)), "--ray", f"127.0.0.1:{free_port()}", "--no-prefix-routing",
                       timeout=60)
    assert_one_line_error(result, "--no-prefix-routing", "is a pipeline artifact")


def _stage_commands(stage: Path, tmp_path: Path) -> dict[str, list[str]]:
    text = tmp_path / "text.txt"
    text.write_text("a few words to score, and a few more after them")
    return {
        "generate": ["generate", str(stage), "--prompt", "hi", "--max-new-tokens", "2"],
        "chat": ["chat", str(stage)],
        "eval": ["eval", str(stage), "--perplexity", str(text)],
        "bench": ["bench", str(stage), "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1"],
        "serve": ["serve", str(stage), "--port", str(free_port())],
        "serve --ray": ["serve", str(stage), "--ray", f"127.0.0.1:{free_port()}"],
        "package": ["package", str(stage), "-o", str(tmp_path / "packaged")],
    }


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "bench", "serve", "serve --ray", "package"])
@pytest.mark.parametrize("stage", ["stage-0", "stage-1"])
def test_a_stage_alone_is_refused_naming_its_pipeline(compiled, tmp_path, command, stage):
    """A stage takes or gives hidden states: run as a whole model it would sample hidden states as logits (stage 0)
    or read token ids as hidden states (the last). Every command that runs or ships a model refuses it in one line
    naming the pipeline directory, before any server or Ray cluster starts, and writes nothing."""
    pipeline_dir = compiled("llama", 2)
    result = run_ember(*_stage_commands(pipeline_dir / stage, tmp_path)[command], timeout=120)
    index = int(stage[-1])
    assert_one_line_error(result, f"stage {index + 1} of 2", "not a whole model",
                          f"give the pipeline directory {pipeline_dir.resolve()}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def _reseal(manifest_dir: Path) -> None:
    """Rewrite the manifest at `manifest_dir` over the files as they are now, as a forger would."""
    from ember.core.manifest import MANIFEST_NAME, manifest_digest, sha256_file

    path = manifest_dir / MANIFEST_NAME
    data = json.loads(path.read_text())
    for relpath in data["files"]:
        data["files"][relpath] = {"sha256": sha256_file(manifest_dir / relpath),
                                  "size": (manifest_dir / relpath).stat().st_size}
    data["manifest_sha256"] = manifest_digest(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("consumer", ["package", "LocalPipeline"])
def test_a_stage_changed_under_a_resealed_pipeline_manifest_is_refused(compiled, tmp_path, consumer):
    """A stage's weights changed and only the pipeline's manifest resealed: the stage's own manifest no longer
    matches, and packaging or running the pipeline says which file, with nothing written."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(compiled("llama", 2), copy)
    shard = sorted((copy / "stage-1" / "params").glob("*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[:4] = bytes(4)
    shard.write_bytes(bytes(data))
    _reseal(copy)
    if consumer == "package":
        result = run_ember("package", str(copy), "-o", str(tmp_path / "packaged"))
        assert_one_line_error(result, f"stage-1/params/{shard.name}")
        assert not (tmp_path / "packaged").exists()
    else:
        from ember.runtime.pipeline import LocalPipeline

        with pytest.raises(ArtifactError, match=f"stage-1/params/{shard.name}"):
            LocalPipeline(copy)


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("pipeline_stage", {}, "pipeline_stage.index"),
    ("pipeline_stage", {"index": 3, "count": 2, "layers": [0, 1], "input": "hidden", "output": "logits",
                        "hidden_size": 64}, "not below its count"),
    ("pipeline_stage", {"index": 0, "count": 2, "layers": [2, 1], "input": "hidden", "output": "logits",
                        "hidden_size": 64}, "pipeline_stage.layers"),
    ("pipeline_stage", "stage", "pipeline_stage must be an object"),
    ("pipeline", {"stages": ["../stage-0"], "layers": [[0, 1]], "hidden_size": 64}, "pipeline.stages"),
    ("pipeline", {"stages": ["stage-0"], "layers": [[0, 1], [1, 2]], "hidden_size": 64}, "2 layer ranges"),
])
def test_forged_pipeline_fields_are_refused_in_one_line(compiled, tmp_path, field, value, expected):
    """A resealed manifest whose pipeline fields are not what compile writes: `ember inspect` (the manifest's first
    reader) refuses it in one line naming the field."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(compiled("llama", 2) / "stage-1", copy)
    data = json.loads((copy / "manifest.json").read_text())
    data[field] = value
    (copy / "manifest.json").write_text(json.dumps(data))
    _reseal(copy)
    assert_one_line_error(run_ember("inspect", str(copy)), expected)
