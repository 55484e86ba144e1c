"""`ember serve`'s /v1/embeddings: the official `openai` client against a served tiny llama compiled with
`--embeddings`, its vectors checked against transformers' pooled `last_hidden_state` of the same checkpoint.

Mean pooling is served in this process (a thread, stopped by its handle); last-token pooling by `ember serve
--pooling last` in a subprocess on 127.0.0.1, stopped by its own PID.
"""

from __future__ import annotations

import base64
import json

import artifact_cache
import numpy as np
import pytest
from helpers import Served, ember_serve, prompt_ids

from ember.core.errors import EmberError
from ember.runtime import load_artifact
from ember.runtime.engine import pooled_embedding

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

TIMEOUT = 60  # seconds; catches a hang, never a speed
PREFILL_CHUNK = 16  # below the longer inputs: the embed entry runs in chunks
TOLERANCE = 1e-4
TEXTS = ["the quick brown fox", "jumps over the lazy dog and keeps on running far away"]


@pytest.fixture(scope="module")
def embedding_artifact(tiny_models, tmp_path_factory):
    """The tiny llama compiled (q0f32) with the embed entry."""
    from ember.driver.compiler import CompileOptions, compile_model

    model_dir = tiny_models.checkpoint("llama")
    artifact_dir = tmp_path_factory.mktemp("embeddings") / "llama-embeddings"
    options = CompileOptions(prefill_chunk=PREFILL_CHUNK, max_batch=4, embeddings=True, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key("tiny-llama-embeddings", options, [model_dir]), artifact_dir,
                         lambda dest: compile_model(model_dir, dest, options))
    return artifact_dir


@pytest.fixture(scope="module")
def served(embedding_artifact):
    with Served(embedding_artifact) as served:
        yield served


@pytest.fixture(scope="module")
def reference(tiny_models):
    """transformers' LlamaModel (float32) of the same checkpoint, and its tokenizer."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model_dir = tiny_models.checkpoint("llama")
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _reference_vector(reference, ids: list[int], pooling: str) -> np.ndarray:
    """transformers' last_hidden_state of `ids`, mean- or last-pooled, L2-normalized as llama.cpp does."""
    import torch

    with torch.no_grad():
        hidden = reference[0](torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
    return vector / np.linalg.norm(vector)


def _assert_close(vectors, expected: list[np.ndarray]) -> None:
    assert len(vectors) == len(expected)
    for got, want in zip(vectors, expected):
        got = np.asarray(got, dtype=np.float64)
        assert got.shape == want.shape
        assert np.abs(got - want).max() < TOLERANCE, np.abs(got - want).max()
        assert abs(np.linalg.norm(got) - 1) < 1e-5


def test_a_batch_of_texts_matches_transformers_mean_pooled_hidden_states(served, reference):
    token_ids = [reference[1](text)["input_ids"] for text in TEXTS]
    assert max(len(ids) for ids in token_ids) > PREFILL_CHUNK
    result = served.client.embeddings.create(model=served.name, input=TEXTS, encoding_format="float")
    assert [item.index for item in result.data] == [0, 1] and result.model == served.name
    _assert_close([item.embedding for item in result.data],
                  [_reference_vector(reference, ids, "mean") for ids in token_ids])
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(ids) for ids in token_ids)

    one = served.client.embeddings.create(model=served.name, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and one.data[0].embedding == result.data[0].embedding


def test_token_id_inputs_and_base64_give_the_same_floats(served, reference):
    inputs = [prompt_ids(40, seed=1), prompt_ids(5, seed=2), prompt_ids(1, seed=3)]
    floats = served.client.embeddings.create(model=served.name, input=inputs, encoding_format="float")
    _assert_close([item.embedding for item in floats.data],
                  [_reference_vector(reference, ids, "mean") for ids in inputs])
    # The openai client asks for base64 by default and decodes it itself (numpy, float32).
    decoded = served.client.embeddings.create(model=served.name, input=inputs)
    assert [item.embedding for item in decoded.data] == [item.embedding for item in floats.data]
    raw = served.client.embeddings.with_raw_response.create(model=served.name, input=inputs,
                                                            encoding_format="base64")
    data = json.loads(raw.text)["data"]
    assert all(isinstance(item["embedding"], str) for item in data)
    as_bytes = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in data]
    assert [vector.tolist() for vector in as_bytes] == [item.embedding for item in floats.data]
    assert floats.usage.prompt_tokens == 46


