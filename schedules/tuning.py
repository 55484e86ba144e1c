"""Tuned matmul schedules: meta_schedule searches the knobs of ember's matmul rule, and
`ember tune` measures every knob tuple of the int8 dot-product matmul.

What is tuned. meta_schedule's generic CPU search space ties the rules at best on a
2-core machine (TVM_NOTES: 64 trials reached the hand schedule's GEMV time) and
needs static shapes, while every ember kernel has a symbolic size (`seq_len` in
prefill, `batch_size` in decode). So the search space here is `NTMatmul` itself with
its sizes sampled (`MATMUL_KNOBS`: weight rows per tile, k-split width, activation
rows per tile): a `ScheduleFn` space whose trace is the rule's schedule with
`SampleCategorical` decisions, searched with meta_schedule's replay-trace strategy,
built by `ember tune`'s candidate builder, timed by meta_schedule's runner, and recorded in its JSONDatabase.

The int8 dot-product matmul (`int8_matmul.py`) is not a schedule of a generic kernel
but a PrimFunc written from its knobs (register tile, row blocks, word loop unrolled),
so meta_schedule's traces cannot vary it. Its space is the short list of knob tuples
the kernel takes (`enumerated_space`: at most 16), which `ember tune` builds and
times one by one with the same builder and runner. A record has the same form as a
float matmul's: a trace of one `SampleCategorical` per knob (here nothing else), whose
decisions are the knobs, for the workload of the rule-built kernel; compile rebuilds
the kernel with them (`schedule_with`). Its workload keeps `int8_matmul.BUILD_ATTR`,
which says what the kernel computes and which symbolic sizes are decode's. The AMX matmuls
(`TILE_KERNELS`: `amx_bf16_matmul.py` and `amx_matmul.py`, prefill on a target with AMX) are tuned the
same way: their knobs (tile blocking, and the row count from which calls run on tiles; each module's
`knob_space`, at most 18) are kept in their `BUILD_ATTR`, so the workload is that of the rule-built kernel.

Shapes. A kernel is tuned as its *workload*: the PrimFunc with `batch_size = 1`
(decode's common case) and `seq_len`/`num_logits = min(TUNE_SEQ_LEN, bound)`
substituted, and its attributes reduced to what meta_schedule expects. At compile
time a symbolic kernel looks up the workload it would be tuned as; a record's
decisions (plain integers) are then replayed through the same rule on the symbolic
kernel, which the rule handles at any size. Replaying decisions rather than the
trace is what makes a static-shape record apply to a symbolic kernel.

An int8 decode kernel serves one stream and a full batch with the same knobs, and
the fastest knobs for one row can lose at a batch: timed at one sequence only, `ember
tune` took a one-block tile for the ~110M q4f32 down projection (barely faster at one
row), which gives up AVX512-VNNI's 8 x 2-block tile, and the tuned model's 8-sequence
step was slower than the rule's (docs/benchmarks.md#schedule-measurements). So each
trial of such a kernel is timed at one row and at the most rows a call of it takes
(`timed_rows`: the artifact's `--max-batch`, or a verify step's tokens), and its time
is the sum. Those rows are
part of its workload (`TIMED_ROWS_ATTR`, absent at one row, the key every decode kernel
had before): a record measured for one batch bound does not apply to another's kernels.
An AMX kernel's row threshold is chosen the same way: each trial is timed at its prefill tokens and at
rows between the thresholds tried (its module's `THRESHOLD_ROWS`), which one side or the other of each
threshold runs, the times summed.

Acceptance. Before a record replaces the rule, the tuned and rule-based kernels run
on the same random inputs at a size that exercises the symbolic tails (37 tokens,
5 sequences) and must agree within rtol 1e-4; a mismatch is a warning and the rule
stays. So does a record whose knobs are the rule's own (`ember tune` records them
when the search does not beat the rule). An AMX kernel's record goes by the check `ember tune` made
(`checks.json`), as a farm device's records do: a compile's process has no permission to run tiles.
Tuned kernels carry
`ember.schedule_source = "tuning"` so the compile report can count them.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms

from ember.ir.module_utils import replace_functions, schedulable_kernels, upper_bounds
from ember.schedules import amx_bf16_matmul, amx_matmul, int8_matmul
from ember.schedules.matmul import MATMUL_KNOBS, Knob, KnobChooser, NTMatmul
from ember.schedules.tuning_db import TuningDatabase, describe
from ember.targets.registry import TargetSpec

log = logging.getLogger("ember")

SCHEDULE_SOURCE_ATTR = "ember.schedule_source"
TIMED_ROWS_ATTR = "ember.tuning.timed_rows"  # an int8 decode kernel's workload: the rows its trials are timed at
TUNE_SEQ_LEN = 128  # prefill kernels are tuned at this many tokens (or their bound, if smaller)
# Sizes the numerical check runs symbolic kernels at: not multiples of any tile (and for the
# int8 matmul's decode, a whole tile of sequences and a tail).
_CHECK_SIZES = {"seq_len": 37, "num_logits": 37, "batch_size": 5}
_TUNE_SIZES = {"seq_len": TUNE_SEQ_LEN, "num_logits": TUNE_SEQ_LEN, "batch_size": 1}
RTOL = 1e-4
# Prefill's AMX kernels. Each module has `built_as`, `kernel_knob_space`, `rebuild` and `THRESHOLD_ROWS`.
TILE_KERNELS = (amx_bf16_matmul, amx_matmul)


def tile_kernel(func: tirx.PrimFunc) -> ModuleType | None:
    """The module of `TILE_KERNELS` that built `func`, else None."""
    return next((module for module in TILE_KERNELS if module.built_as(func) is not None), None)


def workload(func: tirx.PrimFunc, rows: int | None = None) -> tvm.IRModule | None:
    """The static-shaped module `func` is tuned as (its records' key), or None if it has sizes ember does
    not tune; `rows` (one of its `timed_rows`) sets the activation rows it is timed at: an int8 decode kernel's
    batch, an AMX kernel's prefill tokens."""
    sizes = _sizes(func, _TUNE_SIZES if rows is None else _timing_sizes(func, rows))
    if sizes is None:
        return None
    static = func.specialize(_static_buffers(func, sizes)) if sizes else func
    bare = tirx.PrimFunc(static.params, static.body, static.ret_type)
    attrs = {"global_symbol": "main", "tirx.noalias": True}
    for built in (int8_matmul.BUILD_ATTR, *(module.BUILD_ATTR for module in TILE_KERNELS)):
        if built in (func.attrs or {}):
            attrs[built] = func.attrs[built]
    if len(timed := timed_rows(func)) > 1:  # (one row only: the key ember had before it timed batches)
        attrs[TIMED_ROWS_ATTR] = list(timed)
    return tvm.IRModule({"main": bare.with_attrs(attrs)})


def timed_rows(func: tirx.PrimFunc) -> tuple[int, ...]:
    """The activation rows an int8 decode kernel's trials are timed at (their times summed): one, and the most
    a call of it takes when that is more (its batch bound, or a verify step's tokens); an AMX kernel's: its
    prefill tokens and its module's `THRESHOLD_ROWS` (within its bound); () for other kernels, timed at their
    workload's shape."""
    attrs = func.attrs or {}
    if TIMED_ROWS_ATTR in attrs:  # a workload, or a kernel rebuilt from one
        return tuple(int(rows) for rows in attrs[TIMED_ROWS_ATTR])
    bounds = upper_bounds(func)
    tiles = tile_kernel(func)
    if tiles is not None and tiles.kernel_knob_space(func) is not None:
        bound = bounds.get("seq", TUNE_SEQ_LEN)
        return tuple(sorted({min(rows, bound) for rows in (*tiles.THRESHOLD_ROWS, TUNE_SEQ_LEN)}))
    built = int8_matmul.built_as(func)
    if built is None or built["many_tokens"]:
        return ()
    most = bounds.get("batch", 1) * bounds.get("seq", 1)  # decode: [batch, 1]; verify: [1, tokens]
    return (1, most) if most > 1 else (1,)


def matmul_built_as(func: tirx.PrimFunc) -> dict | None:
    """What an int8 or AMX matmul kernel computes ({"format", "n", "k", "many_tokens"}: AMX's serve prefill), else
    None."""
    built = int8_matmul.built_as(func)
    if built is None and (tiles := tile_kernel(func)) is not None:
        amx = tiles.built_as(func)
        built = {"format": amx["format"], "n": amx["n"], "k": amx["k"], "many_tokens": True}
    return built


def is_tunable(func: tirx.PrimFunc, target: TargetSpec) -> bool:
    """Whether `func` has knobs to tune: the matmul rule schedules it, or it is an int8 or AMX matmul."""
    return enumerated_space(func, target) is not None or NTMatmul(target.vector_bits).apply(
        func, target.target, False) is not None


def enumerated_space(func: tirx.PrimFunc, target: TargetSpec) -> list[list[int]] | None:
    """Every knob tuple of an int8 or AMX matmul kernel, the rule's first (None for kernels meta_schedule
    searches)."""
    if target.int8_dot is None:
        return None
    space = int8_matmul.kernel_knob_space(func, target.int8_dot, target.vector_bits)
    if space is None and (tiles := tile_kernel(func)) is not None:
        return tiles.kernel_knob_space(func)
    return space


def tuning_space(target: TargetSpec) -> ms.space_generator.ScheduleFn:
    """meta_schedule's search space: the matmul rule with every knob sampled uniformly."""

    def sample(sch: s_tir.Schedule) -> s_tir.Schedule:
        def choose(_name: str, candidates: Sequence[int], _default: int) -> Knob:
            return sch.sample_categorical(list(candidates), [1.0 / len(candidates)] * len(candidates))

        if NTMatmul(target.vector_bits, choose=choose).apply_to(sch) is None:
            raise ValueError("the matmul rule does not match this workload")
        return sch

    # No generic rules, postprocessors or mutators: the space is exactly the rule's knobs.
    return ms.space_generator.ScheduleFn(sample, sch_rules=[], postprocs=[], mutator_probs={})


def space_size(func: tirx.PrimFunc, target: TargetSpec) -> int:
    """How many knob combinations the search space of `func` has."""
    space = enumerated_space(func, target)
    if space is not None:
        return len(space)
    return math.prod(len(candidates) for candidates, _default in _knob_choices(func, target))


def rule_knobs(func: tirx.PrimFunc, target: TargetSpec) -> list[int]:
    """The knobs the rule picks for `func` by itself."""
    return [default for _candidates, default in _knob_choices(func, target)]


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, linker: str | None) -> str:
    """Runs in the tuning builder's worker: builds a candidate and writes it as a shared library linked by `linker`
    (None: the host's compiler); its path.

    meta_schedule's default build function first imports its tensor intrinsics (hundreds of TVMScript functions,
    seconds to parse), which ember's kernels do not use. Its default export writes a tar of object files, which
    the machine running them must link: a device of a farm may have no compiler, so a candidate goes as a library
    linked here."""
    from tvm.driver import build as tvm_build  # what meta_schedule's default build calls, minus the import

    path = os.path.join(tempfile.mkdtemp(prefix="ember-kernel-"), "kernel.so")
    tvm_build(mod, target=target).export_library(path, **({"cc": linker} if linker else {}))
    return path


