"""`ember compile -o OUT` never loses a user's files, replaces an artifact atomically, and cleans up
only what it wrote.

OUT is replaced only when it is empty or provably an ember artifact (its manifest carries ember's
identity fields and seal, and the directory holds exactly the files it lists, with their hashes);
anything else is refused before any work, without walking it, with the user's files left byte for
byte. A staging directory is ember's only if ember's marker is inside it; a killed compile's is removed
by the next one, which also puts back an artifact the killed one had moved aside. SIGTERM and SIGHUP
clean up as Ctrl-C does; concurrent compiles to one OUT each finish.
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
from helpers import REPO_ROOT, assert_one_line_error, run_ember, tree_snapshot

import ember
from ember.core.errors import EmberError, TuningError
from ember.core.manifest import check_ember_artifact, manifest_digest, read_manifest, verify_files
from ember.driver import artifact_dir
from ember.driver.artifact_dir import STAGING_MARKER, check_output_dir, replace_dir, staging_dir
from ember.driver.compiler import CompileOptions, compile_model

OPTIONS = CompileOptions(prefill_chunk=64, max_batch=4, show_progress=False)
SHARD = "params/params_shard_0.bin"
OLD = "0.0.old"


def web_app(out: Path) -> None:
    """A folder that happens to hold a file named manifest.json (a web app's)."""
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"name": "my app", "start_url": "/"}))
    (out / "index.html").write_text("<h1>hello</h1>")
    (out / "js").mkdir()
    (out / "js" / "app.js").write_text("console.log(1)")


def thesis(out: Path) -> None:
    """The probe's case: a user's file beside a manifest that lists it (integer format_version, a files object)."""
    out.mkdir()
    (out / "thesis.docx").write_bytes(b"years of work")
    (out / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {"thesis.docx": {}}}))


def user_files(out: Path) -> None:
    """A directory of a user's files without any manifest."""
    out.mkdir()
    for name in ("a.txt", "b.txt", "c", "d", "e", "f", "g"):
        (out / name).write_text(name)


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
    """A manifest.json that lists no files: everything else in OUT is the user's."""
    _edit_manifest(out, artifact, lambda data: data.pop("files"))


def forged_identity(out: Path, artifact: Path) -> None:
    """A manifest without ember's version fields, resealed: not one ember wrote."""
    _edit_manifest(out, artifact, lambda data: data.pop("ember_version"))


def forged_seal(out: Path, artifact: Path) -> None:
    """A manifest edited without resealing."""
    _edit_manifest(out, artifact, lambda data: data.update(quantization="q4f16"), reseal=False)


def forged_hash(out: Path, artifact: Path) -> None:
    """A listed file whose recorded hash is not its own (resealed)."""
    _edit_manifest(out, artifact, lambda data: data["files"][SHARD].update(sha256="0" * 64))


def truncated_shard(out: Path, artifact: Path) -> None:
    shutil.copytree(artifact, out)
    os.truncate(out / SHARD, 8)


def _edit_manifest(out: Path, artifact: Path, change, reseal: bool = True) -> None:
    shutil.copytree(artifact, out)
    data = json.loads((out / "manifest.json").read_text())
    change(data)
    if reseal:
        data["manifest_sha256"] = manifest_digest(data)
    (out / "manifest.json").write_text(json.dumps(data))


def plain_file(out: Path) -> None:
    out.write_text("not a directory")


def link_to_directory(out: Path) -> None:
    target = out.parent / "real"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    out.symlink_to(target)


