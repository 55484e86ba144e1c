"""Float matmul kernels (`schedules/matmul.py`): GFLOP/s of two rule versions, side by side.

Builds the NT matmuls of a Llama projection as legalization writes them (prefill:
A[1, seq_len, k] with seq_len bounded by the prefill chunk; decode: A[batch_size, 1, k]),
schedules each with the rule in this checkout and with another version of the file
(`--baseline path/to/matmul.py`, e.g. a copy from an older commit), and times both
round-robin in one process (`time_evaluator`, hot caches), median of `--repeats` rounds.

    python scripts/bench_matmul.py --baseline /tmp/matmul_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from pathlib import Path

import numpy as np
import tvm
from tvm import te, tirx

from ember.schedules.matmul import NTMatmul
from ember.targets.registry import resolve_target

# Projections of a 128-token prompt (110M and 1B Llama shapes), and its one row of logits
# (a kernel whose bound is the prefill chunk, run with m = 1).
PREFILL = [(128, 768, 768), (128, 2048, 768), (128, 768, 2048), (128, 2048, 2048), (128, 5632, 2048), (1, 32000, 768)]
DECODE = [(m, n, 768) for n in (768, 32000) for m in (1, 2, 4, 8)]


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


def rule_class(path: Path) -> type:
    """`NTMatmul` from another copy of matmul.py."""
    spec = importlib.util.spec_from_file_location("baseline_matmul", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NTMatmul


def build(rule: type, func: tirx.PrimFunc, target) -> tvm.runtime.Module:
    sch = rule(target.vector_bits).apply(func, target.target, False)
    assert sch is not None, "the rule did not match"
    return tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target.target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["prefill", "decode"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    # Unset, TVM's pool takes half the cores (see ember.runtime.device.use_cpu_threads).
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    target = resolve_target("cpu")
    rules = {"baseline": rule_class(args.baseline), "new": NTMatmul}
    cases = [(*shape, True) for shape in PREFILL if args.only != "decode"]
    cases += [(*shape, False) for shape in DECODE if args.only != "prefill"]
    rng = np.random.default_rng(0)
    print(f"{'m x n x k':<18} {'kind':<8} {'base ms':>8} {'new ms':>8} {'base GF/s':>9} {'new GF/s':>9} {'speedup':>8}")
    for m, n, k, prefill in cases:
        func = nt_matmul(m, n, k, prefill)
        shape = (1, m, k) if prefill else (m, 1, k)
        a = rng.standard_normal(shape, dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        expected = a @ w.T
        args_ = [tvm.runtime.tensor(a), tvm.runtime.tensor(w)]
        timers = {}
        for name, rule in rules.items():
            lib = build(rule, func, target)
            c = tvm.runtime.tensor(np.zeros((*shape[:2], n), np.float32))
            lib["main"](*args_, c)
            np.testing.assert_allclose(c.numpy(), expected, rtol=1e-3, atol=1e-3 * np.sqrt(k))
            timer = lib.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=1, min_repeat_ms=100)
            timers[name] = (timer, c)
        times = {name: [] for name in rules}
        for _ in range(args.repeats):
            for name, (timer, c) in timers.items():
                times[name].append(timer(*args_, c).mean)
        base, new = (statistics.median(times[name]) for name in rules)
        flops = 2 * m * n * k
        print(f"{f'{m}x{n}x{k}':<18} {'prefill' if prefill else 'decode':<8} {base * 1e3:>8.3f} {new * 1e3:>8.3f} "
              f"{flops / base / 1e9:>9.1f} {flops / new / 1e9:>9.1f} {base / new:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