# Loads a built kernel library where it is to run: its module and the device it runs on.
KernelLoader = Callable[[tvm.runtime.Executable], tuple[tvm.runtime.Module, tvm.runtime.Device]]


def load_here(library: tvm.runtime.Executable) -> tuple[tvm.runtime.Module, tvm.runtime.Device]:
    """A kernel library run in this process, on this machine's CPU."""
    return library.mod, tvm.cpu()


def knobs_record(tuned_as: tvm.IRModule, database: TuningDatabase, target: TargetSpec,
                 run_secs: float | None, knobs: list[int] | None = None) -> ms.database.TuningRecord:
    """A record of `knobs` (default: the rule's own), as if the search had sampled them, timed at
    `run_secs` (None: a failed trial)."""
    sch = s_tir.Schedule(tuned_as)
    values = iter(knobs or [])

    def choose(_name: str, candidates: Sequence[int], default: int) -> Knob:
        candidates = list(candidates)
        return sch.sample_categorical(candidates, [1.0 / len(candidates)] * len(candidates),
                                      decision=candidates.index(next(values) if knobs else default))

    if enumerated_space(tuned_as["main"], target) is None:
        NTMatmul(target.vector_bits, choose=choose).apply_to(sch)
    else:  # the knobs alone: the kernel is rebuilt from them
        for candidates, default in _knob_choices(tuned_as["main"], target):  # `INT8_KNOBS`, `AMX_KNOBS`, ...
            choose("", candidates, default)
    return ms.database.TuningRecord(sch.trace, database.records.commit_workload(tuned_as),
                                    None if run_secs is None else [run_secs], target.target,
                                    ms.arg_info.ArgInfo.from_prim_func(tuned_as["main"]))


