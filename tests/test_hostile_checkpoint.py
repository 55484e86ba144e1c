"""Checkpoints written by a stranger: files reaching outside the model directory, FIFOs and devices,
crafted safetensors headers, config values of the wrong type or range, broken tokenizer files.

Each case copies the tiny llama checkpoint and breaks one thing. Most are imported in this process
(`import_hf_model` must raise a `ModelError` naming the file, tensor or key); a few representative
ones go through `ember compile` to show the one-line error, exit code 1 and nothing left on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import models
import pytest
import tvm
from helpers import assert_one_line_error, run_ember, tree_snapshot

from ember.core.errors import ModelError
from ember.driver.analyze.operators import load_architecture
from ember.frontend.config import load_model_config
from ember.frontend.hf import import_hf_model

TENSOR = "model.layers.1.mlp.down_proj.weight"
TWIN = "model.layers.0.mlp.down_proj.weight"  # same shape as TENSOR


@pytest.fixture
def model(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint, to break."""
    return Path(shutil.copytree(tiny_models.checkpoint("llama"), tmp_path / "model"))


def import_model(model_dir: Path):
    return import_hf_model(model_dir, tvm.target.Target("llvm"))


def refused(model_dir: Path, *expected: str) -> None:
    """Importing `model_dir` raises one `ModelError` line containing each of `expected`; nothing on disk changes."""
    before = tree_snapshot(model_dir.parent)
    with pytest.raises(ModelError) as err:
        import_model(model_dir)
    message = str(err.value)
    assert "\n" not in message, message
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"
    assert tree_snapshot(model_dir.parent) == before


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def shard_index(model: Path, shard: str) -> None:
    """Replace model.safetensors by an index naming `shard` for every tensor."""
    header = read_header(model / "model.safetensors")
    weight_map = {name: shard for name in header if name != "__metadata__"}
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --- 1. files outside the model directory ---------------------------------------------------------


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "/etc/passwd", "../../etc/passwd",
                                   "sub/../../elsewhere/model.safetensors"])
def test_index_shard_outside_the_model_is_refused(model, shard):
    (model.parent / "elsewhere").mkdir()
    shutil.copyfile(model / "model.safetensors", model.parent / "elsewhere" / "model.safetensors")
    shard_index(model, shard)
    refused(model, "model.safetensors.index.json: entry", repr(shard), "outside the model directory")


@pytest.mark.parametrize("index, expected", [
    ({"weight_map": {TENSOR: "a\u0000b"}}, "entry 'a\\x00b': cannot resolve the path"),
    ({"weight_map": {TENSOR: "x" * 5000}}, "cannot resolve the path"),
    ({"weight_map": {TENSOR: ""}}, "is a directory, not a regular file"),
    ({"weight_map": {TENSOR: 5}}, "malformed index ('weight_map' must map tensor names to shard file names)"),
    ({"weight_map": ["model.safetensors"]}, "malformed index"),
    ({}, "malformed index"),
])
def test_malformed_index_is_refused(model, index, expected):
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(model, "model.safetensors.index.json: ", expected)


@pytest.mark.parametrize("name, target", [
    ("tokenizer.json", "/etc/passwd"),
    ("special_tokens_map.json", "/etc/passwd"),
    ("config.json", "/dev/zero"),
    ("generation_config.json", "../outside.json"),
    ("model.safetensors", "../outside.safetensors"),
])
def test_links_out_of_the_model_are_refused(model, name, target):
    shutil.copyfile(model / "model.safetensors", model.parent / "outside.safetensors")
    shutil.copyfile(model / "generation_config.json", model.parent / "outside.json")
    (model / name).unlink(missing_ok=True)
    os.symlink(target, model / name)
    refused(model, f"{name}: resolves to", "outside the model directory")


def test_links_loop_or_dangle(model):
    (model / "tokenizer.json").unlink()
    os.symlink("tokenizer.json", model / "tokenizer.json")
    refused(model, "tokenizer.json: cannot resolve the path")
    (model / "tokenizer.json").unlink()
    os.symlink("gone.json", model / "tokenizer.json")
    refused(model, "tokenizer.json: file not found")


