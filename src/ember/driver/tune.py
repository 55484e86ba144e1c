"""`ember tune`: find a model's hottest kernels and tune them into a database.

The model goes through the same graph and legalization phases as `ember compile`,
so the kernels tuned are exactly the ones compile will look up. Each kernel is
weighted by how often a generation calls it: its call sites in `decode` (run once
per new token, `DECODE_STEPS_PER_PREFILL` tokens per prompt chunk) and in `prefill`,
times a roofline-shaped cost at its tuning shape (the larger of its FLOPs and
`FLOPS_PER_BYTE` times the bytes it touches). The hottest matmuls (the kernels whose
schedule has knobs, `schedules/tuning.py`: the float matmuls, the int8 dot-product
matmuls and, on an AMX target, prefill's AMX matmuls) share the trial budget in proportion to their weight.

Tuning runs in rounds of a few trials, built by one worker process kept for the job
(`candidate_builder`) and timed by meta_schedule's runner, with long timeouts (LLVM is
slow on small machines); they append
every `TRIALS_PER_COMMIT` measurements to the database. Each round starts from the
trials already on disk, so rerunning a killed job continues it, and no new round
starts after `--budget` minutes. An int8 matmul's few knob tuples are built and timed
in order, the rule's first, by the same builder and runner, each round skipping the
tuples already on disk; a decode kernel's at one sequence and at `--max-batch` (or a
verify step's tokens), its time the sum, so that knobs a little faster for one stream
cannot win by slowing a batch more (`schedules/tuning.py`, `timed_rows`); an AMX kernel's (tile blocking and
the row count from which calls run on tiles) at its prefill tokens and at row counts between the thresholds
tried, so that the threshold is chosen by what each side measures. After a kernel's last round, its best
record is run against the rule-based kernel on random inputs: the report shows both
times and flags a record that disagrees numerically (compile would reject it), and
if the rule is faster, a record of the rule's own knobs is added so that the
database's best is never slower than the rule. Each check is noted in the database
(`checks.json`), for compiles that cannot run the kernels themselves.

With `--rpc-tracker HOST:PORT --device-key KEY` the same happens on a device farm
(`src/ember/driver/farm.py`): kernels are built here for `--target` (a board's, cross-linked as
compile links it) and timed on the key's devices by meta_schedule's `RPCRunner`, as many
at once as devices are registered; the check against the rule runs on one of them. The
database is keyed by the fingerprint the devices report about themselves, which must
agree: one database, one kind of CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import tvm
from tvm import relax, s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ember.core.errors import ArtifactError, FarmError, TuningError
from ember.core.machine import cpu_fingerprint, host_cpu_flags
from ember.core.manifest import MANIFEST_NAME, read_manifest
from ember.driver.candidate_builder import CandidateBuilder
from ember.driver.codegen import cross_linker
from ember.driver.compiler import check_sizes
from ember.driver.farm import Farm, runner_arguments, runner_session
from ember.driver.tvm_log import tvm_warnings_hidden
from ember.frontend import records
from ember.frontend import source as model_source
from ember.ir.quant_formats import FORMATS
from ember.ir.tvmscript import stacks_from_linecache
from ember.ir_passes import pipeline
from ember.runtime.amx import AMX_FLAGS, needs_amx, request_amx_permission
from ember.runtime.device import use_cpu_threads
from ember.schedules.tuning import (
    Comparison,
    KernelLoader,
    compare,
    enumerated_space,
    is_tunable,
    knobs_record,
    load_here,
    matmul_built_as,
    record_knobs,
    schedule_with,
    space_size,
    timed_rows,
    tuning_space,
    workload,
)
from ember.schedules.tuning_db import TuningDatabase, check_for_tuning, describe
from ember.targets.registry import TargetSpec, resolve_target

log = logging.getLogger("ember")

DECODE_STEPS_PER_PREFILL = 128  # a generation writes about as many tokens as one prompt chunk
FLOPS_PER_BYTE = 8  # a CPU's compute-to-bandwidth balance: below it a kernel is memory-bound
# Trials of one meta_schedule search, which sets up its task and strategy anew; the budget is checked between them.
TRIALS_PER_ROUND = 16
TRIALS_PER_COMMIT = 4  # measured and appended to the database together: what a killed job can lose
MIN_TRIALS = 4


@dataclass
class TuneOptions:
    """What to tune and for how long."""

    db: Path
    target: str = "cpu"
    quantization: str | None = None  # None: the target's default, as for compile
    trials: int = 64
    budget_minutes: float = 10.0
    kernels: int = 8
    prefill_chunk: int = 256
    max_batch: int = 8
    keep_embedding: bool = False
    keep_lm_head: bool = False
    float_activations: bool = False  # as for compile: projections stay float kernels (and tunable)
    frontend: str = "builtin"  # as for compile: whose graph a checkpoint directory is
    tokenizer_dir: Path | None = None  # as for compile: an ONNX file's config.json and tokenizer
    # Checkpoint tensor -> format, as an artifact recorded them (`records.recorded_formats`); without them and
    # without a --quant, a GGUF file's weights keep their own types, as for compile.
    tensor_formats: dict[str, str] = field(default_factory=dict)
    farm: Farm | None = None  # measure on the devices of a tracker's key (--rpc-tracker/--device-key), not here


@dataclass
class HotKernel:
    """A kernel of the model, the workload it is tuned as, and how much a generation spends in it."""

    name: str
    phases: str  # "decode", "prefill" or both
    calls: int  # call sites per generation step of its phase(s)
    workload: tvm.IRModule
    weight: float  # arbitrary units; only ratios matter


@dataclass
class TunedKernel:
    """What tuning a kernel gave: trials on disk, the best knobs, and tuned vs rule on this machine."""

    kernel: HotKernel
    trials: int
    knobs: list[int] | None
    comparison: Comparison | None


@stacks_from_linecache()
def tune_model(model: Path, options: TuneOptions) -> list[TunedKernel]:
    """Tune the hottest kernels of `model` (a checkpoint or an artifact) into `options.db`."""
    model, options = _resolve_model(Path(model), options)
    target = resolve_target(options.target)
    if options.farm is None and not _runs_here(target):
        raise TuningError(f"--target {options.target}: `ember tune` measures kernels on this machine, so it "
                          "tunes only for this CPU (--target cpu, or a CPU whose extensions it has); tune for "
                          "another CPU on devices of it with --rpc-tracker HOST:PORT --device-key KEY")
    if target.is_gpu:
        raise TuningError(f"--target {options.target}: `ember tune` tunes CPU kernels only")
    quantization = options.quantization or model_source.default_quantization(model, target.default_quantization)
    if quantization not in FORMATS:
        raise TuningError(f"--quant {quantization!r} is not supported; choose one of {', '.join(FORMATS)}")
    if options.trials < 1 or options.kernels < 1 or options.budget_minutes <= 0:
        raise TuningError("--trials, --kernels and --budget must be positive")
    check_sizes(options.prefill_chunk, options.max_batch)  # as compile refuses them
    deadline = time.monotonic() + 60 * options.budget_minutes
    if options.farm is None:
        fingerprint = cpu_fingerprint()
        check_for_tuning(options.db, fingerprint)
        # Kernels are timed (in runner subprocesses, which inherit it) on as many threads as the runtime gives them.
        use_cpu_threads()
        if needs_amx(target.cpu_features):
            try:  # the check against the rule runs AMX kernels in this process (the runner's workers ask themselves)
                request_amx_permission("ember tune")
            except ArtifactError as err:
                raise TuningError(f"--target {options.target}: {err}") from None
    else:
        cross_linker(target)  # a missing cross toolchain is refused before any work
        fingerprint, devices = _devices_fingerprint(options.farm, target, options.target)
        check_for_tuning(options.db, fingerprint)

    fmt = FORMATS[quantization]
    imported = model_source.import_model(model, target.target, fmt.dtype, frontend=options.frontend,
                                         tokenizer_dir=options.tokenizer_dir)
    tensor_formats = options.tensor_formats or (
        model_source.stored_formats(imported) if options.quantization is None else {})
    _progress(f"extracting kernels of {model}")
    config = imported.config
    # The compile's bound on a prefill chunk (`compiler.py`): the context, and a sliding window.
    prefill_chunk = min(options.prefill_chunk, config.context_window, config.sliding_window or options.prefill_chunk)
    lower_options = pipeline.LowerOptions(fmt, prefill_chunk,
                                          options.max_batch, options.keep_embedding, options.keep_lm_head,
                                          int8_activations=not options.float_activations,
                                          tensor_formats=tensor_formats)
    with tvm_warnings_hidden():
        kernels = hot_kernels(pipeline.to_kernels(imported.mod, target, lower_options), target)[: options.kernels]
    if not kernels:
        raise TuningError(f"{model} at --quant {quantization} has no tunable kernels (matmuls) for this CPU")
    measurer = Measurer.here() if options.farm is None else Measurer.on(options.farm, devices, target)
    try:
        # Opened (and created) only once the model is known good: a bad path leaves no empty database behind.
        database = TuningDatabase.for_tuning(options.db, fingerprint)
        total_weight = sum(kernel.weight for kernel in kernels)
        trials_left, weight_left = options.trials, total_weight
        results = []
        for index, kernel in enumerate(kernels, 1):
            # A share of what is left, so trials a small search space cannot use go to the next kernels.
            share = min(trials_left, max(MIN_TRIALS, round(trials_left * kernel.weight / weight_left)))
            wanted = min(share, space_size(kernel.workload["main"], target))
            if wanted == 0:
                break
            trials_left, weight_left = max(trials_left - wanted, 0), weight_left - kernel.weight
            _progress(f"[{index}/{len(kernels)}] {kernel.name} ({kernel.phases}, {kernel.calls} calls, "
                      f"{kernel.weight / total_weight:.0%} of the tuned work): {wanted} trials")
            done = tune_kernel(kernel, wanted, database, target, deadline, measurer)
            results.append(_evaluate(kernel, done, database, target, measurer))
            if time.monotonic() > deadline and index < len(kernels):
                _progress(f"budget of {options.budget_minutes:g} minutes spent; {len(kernels) - index} kernels "
                          "left (rerun to continue)")
                break
    finally:
        measurer.close()
    return results


def _runs_here(target: TargetSpec) -> bool:
    """Whether this machine runs `target`'s kernels: its own CPU target, or a CPU of its architecture whose
    extensions it has (an AMX `mcpu` where LLVM names this CPU one without AMX, as some VMs make it)."""
    if target.is_gpu:
        return False
    host = resolve_target("cpu")
    if target.tvm_target == host.tvm_target:
        return True
    flags = host_cpu_flags()
    return bool(target.arch) and target.arch == host.arch and flags is not None and set(target.cpu_features) <= flags


@dataclass
class Measurer:
    """Where kernels are built and timed (a meta_schedule builder and runner), how a kernel library is run for the
    check against the rule, and how many devices serve (for the progress lines)."""

    builder: ms.builder.Builder
    runner: ms.runner.Runner
    kernels: Callable[[], contextlib.AbstractContextManager[KernelLoader]]
    serving: Callable[[], str] = lambda: ""
    ready: Callable[[], object] = lambda: None  # raises when there is nothing to measure on (no device left)
    close: Callable[[], None] = lambda: None  # stops the builder's worker

    @classmethod
    def here(cls) -> Measurer:
        """This machine: ember's candidate builder and meta_schedule's local runner."""
        builder = CandidateBuilder(None, BUILD_SECONDS)
        runner = ms.runner.LocalRunner(timeout_sec=RUN_SECONDS, evaluator_config=_EVALUATOR,
                                       initializer=allow_tiles)
        return cls(builder, runner, lambda: contextlib.nullcontext(load_here), close=builder.close)

    @classmethod
    def on(cls, farm: Farm, devices: int, target: TargetSpec) -> Measurer:
        """The devices of `farm`: kernels built and linked here for `target`, timed by meta_schedule's RPC runner
        on as many devices at once as are registered now."""
        builder = CandidateBuilder(cross_linker(target), BUILD_SECONDS)
        config = ms.runner.RPCConfig(farm.host, farm.port, farm.key, session_priority=1,
                                     session_timeout_sec=RUN_SECONDS)
        runner = ms.runner.RPCRunner(config, _EVALUATOR, max_workers=devices,
                                     f_create_session=functools.partial(runner_session, farm.wait_seconds),
                                     f_alloc_argument=runner_arguments)

        def serving() -> str:
            try:
                count = farm.devices()
            except FarmError:
                return f" (tracker {farm.tracker} unreachable)"
            return f" ({count} device{'s' if count != 1 else ''} of {farm.key!r} serving)"

        return cls(builder, runner, functools.partial(_kernels_on, farm, cross_linker(target)), serving,
                   farm.wait_for_devices, builder.close)


def allow_tiles() -> None:
    """Runs in each of meta_schedule's local runner workers: on a host with AMX, asks Linux for the tile state its
    AMX kernels need (without it their first tile instruction is SIGILL; a refusal leaves their trials failed)."""
    if set(AMX_FLAGS) <= (host_cpu_flags() or set()):
        with contextlib.suppress(ArtifactError):
            request_amx_permission("ember tune")


@contextlib.contextmanager
def _kernels_on(farm: Farm, linker: str | None) -> Iterator[KernelLoader]:
    """Kernel libraries linked here and run on one device of `farm`, held for the whole comparison."""
    session = farm.session(RUN_SECONDS * 10)
    names = itertools.count()

    def load(library: tvm.runtime.Executable) -> tuple[tvm.runtime.Module, tvm.runtime.Device]:
        name = f"check{next(names)}.so"
        with tempfile.TemporaryDirectory(prefix="ember-check-") as temp:
            library.export_library(os.path.join(temp, name), **({"cc": linker} if linker else {}))
            session.upload(os.path.join(temp, name), name)
        return session.load_module(name), session.cpu()

    yield load


def _devices_fingerprint(farm: Farm, target: TargetSpec, target_option: str) -> tuple[dict, int]:
    """The fingerprint the devices of `farm` report (all alike, and of `target`'s architecture) and their count."""
    fingerprints = farm.fingerprints()
    distinct = [dict(item) for item in {json.dumps(fp, sort_keys=True): fp for fp in fingerprints}.values()]
    if len(distinct) > 1:
        raise TuningError(f"the {len(fingerprints)} devices of key {farm.key!r} are not alike ("
                          f"{'; '.join(map(describe, distinct))}): timings of one kind of CPU only make a database; "
                          "register each kind under a key of its own")
    fingerprint = fingerprints[0]
    machine = str(fingerprint.get("machine", ""))
    if target.arch and machine and target.arch != machine:
        raise TuningError(f"--target {target_option} is for {target.arch}; the devices of key {farm.key!r} are "
                          f"{machine} ({describe(fingerprint)}): give the --target they run")
    _progress(f"{len(fingerprints)} device{'s' if len(fingerprints) > 1 else ''} of key {farm.key!r}: "
              f"{describe(fingerprint)}")
    return fingerprint, len(fingerprints)


def hot_kernels(mod: tvm.IRModule, target: TargetSpec) -> list[HotKernel]:
    """The tunable kernels of a legalized module, hottest first."""
    calls: dict[str, dict[str, int]] = {}
    for phase in ("prefill", "decode"):
        for name in _called_kernels(mod[phase]):
            calls.setdefault(name, {}).setdefault(phase, 0)
            calls[name][phase] += 1
    kernels = []
    for name, per_phase in calls.items():
        func = mod[name]
        tuned_as = workload(func)
        if tuned_as is None or not is_tunable(func, target):
            continue
        steps = per_phase.get("prefill", 0) + DECODE_STEPS_PER_PREFILL * per_phase.get("decode", 0)
        kernels.append(HotKernel(name, "+".join(per_phase), sum(per_phase.values()), tuned_as,
                                 steps * _cost(tuned_as)))
    return sorted(kernels, key=lambda kernel: -kernel.weight)


def tune_kernel(kernel: HotKernel, wanted: int, database: TuningDatabase, target: TargetSpec,
                deadline: float, measurer: Measurer | None = None) -> int:
    """Rounds until `wanted` trials of `kernel` are on disk or the deadline passes; the trials on disk.

    A float matmul's rounds are meta_schedule searches; an int8 matmul's, its next untried knob tuples.
    Timed by `measurer` (default: here)."""
    if measurer is None:
        measurer = Measurer.here()
        try:
            return tune_kernel(kernel, wanted, database, target, deadline, measurer)
        finally:
            measurer.close()
    done = database.trials(kernel.workload)
    enumerated = enumerated_space(kernel.workload["main"], target) is not None
    while done < wanted and time.monotonic() < deadline:
        # Between rounds: a farm whose devices are all gone ends the job (a rerun resumes), rather than
        # recording every remaining trial as failed.
        measurer.ready()
        progress = _Progress(done, wanted, measurer.serving)
        if enumerated:
            if not _measure_next_knobs(kernel, min(TRIALS_PER_COMMIT, wanted - done), database, target,
                                       measurer, progress):
                break  # every knob tuple is on disk
        else:
            # meta_schedule logs every trial to the console (stdout) unless its logger is told otherwise (`-v`
            # keeps it); each tune_tir leaves the logger at DEBUG, so it is told again before each round.
            logging.getLogger("tvm.s_tir.meta_schedule").setLevel(
                logging.DEBUG if log.isEnabledFor(logging.INFO) else logging.WARNING)
            _import_tensor_intrinsics()
            ms.tune_tir(
                kernel.workload, target.target, work_dir=str(database.path / "logs"),
                max_trials_global=min(TRIALS_PER_ROUND, wanted - done), num_trials_per_iter=TRIALS_PER_COMMIT,
                builder=measurer.builder, runner=measurer.runner, database=database.records, cost_model="random",
                task_scheduler="round-robin", measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                                                                 progress],
                space=tuning_space(target), strategy="replay-trace", num_tuning_cores=max(target.num_cores, 1),
            )
        done = database.trials(kernel.workload)
    return done