def record_knobs(record: ms.database.TuningRecord) -> list[int]:
    """The knob values a record chose, in the order of `MATMUL_KNOBS` (`INT8_KNOBS` for an int8 matmul,
    an AMX one's module's)."""
    trace = record.trace
    return [int(inst.attrs[0][int(trace.decisions[inst])]) for inst in trace.insts
            if inst.kind.name == "SampleCategorical"]


def schedule_with(func: tirx.PrimFunc, knobs: list[int] | None, target: TargetSpec) -> tirx.PrimFunc | None:
    """`func` scheduled by the matmul rule, or an int8 or AMX matmul rebuilt, with `knobs` (None: the rule's
    defaults)."""
    space = enumerated_space(func, target)
    if space is not None:
        knobs = space[0] if knobs is None else list(knobs)
        if knobs not in space:
            return None
        tiles = tile_kernel(func)
        rebuild = int8_matmul.rebuild if tiles is None else tiles.rebuild
        return rebuild(func, target.int8_dot, target.vector_bits, knobs)
    rule = NTMatmul(target.vector_bits) if knobs is None else NTMatmul(target.vector_bits, choose=_replay(knobs))
    try:
        sch = rule.apply(func, target.target, False)
    except ValueError:  # a knob value this kernel cannot take
        return None
    return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)


