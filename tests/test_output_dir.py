"""`ember compile -o OUT` never loses a user's files, and cleans up after compiles that were killed.

OUT is replaced only when it is empty or provably an ember artifact (its manifest
parses as ember's and it holds nothing but the files the manifest lists); anything
else is refused before any work, with the user's files left byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_ember, tree_snapshot

from ember.core.errors import EmberError
from ember.core.manifest import read_manifest
from ember.driver.compiler import CompileOptions, compile_model

OPTIONS = CompileOptions(prefill_chunk=64, max_batch=4, show_progress=False)


def web_app(out: Path) -> None:
    """A folder that happens to hold a file named manifest.json (a web app's)."""
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"name": "my app", "start_url": "/"}))
    (out / "index.html").write_text("<h1>hello</h1>")
    (out / "js").mkdir()
    (out / "js" / "app.js").write_text("console.log(1)")


def artifact_with_notes(out: Path, artifact: Path) -> None:
    """An ember artifact the user saved a file into."""
    shutil.copytree(artifact, out)
    (out / "notes.txt").write_text("my benchmark results")


def artifact_with_extra_dir(out: Path, artifact: Path) -> None:
    shutil.copytree(artifact, out)
    (out / "params" / "mine").mkdir()


def artifact_with_link(out: Path, artifact: Path) -> None:
    shutil.copytree(artifact, out)
    (out / "elsewhere").symlink_to(out.parent)


def manifest_without_files(out: Path, artifact: Path) -> None:
    """A manifest.json that parses but lists no files: everything else in OUT is the user's."""
    shutil.copytree(artifact, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("files")
    (out / "manifest.json").write_text(json.dumps(manifest))


def plain_file(out: Path) -> None:
    out.write_text("not a directory")


def link_to_directory(out: Path) -> None:
    target = out.parent / "real"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    out.symlink_to(target)


REFUSED = {
    "web_app": (web_app, ["exists and holds files that are not an ember artifact's", "index.html",
                          "refusing to replace it"]),
    "artifact_with_notes": (artifact_with_notes, ["(notes.txt)"]),
    "artifact_with_extra_dir": (artifact_with_extra_dir, ["(params/mine)"]),
    "artifact_with_link": (artifact_with_link, ["(elsewhere)"]),
    "manifest_without_files": (manifest_without_files, ["manifest.json", "model.so"]),
    "plain_file": (plain_file, ["exists and is not a directory"]),
    "link_to_directory": (link_to_directory, ["is a symbolic link"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_compile_refuses_to_replace_what_is_not_an_artifact(tiny_llama, tmp_path, case):
    """Refused in-process, before the model is even read (the model path does not exist), and the
    user's files stay byte for byte."""
    make, expected = REFUSED[case]
    out = tmp_path / "out"
    make(out, tiny_llama.artifact_dir) if make.__code__.co_argcount == 2 else make(out)
    before = tree_snapshot(tmp_path)
    with pytest.raises(EmberError) as raised:
        compile_model(tmp_path / "no-such-model", out, OPTIONS)
    message = str(raised.value)
    assert message.startswith(f"-o {out}: ") and "\n" not in message
    for text in expected:
        assert text in message
    assert tree_snapshot(tmp_path) == before


def test_cli_refuses_a_web_app_folder(tiny_models, tmp_path):
    """The probe's data-loss case end to end: exit 1, one line, the folder intact."""
    out = tmp_path / "site"
    web_app(out)
    before = tree_snapshot(tmp_path)
    result = run_ember("compile", str(tiny_models.checkpoint("llama")), "-o", str(out), "--no-progress")
    assert_one_line_error(result, f"-o {out}: exists and holds files that are not an ember artifact's")
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_unusable_output_path_fails_before_any_work(tmp_path, where):
    """A parent that is a file, or a place nobody can write (/proc), fails at once: the model path
    is bogus, so an error naming -o proves nothing was read or lowered first."""
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "a_file" / "out" if where == "under_a_file" else Path("/proc/ember-test/out")
    before = tree_snapshot(tmp_path)
    with pytest.raises(EmberError, match=r"^-o .*(is not a directory|cannot write there)"):
        compile_model(tmp_path / "no-such-model", out, OPTIONS)
    assert tree_snapshot(tmp_path) == before


def test_failed_compile_removes_the_parents_it_created(tmp_path):
    """-o deep/new/out with a broken model: the error, and no empty deep/new left behind."""
    with pytest.raises(EmberError, match="not a directory"):
        compile_model(tmp_path / "no-such-model", tmp_path / "deep" / "new" / "out", OPTIONS)
    assert list(tmp_path.iterdir()) == []


def test_recompiling_replaces_an_artifact(tiny_models, tmp_path):
    """A clean artifact at OUT (here of another quantization) is replaced; nothing else is left."""
    out = tmp_path / "out"
    shutil.copytree(tiny_models.quantized("llama", "q8f32").artifact_dir, out)
    compile_model(tiny_models.checkpoint("llama"), out, OPTIONS)
    assert read_manifest(out).quantization == "q0f32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def test_compile_refuses_absurd_batch(tmp_path):
    with pytest.raises(EmberError, match=r"^--max-batch 1000000: must be between 1 and 1024$"):
        compile_model(tmp_path / "model", tmp_path / "out", CompileOptions(max_batch=1_000_000))
    with pytest.raises(EmberError, match=r"^--prefill-chunk 0: must be between 1"):
        compile_model(tmp_path / "model", tmp_path / "out", CompileOptions(prefill_chunk=0))


def test_kill_9_leftovers_are_removed_by_the_next_compile(tiny_models, tmp_path):
    """kill -9 in the middle of a compile leaves its staging directory (nothing can prevent that);
    the next compile to the same OUT removes it and says so, and keeps what is not its own: a
    live compile's staging directory and another OUT's."""
    model = tiny_models.checkpoint("llama")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ember", "compile", str(model), "-o", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.partial-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "compile never made its staging directory"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed = list(tmp_path.glob(".out.partial-*"))
    assert len(killed) == 1, "the killed compile's staging directory should be there to clean"
    dead_old = tmp_path / f".out.old-{proc.pid}-abc"
    (dead_old / "artifact").mkdir(parents=True)
    live = tmp_path / f".out.partial-{os.getpid()}-live"
    live.mkdir()
    other = tmp_path / f".other.partial-{proc.pid}-xyz"
    other.mkdir()

    result = run_ember("compile", str(model), "-o", str(out), "--no-progress")

    assert result.returncode == 0, result.stderr
    assert f"removed 2 directories left by interrupted compiles to {out}" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "out"])


def test_huge_context_is_bounded_by_this_machines_memory(tiny_models, tmp_path):
    """A config claiming 2**24 tokens of context with 8 sequences would need a 64 GiB KV cache for the
    tiny model: the cache is sized to half this machine's memory, with a warning, and generate runs."""
    model = Path(shutil.copytree(tiny_models.checkpoint("llama"), tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**24}))
    out = tmp_path / "out"

    result = run_ember("compile", str(model), "-o", str(out), "--no-progress", "--max-batch", "8")
    assert result.returncode == 0, result.stderr
    assert "does not fit this machine's memory" in result.stderr
    kv = read_manifest(out).kv_cache
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert kv["memory_budget"] == host // 2
    assert kv["max_total_tokens"] * 512 <= host // 2  # 512 bytes of KV per token: 2 layers x 2 heads x 16 x k,v x 4

    generated = run_ember("generate", str(out), "--prompt", "hello", "--max-new-tokens", "4", "--seed", "0")
    assert generated.returncode == 0, generated.stderr


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
