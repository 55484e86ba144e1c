"""The bundled demo model: a real checkpoint that transformers loads as is, and that
ember's compiled artifact continues exactly as transformers does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember import DEMO_MODEL_DIR
from ember.runtime import Engine, SamplingParams, generate, load_artifact
from ember.runtime.evaluate import compare, perplexity, scoring_windows, stream_token_ids

PROMPTS = ("And the LORD said unto Moses,", "In the beginning", "Blessed are they that")
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def demo_engine(demo_builds) -> Engine:
    """The demo as `ember compile demo` builds it (the session's shared build)."""
    return Engine(load_artifact(demo_builds.get("cpu", "q0f32")))


@pytest.fixture(scope="module")
def reference():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    return tokenizer, model


def test_demo_checkpoint_is_a_standard_hf_directory() -> None:
    names = {p.name for p in Path(DEMO_MODEL_DIR).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in Path(DEMO_MODEL_DIR).iterdir()) <= 10 * 2**20


@pytest.mark.parametrize("prompt", PROMPTS)
def test_demo_greedy_continuation_matches_transformers(demo_engine, reference, prompt) -> None:
    tokenizer, model = reference
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    generation = generate(demo_engine, ids[0].tolist(), params)
    got = list(generation.tokens())
    demo_engine.remove_sequence(generation.seq_id)
    assert got == expected, tokenizer.decode(got) + " != " + tokenizer.decode(expected)


@pytest.fixture(scope="module")
def validation_windows(demo_engine) -> list[list[int]]:
    """The scoring windows of validation.txt, tokenized in pieces as `ember eval` reads a text (the whole
    file is past what one encode accepts), which must give the ids `tokenizers` gives the whole text."""
    tokenizer = demo_engine.artifact.tokenizer
    path = Path(DEMO_MODEL_DIR) / "validation.txt"
    with path.open(encoding="utf-8") as text:
        ids = list(stream_token_ids(tokenizer, text))
    whole = Tokenizer.from_file(str(Path(DEMO_MODEL_DIR) / "tokenizer.json"))
    assert ids == whole.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids
    return scoring_windows(ids, tokenizer.bos_token_id, 256)


@pytest.mark.slow
def test_demo_perplexity_matches_transformers(demo_engine, reference, validation_windows) -> None:
    """ember's perplexity on validation.txt is transformers' (and the 62.112 of DATA_SOURCE.md)."""
    _, model = reference
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in validation_windows:
            logits = model(torch.tensor([ids])).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
            count += len(ids) - 1
    assert perplexity(demo_engine, validation_windows).perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)


@pytest.mark.slow
def test_demo_quantized_quality(demo_engine, validation_windows, demo_builds) -> None:
    """q8 within 1% of float32 perplexity, q4 within 10%, and q4_zp closer to float32 than q4."""
    formats = ("q8f32", "q4f32", "q4f32_zp")  # compiled side by side, and shared with the edge tests
    artifacts = demo_builds.get_many([("cpu", quantization, False, None) for quantization in formats])
    results = {quantization: compare(Engine(load_artifact(artifact)), demo_engine, validation_windows)
               for quantization, artifact in zip(formats, artifacts)}
    baseline = results["q8f32"].reference.perplexity
    assert results["q8f32"].candidate.perplexity <= baseline * 1.01
    assert results["q4f32"].candidate.perplexity <= baseline * 1.10
    plain, fitted = results["q4f32"], results["q4f32_zp"]
    assert fitted.candidate.perplexity < plain.candidate.perplexity
    assert fitted.divergence.mean_kl < 0.8 * plain.divergence.mean_kl
    assert fitted.divergence.top1_agreement > plain.divergence.top1_agreement


def test_readme_eval_command_prints_the_readme_figure(demo_engine, capsys) -> None:
    """The README's `ember eval` line for the demo, run as written (default window: the demo's trained
    context of 256), prints the README's figure: it printed 70.658 when the artifact allowed 1024."""
    import re

    from ember.cli import main

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    command = re.search(r"^\s*(ember eval demo-cpu --perplexity \S+)\s*$", readme, re.M)[1].split()
    shown = re.search(r"demo-cpu \(q0f32\): (perplexity [\d.]+ over \d+ tokens \(\d+ windows of \d+\))", readme)[1]
    artifact = demo_engine.artifact.path
    assert demo_engine.artifact.manifest.kv_cache["max_context"] == 256
    root = Path(__file__).resolve().parent.parent  # where the README's commands run
    argv = [str(artifact) if arg == "demo-cpu" else str(root / arg) if "/" in arg else arg
            for arg in command[1:]]
    assert main([*argv, "--no-progress"]) == 0
    assert shown in capsys.readouterr().out
