"""`ember compile model.onnx`: a decoder's full-sequence forward as `torch.onnx.export` writes it.

The tiny Llama and GPT-2 checkpoints are exported by torch's own ONNX exporter (its
dynamo exporter, sdpa attention) and compiled through the CLI with their tokenizer
directory. onnxruntime runs the same file as the reference that the file itself is
right; ember must then match transformers as the torch.export path does (prefill at
every position, 16 decode steps on the paged cache, greedy tokens, batching).
Malformed and unsupported files are refused in one line, with nothing written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import assert_batched_equals_solo, assert_logits_close, prompt_ids, run_ember

from ember.runtime import SamplingParams, generate

ONNX_MODELS = ("llama", "gpt2")
DECODE_STEPS = 16


def _onnxruntime_logits(path: Path, ids: list[int]) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": np.array([ids], np.int64)})[0][0]


@pytest.mark.parametrize("name", ONNX_MODELS)
@pytest.mark.slow
def test_onnxruntime_ember_and_transformers_agree_on_the_full_sequence(tiny_models, name):
    """onnxruntime on the file equals transformers (the export is right), and ember's prefill equals both."""
    model = tiny_models.onnx(name)
    ids = prompt_ids(100, seed=13)
    expected = model.reference_logits(ids)
    assert_logits_close(_onnxruntime_logits(tiny_models.onnx_file(name), ids), expected,
                        f"{name}: onnxruntime on the exported file")
    engine = model.engine()
    ember = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    assert_logits_close(ember, expected, f"{name}: ember from the ONNX file")
    assert_logits_close(ember, _onnxruntime_logits(tiny_models.onnx_file(name), ids), f"{name}: ember vs onnxruntime")


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_onnx_decode_matches_transformers_cached_decoding(tiny_models, name):
    """100 prompt tokens in two prefill chunks, then 16 decode steps on the paged cache."""
    model = tiny_models.onnx(name)
    engine = model.engine()
    ids = prompt_ids(100, seed=3)
    continuation = prompt_ids(DECODE_STEPS + 1, seed=4)[1:]
    seq = engine.add_sequence()
    engine.prefill(seq, ids)
    expected = model.reference_decode_logits(ids, continuation)
    for step, token in enumerate(continuation):
        assert_logits_close(engine.decode([seq], [token])[0], expected[step], f"{name}: ONNX decode step {step + 1}")


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_onnx_greedy_tokens_equal_transformers_generate(tiny_models, name):
    model = tiny_models.onnx(name)
    ids = prompt_ids(60, seed=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=())
    assert list(generate(model.engine(), ids, params).tokens()) == model.reference_greedy(ids, 32)


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_onnx_interleaved_sequences_equal_their_solo_runs(tiny_models, name):
    model = tiny_models.onnx(name)
    prompts, steps = [prompt_ids(30, seed=9), prompt_ids(45, seed=10)], [prompt_ids(6, seed=11), prompt_ids(6, seed=12)]
    assert_batched_equals_solo(model, prompts, steps)


def test_the_artifact_says_where_its_graph_came_from(tiny_models):
    model = tiny_models.onnx("gpt2")
    result = run_ember("inspect", str(model.artifact_dir))
    assert result.returncode == 0, result.stderr
    assert "ONNX file" in result.stdout and str(tiny_models.checkpoint("gpt2").resolve()) in result.stdout


# --- files ember refuses ----------------------------------------------------------------------------------------

def _graph(nodes, inputs, initializers, output_shape=("1", "seq", 8)):
    from onnx import TensorProto, helper

    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(output_shape))
    graph = helper.make_graph(nodes, "decoder", inputs, [logits], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _ids(name: str = "input_ids"):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.INT64, [1, "seq"])


def _embedding():
    from onnx import numpy_helper

    return numpy_helper.from_array(np.ones((8, 8), np.float32), "embed")


def _no_attention():
    from onnx import helper

    return _graph([helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
                   helper.make_node("MatMul", ["x", "embed"], ["logits"])], [_ids()], [_embedding()])


def _unsupported_operator():
    from onnx import helper

    return _graph([helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
                   helper.make_node("Hardmax", ["x"], ["logits"], name="strange_op")], [_ids()], [_embedding()])


def _two_inputs():
    from onnx import helper

    return _graph([helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
                   helper.make_node("MatMul", ["x", "embed"], ["logits"])],
                  [_ids(), _ids("attention_mask")], [_embedding()])


def _external_outside():
    from onnx import external_data_helper

    model = _no_attention()
    tensor = model.graph.initializer[0]
    external_data_helper.set_external_data(tensor, location="../weights.bin", offset=0, length=256)
    tensor.data_location = 1
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    return model


def _external_truncated(directory: Path):
    from onnx import external_data_helper

    (directory / "weights.bin").write_bytes(b"\0" * 100)
    model = _no_attention()
    tensor = model.graph.initializer[0]
    external_data_helper.set_external_data(tensor, location="weights.bin", offset=0, length=256)
    tensor.data_location = 1
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    return model


REFUSALS = {
    "not-onnx": (None, "not an ONNX model"),
    "two-inputs": (_two_inputs, "the graph takes 2 inputs (input_ids, attention_mask)"),
    "unsupported-operator": (_unsupported_operator, "node 1 (Hardmax 'strange_op'): operator not converted"),
    "no-attention": (_no_attention, "found no attention"),
    "external-data-outside": (_external_outside, "outside the model directory"),
    "external-data-truncated": (_external_truncated, "needs 256 bytes, but its external data is 256 bytes at offset 0 "
                                                     "of weights.bin (100 bytes)"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_onnx_files_are_refused_in_one_line(tiny_models, tmp_path, case):
    build, expected = REFUSALS[case]
    directory = tmp_path / "model"
    directory.mkdir()
    path = directory / "model.onnx"
    if build is None:
        path.write_bytes(b"\x08\x07this is not a protobuf of a model" * 10)
    else:
        model = build(directory) if build is _external_truncated else build()
        path.write_bytes(model.SerializeToString())
    out = tmp_path / "out"
    result = run_ember("compile", str(path), "--tokenizer", str(tiny_models.checkpoint("llama")), "-o", str(out),
                       "--no-progress")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [directory]


def test_an_onnx_file_without_a_config_is_refused_in_one_line(tiny_models, tmp_path):
    """The context window and token ids come from config.json in the tokenizer directory: named when missing."""
    onnx_file = tiny_models.onnx_file("llama")
    result = run_ember("compile", str(onnx_file), "--tokenizer", str(tmp_path), "-o", str(tmp_path / "out"),
                       "--no-progress")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"ember: error: {tmp_path / 'config.json'}: file not found (an ONNX file takes "
                                     "its config and tokenizer from --tokenizer DIR, by default its own directory)")


def test_tokenizer_option_is_only_for_onnx_files(tiny_models, tmp_path):
    result = run_ember("compile", str(tiny_models.checkpoint("llama")), "--tokenizer", str(tmp_path),
                       "-o", str(tmp_path / "out"), "--no-progress")
    assert result.returncode == 1 and "only an ONNX file takes its tokenizer from another directory" in result.stderr