def _import_tensor_intrinsics() -> None:
    """Import TVM's tensor intrinsics, which meta_schedule's `TuneContext` imports on first use, in ~1 s, not ~30:
    the module defines ~250 TVMScript functions, each decorator reads the stack, and the import machinery's
    frames are files no module was loaded from (see `ember.ir.tvmscript`)."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with stacks_from_linecache():
        import tvm.s_tir.tensor_intrin  # noqa: F401


def _measure_next_knobs(kernel: HotKernel, count: int, database: TuningDatabase, target: TargetSpec,
                        measurer: Measurer, progress: _Progress) -> bool:
    """Build, time and record the next `count` knob tuples of an int8 matmul not on disk; False if none is left.

    A decode kernel's tuple is timed at each of its `timed_rows` (one sequence and a full batch), and its
    record's time is their sum."""
    func = kernel.workload["main"]
    entry = database.records.commit_workload(kernel.workload)
    tried = [record_knobs(record) for record in database.records.get_all_tuning_records()
             if record.workload.same_as(entry)]
    todo = [knobs for knobs in enumerated_space(func, target) if knobs not in tried][:count]
    if not todo:
        return False
    rows = timed_rows(func) or (1,)
    candidates = [workload(schedule_with(func, knobs, target), batch) for knobs in todo for batch in rows]
    builds = measurer.builder.build([ms.builder.BuilderInput(candidate, target.target) for candidate in candidates])
    built = [(build, candidate) for build, candidate in zip(builds, candidates) if not build.error_msg]
    futures = iter(measurer.runner.run([ms.runner.RunnerInput(build.artifact_path, target.name,
                                                              ms.arg_info.ArgInfo.from_prim_func(candidate["main"]))
                                        for build, candidate in built]))
    runs = [ms.runner.RunnerResult(None, build.error_msg) if build.error_msg else next(futures).result()
            for build in builds]
    times = [_mean_seconds(run) for run in runs]
    summed = []
    for index, knobs in enumerate(todo):
        parts = times[index * len(rows): (index + 1) * len(rows)]
        seconds = None if None in parts else sum(parts)
        database.records.commit_tuning_record(knobs_record(kernel.workload, database, target, seconds, knobs))
        summed.append(seconds)
    for build in builds:
        if not build.error_msg:
            ms.utils.remove_build_dir(build.artifact_path)
    progress.count(summed)
    return True


