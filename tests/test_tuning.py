"""Autotuning: the database round-trips, tuned kernels match the rules, other machines' databases
are ignored, and a killed tuning job resumes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
import tvm
import tvm_ffi
from helpers import REPO_ROOT
from test_int8_matmul import level_target
from tvm import te, tirx
from tvm.s_tir import meta_schedule as ms

from ember.core.errors import TuningError
from ember.core.machine import host_cpu_flags
from ember.driver.tune import HotKernel, Measurer, tune_kernel
from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir.quant_formats import FORMATS
from ember.runtime import amx
from ember.runtime.amx import AMX_FLAGS
from ember.schedules import amx_bf16_matmul, amx_matmul, int8_matmul, schedule_passes
from ember.schedules.tuning import (
    SCHEDULE_SOURCE_ATTR,
    ScheduleSources,
    apply_tuning_database,
    compare,
    enumerated_space,
    is_tunable,
    knobs_record,
    load_here,
    record_knobs,
    rule_knobs,
    schedule_sources,
    schedule_with,
    space_size,
    tile_kernel,
    timed_rows,
    workload,
)
from ember.schedules.tuning_db import FINGERPRINT_NAME, TuningDatabase
from ember.targets.registry import resolve_target

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif(resolve_target("cpu").arch != "x86_64", reason="the targets compared are x86 CPUs")
def test_tune_takes_a_target_whose_extensions_this_cpu_has(tmp_path, monkeypatch):
    """`ember tune` measures here: it takes a --target of this CPU's architecture whose extensions this CPU has (an
    AMX mcpu where LLVM names the CPU one without AMX) and refuses one with an extension it lacks, before any work."""
    from ember.core.errors import EmberError
    from ember.driver import tune

    haswell = '{"kind": "llvm", "mcpu": "haswell"}'
    features = set(resolve_target(haswell).cpu_features)

    def tuned(flags):
        monkeypatch.setattr(tune, "host_cpu_flags", lambda: flags)
        with pytest.raises(EmberError) as refused:
            tune.tune_model(tmp_path / "missing", tune.TuneOptions(db=tmp_path / "db", target=haswell))
        return str(refused.value)

    assert "missing" in tuned(features)  # past the target: the model is what is wrong
    assert "measures kernels on this machine" in tuned(features - {"avx2"})
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("option, value", [("--max-batch", "0"), ("--max-batch", "-1"), ("--max-batch", "2000"),
                                           ("--prefill-chunk", "-5")])
def test_tune_refuses_sizes_compile_refuses_and_writes_no_database(tmp_path, option, value):
    """--max-batch and --prefill-chunk are checked as compile checks them: one line, exit 1, no database (a batch of
    0 ended in TVM's divide-by-zero, -1 in an internal error after creating the database, a chunk of -5 tuned)."""
    from helpers import run_ember

    db = tmp_path / "db"
    result = run_ember("tune", "demo", "--db", str(db), option, value, "--trials", "1")
    assert result.returncode == 1 and result.stderr.strip() == f"ember: error: {option} {value}: must be between 1 " \
        f"and {65536 if option == '--prefill-chunk' else 1024}", result.stderr
    assert not db.exists()


def _int8_kernel(target, many_tokens=True):
    """A q4f32 int8 matmul as the quantization pass adds it to a model (built by the rule, tagged)."""
    func = int8_matmul.int8_dot_matmul(FORMATS["q4f32"], 64, 256, target.int8_dot, many_tokens, target.vector_bits)
    return func.with_attr(KERNEL_SOURCE_ATTR, int8_matmul.__name__)


@pytest.mark.parametrize("level", ["avx2", "avx512vnni"])
def test_int8_records_are_checked_and_applied(tmp_path, caplog, level):
    """Records of int8 matmul knobs have the float path's form and fate: the rule's knobs leave the rule,
    others rebuild the kernel with them (counted as tuned), a tuple the kernel cannot take is refused."""
    target = level_target(level)
    func = _int8_kernel(target)
    tuned_as, space = workload(func), enumerated_space(func, target)
    assert space_size(func, target) == len(space) >= 12 and rule_knobs(func, target) == space[0]
    assert is_tunable(func, target) and enumerated_space(nt_matmul(), target) is None
    database = TuningDatabase.for_tuning(tmp_path / "db")
    mod = tvm.IRModule({"int8_dot_matmul": func, "nt_matmul": nt_matmul()})

    def applied(knobs, seconds):
        database.records.commit_tuning_record(knobs_record(tuned_as, database, target, seconds, knobs))
        reread = TuningDatabase.for_compiling(tmp_path / "db")  # what compile reads back from disk
        assert record_knobs(reread.best(workload(func), target.target)) == (knobs or space[0])
        with target.target:
            return apply_tuning_database(reread, target)(mod)

    assert schedule_sources(applied(None, 1e-3)) == ScheduleSources(tuned=0, rule_won=1, untuned=1)
    other = space[-1]
    result = applied(other, 1e-4)
    assert schedule_sources(result) == ScheduleSources(tuned=1, rule_won=0, untuned=1)
    kernel = result["int8_dot_matmul"]
    tvm.ir.assert_structural_equal(kernel.without_attr(SCHEDULE_SOURCE_ATTR),
                                   int8_matmul.rebuild(func, target.int8_dot, target.vector_bits, other))
    with pytest.raises(ValueError):  # another kernel than the rule's
        tvm.ir.assert_structural_equal(kernel.without_attr(SCHEDULE_SOURCE_ATTR), func)
    assert kernel.attrs[KERNEL_SOURCE_ATTR] == int8_matmul.__name__  # the rules still leave it alone
    with caplog.at_level(logging.WARNING, logger="ember"):
        # each value a candidate, the tile over the register budget (AVX512-VNNI's prefill multiplies 16 rows)
        refused = applied([4, 8, 1] if level == "avx512vnni" else [4, 4, 1], 1e-5)
    assert "does not fit; using the rule" in caplog.text
    assert schedule_sources(refused) == ScheduleSources(tuned=0, rule_won=0, untuned=2)


class _StubMeasurer:
    """meta_schedule's builder and runner as `tune_kernel` calls them: nothing is built or run, and each candidate
    takes the time `seconds(candidate module)` gives."""

    def __init__(self, seconds, scratch):
        self.seconds, self.scratch, self.candidates = seconds, scratch, {}

    def build(self, inputs):
        results = []
        for built in inputs:
            path = os.path.join(tempfile.mkdtemp(dir=self.scratch), "kernel.so")
            self.candidates[path] = built.mod
            results.append(SimpleNamespace(artifact_path=path, error_msg=None))
        return results

    def run(self, inputs):
        return [SimpleNamespace(result=lambda mod=self.candidates[run.artifact_path]: ms.runner.RunnerResult(
            [self.seconds(mod)], None)) for run in inputs]


def test_int8_decode_knobs_are_timed_at_one_sequence_and_a_full_batch(tmp_path, caplog):
    """An int8 decode kernel's knob tuples are timed at one sequence and at the most rows its calls take, and a
    record's time is the sum: a tuple that wins at one sequence but loses more at a full batch does not become
    the database's best. Those rows are part of the workload: a record for one batch bound is not another's,
    and a compile for another says so."""
    target = level_target("avx2")
    decode = _int8_kernel(target, many_tokens=False)
    batch4, batch8 = (decode.with_attr("tir_var_upper_bound", {"batch": rows}) for rows in (4, 8))
    verify = decode.with_attr("tir_var_upper_bound", {"seq": 8})  # a verify step's tokens, one sequence
    assert (timed_rows(batch4), timed_rows(verify), timed_rows(_int8_kernel(target)), timed_rows(nt_matmul())) == \
        ((1, 4), (1, 8), (), ())
    assert tvm_ffi.structural_equal(workload(batch8), workload(verify))
    assert not tvm_ffi.structural_equal(workload(batch4), workload(batch8))
    # One sequence at most (--max-batch 1): timed at one row, under the key ember gave every decode kernel before.
    batch1 = decode.with_attr("tir_var_upper_bound", {"batch": 1})
    assert timed_rows(batch1) == (1,) and "ember.tuning.timed_rows" not in workload(batch1)["main"].attrs

    kernel = HotKernel("int8_dot_matmul", "decode", 1, workload(batch4), 1.0)
    func = kernel.workload["main"]
    space = enumerated_space(func, target)
    candidates = {(index, rows): workload(schedule_with(func, knobs, target), rows)
                  for index, knobs in enumerate(space) for rows in (1, 4)}
    # The rule: 1 ms at one sequence, 2 at four; the last tuple 0.9 and 2.5; the others 5 and 5.
    times = {(0, 1): 1e-3, (0, 4): 2e-3, (len(space) - 1, 1): 0.9e-3, (len(space) - 1, 4): 2.5e-3}
    timed = []

    def seconds(mod):
        (key,) = [key for key, candidate in candidates.items() if tvm_ffi.structural_equal(candidate, mod)]
        timed.append(key)
        return times.get(key, 5e-3)

    stub = _StubMeasurer(seconds, tmp_path)
    database = TuningDatabase.for_tuning(tmp_path / "db")
    measurer = Measurer(stub, stub, lambda: contextlib.nullcontext(load_here))
    assert tune_kernel(kernel, len(space), database, target, time.monotonic() + 300, measurer) == len(space)
    assert sorted(timed) == sorted(candidates)  # every tuple at 1 and 4 rows
    recorded = {tuple(record_knobs(record)): float(record.run_secs[0])
                for record in database.records.get_all_tuning_records()}
    assert recorded[tuple(space[0])] == pytest.approx(3e-3) and recorded[tuple(space[-1])] == pytest.approx(3.4e-3)
    assert record_knobs(database.best(kernel.workload, target.target)) == space[0]

    def compiled(func):
        with caplog.at_level(logging.WARNING, logger="ember"), target.target:
            mod = apply_tuning_database(TuningDatabase.for_compiling(tmp_path / "db"), target)(
                tvm.IRModule({"int8_dot_matmul": func}))
        return schedule_sources(mod)

    assert compiled(batch4) == ScheduleSources(tuned=0, rule_won=1, untuned=0) and not caplog.text
    assert compiled(batch8) == ScheduleSources(tuned=0, rule_won=0, untuned=1)
    assert "tuned for --max-batch 4, not this compile's 8" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "avx512vnni"])
