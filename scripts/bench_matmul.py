"""Matmul kernels: GFLOP/s of two versions of a kernel file, side by side.

`--kernel float` (`schedules/matmul.py`): the NT matmuls of a Llama projection as
legalization writes them (prefill: A[1, seq_len, k] with seq_len bounded by the prefill
chunk; decode: A[batch_size, 1, k]), scheduled by each version's rule.
`--kernel int8` (`schedules/int8_matmul.py`): the int8 dot-product matmuls of the ~110M
Llama's projections in q4f32 and q8f32 (decode at batch 1, 2, 4 and 8, and prefill), as
each version builds them for `--target`; besides the speedup, each decode row shows the
new kernel's time over its batch-1 time.

Each kernel is built with the file in this checkout and with another version of it
(`--baseline path/to/the_file.py`, e.g. a copy from an older commit), and both are timed
round-robin in one process (`time_evaluator`, hot caches), median of `--repeats` rounds.

    python scripts/bench_matmul.py --baseline /tmp/matmul_old.py
    git show HEAD~1:schedules/int8_matmul.py > /tmp/int8_old.py
    python scripts/bench_matmul.py --kernel int8 --baseline /tmp/int8_old.py --threads 2 \\
        --target '{"kind": "llvm", "mcpu": "znver3", "num-cores": 2}'
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from pathlib import Path

from ember.core.without_torch import hide_torch_from_tvm

hide_torch_from_tvm()  # before TVM is imported: the kernels are built and timed without the torch it would load

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import te, tirx  # noqa: E402

from ember.ir.quant_formats import FORMATS, INTERLEAVED  # noqa: E402
from ember.schedules import int8_matmul  # noqa: E402
from ember.schedules.matmul import NTMatmul  # noqa: E402
from ember.targets.registry import TargetSpec, resolve_target  # noqa: E402

# Projections of a 128-token prompt (110M and 1B Llama shapes), and its one row of logits
# (a kernel whose bound is the prefill chunk, run with m = 1).
PREFILL = [(128, 768, 768), (128, 2048, 768), (128, 768, 2048), (128, 2048, 2048), (128, 5632, 2048), (1, 32000, 768)]
DECODE = [(m, n, 768) for n in (768, 32000) for m in (1, 2, 4, 8)]
# The ~110M Llama's projections (n, k): fused q/k/v, o, fused gate/up, down, lm_head.
INT8_SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048), (32000, 768)]
INT8_BATCHES = (1, 2, 4, 8)
INT8_PREFILL = 128


def nt_matmul(m: int, n: int, k: int, prefill: bool) -> tirx.PrimFunc:
    """C = A @ W^T with the symbolic size a compiled model has: seq_len (prefill) or batch_size (decode)."""
    size = tirx.Var("seq_len" if prefill else "batch_size", "int64")
    one, n, k = (tirx.IntImm("int64", value) for value in (1, n, k))  # legalization's index type
    shape = (one, size, k) if prefill else (size, one, k)
    a = te.placeholder(shape, name="A")
    w = te.placeholder((n, k), name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((*shape[:2], n), lambda b, i, j: te.sum(a[b, i, r] * w[j, r], axis=r), name="NT_matmul")
    bound = 2048 if prefill else 8
    return te.create_prim_func([a, w, c]).with_attr("tir_var_upper_bound", {size.name: bound})


def load_file(path: Path, name: str):
    """Another copy of a module of ember (its imports resolve to this checkout)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(rule: type, func: tirx.PrimFunc, target) -> tvm.runtime.Module:
    sch = rule(target.vector_bits).apply(func, target.target, False)
    assert sch is not None, "the rule did not match"
    return tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target.target)


