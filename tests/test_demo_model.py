"""The bundled demo model: a real checkpoint that transformers loads as is, and that
ember's compiled artifact continues exactly as transformers does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember.cli import DEMO_MODEL_DIR
from ember.compiler import CompileOptions, compile_model
from ember.runtime import Engine, SamplingParams, generate, load_artifact

PROMPTS = ("And the LORD said unto Moses,", "In the beginning", "Blessed are they that")
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory) -> Engine:
    artifact = tmp_path_factory.mktemp("demo") / "demo-cpu"
    compile_model(DEMO_MODEL_DIR, artifact, CompileOptions(show_progress=False, max_batch=2))
    return Engine(load_artifact(artifact))


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
