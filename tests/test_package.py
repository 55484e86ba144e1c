"""`ember package ARTIFACT -o DIR` ships exactly the artifact ember wrote, and reads nothing outside it.

The artifact is verified first, as the runtime verifies it; only the files its manifest lists (and the
manifest) are copied, each as a regular file opened without following links. Links (to files or
directories, inside or outside the artifact, to /dev/zero), FIFOs, extra files, truncated shards and a DIR
inside the artifact are refused in one line naming the path, with nothing written and nothing hanging.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, deadline, run_ember, tree_snapshot

from ember.core.errors import EmberError
from ember.core.manifest import read_manifest, verify_files
from ember.driver.package import ARTIFACT_SUBDIR, REQUIREMENTS_NAME, package_artifact

SHARD = "params/params_shard_0.bin"


@pytest.fixture
def artifact(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny llama's artifact, to damage."""
    return Path(shutil.copytree(tiny_llama.artifact_dir, tmp_path / "art"))


def test_package_holds_the_verified_artifact_and_the_runtime(artifact, tmp_path):
    out = package_artifact(artifact, tmp_path / "pkg")
    copy = out / ARTIFACT_SUBDIR
    verify_files(copy, read_manifest(copy))
    assert tree_snapshot(copy) == tree_snapshot(artifact)
    assert (out / "ember" / "runtime" / "__init__.py").is_file() and (out / REQUIREMENTS_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "pkg"]  # no staging directory left


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's secret")
    return secret


# name -> (what to do to the artifact, what the one error line names)
DAMAGE = {
    "link_to_etc_passwd": (lambda art, tmp: (art / "notes").symlink_to("/etc/passwd"), "notes: is a symbolic link"),
    "link_to_file_outside": (lambda art, tmp: (art / "notes").symlink_to(os.path.relpath(_secret(tmp), art)),
                             "notes: is a symbolic link"),
    "link_to_dir_outside": (lambda art, tmp: (art / "more").symlink_to(tmp), "more: is a symbolic link"),
    "link_to_file_inside": (lambda art, tmp: (art / "again.json").symlink_to("tokenizer.json"),
                            "again.json: is a symbolic link"),
    "link_to_dir_inside": (lambda art, tmp: (art / "weights").symlink_to("params"), "weights: is a symbolic link"),
    "listed_file_replaced_by_link": (lambda art, tmp: (os.replace(art / "tokenizer.json", tmp / "tok.json"),
                                                       (art / "tokenizer.json").symlink_to(tmp / "tok.json")),
                                     "tokenizer.json: is a symbolic link"),
    "link_to_dev_zero": (lambda art, tmp: (art / "zeros").symlink_to("/dev/zero"), "zeros: is a symbolic link"),
    "fifo": (lambda art, tmp: os.mkfifo(art / "pipe"), "pipe: not a regular file"),
    "extra_file": (lambda art, tmp: (art / "notes.txt").write_text("mine"),
                   "notes.txt: file not listed in the manifest"),
    "extra_dir": (lambda art, tmp: (art / "params" / "mine").mkdir(), "params/mine: directory holds no file"),
    "truncated_shard": (lambda art, tmp: os.truncate(art / SHARD, (art / SHARD).stat().st_size // 2),
                        f"{SHARD}: "),
    "flipped_byte": (lambda art, tmp: _flip_last_byte(art / SHARD), f"{SHARD}: contents do not match"),
    "missing_manifest": (lambda art, tmp: (art / "manifest.json").unlink(), "not an ember artifact"),
}


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_artifacts_are_refused_in_one_line(artifact, tmp_path, case):
    """In-process: an EmberError naming the path, nothing outside read (the secret is never opened: no
    output), and no output or staging directory left."""
    damage, expected = DAMAGE[case]
    damage(artifact, tmp_path)
    before = tree_snapshot(tmp_path)
    with deadline(), pytest.raises(EmberError) as raised:
        package_artifact(artifact, tmp_path / "pkg")
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    assert tree_snapshot(tmp_path) == before


def test_cli_refuses_a_link_to_etc_passwd(artifact, tmp_path):
    """The probe's case end to end: exit 1, one line naming the link, no package written."""
    (artifact / "notes").symlink_to("/etc/passwd")
    result = run_ember("package", str(artifact), "-o", str(tmp_path / "pkg"), timeout=120)
    assert_one_line_error(result, f"{artifact / 'notes'}: is a symbolic link")
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("inside", [".", "pkg", "params/pkg", "params"])
def test_output_inside_the_artifact_is_refused(artifact, inside):
    before = tree_snapshot(artifact)
    with deadline(), pytest.raises(EmberError, match=r"^-o .*: is inside the artifact .*; choose a directory "):
        package_artifact(artifact, artifact / inside)
    assert tree_snapshot(artifact) == before


def test_output_inside_the_artifact_through_a_link_is_refused(artifact, tmp_path):
    (tmp_path / "shortcut").symlink_to(artifact)
    with pytest.raises(EmberError, match="is inside the artifact"):
        package_artifact(artifact, tmp_path / "shortcut" / "pkg")


def test_output_must_be_new_or_empty(artifact, tmp_path):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "thesis.docx").write_text("years of work")
    with pytest.raises(EmberError, match=r"^-o .*pkg: exists and is not an empty directory"):
        package_artifact(artifact, out)
    assert (out / "thesis.docx").read_text() == "years of work"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert package_artifact(artifact, empty) == empty and (empty / ARTIFACT_SUBDIR / "manifest.json").is_file()


def test_a_file_changed_after_verification_is_refused(artifact, tmp_path, monkeypatch):
    """The copy is hashed as it is made: a shard rewritten between the check and the copy does not ship."""
    from ember.driver import package

    verify = package.verify_files

    def verify_then_damage(path, manifest):
        verify(path, manifest)
        _flip_last_byte(artifact / SHARD)

    monkeypatch.setattr(package, "verify_files", verify_then_damage)
    with pytest.raises(EmberError, match=f"{SHARD}: changed while it was packaged"):
        package_artifact(artifact, tmp_path / "pkg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
