"""`ember compile MODEL --dump-ir DIR`: the module as TVMScript before the pipeline and after each of its
phases, one file each, named by order and phase; the artifact is the one compiled without it."""

from __future__ import annotations

import ast
import json
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