def hf_cache_snapshot(model: Path, cache: Path) -> Path:
    """`model` laid out as the hub cache does: snapshot files are links to ../../blobs/<hash>."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(model.iterdir())):
        shutil.copyfile(path, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / path.name)
    return snapshot


def test_hf_cache_layout_is_followed(model, tmp_path):
    snapshot = hf_cache_snapshot(model, tmp_path / "hub")
    imported = import_model(snapshot)
    assert sorted(p.name for p in imported.tokenizer_files) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
    assert all(p.parent == snapshot for p in imported.tokenizer_files), "files are copied under their own names"


def test_hf_cache_link_into_another_repo_is_refused(model, tmp_path):
    snapshot = hf_cache_snapshot(model, tmp_path / "hub")
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(model / "tokenizer.json", other / "secret")
    (snapshot / "tokenizer.json").unlink()
    os.symlink("../../../models--someone--else/blobs/secret", snapshot / "tokenizer.json")
    refused(snapshot, "tokenizer.json: resolves to", "models--someone--else", "outside the model directory")


# --- 2. file types and sizes ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["directory", "FIFO", "device or socket"])
def test_special_files_are_refused_before_reading(model, name, kind):
    (model / name).unlink()
    if kind == "directory":
        (model / name).mkdir()
    elif kind == "FIFO":
        os.mkfifo(model / name)  # opening it would block forever
    else:
        try:  # a /dev/zero of its own: read until memory runs out
            os.mknod(model / name, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")
    refused(model, f"{name}: is a {kind}, not a regular file")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_oversized_json_is_refused(model, name):
    with (model / name).open("a") as f:
        f.write(" " * (16 * 1024 * 1024))
    refused(model, f"{name}: ", "bytes is larger than the 16777216 bytes such a file may have")


# --- 3. safetensors headers -----------------------------------------------------------------------


def read_header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length])


def rewrite_header(path: Path, edit: Callable[[dict], object] | bytes) -> None:
    """Replace the header of a safetensors file, keeping its data section (a new header object, or raw bytes)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    if isinstance(edit, bytes):
        raw = edit
    else:
        result = edit(header)
        raw = json.dumps(header if result is None else result).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def set_field(field: str, value: object) -> Callable[[dict], None]:
    return lambda header: header[TENSOR].update({field: value})


def shift_offsets(delta: int) -> Callable[[dict], None]:
    return lambda header: header[TENSOR].update(data_offsets=[x + delta for x in header[TENSOR]["data_offsets"]])