def test_last_token_pooling_through_the_cli(embedding_artifact, reference, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("test-key")
    inputs = [prompt_ids(30, seed=4), prompt_ids(3, seed=5)]
    with ember_serve(embedding_artifact, key_file, TIMEOUT, "--pooling", "last") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=TIMEOUT)
        result = client.embeddings.create(model=embedding_artifact.name, input=inputs)
    _assert_close([item.embedding for item in result.data],
                  [_reference_vector(reference, ids, "last") for ids in inputs])


@pytest.mark.parametrize("inputs, words", [
    ([], "no inputs"),
    ([""], "empty"),
    ([[]], "empty"),
    ([[1, 5, 10**6]], "token ids must be in"),
    ([[1] * 300], "context window of 256"),
    (["word " * 300], "context window of 256"),
], ids=["no inputs", "empty text", "empty ids", "id outside the vocabulary", "ids past the context",
        "text past the context"])
def test_bad_inputs_are_refused_naming_input(served, inputs, words):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.embeddings.create(model=served.name, input=inputs, encoding_format="float")
    assert caught.value.status_code == 400 and caught.value.param == "input"
    assert words in caught.value.message
    assert served.client.embeddings.create(model=served.name, input="still serving").data


def test_an_artifact_without_the_embed_function_answers_400_and_goes_on(tiny_llama):
    served = Served(tiny_llama.artifact_dir)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            served.client.embeddings.create(model=served.name, input="hello")
        assert caught.value.param == "model" and "ember compile --embeddings" in caught.value.message
        body = caught.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
        reply = served.client.completions.create(model=served.name, prompt=prompt_ids(5), max_tokens=2)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        served.close()


def test_the_manifest_lists_embed_only_when_compiled_with_it(embedding_artifact, tiny_llama):
    assert "embed" in load_artifact(embedding_artifact).manifest.entry_functions
    assert "embed" not in load_artifact(tiny_llama.artifact_dir).manifest.entry_functions


def test_other_frontends_refuse_embeddings_naming_the_option(tiny_models, tmp_path):
    from ember.driver.compiler import CompileOptions, compile_model

    options = CompileOptions(frontend="torch-export", embeddings=True, show_progress=False)
    with pytest.raises(EmberError, match="--embeddings: .*--frontend torch-export"):
        compile_model(tiny_models.checkpoint("llama"), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_pooling_normalizes_and_keeps_a_zero_vector_zero():
    hidden = np.array([[3.0, 0.0], [1.0, 4.0]], dtype=np.float32)
    assert np.allclose(pooled_embedding(hidden, "mean"), [2 / 8**0.5, 2 / 8**0.5])
    assert np.allclose(pooled_embedding(hidden, "last"), [1 / 17**0.5, 4 / 17**0.5])
    assert pooled_embedding(np.zeros((2, 3), np.float32), "mean").tolist() == [0.0, 0.0, 0.0]


def test_a_client_that_leaves_stops_its_embeddings_within_a_step(served):
    """A client sends many inputs and closes the connection once the work has begun: the server stops embedding
    them (the tokens it embeds stop growing, far short of the request's), frees the sequence and goes on serving."""
    import http.client
    import socket
    import time

    inputs = [prompt_ids(40, seed=i) for i in range(400)]
    key = "ember_embedding_tokens_total"
    before = served.metrics().get(key, 0)
    connection = http.client.HTTPConnection(served.server.host, served.server.port, timeout=TIMEOUT)
    connection.request("POST", "/v1/embeddings", json.dumps({"model": served.name, "input": inputs}),
                       {"Content-Type": "application/json"})
    deadline = time.monotonic() + TIMEOUT
    while served.metrics().get(key, 0) <= before:
        assert time.monotonic() < deadline, "the embeddings never began"
        time.sleep(0.01)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    left = time.monotonic()
    settled = served.metrics().get(key, 0)
    while time.monotonic() - left < 2:  # a step is milliseconds on the tiny model: 2 s is many of them
        time.sleep(0.2)
        now = served.metrics().get(key, 0)
        if now == settled:
            break
        settled = now
    time.sleep(0.5)
    after = served.metrics().get(key, 0)
    assert after == settled, "embedding went on after the client left"
    assert after - before < sum(map(len, inputs)) // 2, (after - before, sum(map(len, inputs)))
    assert served.metrics()["ember_running_sequences"] == 0
    vectors = served.client.embeddings.create(model=served.name, input=TEXTS).data
    assert len(vectors) == len(TEXTS)