def test_int8_matmuls_of_a_q4f32_model_are_tuned_and_applied(tiny_models, tmp_path, level):
    """A q4f32 model for an AVX2 target (haswell, run here) or this CPU's VNNI: its hottest kernels are int8
    matmuls; tune_kernel measures their knob tuples into a database, compile reads it back, checks and
    applies a tuned kernel, and the model still matches transformers on its quantized weights."""
    from conftest import MAX_BATCH, PREFILL_CHUNK, TinyModel
    from test_quantization import _assert_logits_match_reference

    from ember.driver.compiler import CompileOptions, compile_model
    from ember.driver.tune import hot_kernels
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline

    target = level_target(level)
    checkpoint, db = tiny_models.checkpoint("llama"), tmp_path / "db"
    imported = import_hf_model(checkpoint, target.target, "float32")
    options = pipeline.LowerOptions(FORMATS["q4f32"], PREFILL_CHUNK, MAX_BATCH)
    lowered = pipeline.to_kernels(imported.mod, target, options)
    kernels = hot_kernels(lowered, target)
    int8 = [kernel for kernel in kernels if enumerated_space(kernel.workload["main"], target) is not None]
    assert kernels[0] in int8 and {kernel.phases for kernel in int8} == {"decode", "prefill"}
    hottest = kernels[0]
    database = TuningDatabase.for_tuning(db)
    assert tune_kernel(hottest, 2, database, target, time.monotonic() + 300) == 2
    space = enumerated_space(hottest.workload["main"], target)
    assert sorted(record_knobs(record) for record in database.records.get_all_tuning_records()) == sorted(space[:2])
    # Whichever was faster here, a faster record of a third tuple is what compile must apply.
    database.records.commit_tuning_record(knobs_record(hottest.workload, database, target, 1e-10, space[2]))
    # The record applies to every kernel tuned as that workload: the one kernel and its copies per sequence
    # bound (decode's and verify's calls of one matmul).
    sharing = [func for func in lowered.functions.values() if isinstance(func, tirx.PrimFunc)
               and (tuned_as := workload(func)) is not None and tvm_ffi.structural_equal(tuned_as, hottest.workload)]
    assert sharing

    out = tmp_path / "artifact"
    result = compile_model(checkpoint, out, CompileOptions(
        target=json.dumps(target.tvm_target), quantization="q4f32", prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH,
        tuning_db=db, show_progress=False))
    assert result.schedules.tuned == len(sharing) and result.manifest.activations == "int8"
    _assert_logits_match_reference(TinyModel("llama", checkpoint, out, quantization="q4f32"))