@dataclass(frozen=True)
class Comparison:
    """Tuned against rule-based on the same inputs: worst error and, if timed, seconds per call (an int8
    decode kernel's: a call at each of its `timed_rows`, summed, as its trials were timed)."""

    max_error: float
    scale: float
    rule_seconds: float | None = None
    tuned_seconds: float | None = None

    @property
    def agrees(self) -> bool:
        return self.max_error <= RTOL * self.scale


def compare(func: tirx.PrimFunc, knobs: list[int], target: TargetSpec, timed: bool = False,
            load: KernelLoader = load_here) -> Comparison | None:
    """Run `func` scheduled by the rule and with `knobs` on the same random inputs (None: knobs unusable),
    where `load` puts them: here by default, on a device of the farm for `ember tune --rpc-tracker`."""
    sizes = _sizes(func, _CHECK_SIZES)
    tuned = schedule_with(func, knobs, target)
    rule = schedule_with(func, None, target)
    if sizes is None or tuned is None or rule is None:
        return None
    inputs = _random_arguments(func, sizes)
    # Timed on the check's inputs, or an int8 decode or AMX kernel at each of its `timed_rows` (the times summed).
    timing = [_random_arguments(rule, _sizes(rule, _timing_sizes(rule, rows)))
              for rows in timed_rows(func)] if timed else []
    runs, results = [], []
    for scheduled in (rule, tuned):
        module, device = load(tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}),
                                          target.target))
        arguments = [tvm.runtime.tensor(array, device) for array in inputs]
        module["main"](*arguments)
        results.append([argument.numpy() for argument in arguments])
        timed_arguments = [[tvm.runtime.tensor(array, device) for array in arrays] for arrays in timing] or [arguments]
        runs.append((module.time_evaluator("main", device, number=10, repeat=1, min_repeat_ms=50), timed_arguments))
    best = [[math.inf] * len(timed_arguments) for _timer, timed_arguments in runs]
    # Alternated, best of three each: a machine whose memory bandwidth drifts (shared hosts)
    # then slows both schedules alike, which back-to-back runs of one then the other do not.
    for _round in range(3 if timed else 0):
        for index, (timer, timed_arguments) in enumerate(runs):
            best[index] = [min(seconds, timer(*arguments).results[0])
                           for seconds, arguments in zip(best[index], timed_arguments)]
    scale = max(1.0, max(float(np.abs(a).max(initial=0)) for a in results[0] if a.dtype.kind == "f"))
    error = max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0))
                for a, b in zip(*results))
    return Comparison(error, scale, *([sum(seconds) for seconds in best] if timed else [None, None]))