REFUSED = {
    "web_app": (web_app, ["is not an ember artifact as ember wrote it", "format_version is not"]),
    "thesis": (thesis, ["is not an ember artifact as ember wrote it", "ember_version is not a string"]),
    "user_files": (user_files, ["exists and holds files that are not an ember artifact's",
                                " and more); refusing to replace it"]),  # five of the names, not a listing
    "artifact_with_notes": (artifact_with_notes, ["notes.txt: file not listed in the manifest"]),
    "artifact_with_extra_dir": (artifact_with_extra_dir, ["params/mine: directory holds no file of the manifest"]),
    "artifact_with_link": (artifact_with_link, ["elsewhere: is a symbolic link"]),
    "manifest_without_files": (manifest_without_files, ["files is not an object"]),
    "forged_identity": (forged_identity, ["ember_version is not a string"]),
    "forged_seal": (forged_seal, ["does not match its manifest_sha256"]),
    "forged_hash": (forged_hash, [f"{SHARD}: contents do not match the manifest's sha256"]),
    "truncated_shard": (truncated_shard, [f"{SHARD}: 8 bytes"]),
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
    assert_one_line_error(result, f"-o {out}: exists and is not an ember artifact as ember wrote it")
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_unusable_output_path_fails_before_any_work(tmp_path, where):
    """A parent that is a file, or a place nobody can write (/proc), fails at once: the model path
    is bogus, so an error naming -o proves nothing was read or lowered first."""
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "a_file" / "out" if where == "under_a_file" else Path("/proc/ember-test/out")
    before = tree_snapshot(tmp_path)
    with pytest.raises(EmberError, match=r"^-o .*(is not a directory|cannot write)"):
        compile_model(tmp_path / "no-such-model", out, OPTIONS)
    assert tree_snapshot(tmp_path) == before


def test_failed_compile_removes_the_parents_it_created(tmp_path):
    """-o deep/new/out with a broken model: the error, and no empty deep/new left behind."""
    with pytest.raises(EmberError, match="not a directory"):
        compile_model(tmp_path / "no-such-model", tmp_path / "deep" / "new" / "out", OPTIONS)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_recompiling_replaces_an_artifact(old_and_new, tiny_models, tmp_path):
    """A clean artifact at OUT (here an older ember's) is replaced; nothing else is left."""
    out, _ = old_and_new
    compile_model(tiny_models.checkpoint("llama"), out, OPTIONS)
    assert read_manifest(out).ember_version == ember.__version__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def test_compile_refuses_absurd_batch(tmp_path):
    with pytest.raises(EmberError, match=r"^--max-batch 1000000: must be between 1 and 1024$"):
        compile_model(tmp_path / "model", tmp_path / "out", CompileOptions(max_batch=1_000_000))
    with pytest.raises(EmberError, match=r"^--prefill-chunk 0: must be between 1"):
        compile_model(tmp_path / "model", tmp_path / "out", CompileOptions(prefill_chunk=0))


@pytest.mark.slow
def test_kill_9_leftovers_are_removed_by_the_next_compile(tiny_models, tmp_path):
    """kill -9 in the middle of a compile leaves its staging directory (nothing can prevent that);
    the next compile to the same OUT removes it and says so, and keeps what is not its own: a
    live compile's staging directory, another OUT's, and a user's directory named like a staging one."""
    model = tiny_models.checkpoint("llama")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ember", "compile", str(model), "-o", str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f".out.partial-*/{STAGING_MARKER}")) and proc.poll() is None:
        assert time.monotonic() < deadline, "compile never made its staging directory"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed = list(tmp_path.glob(".out.partial-*"))
    assert len(killed) == 1, "the killed compile's staging directory should be there to clean"
    live = _fake_staging(tmp_path, "out", os.getpid(), "live")
    other = _fake_staging(tmp_path, "other", proc.pid, "xyz")
    users = tmp_path / ".out.partial-999999-keep"
    users.mkdir()
    (users / "mine.txt").write_text("keep")

    result = run_ember("compile", str(model), "-o", str(out), "--no-progress")

    assert result.returncode == 0, result.stderr
    assert f"removed 1 directories left by interrupted compiles to {out}" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, users.name, "out"])
    assert (users / "mine.txt").read_text() == "keep"


def _fake_staging(parent: Path, output: str, pid: int, tag: str) -> Path:
    """A staging directory as ember writes one, for `output`, owned by process `pid`."""
    holder = parent / f".{output}.partial-{pid}-{tag}"
    (holder / "new").mkdir(parents=True)
    (holder / STAGING_MARKER).write_text(json.dumps({"output": output, "pid": pid, "started": None}))
    return holder


@pytest.mark.slow
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


# A process that stages a copy of an artifact for OUT and replaces OUT with it, as a compile does at its end,
# dying by SIGKILL at a chosen step: what `kill -9` (or a power cut) leaves on disk at that instant.
INSTALL = """
import os, shutil, signal, sys, time
from pathlib import Path
from ember.driver import artifact_dir
# Ctrl-C as in a terminal: a shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT.
signal.signal(signal.SIGINT, signal.default_int_handler)
source, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
die = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
with artifact_dir.staging_dir(out) as staging:
    print("staged", flush=True)
    if mode == "wait":
        time.sleep(120)
    while mode.startswith("after:") and not Path(mode[6:]).exists():
        time.sleep(0.001)
    shutil.copytree(source, staging, dirs_exist_ok=True)
    exchange, rename = artifact_dir._exchange, os.rename
    if mode == "kill_before_exchange":
        artifact_dir._exchange = die
    elif mode == "kill_after_exchange":
        artifact_dir._exchange = lambda new, old: (exchange(new, old), die())
    elif mode == "kill_between_renames":  # a filesystem that cannot exchange
        artifact_dir._exchange = lambda new, old: False
        os.rename = lambda a, b: (rename(a, b), die())
    artifact_dir.replace_dir(staging, out)
"""


