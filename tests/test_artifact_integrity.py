"""The artifact verified as a whole: the directory must hold exactly the files the
manifest lists, as regular files of the recorded sizes and hashes; the manifest is sealed by a
hash of its own content and its fields are checked once, in `read_manifest`; a KV cache larger
than this machine's memory is refused at load. Every refusal is one line naming what is at
fault, and nothing hangs (not on /dev/zero, nor on a FIFO)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_one_line_error, deadline, run_ember, tree_snapshot

from ember.core.errors import ArtifactError
from ember.core.manifest import (
    KV_QUANTIZATIONS,
    QUANTIZATIONS,
    SCHEMA,
    manifest_digest,
    read_manifest,
    verify_files,
    write_manifest,
)
from ember.runtime import load_artifact

SHARD = "params/params_shard_0.bin"
INDEX = "params/tensor-cache.json"
CLI_TIMEOUT = 60


def edit_manifest(artifact: Path, change: Callable[[dict], None], seal: bool) -> None:
    """Apply `change` to the manifest's data; `seal`: recompute its manifest_sha256, as someone rewriting
    the manifest on purpose (or a bug of ember's) would, so the checks behind the seal are reached."""
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    if seal:
        data["manifest_sha256"] = manifest_digest(data)
    path.write_text(json.dumps(data))


def edit_index(artifact: Path, change: Callable[[dict], None]) -> None:
    """Apply `change` to the weight index and re-record every file, as a bug of ember's writing it would."""
    path = artifact / INDEX
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))
    write_manifest(artifact, read_manifest(artifact))


def unlist_and_zero_shard(artifact: Path, seal: bool) -> None:
    """The probe: the shard's entry removed from `files` and half its weights zeroed."""
    edit_manifest(artifact, lambda data: data["files"].pop(SHARD), seal)
    shard = artifact / SHARD
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    shard.write_bytes(bytes(data))


def set_field(*keys: str, value) -> Callable[[dict], None]:
    """A manifest change: the field at `keys` (nested) set to `value`."""
    def change(data: dict) -> None:
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return change


def list_file(relpath: str) -> Callable[[dict], None]:
    """A manifest change: `relpath` listed with the hash and size of model.so's entry."""
    return lambda data: data["files"].__setitem__(relpath, dict(data["files"]["model.so"]))


