"""The test-artifact cache (tests/artifact_cache.py): what its key depends on, and that it hands out only
artifacts that match their manifest."""

from __future__ import annotations

import os
import shutil
import threading
from collections import Counter
from dataclasses import replace

import artifact_cache
import pytest
from conftest import MAX_BATCH, PREFILL_CHUNK

from ember.core.manifest import read_manifest, verify_files
from ember.driver.compiler import CompileOptions

OPTIONS = CompileOptions(prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH, show_progress=False)


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """An empty cache for this test, on (its outcomes kept out of the session's tally)."""
    root = tmp_path / "cache"
    monkeypatch.setattr(artifact_cache, "CACHE_ROOT", root)
    monkeypatch.setattr(artifact_cache, "TALLY", Counter())
    monkeypatch.delenv("EMBER_TEST_CACHE", raising=False)
    return root


def test_key_changes_with_options_inputs_and_sources(tiny_models, tmp_path, monkeypatch):
    checkpoint = tiny_models.checkpoint("llama")
    key = artifact_cache.artifact_key("tiny-llama", OPTIONS, [checkpoint])
    assert key == artifact_cache.artifact_key("tiny-llama", OPTIONS, [checkpoint])
    assert key != artifact_cache.artifact_key("tiny-llama", replace(OPTIONS, kv_quant="q8"), [checkpoint])
    edited = shutil.copytree(checkpoint, tmp_path / "edited")
    (edited / "config.json").write_text((edited / "config.json").read_text().replace("64", "65", 1))
    assert key != artifact_cache.artifact_key("tiny-llama", OPTIONS, [edited])
    monkeypatch.setattr(artifact_cache, "_environment_digest", lambda: "other compiler sources")
    assert key != artifact_cache.artifact_key("tiny-llama", OPTIONS, [checkpoint])


def test_environment_covers_compiler_sources_tvm_and_cpu(monkeypatch):
    """Editing a compiler source, another TVM version or another CPU each give another digest."""
    digest = artifact_cache._environment_digest()
    real_version = artifact_cache.importlib.metadata.version
    patches = [(artifact_cache, "cpu_model", lambda: "another CPU"),
               (artifact_cache, "host_cpu_flags", lambda: {"sse2"}),
               (artifact_cache.importlib.metadata, "version",
                lambda name: "0.0.0" if name == "apache-tvm" else real_version(name)),
               (artifact_cache, "COMPILER_SOURCES", ("src/ember/driver",))]
    for target, name, value in patches:
        with monkeypatch.context() as patched:
            patched.setattr(target, name, value)
            assert artifact_cache._environment_digest() != digest, name
    assert artifact_cache._environment_digest() == digest


def test_environment_covers_the_compiler_not_the_cli(tmp_path, monkeypatch):
    """An edit under src/ember/driver changes the digest, one under src/ember/cli (it only parses options) does not."""
    digest = artifact_cache._environment_digest()
    for source in (*artifact_cache.COMPILER_SOURCES, "src/ember/cli"):
        copy = shutil.copytree if (artifact_cache.REPO_ROOT / source).is_dir() else shutil.copyfile
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        copy(artifact_cache.REPO_ROOT / source, tmp_path / source)
    monkeypatch.setattr(artifact_cache, "REPO_ROOT", tmp_path)
    assert artifact_cache._environment_digest() == digest
    with (tmp_path / "src" / "ember" / "cli" / "compile.py").open("a") as cli:
        cli.write("# edited\n")
    assert artifact_cache._environment_digest() == digest
    with (tmp_path / "src" / "ember" / "driver" / "compiler.py").open("a") as compiler:
        compiler.write("# edited\n")
    assert artifact_cache._environment_digest() != digest


def test_a_restored_artifact_names_the_checkpoint_it_was_restored_for(cache_root, tiny_models, tiny_llama, tmp_path):
    """The manifest's `source` of a reused artifact is the restoring session's checkpoint (the compiling session's
    is gone), and the copy passes the manifest's own checks; the entry itself names no session's path."""
    checkpoint = tiny_models.checkpoint("llama")
    artifact_cache.store(artifact_cache.artifact_key("tiny-llama", OPTIONS, [checkpoint]), tiny_llama.artifact_dir)
    (entry,) = cache_root.iterdir()
    assert str(checkpoint.resolve()) not in (entry / "manifest.json").read_text()
    moved = shutil.copytree(checkpoint, tmp_path / "another session" / "llama")
    assert artifact_cache.restore(artifact_cache.artifact_key("tiny-llama", OPTIONS, [moved]), tmp_path / "restored")
    manifest = read_manifest(tmp_path / "restored")
    verify_files(tmp_path / "restored", manifest)
    assert manifest.source == str(moved.resolve())
    assert read_manifest(tiny_llama.artifact_dir).source == str(checkpoint.resolve())