def apply_tuning_database(database: TuningDatabase, target: TargetSpec) -> tvm.transform.Pass:
    """A pass scheduling every kernel with a matching, numerically checked record; the rules do the rest."""

    @tvm.transform.module_pass(opt_level=0, name="ApplyTuningDatabase")
    def _apply(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # A device's database (another architecture, tuned over RPC): its kernels cannot run here, so its
        # records apply to compiles for its target only, and only where the device checked them.
        device = not database.measured_here
        if device and database.fingerprint.get("machine") != target.arch:
            log.warning("tuning database %s was made on %s, not a %s CPU; ignoring it", database.path,
                        describe(database.fingerprint), target.arch)
            return mod
        updates, untuned_rows = {}, set()
        for gv, func in _tunable_kernels(mod):
            tuned_as = workload(func)
            record = database.best(tuned_as, target.target) if tuned_as is not None else None
            if record is None or (device and record.target.export() != target.target.export()):
                if "batch" in upper_bounds(func) and tile_kernel(func) is None:
                    untuned_rows.add(timed_rows(func))  # a decode kernel (not a verify step's copy): the notice below
                continue
            knobs = record_knobs(record)
            if knobs == rule_knobs(func, target):
                # The rule won the search: it schedules this kernel itself.
                updates[gv.name_hint] = func.with_attr(SCHEDULE_SOURCE_ATTR, "rule-won-tuning")
                continue
            if device or tile_kernel(func) is not None:
                # An AMX kernel's tiles need Linux's permission, which a compile's process has not asked for: its
                # record goes by the check `ember tune` made, as a device's do.
                checked = database.checked(tuned_as, knobs)
                if not checked:
                    why = "was never checked against the rule" if checked is None else "differed from the rule"
                    log.warning("tuning record for %s (%s) %s %s; using the rule", gv.name_hint, knobs, why,
                                "on the device" if device else "when tuned")
                    continue
            elif (check := compare(func, knobs, target)) is None or not check.agrees:
                why = "does not fit" if check is None else f"differs from the rule by {check.max_error:.3g}"
                log.warning("tuning record for %s (%s) %s; using the rule", gv.name_hint, knobs, why)
                continue
            scheduled = schedule_with(func, knobs, target)
            if scheduled is None:  # checked on the device, but not here: a record from another ember version
                log.warning("tuning record for %s (%s) does not fit; using the rule", gv.name_hint, knobs)
                continue
            updates[gv.name_hint] = scheduled.with_attr(SCHEDULE_SOURCE_ATTR, "tuning")
        _explain_other_decode_rows(database, untuned_rows)
        return replace_functions(mod, updates)

    return _apply


def _explain_other_decode_rows(database: TuningDatabase, untuned: set[tuple[int, ...]]) -> None:
    """A notice when int8 decode kernels timed at `untuned` rows found no record while the database has decode
    records timed at others: tuned for another --max-batch (or, by an earlier ember, at one sequence only)."""
    if not untuned:
        return
    recorded = {timed_rows(main) for record in database.records.get_all_tuning_records()
                if (built := int8_matmul.built_as(main := record.workload.mod["main"])) and not built["many_tokens"]}
    if not recorded or recorded & untuned:
        return
    wanted = max(max(rows) for rows in untuned)
    log.warning("tuning database %s has decode kernels tuned for --max-batch %s, not this compile's %d: they keep "
                "the rules' schedules (`ember tune --max-batch %d` tunes them)", database.path,
                " and ".join(sorted({str(max(rows)) for rows in recorded}, key=int)), wanted, wanted)


@dataclass(frozen=True)
class ScheduleSources:
    """Where the kernels of a lowered module got their schedules."""

    tuned: int  # a tuning record's schedule
    rule_won: int  # the rule's, which the tuning database measured as the fastest
    untuned: int  # the rule's, with no tuning record


def describe_schedule_sources(sources: ScheduleSources) -> str:
    """One line for people: `3 kernels from the tuning database, 1 where the rule's schedule won the tuning,
    24 from rules`."""
    return (f"{sources.tuned} kernels from the tuning database, {sources.rule_won} where the rule's schedule "
            f"won the tuning, {sources.untuned} from rules")


def schedule_sources(mod: tvm.IRModule) -> ScheduleSources:
    """Count the kernels of a lowered module by where their schedule came from."""
    sources = Counter((func.attrs or {}).get(SCHEDULE_SOURCE_ATTR, "rule") for _gv, func in _tunable_kernels(mod))
    return ScheduleSources(sources["tuning"], sources["rule-won-tuning"], sources["rule"])


def _tunable_kernels(mod: tvm.IRModule) -> list[tuple[tvm.ir.GlobalVar, tirx.PrimFunc]]:
    """The kernels a tuning record may schedule: those the rules own, and the int8 and AMX matmuls."""
    int8 = [(gv, func) for gv, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc) and matmul_built_as(func) is not None]
    return [*schedulable_kernels(mod), *int8]