def _install(source: Path, out: Path, mode: str = "plain", **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", INSTALL, str(source), str(out), mode], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.fixture
def old_and_new(tiny_llama, tmp_path) -> tuple[Path, Path]:
    """OUT holding an artifact of an older ember (ember_version "0.0.old", resealed), and the tiny llama's
    artifact to replace it with: no second compile needed to tell the two apart."""
    out = Path(shutil.copytree(tiny_llama.artifact_dir, tmp_path / "out"))
    data = json.loads((out / "manifest.json").read_text())
    data["ember_version"] = OLD
    data["manifest_sha256"] = manifest_digest(data)
    (out / "manifest.json").write_text(json.dumps(data))
    return out, tiny_llama.artifact_dir


@pytest.mark.parametrize("mode, version_at_out",
                         [("kill_before_exchange", OLD), ("kill_after_exchange", ember.__version__),
                          ("kill_between_renames", None)])
def test_a_replace_killed_at_any_step_keeps_an_artifact(old_and_new, tmp_path, mode, version_at_out):
    """SIGKILL before or after the exchange: OUT is the old or the new artifact, whole. Without an exchange
    (two renames), OUT is missing between them: the next compile to OUT, even one that fails on its own
    error, puts the old artifact back first, and removes the killed one's staging directory."""
    out, new = old_and_new
    proc = _install(new, out, mode)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob(f".out.partial-*/{STAGING_MARKER}"))) == 1
    if version_at_out:
        check_ember_artifact(out)
        assert read_manifest(out).ember_version == version_at_out
    else:
        assert not out.exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")

    result = run_ember("compile", str(broken), "-o", str(out), "--no-progress")

    assert result.returncode == 1, result.stderr
    check_ember_artifact(out)
    assert read_manifest(out).ember_version == (version_at_out or OLD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_termination_signals_remove_the_staging_directory(old_and_new, tmp_path, signum):
    out, new = old_and_new
    before = tree_snapshot(tmp_path)
    proc = _install(new, out, "wait")
    assert proc.stdout.readline() == "staged\n"
    proc.send_signal(signum)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert tree_snapshot(tmp_path) == before


def test_cli_compile_terminated_leaves_nothing(tiny_models, tmp_path):
    """`ember compile` killed by SIGTERM (as `timeout` or a service manager stops it) cleans up as on Ctrl-C."""
    out = tmp_path / "deep" / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ember", "compile", str(tiny_models.checkpoint("llama")), "-o",
                             str(out), "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f"deep/.out.partial-*/{STAGING_MARKER}")) and proc.poll() is None:
        assert time.monotonic() < deadline, "compile never made its staging directory"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and stderr.splitlines()[0] == "ember: interrupted", stderr
    assert list(tmp_path.iterdir()) == []


def test_concurrent_replaces_of_one_new_output_each_finish(old_and_new, tmp_path):
    """Processes staging for the same new OUT at once, released together: each replaces OUT in turn (the lock
    serializes them), all exit 0, and OUT is a whole artifact with nothing left beside it."""
    out, new = old_and_new
    shutil.rmtree(out)
    go = tmp_path / "go"
    procs = [_install(new, out, f"after:{go}") for _ in range(4)]
    for proc in procs:
        assert proc.stdout.readline() == "staged\n"
    go.touch()
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    verify_files(out, read_manifest(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "out"]


def test_without_an_exchange_a_replace_still_succeeds(old_and_new, tmp_path, monkeypatch):
    out, new = old_and_new
    monkeypatch.setattr(artifact_dir, "_exchange", lambda new, old: False)
    with staging_dir(out) as staging:
        shutil.copytree(new, staging, dirs_exist_ok=True)
        replace_dir(staging, out)
    assert read_manifest(out).ember_version == ember.__version__
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_artifact_of_an_older_format_is_replaced(old_and_new, tmp_path):
    """Identity does not depend on the format version: an older ember's artifact (sealed, hashes intact) is
    replaceable by a newer compile."""
    out, new = old_and_new
    data = json.loads((out / "manifest.json").read_text())
    data.update(format_version=data["format_version"] - 1, model={"renamed": True})
    data["manifest_sha256"] = manifest_digest(data)
    (out / "manifest.json").write_text(json.dumps(data))
    check_output_dir(out)
    with staging_dir(out) as staging:
        shutil.copytree(new, staging, dirs_exist_ok=True)
        replace_dir(staging, out)
    assert read_manifest(out).ember_version == ember.__version__


def test_output_dot_from_inside_an_empty_directory(old_and_new, tmp_path, monkeypatch):
    """`-o .` stages beside the directory, not inside it, and puts the artifact at its path."""
    _, new = old_and_new
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    check_output_dir(Path("."))
    with staging_dir(Path(".")) as staging:
        assert staging.parent.parent == tmp_path
        shutil.copytree(new, staging, dirs_exist_ok=True)
        replace_dir(staging, Path("."))
    monkeypatch.chdir(tmp_path)
    verify_files(here, read_manifest(here))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "out"]


@pytest.mark.parametrize("where", ["/", "/usr"])
def test_system_directories_are_refused_without_walking_them(where, monkeypatch):
    """`-o /` names the root; a non-empty directory without an ember manifest is refused after reading at
    most a few of its entries (one listing, not a walk of the tree)."""
    listings = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listings.append(path) or scandir(path))
    with pytest.raises(EmberError, match=r"^-o /(usr)?: (is the root directory|exists and holds files that are)"):
        check_output_dir(Path(where))
    assert len(listings) <= 1