def _mean_seconds(run: ms.runner.RunnerResult) -> float | None:
    """A run's mean time, or None if it failed."""
    return None if run.error_msg or not run.run_secs else sum(map(float, run.run_secs)) / len(run.run_secs)


BUILD_SECONDS = 120.0
RUN_SECONDS = 60.0
_EVALUATOR = ms.runner.EvaluatorConfig(number=5, repeat=3, min_repeat_ms=20, enable_cpu_cache_flush=False)


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """Prints the trial count and the best time after each batch of measurements."""

    def __init__(self, done: int, wanted: int, serving: Callable[[], str] = lambda: "") -> None:
        self.done, self.wanted, self.best, self.serving = done, wanted, math.inf, serving

    def apply(self, _scheduler, _task_id, _candidates, _builds, runs) -> None:
        self.count([_mean_seconds(run) for run in runs])

    def count(self, times: list[float | None]) -> None:
        """Count a batch of trials (their times, None for a failed one) and print the trials so far."""
        self.done += len(times)
        self.best = min([self.best, *(seconds for seconds in times if seconds is not None)])
        best = f", best {_ms(self.best)}" if self.best < math.inf else ""
        _progress(f"    {self.done}/{self.wanted} trials{best}{self.serving()}")


def _evaluate(kernel: HotKernel, trials: int, database: TuningDatabase, target: TargetSpec,
              measurer: Measurer) -> TunedKernel:
    """The best record against the rule, both run where the trials ran (here, or one device) on the same inputs."""
    best = database.best(kernel.workload, target.target)
    if best is None:
        return TunedKernel(kernel, trials, None, None)
    knobs = record_knobs(best)
    with measurer.kernels() as load:
        comparison = compare(kernel.workload["main"], knobs, target, timed=True, load=load)
    database.record_check(kernel.workload, knobs, comparison is not None and comparison.agrees,
                          math.inf if comparison is None else comparison.max_error)
    if comparison is None or not comparison.agrees:
        _progress(f"    best record {knobs} is unusable (compile will use the rule)")
        return TunedKernel(kernel, trials, knobs, comparison)
    _progress(f"    knobs {knobs}: rule {_ms(comparison.rule_seconds)}, tuned {_ms(comparison.tuned_seconds)} "
              f"({comparison.rule_seconds / comparison.tuned_seconds:.2f}x), max error {comparison.max_error:.2g}")
    if comparison.rule_seconds <= comparison.tuned_seconds:
        # The search never beat the rule: record the rule's knobs, ranked by the side-by-side ratio, so the
        # database's best (what compile applies) is never slower than the rule.
        best_seconds = sum(map(float, best.run_secs)) / len(best.run_secs)
        ratio = comparison.rule_seconds / comparison.tuned_seconds
        database.records.commit_tuning_record(knobs_record(kernel.workload, database, target, best_seconds * ratio))
        _progress("    the rule stays best; recorded its knobs")
    return TunedKernel(kernel, trials, knobs, comparison)