def replace_with(relpath: str, make: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """A tampering: `relpath` deleted and made again by `make(path)`."""
    def tamper(artifact: Path, _outside: Path) -> None:
        path = artifact / relpath
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        make(path)
    return tamper


def link_outside(artifact: Path, outside: Path) -> None:
    """model.so replaced by a link to an identical copy outside the artifact."""
    copy = outside / "elsewhere.so"
    shutil.copyfile(artifact / "model.so", copy)
    (artifact / "model.so").unlink()
    (artifact / "model.so").symlink_to(copy)


def append_byte(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b" ")


def huge_manifest(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(65 * 2**20)  # sparse: no disk used


def shift_last_tensor(index: dict) -> None:
    index["records"][0]["records"][-1]["byteOffset"] += 64


# id: (tampering(artifact, a directory outside it), what the one-line error must contain; {art} is the artifact).
EDITED = "{art}/manifest.json: the manifest was edited after compile"

def edit_entries(edit):
    """A tampering that edits the manifest's entry functions and reseals it."""
    return lambda art, _: edit_manifest(art, lambda data: edit(data["entry_functions"]), seal=True)


TAMPERINGS: dict[str, tuple[Callable[[Path, Path], None], tuple[str, ...]]] = {
    # Files on disk against the files listed.
    "unlisted zeroed shard": (lambda art, _: unlist_and_zero_shard(art, seal=False), (EDITED, "recompile")),
    "unlisted zeroed shard, resealed": (lambda art, _: unlist_and_zero_shard(art, seal=True),
                                        (f"{{art}}/{SHARD}: file not listed in the manifest",)),
    "files {}": (lambda art, _: edit_manifest(art, set_field("files", value={}), seal=False), (EDITED,)),
    "files {}, resealed": (lambda art, _: edit_manifest(art, set_field("files", value={}), seal=True),
                           ("{art}/manifest.json: the manifest does not list model.so",)),
    "extra file": (lambda art, _: (art / "notes.txt").write_text("hi"),
                   ("{art}/notes.txt: file not listed in the manifest",)),
    "extra empty directory": (lambda art, _: (art / "extra").mkdir(), ("{art}/extra: directory holds no file",)),
    "file removed": (lambda art, _: (art / "tokenizer_config.json").unlink(),
                     ("{art}/tokenizer_config.json: file listed in the manifest is missing",)),
    "size mismatch": (lambda art, _: append_byte(art / "tokenizer.json"),
                      ("{art}/tokenizer.json: ", "bytes, the manifest records")),
    "FIFO in params": (lambda art, _: os.mkfifo(art / "params" / "queue"), ("{art}/params/queue: not a regular file",)),
    # Paths that leave the artifact.
    "absolute path entry": (lambda art, _: edit_manifest(art, list_file("/etc/hostname"), seal=True),
                            ("files entry '/etc/hostname' is not a normalized path inside the artifact",)),
    "listed /dev/zero": (lambda art, _: edit_manifest(art, list_file("/dev/zero"), seal=True),
                         ("files entry '/dev/zero' is not a normalized path",)),
    "../ entry": (lambda art, _: edit_manifest(art, list_file("../outside.bin"), seal=True),
                  ("files entry '../outside.bin' is not a normalized path",)),
    "backslash entry": (lambda art, _: edit_manifest(art, list_file("params\\..\\..\\x"), seal=True),
                        ("is not a normalized path",)),
    "model.so links outside": (link_outside, ("{art}/model.so: is a symbolic link",)),
    "model.so links to /dev/zero": (replace_with("model.so", lambda p: p.symlink_to("/dev/zero")),
                                    ("{art}/model.so: is a symbolic link",)),
    # The manifest's own content.
    "eos_token_ids edited": (lambda art, _: edit_manifest(art, set_field("model", "eos_token_ids", value=[7]),
                                                           seal=False), (EDITED,)),
    "rms_norm_eps edited": (lambda art, _: edit_manifest(art, set_field("model", "rms_norm_eps", value=0.5),
                                                          seal=False), (EDITED,)),
    "quantization edited": (lambda art, _: edit_manifest(art, set_field("quantization", value="q4f32"), seal=False),
                            (EDITED,)),
    "unknown quantization": (lambda art, _: edit_manifest(art, set_field("quantization", value="q3k"), seal=True),
                             ("manifest field quantization must be one of q0f32",)),
    "memory {}": (lambda art, _: edit_manifest(art, set_field("memory", value={}), seal=True),
                  ("{art}/manifest.json: the manifest has no memory.weight_bytes",)),
    "max_batch a string": (lambda art, _: edit_manifest(art, set_field("kv_cache", "max_batch", value="4"), seal=True),
                           ("manifest field kv_cache.max_batch must be a whole number >= 1, got '4'",)),
    "entry argument as text": (
        edit_entries(lambda entries: entries["decode"]["inputs"].__setitem__(0, "input_ids[batch_size, 1] int32")),
        ("manifest field entry_functions.decode.inputs[0] must be an object with an identifier as its name, "
         "got 'input_ids[",)),
    "entry shape without dtype": (
        edit_entries(lambda entries: entries["prefill"]["inputs"][0].pop("dtype")),
        ("manifest field entry_functions.prefill.inputs[0] must be a shape and a dtype, or neither",)),
    "entry dimension not a name": (
        edit_entries(lambda entries: entries["verify"]["outputs"][0].__setitem__("shape", [1, "n+1"])),
        ("manifest field entry_functions.verify.outputs[0] must be a shape of sizes and dimension names, and a "
         "dtype's name",)),
    "verify max_tokens 0": (
        edit_entries(lambda entries: entries["verify"].__setitem__("max_tokens", 0)),
        ("manifest field entry_functions.verify.max_tokens must be a whole number >= 1, got 0",)),
    "model config key missing": (lambda art, _: edit_manifest(art, lambda data: data["model"].pop("vocab_size"),
                                                               seal=True), ("the manifest has no model.vocab_size",)),
    "manifest is a directory": (replace_with("manifest.json", Path.mkdir),
                                ("{art}/manifest.json: not a regular file",)),
    "manifest is a FIFO": (replace_with("manifest.json", os.mkfifo), ("{art}/manifest.json: not a regular file",)),
    "manifest is a link": (replace_with("manifest.json", lambda p: p.symlink_to("/dev/zero")),
                           ("{art}/manifest.json: is a symbolic link",)),
    "manifest not UTF-8": (replace_with("manifest.json", lambda p: p.write_bytes(b'{"format_version": "\xff"}')),
                           ("{art}/manifest.json: malformed manifest",)),
    "manifest over 64 MiB": (replace_with("manifest.json", huge_manifest),
                             ("{art}/manifest.json: larger than 64 MiB",)),
    # Memory and weights.
    "huge kv cache": (lambda art, _: edit_manifest(art, set_field("kv_cache", "max_total_tokens", value=10**12),
                                                   seal=True),
                      ("{art}: needs ", "this machine has", "recompile with a smaller --max-batch or --memory-budget")),
    "tensor past its shard": (lambda art, _: edit_index(art, shift_last_tensor),
                              ("{art}/params/params_shard_0.bin: tensor 'lm_head.weight': bytes", "beyond the shard")),
    "unknown tensor dtype": (lambda art, _: edit_index(art, lambda index: index["records"][0]["records"][0]
                                                       .__setitem__("dtype", "float7")),
                             ("tensor 'model.embed_tokens.weight': unknown dtype 'float7'",)),
    "unlisted shard in the index": (lambda art, _: edit_index(art, lambda index: index["records"].append(
                                        {"dataPath": "params_shard_9.bin", "records": []})),
                                    ("{art}/params/params_shard_9.bin: weight shard named by tensor-cache.json "
                                     "is not listed",)),
}
# Damage `ember inspect` meets: the manifest's own (the files around it are `load_artifact`'s to check).
MANIFEST_LEVEL = ["unlisted zeroed shard", "files {}, resealed", "absolute path entry", "../ entry",
                  "eos_token_ids edited", "unknown quantization", "memory {}", "max_batch a string",
                  "model config key missing", "entry argument as text", "entry shape without dtype",
                  "entry dimension not a name", "verify max_tokens 0", "manifest is a directory",
                  "manifest is a FIFO", "manifest is a link", "manifest not UTF-8", "manifest over 64 MiB"]


@pytest.fixture
def tampered(tiny_llama, copy_artifact, tmp_path):
    """`tampered(name)`: a copy of the tiny llama artifact with tampering `name` applied, and its expected messages."""
    def make(name: str) -> tuple[Path, list[str]]:
        artifact = copy_artifact(tiny_llama)
        tamper, expected = TAMPERINGS[name]
        tamper(artifact, tmp_path)
        return artifact, [text.format(art=artifact) for text in expected]
    return make


@pytest.mark.parametrize("name", TAMPERINGS)
def test_tampering_is_refused_at_load(tampered, name):
    """`load_artifact` refuses each tampering with one ArtifactError line naming the file or field, within a
    deadline, and leaves the artifact as it found it."""
    artifact, expected = tampered(name)
    before = tree_snapshot(artifact)
    with deadline(60), pytest.raises(ArtifactError) as refused:
        load_artifact(artifact)
    message = str(refused.value)
    assert "\n" not in message
    for text in expected:
        assert text in message
    assert tree_snapshot(artifact) == before


@pytest.mark.parametrize("name", MANIFEST_LEVEL)
def test_inspect_refuses_a_damaged_manifest(tampered, capsys, name):
    """`ember inspect` reports a damaged manifest as one error line (exit 1), never a KeyError."""
    from ember.cli import main

    artifact, expected = tampered(name)
    with deadline(60):
        assert main(["inspect", str(artifact)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("ember: error: ")
    for text in expected:
        assert text in captured.err


@pytest.mark.parametrize(("command", "name"), [
    ("generate", "unlisted zeroed shard, resealed"),
    ("generate", "model.so links to /dev/zero"),
    ("generate", "quantization edited"),
    ("generate", "huge kv cache"),
    ("inspect", "unknown quantization"),
    ("inspect", "memory {}"),
    ("inspect", "manifest is a FIFO"),
])
def test_cli_refuses_tampering(tampered, command, name):
    """Through the CLI in another process: one `ember: error:` line, exit 1, no traceback, no hang."""
    artifact, expected = tampered(name)
    args = ("--prompt", "hi", "--max-new-tokens", "2") if command == "generate" else ()
    result = run_ember(command, str(artifact), *args, timeout=CLI_TIMEOUT)
    assert_one_line_error(result, *expected)
    assert result.stdout == ""


def test_fresh_artifact_verifies(tiny_llama):
    """A fresh artifact lists exactly its files with their sizes, its seal matches its content, and it
    passes every check."""
    artifact = tiny_llama.artifact_dir
    data = json.loads((artifact / "manifest.json").read_text())
    assert data["manifest_sha256"] == manifest_digest(data)
    on_disk = {path.relative_to(artifact).as_posix(): path.stat().st_size
               for path in artifact.rglob("*") if path.is_file() and path.name != "manifest.json"}
    assert {relpath: entry["size"] for relpath, entry in data["files"].items()} == on_disk
    manifest = read_manifest(artifact)
    verify_files(artifact, manifest)
    assert manifest.manifest_sha256 == data["manifest_sha256"]


def test_manifest_schema_matches_its_sources():
    """The names the manifest checks without importing the compiler are the compiler's: the quantization
    formats, the KV cache's packed formats and the model config's fields."""
    from ember.frontend.config import ModelConfig
    from ember.ir.kv_cache import KV_ROWS
    from ember.ir.quant_formats import FORMATS

    assert set(QUANTIZATIONS) == set(FORMATS)
    assert set(KV_QUANTIZATIONS) == set(KV_ROWS)
    assert set(SCHEMA["model"]) == {field.name for field in dataclasses.fields(ModelConfig)}


def test_the_manifests_typed_records_are_its_schema():
    """Each typed record of the manifest (what mypy checks readers against) has the fields the schema checks, and
    the optional ones it checks apart, no more; the memory record's are the memory report's."""
    from ember.core import manifest
    from ember.ir_passes.memory_report import MemoryReport

    records = {"target": manifest.TargetRecord, "kv_cache": manifest.KVCacheRecord, "memory": manifest.MemoryRecord,
               "kept_float": manifest.KeptFloat}
    for field, record in records.items():
        assert record.__required_keys__ == set(SCHEMA[field]), field
    assert manifest.TargetRecord.__optional_keys__ == {"cpu_features"}
    assert manifest.MemoryRecord.__optional_keys__ == {"expert_weight_bytes", "active_weight_bytes"}
    assert set(manifest.MemoryRecord.__annotations__) == {f.name for f in dataclasses.fields(MemoryReport)} | {
        "peak_workspace_bytes"}
