"""Tuned against rule-based schedules, one run: per kernel, then end to end.

For every hot kernel of the model with a record in the tuning database, times the
rule-based and the tuned kernel side by side on the same inputs (`time_evaluator`,
hot caches, at the tuning shape). Then compiles the model twice, without and with
`--tuning-db`, and measures prefill and decode tok/s of both artifacts in fresh
processes, alternating, best of `--repeats` (prompt 128 tokens, 64 new tokens).

    python scripts/bench_tuning.py --model /tmp/llama110m --db /tmp/tune110 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
import peers  # noqa: E402


def kernel_table(model: Path, db: Path) -> None:
    """Rule-based vs tuned time of every hot kernel that has a record."""
    from ember.driver.tune import hot_kernels
    from ember.frontend.hf import import_hf_model
    from ember.ir.quant_formats import FORMATS
    from ember.ir_passes import pipeline
    from ember.schedules.tuning import compare, record_knobs, rule_knobs
    from ember.schedules.tuning_db import TuningDatabase
    from ember.targets.registry import resolve_target

    target = resolve_target("cpu")
    database = TuningDatabase.for_compiling(db)
    fmt = FORMATS[target.default_quantization]
    imported = import_hf_model(model, target.target, fmt.dtype)
    kernels = hot_kernels(pipeline.to_kernels(imported.mod, target, pipeline.LowerOptions(fmt, 256, 8)), target)
    print(f"{'kernel':<22} {'phase':<8} {'calls':>5} {'knobs':<12} {'rule ms':>8} {'tuned ms':>9} {'speedup':>8}")
    for kernel in kernels:
        record = database.best(kernel.workload, target.target) if database else None
        if record is None:
            continue
        knobs = record_knobs(record)
        result = compare(kernel.workload["main"], knobs, target, timed=True)
        shown = "rule's" if knobs == rule_knobs(kernel.workload["main"], target) else str(knobs)
        print(f"{kernel.name:<22} {kernel.phases:<8} {kernel.calls:>5} {shown:<12} "
              f"{result.rule_seconds * 1e3:>8.3f} {result.tuned_seconds * 1e3:>9.3f} "
              f"{result.rule_seconds / result.tuned_seconds:>7.2f}x")


def end_to_end(model: Path, db: Path, repeats: int, threads: int) -> None:
    """Prefill and decode tok/s of the model compiled without and with the database."""
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.schedules.tuning import describe_schedule_sources

    prompt = np.random.default_rng(0).integers(0, 32000, 128).tolist()
    with tempfile.TemporaryDirectory(prefix="ember-tuning-bench-") as tmp:
        artifacts = {}
        for name, tuning_db in (("rules", None), ("tuned", db)):
            result = compile_model(model, Path(tmp) / name, CompileOptions(tuning_db=tuning_db, show_progress=False))
            artifacts[name] = result.output_dir
            print(f"compiled {name}: {describe_schedule_sources(result.schedules)}, {result.seconds:.1f} s")
        best: dict[str, list[float]] = {name: [0.0, 0.0] for name in artifacts}
        for _ in range(repeats):
            for name, artifact in artifacts.items():
                peers.wait_for_quiet_machine()
                measured = bench_cpu.measure_ember(artifact, prompt, 64, threads)
                best[name] = [max(best[name][0], measured.prefill_tokens_per_s),
                              max(best[name][1], measured.decode_tokens_per_s)]
    print(f"{'schedules':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, (prefill, decode) in best.items():
        print(f"{name:<10} {prefill:>14.1f} {decode:>13.1f}")
    print(f"tuned/rules: prefill {best['tuned'][0] / best['rules'][0]:.2f}x, "
          f"decode {best['tuned'][1] / best['rules'][1]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("/tmp/llama110m"))
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernels-only", action="store_true")
    args = parser.parse_args()
    from ember.runtime.device import use_cpu_threads

    use_cpu_threads(args.threads)  # the kernel table's timings run in this process, on the artifacts' thread count
    kernel_table(args.model, args.db)
    if not args.kernels_only:
        end_to_end(args.model, args.db, args.repeats, args.threads)


if __name__ == "__main__":
    main()