def float_cases(baseline: Path, only: str | None, target: TargetSpec, rng: np.random.Generator):
    """(label, phase, FLOPs, {version: (library, arguments with the output last)}) of each float matmul."""
    rules = {"baseline": load_file(baseline, "baseline_matmul").NTMatmul, "new": NTMatmul}
    cases = [(*shape, True) for shape in PREFILL if only != "decode"]
    cases += [(*shape, False) for shape in DECODE if only != "prefill"]
    for m, n, k, prefill in cases:
        func = nt_matmul(m, n, k, prefill)
        shape = (1, m, k) if prefill else (m, 1, k)
        a = rng.standard_normal(shape, dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        expected = a @ w.T
        runs = {}
        for name, rule in rules.items():
            lib = build(rule, func, target)
            out = np.zeros((*shape[:2], n), np.float32)
            args = [tvm.runtime.tensor(a), tvm.runtime.tensor(w), tvm.runtime.tensor(out)]
            lib["main"](*args)
            np.testing.assert_allclose(args[-1].numpy(), expected, rtol=1e-3, atol=1e-3 * np.sqrt(k))
            runs[name] = (lib, args)
        yield f"{m}x{n}x{k}", "prefill" if prefill else "decode", 2 * m * n * k, runs


def int8_cases(baseline: Path, only: str | None, target: TargetSpec, rng: np.random.Generator):
    """As `float_cases`, for the int8 dot-product matmuls of the ~110M Llama in q4f32 and q8f32."""
    assert target.int8_dot is not None, f"{target.target} has no int8 dot product"
    versions = {"baseline": load_file(baseline, "baseline_int8_matmul"), "new": int8_matmul}
    phases = [phase for phase in (False, True) if only != ("decode" if phase else "prefill")]
    for name in ("q4f32", "q8f32"):
        fmt = FORMATS[name]
        for n, k in INT8_SHAPES:
            quantized = fmt.quantize(rng.standard_normal((n, k), dtype=np.float32), INTERLEAVED)
            parts = [tvm.runtime.tensor(quantized[part]) for part in fmt.parts]
            for prefill in phases:
                libs = {version: tvm.compile(tvm.IRModule({"main": module.int8_dot_matmul(
                    fmt, n, k, target.int8_dot, prefill, target.vector_bits)}), target=target.target)
                    for version, module in versions.items()}
                for m in (INT8_PREFILL,) if prefill else INT8_BATCHES:
                    shape = (1, m, k) if prefill else (m, 1, k)
                    x = tvm.runtime.tensor(rng.standard_normal(shape, dtype=np.float32))
                    runs = {version: (lib, [x, *parts, tvm.runtime.tensor(np.zeros((*shape[:2], n), np.float32))])
                            for version, lib in libs.items()}
                    for lib, args in runs.values():
                        lib["main"](*args)
                    base, new = (args[-1].numpy() for _lib, args in runs.values())
                    np.testing.assert_allclose(new, base, rtol=0, atol=1e-5 * np.abs(base).max())
                    yield f"{m}x{n}x{k}", f"{name} {'prefill' if prefill else 'decode'}", 2 * m * n * k, runs


def median_times(runs: dict[str, tuple[tvm.runtime.Module, list]], repeats: int) -> dict[str, float]:
    """Seconds per call of each version, timed round-robin, median of `repeats` rounds."""
    timers = {name: lib.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=1, min_repeat_ms=100)
              for name, (lib, _args) in runs.items()}
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer(*runs[name][1]).mean)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other version of the kernel's file")
    parser.add_argument("--kernel", choices=["float", "int8"], default="float")
    parser.add_argument("--target", default="cpu", help="an ember --target (default: this CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["prefill", "decode"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    # Unset, TVM's pool takes half the cores (see ember.runtime.device.use_cpu_threads).
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    target = resolve_target(args.target)
    make_cases = int8_cases if args.kernel == "int8" else float_cases
    cases = make_cases(args.baseline, args.only, target, np.random.default_rng(0))
    print(f"{'m x n x k':<18} {'kind':<14} {'base ms':>8} {'new ms':>8} {'base GF/s':>9} {'new GF/s':>9} "
          f"{'speedup':>8} {'new/m=1':>8}")
    batch_one = {}
    for label, kind, flops, runs in cases:
        base, new = median_times(runs, args.repeats).values()
        _m, shape = label.split("x", 1)
        batch_one.setdefault((kind, shape), new)  # each shape's decode rows come m = 1 first
        over_one = f"{new / batch_one[kind, shape]:>7.2f}x" if kind.endswith("decode") else ""
        print(f"{label:<18} {kind:<14} {base * 1e3:>8.3f} {new * 1e3:>8.3f} {flops / base / 1e9:>9.1f} "
              f"{flops / new / 1e9:>9.1f} {base / new:>7.2f}x {over_one:>8}", flush=True)


if __name__ == "__main__":
    main()