HEADER_CASES = {
    "negative_offsets": (shift_offsets(-10**9), f"tensor '{TENSOR}' has malformed data_offsets"),
    "begin_after_end": (lambda h: h[TENSOR].update(data_offsets=h[TENSOR]["data_offsets"][::-1]),
                        f"tensor '{TENSOR}' has malformed data_offsets"),
    "overlapping": (lambda h: h[TENSOR].update(data_offsets=h[TWIN]["data_offsets"]),
                    "overlaps the bytes of another tensor"),
    "past_the_data": (shift_offsets(10**6), f"truncated file: tensor '{TENSOR}'"),
    "string_offsets": (set_field("data_offsets", ["0", "4"]), f"tensor '{TENSOR}' has malformed data_offsets"),
    "float_offsets": (set_field("data_offsets", [0.0, 4.0]), f"tensor '{TENSOR}' has malformed data_offsets"),
    "bool_offsets": (set_field("data_offsets", [False, True]), f"tensor '{TENSOR}' has malformed data_offsets"),
    "one_offset": (set_field("data_offsets", [0]), f"tensor '{TENSOR}' has malformed data_offsets"),
    "string_shape": (set_field("shape", "64"), f"tensor '{TENSOR}' has a malformed shape"),
    "negative_dim": (set_field("shape", [-64, -64]), f"tensor '{TENSOR}' has a malformed shape"),
    "float_dim": (set_field("shape", [64.0, 128]), f"tensor '{TENSOR}' has a malformed shape"),
    "dtype_not_a_string": (set_field("dtype", ["F32"]), f"tensor '{TENSOR}' has unsupported dtype ['F32']"),
    "entry_a_number": (lambda h: h.update({TENSOR: 5}), f"tensor '{TENSOR}' has an entry that is a int"),
    "entry_a_list": (lambda h: h.update({TENSOR: [1, 2]}), f"tensor '{TENSOR}' has an entry that is a list"),
    "header_a_list": (lambda h: list(h), "expected a JSON object, got list"),
    "deep_nesting": (b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
    "nan_in_header": (b'{"x": NaN}', "NaN is not a JSON number"),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_crafted_safetensors_headers_are_refused(model, case):
    edit, expected = HEADER_CASES[case]
    rewrite_header(model / "model.safetensors", edit)
    refused(model, "model.safetensors: ", expected)


def test_tensor_in_two_shards_is_refused(model):
    shutil.copyfile(model / "model.safetensors", model / "copy.safetensors")
    header = read_header(model / "model.safetensors")
    weight_map = {name: "model.safetensors" for name in header if name != "__metadata__"}
    weight_map["x"] = "copy.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(model, "copy.safetensors: tensor", "is also in")


# --- 4. config.json values ------------------------------------------------------------------------


CONFIG_CASES = [
    ("num_key_value_heads", "2", "'num_key_value_heads' must be an integer in [1, 1048576], got '2'"),
    ("num_key_value_heads", -2, "'num_key_value_heads' must be an integer in [1, 1048576], got -2"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be an integer in [1, 1048576], got 0"),
    ("head_dim", "16", "'head_dim' must be an integer"),
    ("head_dim", 0, "'head_dim' must be an integer in [1, 1048576], got 0"),
    ("head_dim", 15, "must be a positive even number, got 15"),
    ("rope_scaling", "linear", "'rope_scaling' must be a JSON object, got 'linear'"),
    ("rope_parameters", [1], "'rope_parameters' must be a JSON object, got [1]"),
    ("rope_parameters", {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4,
                         "original_max_position_embeddings": 64}, "'rope_parameters.factor' must be a number"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4,
                         "original_max_position_embeddings": 64}, "high_freq_factor (4.0) must exceed"),
    ("rope_parameters", {"rope_type": "yarn"}, "RoPE type 'yarn' is not supported"),
    ("rope_theta", "big", "'rope_theta' must be a number greater than 0, finite, got 'big'"),
    ("rope_theta", 10**400, "'rope_theta' must be a number greater than 0"),
    ("rms_norm_eps", "tiny", "'rms_norm_eps' must be a number in (0, 1), got 'tiny'"),
    ("rms_norm_eps", 0, "'rms_norm_eps' must be a number in (0, 1), got 0"),
    ("sliding_window", "4k", "'sliding_window' must be an integer"),
    ("eos_token_id", "</s>", "'eos_token_id' must be a token id or a list of token ids in [0, 256), got '</s>'"),
    ("eos_token_id", [2, 256], "'eos_token_id' must be a token id or a list of token ids in [0, 256)"),
    ("bos_token_id", "x", "'bos_token_id' must be a token id in [0, 256), got 'x'"),
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be a JSON boolean (true or false), got 'false'"),
    ("hidden_size", 10**30, "'hidden_size' must be an integer in [1, 1048576], got 1000000000000000000000"),
    ("num_hidden_layers", True, "'num_hidden_layers' must be an integer"),
    ("vocab_size", 2**23, "'vocab_size' must be an integer in [1, 4194304]"),
    ("torch_dtype", 5, "'torch_dtype' must be a string, got 5"),
    ("max_position_embeddings", 0, "'max_position_embeddings' must be an integer in [1, 16777216], got 0"),
    ("hidden_act", 5, "'hidden_act' must be a string, got 5"),
    ("model_type", ["llama"], "'model_type' must be a string, got ['llama']"),
    ("attention_bias", 1, "'attention_bias' must be a JSON boolean"),
    ("intermediate_size", "x" * 1000, "got 'xxxxxxxxxx"),
]


@pytest.mark.parametrize("key, value, expected", CONFIG_CASES, ids=[f"{k}={v!r:.20}" for k, v, _ in CONFIG_CASES])
def test_config_values_are_checked(model, key, value, expected):
    edit_json(model / "config.json", lambda c: c.update({key: value}))
    if key in ("bos_token_id", "eos_token_id"):  # generation_config.json has its own ids, read first
        edit_json(model / "generation_config.json", lambda c: c.pop(key))
    with pytest.raises(ModelError) as err:
        load_model_config(model)
    assert f"{model / 'config.json'}: " in str(err.value)
    assert expected in str(err.value)
    assert len(str(err.value)) < 250, "a hostile value is shown cut short"


@pytest.mark.parametrize("text, expected", [
    ('"rms_norm_eps": NaN', "NaN is not a JSON number"),
    ('"rope_theta": Infinity', "Infinity is not a JSON number"),
    ('"x": ' + "[" * 200_000 + "]" * 200_000, "nested too deeply"),
])
def test_config_json_that_python_would_accept_is_refused(model, text, expected):
    config = (model / "config.json").read_text().strip()
    (model / "config.json").write_text(config[:-1] + ", " + text + "}")
    with pytest.raises(ModelError, match=f"config.json: malformed JSON: {expected}"):
        load_model_config(model)


@pytest.mark.parametrize("key, value", [("eos_token_id", "</s>"), ("eos_token_id", 10**6), ("bos_token_id", [1])])
def test_generation_config_ids_are_checked(model, key, value):
    edit_json(model / "generation_config.json", lambda c: c.update({key: value}))
    with pytest.raises(ModelError, match=f"generation_config.json: '{key}' must be a token id"):
        load_model_config(model)


def test_analyze_uses_the_same_checks(model):
    edit_json(model / "config.json", lambda c: c.update(num_key_value_heads=-2))
    with pytest.raises(ModelError, match="'num_key_value_heads' must be an integer in"):
        load_architecture(str(model))


# --- 5. tokenizer files ---------------------------------------------------------------------------


def test_garbage_tokenizer_is_refused_at_compile(model):
    (model / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    refused(model, "tokenizer.json: cannot load tokenizer")


def test_tokenizer_larger_than_the_embedding_is_refused(model):
    models.write_tokenizer(model, models.VOCAB_SIZE + 8)
    refused(model, "tokenizer.json: has token id 263, but config.json's vocab_size is 256")


def test_named_chat_templates_with_a_default_are_accepted(model):
    templates = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "{{ messages }}"}]
    edit_json(model / "tokenizer_config.json", lambda c: c.update(chat_template=templates))
    assert import_model(model).config.vocab_size == models.VOCAB_SIZE
    from ember.runtime.tokenizer import Tokenizer

    rendered = Tokenizer.from_dir(model).apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[{'role': 'user', 'content': 'hi'}]"  # the default one, rendered by the runtime


@pytest.mark.parametrize("key, value, expected", [
    ("chat_template", 5, "'chat_template' must be a string or a list of {name, template}"),
    ("chat_template", [{"name": "tool_use", "template": "x"}], "with a 'default' one"),
    ("bos_token", 5, "'bos_token' must be a string or {\"content\": string}, got 5"),
    ("eos_token", {"content": 2}, "'eos_token' must be a string"),
])
def test_tokenizer_config_values_are_checked(model, key, value, expected):
    edit_json(model / "tokenizer_config.json", lambda c: c.update({key: value}))
    refused(model, "tokenizer_config.json: ", expected)


# --- through the CLI: one line, exit 1, nothing written -------------------------------------------


def fifo_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")


CLI_CASES = {
    "fifo_weights": (fifo_weights, ["model.safetensors: is a FIFO, not a regular file"]),
    "shard_outside": (lambda m: shard_index(m, "../../etc/passwd"),
                      ["model.safetensors.index.json: entry '../../etc/passwd'", "outside the model directory"]),
    "string_false": (lambda m: edit_json(m / "config.json", lambda c: c.update(tie_word_embeddings="false")),
                     ["config.json: 'tie_word_embeddings' must be a JSON boolean"]),
    "negative_offsets": (lambda m: rewrite_header(m / "model.safetensors", shift_offsets(-10**9)),
                         [f"model.safetensors: tensor '{TENSOR}' has malformed data_offsets"]),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_compile_refuses_hostile_checkpoint(model, tmp_path, case):
    break_checkpoint, expected = CLI_CASES[case]
    break_checkpoint(model)
    out_parent = tmp_path / "out"
    out_parent.mkdir()

    result = run_ember("compile", str(model), "-o", str(out_parent / "artifact"), "--no-progress", timeout=120)

    assert_one_line_error(result, str(model), *expected)
    assert list(out_parent.iterdir()) == [], "no OUT and no staging directory"