def test_a_key_being_built_is_waited_for_then_restored(cache_root, tiny_llama, tmp_path):
    """A second builder of the same key (another test worker) waits for the first, then restores its entry
    instead of compiling it again."""
    compiled, restored = [], []

    def second_build():
        restored.append(artifact_cache.build("k", tmp_path / "second", lambda dest: compiled.append(
            shutil.copytree(tiny_llama.artifact_dir, dest))))

    def first_compile(dest):
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive(), "the second build did not wait for the first"
        compiled.append(shutil.copytree(tiny_llama.artifact_dir, dest))

    waiting = threading.Thread(target=second_build)
    assert not artifact_cache.build("k", tmp_path / "first", first_compile)
    waiting.join()
    assert compiled == [tmp_path / "first"] and restored == [True]


def test_an_artifact_whose_sources_changed_while_it_compiled_is_not_stored(cache_root, tiny_models, tiny_llama,
                                                                          monkeypatch):
    key = artifact_cache.artifact_key("tiny-llama", OPTIONS, [tiny_models.checkpoint("llama")])
    monkeypatch.setattr(artifact_cache, "_environment_digest", lambda: "sources edited meanwhile")
    artifact_cache.store(key, tiny_llama.artifact_dir)
    assert not cache_root.exists()


def test_build_stores_then_reuses_an_intact_entry(cache_root, tiny_llama, tmp_path):
    compiled = []

    def compile_into(dest):
        compiled.append(dest)
        shutil.copytree(tiny_llama.artifact_dir, dest)

    assert not artifact_cache.build("k", tmp_path / "first", compile_into)
    assert artifact_cache.build("k", tmp_path / "second", compile_into)
    assert compiled == [tmp_path / "first"]
    assert (tmp_path / "second" / "model.so").read_bytes() == (tiny_llama.artifact_dir / "model.so").read_bytes()
    assert [p.name for p in cache_root.iterdir()] == ["k"]  # no staging directory left behind


@pytest.mark.parametrize("damage", ["truncated library", "extra file", "missing manifest"])
def test_a_damaged_entry_is_evicted_and_recompiled(cache_root, tiny_llama, tmp_path, damage):
    artifact_cache.store("k", tiny_llama.artifact_dir)
    artifact_cache.TALLY.clear()
    entry = cache_root / "k"
    if damage == "truncated library":
        (entry / "model.so").write_bytes((entry / "model.so").read_bytes()[:100])
    elif damage == "extra file":
        (entry / "notes.txt").write_text("left here")
    else:
        (entry / "manifest.json").unlink()
    compiled = []
    fresh = artifact_cache.build("k", tmp_path / "out", lambda dest: compiled.append(
        shutil.copytree(tiny_llama.artifact_dir, dest)))
    assert not fresh and compiled == [tmp_path / "out"]
    verify_files(entry, read_manifest(entry))  # the entry was replaced by the fresh compile
    assert artifact_cache.TALLY == {"damaged": 1, "compiled": 1}


def test_only_the_newest_used_entries_of_a_name_are_kept(cache_root, tiny_llama, tmp_path, monkeypatch):
    keys = [f"tiny-llama-{str(n) * artifact_cache.DIGEST_CHARS}" for n in range(4)]
    other = f"tiny-llama-q8f32-{'0' * artifact_cache.DIGEST_CHARS}"
    artifact_cache.store(other, tiny_llama.artifact_dir)
    for age, key in enumerate(keys[:3]):
        artifact_cache.store(key, tiny_llama.artifact_dir)
        os.utime(cache_root / key, (1000 + age, 1000 + age))
    monkeypatch.setattr(artifact_cache, "KEEP_PER_NAME", 2)
    with artifact_cache.locked(keys):  # their lock files
        pass
    assert artifact_cache.restore(keys[0], tmp_path / "used")  # now the newest used
    artifact_cache.store(keys[3], tiny_llama.artifact_dir)
    assert sorted(p.name for p in cache_root.iterdir()) == sorted([keys[0], keys[3], other])
    assert sorted(p.name for p in artifact_cache._lock_root().iterdir()) == sorted([keys[0], keys[3]])


def test_env_var_turns_the_cache_off(cache_root, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_TEST_CACHE", "0")
    compiled = []
    for name in ("first", "second"):
        artifact_cache.build("k", tmp_path / name, lambda dest: compiled.append(
            shutil.copytree(tiny_llama.artifact_dir, dest)))
    assert len(compiled) == 2 and not cache_root.exists()


def test_cli_compile_builds_the_files_the_session_llama_holds(cli_compiled_llama, tiny_llama):
    """`ember compile` run now (never cached) writes byte for byte the files of the session's tiny llama, which
    comes from the cache when it is warm: a cached artifact is what the current sources build."""
    import json

    def files(artifact):
        return json.loads((artifact / "manifest.json").read_text())["files"]

    assert files(cli_compiled_llama.artifact_dir) == files(tiny_llama.artifact_dir)
