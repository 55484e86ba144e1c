"""One int8 matmul on AMX tiles against the AVX512-VNNI kernel: ms of each and their ratio.

Each case is one weight of the 1B Llama's shapes ([n, k]: 2048 x 2048, the gate/up 8192 x 2048, the down
2048 x 8192) in q8f32 and q4f32, with `--rows` activation rows (prefill), compiled for `--target` (an
`amx-int8` one) twice: `schedules/amx_matmul.py`'s kernel and `schedules/int8_matmul.py`'s prefill kernel
(the same target's VNNI code). With `--baseline path/to/amx_matmul.py` (e.g. a copy from an older commit)
that version is timed too. All are timed round-robin in one process (`time_evaluator`, hot caches), the
median of `--repeats` rounds, on `--threads` threads; the outputs are checked equal (1e-5) first.

    python scripts/bench_amx_kernel.py --threads 2 --repeats 7
    git show HEAD~1:schedules/amx_matmul.py > /tmp/amx_old.py
    python scripts/bench_amx_kernel.py --baseline /tmp/amx_old.py --rows 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path

from ember.core.without_torch import hide_torch_from_tvm

hide_torch_from_tvm()  # before TVM is imported: the kernels are built and timed without the torch it would load

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from ember.ir.quant_formats import FORMATS, INTERLEAVED  # noqa: E402
from ember.runtime import amx  # noqa: E402
from ember.schedules import amx_matmul, int8_matmul  # noqa: E402
from ember.targets.registry import resolve_target  # noqa: E402

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]  # (n, k): the 1B Llama's o-projection, gate/up, down
AMX_TARGET = '{"kind": "llvm", "mcpu": "sapphirerapids"}'


def load_file(path: Path, name: str):
    """Another copy of a module of ember (its imports resolve to this checkout)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels(fmt, n: int, k: int, target, baseline) -> dict[str, tvm.runtime.Module]:
    """The compiled kernels of one weight, by version name."""
    funcs = {"vnni": int8_matmul.int8_dot_matmul(fmt, n, k, target.int8_dot, True, target.vector_bits),
             "amx": amx_matmul.amx_int8_matmul(fmt, n, k)}
    if baseline is not None:
        funcs["amx-base"] = baseline.amx_int8_matmul(fmt, n, k)
    return {name: tvm.compile(tvm.IRModule({"main": func}), target=target.target) for name, func in funcs.items()}


def median_ms(runs: dict[str, tuple[tvm.runtime.Module, list]], repeats: int) -> dict[str, float]:
    """Milliseconds per call of each kernel, timed round-robin, median of `repeats` rounds."""
    timers = {name: lib.mod.time_evaluator("main", tvm.cpu(), number=2, repeat=1, min_repeat_ms=150)
              for name, (lib, _args) in runs.items()}
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer(*runs[name][1]).mean * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def case_parser(description: str) -> argparse.ArgumentParser:
    """The options of a kernel comparison: target, formats, row counts, weight shapes, repeats, threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", default=AMX_TARGET)
    parser.add_argument("--formats", default="q8f32,q4f32")
    parser.add_argument("--rows", default="512,2048", help="activation rows, comma-separated")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def cases(args: argparse.Namespace, build) -> Iterator[tuple[str, str, int, dict[str, tuple]]]:
    """(shape, format, rows, runs) for every case of `args`: runs maps each kernel `build(fmt, n, k)` compiled to
    (its library, its arguments: random x, a random weight's parts, y), each called once already."""
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for name in args.formats.split(","):
            fmt = FORMATS[name]
            parts = fmt.quantize(rng.standard_normal((n, k), dtype=np.float32), INTERLEAVED)
            parts = [tvm.runtime.tensor(parts[p]) for p in fmt.parts]
            libs = build(fmt, n, k)
            for rows in (int(r) for r in args.rows.split(",")):
                x = tvm.runtime.tensor(rng.standard_normal((1, rows, k), dtype=np.float32))
                runs = {v: (lib, [x, *parts, tvm.runtime.tensor(np.zeros((1, rows, n), np.float32))])
                        for v, lib in libs.items()}
                for lib, call in runs.values():
                    lib["main"](*call)
                yield shape, name, rows, runs


def main() -> None:
    """Print one row per (shape, format, rows): each kernel's ms and AMX's speed over VNNI's."""
    parser = case_parser(__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another amx_matmul.py to time beside this one")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    target = resolve_target(args.target)
    amx.request_amx_permission("bench_amx_kernel")
    baseline = None if args.baseline is None else load_file(args.baseline, "baseline_amx_matmul")
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("flags:", " ".join(f for line in flags.splitlines() if line.startswith("Flags")
                             for f in line.split() if f.startswith(("amx", "avx512_vnni"))))
    print(f"{'n x k':<11} {'format':<7} {'rows':>5} " + "".join(f"{name:>10}" for name in
          ("amx ms", "vnni ms", "ratio")) + ("   base ms  base ratio" if baseline else ""))
    for shape, name, rows, runs in cases(args, lambda fmt, n, k: kernels(fmt, n, k, target, baseline)):
        want = runs["vnni"][1][-1].numpy()
        for v, (_lib, call) in runs.items():
            np.testing.assert_allclose(call[-1].numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=v)
        ms = median_ms(runs, args.repeats)
        line = f"{shape:<11} {name:<7} {rows:>5} {ms['amx']:>10.2f}{ms['vnni']:>10.2f}{ms['vnni'] / ms['amx']:>9.2f}x"
        if baseline:
            line += f"{ms['amx-base']:>10.2f}{ms['vnni'] / ms['amx-base']:>10.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