AMX_TARGET = resolve_target('{"kind": "llvm", "mcpu": "sapphirerapids"}')  # prefill on bfloat16 tiles
INT8_TILES_TARGET = resolve_target('{"kind": "llvm", "mcpu": "icelake-server", "mattr": ["+amx-tile", "+amx-int8"]}')


@pytest.mark.slow
@pytest.mark.skipif(not {*AMX_FLAGS, "amx_bf16", "avx512_bf16"} <= (host_cpu_flags() or set()),
                    reason="this CPU has no AMX tiles (no amx_tile, amx_int8, amx_bf16 in /proc/cpuinfo)")
@pytest.mark.parametrize("target,module,knob_names,between", [
    (AMX_TARGET, amx_bf16_matmul, amx_bf16_matmul.BF16_KNOBS, (24, 48)),
    (INT8_TILES_TARGET, amx_matmul, amx_matmul.AMX_KNOBS, (48,)),
], ids=["bf16", "int8"])
def test_amx_matmuls_of_a_q8f32_model_are_tuned_and_applied(tiny_models, tmp_path, caplog, target, module,
                                                            knob_names, between):
    """On an AMX target, prefill's AMX matmuls (bfloat16 tiles, or int8 ones without AMX-BF16) are tuned: their
    knob tuples (blocking, and `vnni_below`: the rows from which a call runs on tiles), the rule's first, timed at the
    prefill tokens and between the thresholds tried; compile applies a record only once its check against the rule
    (made when tuning: a compile has no tile permission) agreed, rebuilding the kernel with the record's knobs, and
    the model still matches transformers on its quantized weights."""
    from conftest import MAX_BATCH, PREFILL_CHUNK, TinyModel
    from test_quantization import _assert_logits_match_reference

    from ember.driver.compiler import CompileOptions, compile_model
    from ember.driver.tune import hot_kernels
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline

    checkpoint, db = tiny_models.checkpoint("llama"), tmp_path / "db"
    imported = import_hf_model(checkpoint, target.target, "float32")
    lowered = pipeline.to_kernels(imported.mod, target, pipeline.LowerOptions(FORMATS["q8f32"], PREFILL_CHUNK,
                                                                              MAX_BATCH))
    tiles = [kernel for kernel in hot_kernels(lowered, target) if tile_kernel(kernel.workload["main"])]
    assert tiles and {kernel.phases for kernel in tiles} == {"prefill"}
    assert {tile_kernel(kernel.workload["main"]) for kernel in tiles} == {module}
    hottest = tiles[0]
    func = hottest.workload["main"]
    space = enumerated_space(func, target)
    assert rule_knobs(func, target) == space[0] and space[0][-1] == module.VNNI_BELOW_ROWS
    assert {knobs[-1] for knobs in space} == set(module.VNNI_BELOW_SPACE) and len(space) == space_size(func, target)
    assert timed_rows(func) == (*between, PREFILL_CHUNK)  # between the thresholds tried, and a whole prefill chunk
    database = TuningDatabase.for_tuning(db)
    assert tune_kernel(hottest, 2, database, target, time.monotonic() + 300) == 2
    trials = database.records.get_all_tuning_records()
    assert sorted(record_knobs(record) for record in trials) == sorted(space[:2])
    assert all(record.run_secs for record in trials)  # run on tiles: the runner's workers have the permission

    # A faster record of other blocking and another threshold: unchecked, compile keeps the rule.
    other = next(knobs for knobs in space if knobs[1] != space[0][1] and knobs[-1] != space[0][-1])
    database.records.commit_tuning_record(knobs_record(hottest.workload, database, target, 1e-10, other))
    mod = tvm.IRModule({hottest.name: lowered[hottest.name]})

    def applied():
        with caplog.at_level(logging.WARNING, logger="ember"), target.target:
            return apply_tuning_database(TuningDatabase.for_compiling(db), target)(mod)

    assert schedule_sources(applied()) == ScheduleSources(tuned=0, rule_won=0, untuned=1)
    assert "was never checked against the rule when tuned" in caplog.text
    amx.request_amx_permission("test_tuning")  # the check runs the tiles in this process, as `ember tune` does
    check = compare(func, other, target)
    database.record_check(hottest.workload, other, check.agrees, check.max_error)
    result = applied()
    assert check.agrees and schedule_sources(result) == ScheduleSources(tuned=1, rule_won=0, untuned=0)
    rebuilt = module.built_as(result[hottest.name])
    assert [rebuilt[name] for name in knob_names] == other

    sharing = [func for func in lowered.functions.values() if isinstance(func, tirx.PrimFunc)
               and (tuned_as := workload(func)) is not None and tvm_ffi.structural_equal(tuned_as, hottest.workload)]
    out = tmp_path / "artifact"
    compiled = compile_model(checkpoint, out, CompileOptions(
        target=json.dumps(target.tvm_target), quantization="q8f32", prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH,
        tuning_db=db, show_progress=False))
    assert compiled.schedules.tuned == len(sharing) >= 1
    _assert_logits_match_reference(TinyModel("llama", checkpoint, out, quantization="q8f32"))


@pytest.mark.slow
@pytest.mark.skipif(resolve_target("cpu").int8_dot is None, reason="this CPU has no int8 dot-product instruction")
def test_tune_searches_the_int8_matmuls_of_a_q4f32_model(tiny_models, tmp_path):
    """`ember tune` on a q4f32 model on this CPU tunes its int8 matmuls: their schedules are searched, not
    reported as fixed."""
    from helpers import run_ember

    checkpoint, db = tiny_models.checkpoint("llama"), tmp_path / "db"
    result = run_ember("tune", str(checkpoint), "--db", str(db), "--quant", "q4f32", "--prefill-chunk", "64",
                       "--trials", "2", "--kernels", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "int8_dot_matmul" in result.stderr and "2/2 trials" in result.stderr and "knobs [" in result.stderr
    assert "fixed" not in result.stderr and result.stdout == f"tuned 1 kernels into {db}\n"
    records = (db / RECORDS).read_text().splitlines()
    assert len(records) in (2, 3)  # and the rule's own knobs, where the other tuple measured faster


@pytest.mark.slow
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


@pytest.mark.slow
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
    """`--db FILE` / `--tuning-db FILE`: one line saying it is not a directory (nothing tells the user to delete it)."""
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
