"""`ember compile MODEL --dump-ir DIR`: the module as TVMScript before the pipeline and after each of its
phases, one file each, named by order and phase; the artifact is the one compiled without it."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
from helpers import assert_one_line_error, compile_cached, run_ember, run_main

from ember import DEMO_MODEL_DIR


def pipeline_phase_names() -> list[str]:
    """The phases `pipeline.lower` runs for this CPU, in order."""
    from ember.ir.quant_formats import FORMATS
    from ember.ir_passes import pipeline
    from ember.targets.registry import resolve_target

    return [name for name, _ in pipeline.phases(resolve_target("cpu"), pipeline.LowerOptions(FORMATS["q0f32"], 256, 8))]


@pytest.mark.slow
def test_dump_ir_writes_one_script_per_phase(tmp_path):
    """00-imported.py, then NN-<phase>.py for each phase: each TVMScript that parses as Python; the artifact's
    files are byte for byte those of a compile without --dump-ir."""
    dump = tmp_path / "ir"
    result = run_ember("compile", "demo", "--dump-ir", str(dump), "-o", str(tmp_path / "dumped"), "--no-progress")
    assert result.returncode == 0, result.stderr
    phases = pipeline_phase_names()
    assert phases[:3] == ["imported-graph", "graph", "legalize"] and phases[-1] == "finalize"
    expected = ["00-imported.py"] + [f"{number:02d}-{name}.py" for number, name in enumerate(phases, start=1)]
    assert sorted(path.name for path in dump.iterdir()) == expected
    for name in expected:
        script = (dump / name).read_text(encoding="utf-8")
        assert "@I.ir_module" in script, name
        ast.parse(script, filename=name)
    assert "T.prim_func" in (dump / "03-legalize.py").read_text()

    compile_cached("demo-cli", Path(DEMO_MODEL_DIR), tmp_path / "plain", "--no-progress")
    manifests = [json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("dumped", "plain")]
    assert manifests[0]["files"] == manifests[1]["files"]


@pytest.mark.parametrize("what", ["file", "full_dir"])
def test_dump_ir_refuses_what_is_not_a_new_or_empty_directory(capsys, tmp_path, what):
    """A file, or a directory holding anything, is refused in one line before compiling; nothing is written."""
    dump = tmp_path / "ir"
    if what == "file":
        dump.write_text("keep me")
        expected = "exists and is not a directory"
    else:
        dump.mkdir()
        (dump / "old.py").write_text("keep me")
        expected = "the directory is not empty"
    result = run_main(capsys, "compile", "demo", "--dump-ir", str(dump), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, f"--dump-ir {dump}: {expected}")
    assert not (tmp_path / "out").exists()
    assert (dump.read_text() if what == "file" else (dump / "old.py").read_text()) == "keep me"


def _never_compiled(monkeypatch) -> None:
    import ember.driver.compiler

    def compile_model(*_args, **_kwargs):
        raise AssertionError("the compile started before its output paths were checked")

    monkeypatch.setattr(ember.driver.compiler, "compile_model", compile_model)


@pytest.mark.parametrize(("dump", "out", "expected"), [
    ("/proc/ember-ir", "out", "--dump-ir /proc/ember-ir: cannot write in /proc"),
    ("/proc/self/ember-ir", "out", "--dump-ir /proc/self/ember-ir: cannot write in /proc/self"),
    ("/sys/ember-ir", "out", "--dump-ir /sys/ember-ir: cannot write in /sys"),
    ("out/ir", "out", "--dump-ir {tmp}/out/ir: is inside -o {tmp}/out"),
    ("out", "out/art", "-o {tmp}/out/art: is inside --dump-ir {tmp}/out"),
    ("same", "same", "-o {tmp}/same: is the same as --dump-ir {tmp}/same"),
])
def test_dump_ir_that_cannot_be_written_is_refused_before_compiling(capsys, tmp_path, monkeypatch, dump, out,
                                                                    expected):
    """--dump-ir where nothing can be written (/proc, /sys), or inside -o (or around it): one line naming both
    before the compile starts (a compile that started fails the test), nothing written."""
    _never_compiled(monkeypatch)
    dump, out = (p if p.startswith("/") else str(tmp_path / p) for p in (dump, out))
    result = run_main(capsys, "compile", "demo", "--dump-ir", dump, "-o", out)
    assert_one_line_error(result, expected.format(tmp=tmp_path))
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory whatever its mode")
def test_dump_ir_in_a_read_only_directory_is_refused_before_compiling(capsys, tmp_path, monkeypatch):
    _never_compiled(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = run_main(capsys, "compile", "demo", "--dump-ir", str(locked / "ir"), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, f"--dump-ir {locked / 'ir'}: cannot write in {locked}")
