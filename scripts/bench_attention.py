"""Prefill attention kernels: time and GFLOP/s of two versions of `schedules/prefill_attention.py`, side by side.

The kernels of the ~110M Llama shape (4 KV heads of 3 query heads, head dim 64, float32 pages
of 16 tokens), one layer's call each:

    paged  q256 over 1792   a prompt's 8th chunk of 256 tokens against the 1,792 tokens cached before it
    ragged causal 256       a chunk's tokens against each other
    ragged causal 72        a benchmark-sized prompt, read in one chunk
    paged  q8 over 100      a few tokens against a short cache (a verify step's shape)

Each is built with the file in this checkout and with another version of it (`--baseline`,
e.g. `git show HEAD~1:schedules/prefill_attention.py > /tmp/old.py`; a version from before the
builders took `lanes` is called without it), for `--target`, and timed round-robin in one
process (`time_evaluator`, hot caches), median of `--repeats` rounds. The two versions' outputs
must agree to 1e-4.

    python scripts/bench_attention.py --baseline /tmp/old.py --threads 2
    python scripts/bench_attention.py --baseline /tmp/old.py --threads 2 \\
        --target '{"kind": "llvm", "mcpu": "znver3", "num-cores": 2}'
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

from ember.core.without_torch import hide_torch_from_tvm

hide_torch_from_tvm()  # before TVM is imported: the kernels are built and timed without the torch it would load

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from ember.core.errors import EmberError  # noqa: E402
from ember.schedules import prefill_attention  # noqa: E402
from ember.targets.registry import TargetSpec, resolve_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
from bench_matmul import load_file, median_times  # noqa: E402

KV_HEADS, QO_HEADS, HEAD_DIM, PAGE = 4, 12, 64, 16
# (queries, cached keys before them): 0 cached is the ragged kernel (causal), else the paged one.
CASES = [(256, 1792), (256, 0), (72, 0), (8, 100)]


def kernel(module, queries: int, cached: int, target: TargetSpec) -> tvm.tirx.PrimFunc:
    """The version `module`'s kernel for a case: ragged without a cache, paged with one."""
    build = module.ragged_prefill_attention if cached == 0 else module.paged_prefill_attention
    sizes = (KV_HEADS, QO_HEADS, HEAD_DIM, "float32") + (() if cached == 0 else (PAGE,))
    lanes = (target.vector_bits // 32,) if "lanes" in inspect.signature(build).parameters else ()
    return build(*sizes, *lanes, "main")


def inputs(queries: int, cached: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The kernel's arguments before its outputs: q, then the new tokens' k and v or the cache's pages."""
    q = rng.standard_normal((queries, QO_HEADS, HEAD_DIM), dtype=np.float32)
    indptr = np.array([0, queries], np.int32)
    if cached == 0:
        k, v = rng.standard_normal((2, queries, KV_HEADS, HEAD_DIM), dtype=np.float32)
        return [q, indptr, k, v, indptr, np.zeros(queries, np.int32), np.zeros(1, np.int32)]
    pages_used = -(-cached // PAGE)
    pages = rng.standard_normal((pages_used + 2, 2, KV_HEADS, PAGE, HEAD_DIM), dtype=np.float32)
    table = rng.permutation(pages_used + 2)[:pages_used].astype(np.int32)  # scattered, as a cache's are
    last = np.array([cached - (pages_used - 1) * PAGE], np.int32)
    return [q, indptr, pages, np.array([0, pages_used], np.int32), table, last, np.zeros(1, np.int32),
            np.zeros(queries, np.int32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other version of prefill_attention.py")
    parser.add_argument("--target", default="cpu", help="an ember --target (default: this CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error(f"--threads {args.threads} --repeats {args.repeats}: each must be at least 1")
    if not args.baseline.is_file() or args.baseline.suffix != ".py":
        parser.error(f"--baseline {args.baseline}: no such Python file")
    try:
        target = resolve_target(args.target)
    except EmberError as err:
        parser.error(str(err))
    if target.is_gpu or target.foreign_architecture:
        parser.error(f"--target {args.target}: the kernels are timed here, so the target must be this machine's "
                     "kind of CPU (a lower ISA level, e.g. mcpu znver3 or haswell, runs too)")
    try:
        baseline = load_file(args.baseline, "baseline_prefill_attention")
    except Exception as err:  # any error of someone else's file: say which file, in one line
        parser.error(f"--baseline {args.baseline}: cannot be loaded ({type(err).__name__}: {err})")
    entries = ("ragged_prefill_attention", "paged_prefill_attention")
    if not all(callable(getattr(baseline, name, None)) for name in entries):
        parser.error(f"--baseline {args.baseline}: not a version of schedules/prefill_attention.py "
                     "(no ragged_prefill_attention and paged_prefill_attention)")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # unset, TVM's pool takes half the cores
    versions = {"baseline": baseline, "new": prefill_attention}
    rng = np.random.default_rng(0)
    print(bench_cpu.host_line())
    print(f"target {target.describe()}, {args.threads} threads, median of {args.repeats} rounds")
    print(f"{'kernel':<24} {'base us':>9} {'new us':>9} {'base GF/s':>9} {'new GF/s':>9} {'speedup':>8}")
    for queries, cached in CASES:
        arguments = inputs(queries, cached, rng)
        runs = {}
        for name, module in versions.items():
            lib = tvm.compile(tvm.IRModule({"main": kernel(module, queries, cached, target)}), target=target.target)
            out = tvm.runtime.tensor(np.zeros((queries, QO_HEADS, HEAD_DIM), np.float32))
            lse = tvm.runtime.tensor(np.zeros((queries, QO_HEADS), np.float32))
            causal = int(cached == 0)
            call = [tvm.runtime.tensor(a) for a in arguments] + [out, lse, causal, 0, 1.0, 10000.0, HEAD_DIM ** -0.5]
            lib["main"](*call)
            runs[name] = (lib, call)
        base_out, new_out = (call[len(arguments)].numpy() for _lib, call in runs.values())
        np.testing.assert_allclose(new_out, base_out, rtol=1e-4, atol=1e-4)
        # Query-key pairs each query head scores: all cached keys, or the causal triangle.
        pairs = queries * cached if cached else queries * (queries + 1) // 2
        flops = 4 * HEAD_DIM * QO_HEADS * pairs  # q.k and p.v: a multiply and an add each
        base, new = median_times(runs, args.repeats).values()
        label = f"paged q{queries} over {cached}" if cached else f"ragged causal {queries}"
        print(f"{label:<24} {base * 1e6:>9.1f} {new * 1e6:>9.1f} {flops / base / 1e9:>9.1f} {flops / new / 1e9:>9.1f} "
              f"{base / new:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