def _resolve_model(model: Path, options: TuneOptions) -> tuple[Path, TuneOptions]:
    """An artifact stands for its source (a checkpoint directory, a GGUF or ONNX file), compiled with the artifact's
    options and frontend."""
    if not (model / MANIFEST_NAME).exists():
        return model, options
    manifest = read_manifest(model)
    source = Path(manifest.source)
    if not (source.is_dir() or source.is_file()):
        raise TuningError(f"{model}: the artifact's source checkpoint {source} is gone; tune the checkpoint instead")
    return source, dataclasses.replace(
        options, quantization=manifest.quantization, prefill_chunk=manifest.kv_cache["prefill_chunk"],
        max_batch=manifest.kv_cache["max_batch"], keep_embedding=manifest.kept_float["embedding"],
        keep_lm_head=manifest.kept_float["lm_head"],
        float_activations=manifest.activations == "float",
        tensor_formats=records.recorded_formats(manifest.source_weights, manifest.model_dtype),
        frontend=records.recorded_frontend(manifest.source_weights),
        tokenizer_dir=records.recorded_config_dir(manifest.source_weights))


def _called_kernels(func: relax.Function) -> list[str]:
    """The PrimFunc name of every call_tir in `func`, once per call site."""
    names = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name.startswith(
                "relax.call_tir") and isinstance(expr.args[0], tvm.ir.GlobalVar):
            names.append(expr.args[0].name_hint)

    relax.analysis.post_order_visit(func, visit)
    return names


def _cost(tuned_as: tvm.IRModule) -> float:
    """max(FLOPs, FLOPS_PER_BYTE x bytes touched) of a static kernel."""
    func = tuned_as["main"]
    data = sum(math.prod(int(d) for d in param.shape) * tvm.runtime.DataType(param.dtype).bits // 8
               for param in func.params)
    built = matmul_built_as(func)
    # TVM's estimate cannot read the int8 and AMX matmuls' vector and tile code; their multiply-adds are those of the
    # matmul they compute.
    flops = (2 * math.prod(int(d) for d in func.params[0].shape[:-1]) * built["n"] * built["k"] if built
             else s_tir.analysis.estimate_tir_flops(tuned_as))
    return max(flops, FLOPS_PER_BYTE * data)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
