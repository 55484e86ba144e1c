"""Autotuning: the database round-trips, tuned kernels match the rules, other machines' databases
are ignored, and a killed tuning job resumes."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import tvm
from tvm import te, tirx

from ember.errors import TuningError
from ember.schedules.tuning import (
    SCHEDULE_SOURCE_ATTR, ScheduleSources, apply_tuning_database, compare, record_knobs, knobs_record, rule_knobs, schedule_sources,
    space_size, workload,
)
from ember.schedules import schedule_passes
from ember.schedules.tuning_db import FINGERPRINT_NAME, TuningDatabase
from ember.targets.registry import resolve_target
from ember.tune import HotKernel, tune_kernel
from helpers import REPO_ROOT

RECORDS = "database_tuning_record.json"


def nt_matmul(n: int = 64, k: int = 128, bound: int = 64) -> tirx.PrimFunc:
    """C[1, seq_len, n] = A[1, seq_len, k] @ W[n, k]^T, as legalization writes a prefill projection."""
    seq_len = tirx.Var("seq_len", "int64")
    a = te.placeholder((1, seq_len, k), name="A")
    w = te.placeholder((n, k), name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((1, seq_len, n), lambda b, m, j: te.sum(a[b, m, r] * w[j, r], axis=r), name="NT_matmul")
    return te.create_prim_func([a, w, c]).with_attr("tir_var_upper_bound", {"seq_len": bound})


@pytest.fixture(scope="module")
def target():
    return resolve_target("cpu")


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory, target):
    """A database with a few trials of `nt_matmul()`."""
    path = tmp_path_factory.mktemp("tuning")
    func = nt_matmul()
    kernel = HotKernel("nt_matmul", "prefill", 1, workload(func), 1.0)
    assert tune_kernel(kernel, 4, TuningDatabase.for_tuning(path), target, time.monotonic() + 300) == 4
    return path


def test_database_round_trips(tuned_db, target):
    database = TuningDatabase.for_compiling(tuned_db)
    func = nt_matmul()
    assert database.trials(workload(func)) == 4
    record = database.best(workload(func), target.target)
    assert record is not None and len(record_knobs(record)) == 3
    # The search may have found the rule's own knobs best; a faster record of other knobs decides.
    other_knobs = [2, 8, 2] if rule_knobs(func, target) != [2, 8, 2] else [1, 16, 4]
    database.records.commit_tuning_record(knobs_record(workload(func), database, target, 1e-10, other_knobs))
    assert record_knobs(database.best(workload(func), target.target)) == other_knobs

    mod = tvm.IRModule({"nt_matmul": func})
    with target.target:
        applied = apply_tuning_database(database, target)(mod)
    assert applied["nt_matmul"].attrs[SCHEDULE_SOURCE_ATTR] == "tuning"
    assert int(applied["nt_matmul"].attrs["tirx.is_scheduled"]) == 1
    assert schedule_sources(applied) == ScheduleSources(tuned=1, rule_won=0, untuned=0)
    # When the rule's own knobs are the best record, the rule schedules the kernel (and says it won).
    database.records.commit_tuning_record(knobs_record(workload(func), database, target, 1e-11))
    assert record_knobs(database.best(workload(func), target.target)) == rule_knobs(func, target)
    with target.target:
        ruled = apply_tuning_database(database, target)(mod)
        assert schedule_sources(ruled) == ScheduleSources(tuned=0, rule_won=1, untuned=0)
        scheduled = schedule_passes(target)[0](ruled)
    assert schedule_sources(scheduled) == ScheduleSources(tuned=0, rule_won=1, untuned=0)
    # A kernel of another shape has no record: left for the rules.
    other = tvm.IRModule({"other": nt_matmul(n=32)})
    with target.target:
        assert SCHEDULE_SOURCE_ATTR not in (apply_tuning_database(database, target)(other)["other"].attrs or {})


@pytest.mark.parametrize("knobs", [[4, 16, 1], [8, 32, 8], [2, 8, 4], [1, 16, 2]])
def test_tuned_and_rule_kernels_agree(target, knobs):
    func = nt_matmul()
    lanes = [knob for knob in (8, 16, 32) if knob * 32 <= 2 * target.vector_bits]
    if knobs[1] not in lanes:
        pytest.skip(f"{knobs[1]} lanes exceed this CPU's vectors")
    result = compare(func, knobs, target, timed=knobs[2] == 8)  # at 37 tokens: m tiles with a ragged tail
    assert result is not None and result.agrees, result
    assert space_size(func, target) >= 4 * 4


def test_other_machines_database_is_ignored(tuned_db, tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir()
    for name in os.listdir(tuned_db):
        if name.endswith(".json"):
            (other / name).write_bytes((tuned_db / name).read_bytes())
    fingerprint = json.loads((other / FINGERPRINT_NAME).read_text())
    (other / FINGERPRINT_NAME).write_text(json.dumps({**fingerprint, "cpu": "Some Other CPU", "cores": 96}))
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert TuningDatabase.for_compiling(other) is None
    assert f"tuning database {other} was made on Some Other CPU" in caplog.text and "ignoring it" in caplog.text
    with pytest.raises(TuningError, match="tune into another directory"):
        TuningDatabase.for_tuning(other)
    with pytest.raises(TuningError, match="not a tuning database"):
        TuningDatabase.for_compiling(tmp_path / "missing")


@pytest.mark.slow
def test_killed_tuning_job_resumes(tiny_models, tmp_path):
    """kill -9 after the first records; a rerun keeps them and adds more; compile applies them."""
    checkpoint, db = tiny_models.checkpoint("llama"), tmp_path / "db"
    records = db / RECORDS

    def tune(trials: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "ember", "tune", str(checkpoint), "--db", str(db),
                                 "--trials", str(trials), "--kernels", "1", "--prefill-chunk", "64"],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def lines() -> int:
        return len(records.read_text().splitlines()) if records.exists() else 0

    job = tune(64)
    deadline = time.monotonic() + 120
    while lines() < 1 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    job.send_signal(signal.SIGKILL)
    job.wait()
    before = lines()
    assert before >= 1, job.stderr.read()

    resumed = tune(before + 2)
    summary, output = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    # The killed job's trials count towards the target: two more are measured (and maybe the rule recorded).
    assert f"{before + 2}/{before + 2} trials" in output and lines() in (before + 2, before + 3), output
    # Progress goes to stderr; stdout holds the result alone (no meta_schedule tables from the resumed job).
    assert summary == f"tuned 1 kernels into {db}\n", summary

    compiled = subprocess.run([sys.executable, "-m", "ember", "compile", str(checkpoint), "-o", str(tmp_path / "a"),
                               "--tuning-db", str(db), "--prefill-chunk", "64", "--no-progress"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert compiled.returncode == 0, compiled.stderr
    # The record is applied, or measured the rule's own schedule fastest (timing noise decides which).
    applied = re.search(r"(\d+) kernels from the tuning database, (\d+) where the rule's schedule won", compiled.stdout)
    assert applied and int(applied[1]) + int(applied[2]) == 1, compiled.stdout + compiled.stderr


def test_tune_refuses_a_missing_model_and_writes_no_database(tmp_path):
    from helpers import run_ember

    db = tmp_path / "db"
    result = run_ember("tune", str(tmp_path / "missing"), "--db", str(db))
    assert result.returncode == 1 and "missing" in result.stderr and "Traceback" not in result.stderr
    assert not db.exists()


@pytest.mark.skipif(resolve_target("cpu").int8_dot is None, reason="this CPU has no int8 dot-product instruction")
def test_tune_explains_a_model_without_tunable_kernels(tiny_models, tmp_path):
    """q4f32 with int8 activations runs only fixed-schedule projections: a clear error, no database, and
    --float-activations finds the float kernels to tune."""
    from helpers import run_ember

    checkpoint, db = tiny_models.checkpoint("llama"), tmp_path / "db"
    result = run_ember("tune", str(checkpoint), "--db", str(db), "--quant", "q4f32", "--prefill-chunk", "64")
    assert result.returncode == 1 and "no tunable kernels" in result.stderr and "--float-activations" in result.stderr
    assert "Traceback" not in result.stderr and not db.exists()
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline
    from ember.ir_passes.quant_formats import FORMATS
    from ember.tune import hot_kernels

    target = resolve_target("cpu")
    imported = import_hf_model(checkpoint, target.target, "float32")
    options = pipeline.LowerOptions(FORMATS["q4f32"], 64, 4, int8_activations=False)
    assert hot_kernels(pipeline.to_kernels(imported.mod, target, options), target)


def test_compiling_reads_a_database_without_writing_it(tuned_db, tmp_path):
    """A torn last line (a killed job's) is skipped in memory, not cut on disk: compiling only reads."""
    db = tmp_path / "db"
    db.mkdir()
    for name in os.listdir(tuned_db):
        if name.endswith(".json"):
            (db / name).write_bytes((tuned_db / name).read_bytes())
    with (db / RECORDS).open("a") as f:
        f.write('[0, [[[1, 2')
    from helpers import tree_snapshot

    before = tree_snapshot(db)
    stamps = {path.name: path.stat().st_mtime_ns for path in db.iterdir()}
    database = TuningDatabase.for_compiling(db)
    assert database is not None and database.best(workload(nt_matmul()), resolve_target("cpu").target) is not None
    assert tree_snapshot(db) == before
    assert {path.name: path.stat().st_mtime_ns for path in db.iterdir()} == stamps


def test_compile_with_a_database_on_a_read_only_filesystem(tuned_db, tiny_models, tmp_path):
    """The probe's case: `compile --tuning-db` on a read-only mount (a private mount namespace, so
    nothing outside this test sees it) compiles instead of failing with EROFS."""
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespaces here (needs unshare -m as root)")
    db = tmp_path / "db"
    shutil.copytree(tuned_db, db)
    with (db / RECORDS).open("a") as f:
        f.write('[0, [[[1, 2')  # what made the old code rewrite the file
    out = tmp_path / "out"
    script = (f"mount --bind {db} {db} && mount -o remount,bind,ro {db} && touch {db}/probe 2>/dev/null && exit 9; "
              f"exec {sys.executable} -m ember compile {tiny_models.checkpoint('llama')} -o {out} "
              f"--tuning-db {db} --prefill-chunk 64 --no-progress")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert (out / "manifest.json").exists()


@pytest.mark.parametrize("command", ["tune", "compile"])
def test_a_file_is_not_a_database(tiny_models, tmp_path, command):
    """`--db FILE` / `--tuning-db FILE`: one line saying it is not a directory (it used to say to delete it)."""
    from helpers import assert_one_line_error, run_ember, tree_snapshot

    db = tmp_path / "db.json"
    db.write_text("{}")
    option = "--db" if command == "tune" else "--tuning-db"
    before = tree_snapshot(tmp_path)
    result = run_ember(command, str(tiny_models.checkpoint("llama")), *(["-o", str(tmp_path / "out")] if
                       command == "compile" else []), option, str(db), "--prefill-chunk", "64")
    assert_one_line_error(result, f"{option} {db}: not a directory")
    assert "delete" not in result.stderr
    assert tree_snapshot(tmp_path) == before