def test_stale_staging_directories_need_ember_marker_and_a_dead_owner(tmp_path):
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    ours = _fake_staging(tmp_path, "out", dead_pid, "a")
    reused = _fake_staging(tmp_path, "out", os.getppid(), "b")  # a live pid, but recorded with another start time
    marker = json.loads((reused / STAGING_MARKER).read_text())
    (reused / STAGING_MARKER).write_text(json.dumps({**marker, "started": 1}))
    forged = tmp_path / ".out.partial-999999-keep"
    forged.mkdir()
    (forged / "mine.txt").write_text("keep")
    linked = tmp_path / ".out.partial-999998-link"
    linked.symlink_to(ours)
    removed = artifact_dir.remove_stale_leftovers(out)
    assert sorted(removed) == sorted([ours, reused])
    assert (forged / "mine.txt").read_text() == "keep" and linked.is_symlink()


def _tuning_database(path: Path) -> None:
    """What `ember tune --db` leaves: the fingerprint of this machine and meta_schedule's tables and logs."""
    from ember.targets.hardware import cpu_fingerprint

    path.mkdir()
    (path / "fingerprint.json").write_text(json.dumps(cpu_fingerprint()))
    (path / "database_workload.json").write_text("")
    (path / "logs").mkdir()


@pytest.mark.parametrize("contents, refused", [
    ({}, None), ({"fingerprint.json": None}, None),
    ({"thesis.docx": b"years of work"}, "holds thesis.docx"),
    ({"fingerprint.json": None, "thesis.docx": b"years of work"}, "holds thesis.docx"),
    ({"database_workload.json": b"mine"}, "holds database_workload.json"),  # ember's name, but no fingerprint
])
def test_tune_db_takes_a_new_or_empty_directory_or_an_ember_database(tmp_path, contents, refused):
    from ember.schedules.tuning_db import check_for_tuning

    db = tmp_path / "db"
    if contents.pop("fingerprint.json", 0) is None:
        _tuning_database(db)
    else:
        db.mkdir()
    for name, data in contents.items():
        (db / name).write_bytes(data)
    before = tree_snapshot(tmp_path)
    if refused is None:
        check_for_tuning(db)
    else:
        with pytest.raises(TuningError, match=f"^--db {db}: exists and is not a tuning database .*{refused}"):
            check_for_tuning(db)
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("db", ["/proc/ember-db", "/sys/ember-db", "/proc/self/ember-db"])
def test_tune_db_where_nothing_can_be_written_is_refused_before_tuning(tiny_models, db):
    result = run_ember("tune", str(tiny_models.checkpoint("llama")), "--db", db, "--trials", "1")
    assert_one_line_error(result, f"--db {db}: cannot write in")


def test_cli_tune_refuses_a_directory_of_user_files(tiny_models, tmp_path):
    db = tmp_path / "db"
    db.mkdir()
    (db / "database_tuning_record.json").write_text("my own records")
    (db / "notes.txt").write_text("keep")
    before = tree_snapshot(tmp_path)
    result = run_ember("tune", str(tiny_models.checkpoint("llama")), "--db", str(db), "--trials", "1")
    assert_one_line_error(result, f"--db {db}: exists and is not a tuning database")
    assert tree_snapshot(tmp_path) == before


def test_an_interrupt_between_the_fallback_renames_puts_the_old_artifact_back(old_and_new, tmp_path, monkeypatch):
    """Without an exchange, an error (or Ctrl-C) after the old artifact was moved aside moves it back."""
    out, new = old_and_new
    monkeypatch.setattr(artifact_dir, "_exchange", lambda new, old: False)
    rename, interrupted = os.rename, []

    def rename_then_fail(source, destination):
        if Path(destination) == out and not interrupted:  # the new artifact's move into place
            interrupted.append(True)
            raise KeyboardInterrupt
        rename(source, destination)

    with pytest.raises(KeyboardInterrupt), staging_dir(out) as staging:
        shutil.copytree(new, staging, dirs_exist_ok=True)
        monkeypatch.setattr(os, "rename", rename_then_fail)
        replace_dir(staging, out)
    monkeypatch.setattr(os, "rename", rename)
    assert read_manifest(out).ember_version == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