def _knob_choices(func: tirx.PrimFunc, target: TargetSpec) -> list[tuple[Sequence[int], int]]:
    """(candidates, the rule's default) of each knob of `func`."""
    space = enumerated_space(func, target)
    if space is not None:
        return [(sorted({knobs[index] for knobs in space}), space[0][index]) for index in range(len(space[0]))]
    choices = []

    def record(_name: str, candidates: Sequence[int], default: int) -> Knob:
        choices.append((list(candidates), default))
        return default

    NTMatmul(target.vector_bits, choose=record).apply(func, target.target, False)
    return choices


def _replay(knobs: list[int]) -> KnobChooser:
    values: Iterator[int] = iter(knobs)

    def choose(name: str, candidates: Sequence[int], _default: int) -> Knob:
        value = next(values, None)
        if value not in candidates:
            raise ValueError(f"knob {name}={value} is not one of {list(candidates)}")
        return value

    assert len(knobs) == len(MATMUL_KNOBS), knobs
    return choose


def _timing_sizes(func: tirx.PrimFunc, rows: int) -> dict[str, int]:
    """The sizes `func` is timed at with `rows` activation rows: an AMX kernel's prefill tokens, else a batch."""
    return {**_TUNE_SIZES, ("seq_len" if tile_kernel(func) is not None else "batch_size"): rows}


def _sizes(func: tirx.PrimFunc, values: dict[str, int]) -> dict[tirx.Var, tirx.IntImm] | None:
    """Each symbolic size of `func`'s buffers bound to `values` (clipped to its bound); None if one is unknown."""
    built = matmul_built_as(func)
    if built is not None:  # its [batch, seq] is a decode step's [batch_size, 1] or a prefill chunk's
        values = {"batch": values["batch_size"], "seq": values["seq_len"] if built["many_tokens"] else 1}
    bounds = upper_bounds(func)
    sizes = {}
    for param in func.params:
        if getattr(param, "shape", None) is None:  # a scalar parameter: not a kernel ember tunes
            return None
        for dim in param.shape:
            if isinstance(dim, tirx.Var):
                if dim.name not in values:
                    return None
                value = min(values[dim.name], bounds.get(dim.name, values[dim.name]))
                sizes[dim] = tirx.IntImm(str(dim.ty.dtype), value)
            elif not isinstance(dim, tirx.IntImm):
                return None
    return sizes


def _static_buffers(func: tirx.PrimFunc, sizes: dict[tirx.Var, tirx.IntImm]) -> dict[tirx.Var, tirx.Buffer]:
    """Each buffer parameter with a symbolic size, mapped to a static buffer (what `specialize` takes)."""
    static = {}
    for param in func.params:
        if any(isinstance(dim, tirx.Var) for dim in param.shape):
            shape = [sizes[dim] if isinstance(dim, tirx.Var) else dim for dim in param.shape]
            static[param] = tirx.decl_buffer(shape, param.dtype, param.name)
    return static


def _random_arguments(func: tirx.PrimFunc, sizes: dict[tirx.Var, tirx.IntImm]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = []
    for param in func.params:
        shape = [int(sizes[dim]) if isinstance(dim, tirx.Var) else int(dim) for dim in param.shape]
        dtype = np.dtype(str(param.dtype))
        if dtype.kind == "f":
            arrays.append(rng.uniform(-1, 1, shape).astype(dtype))
        else:
            info = np.iinfo(dtype)
            arrays.append(rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True))
    return arrays
