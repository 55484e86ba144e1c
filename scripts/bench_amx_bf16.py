"""The AMX-BF16 prototype matmul against the int8 AMX and the AVX512-VNNI kernels: ms of each, their ratios, and
how far the bf16 output is from the VNNI one.

Each case is one weight of the 1B Llama's shapes (`bench_amx_kernel.SHAPES`) in q8f32 and q4f32, with `--rows`
activation rows (prefill), compiled for `--target` (an `amx-bf16` one): `schedules/amx_bf16_matmul.py`'s kernel,
`schedules/amx_matmul.py`'s and `schedules/int8_matmul.py`'s prefill kernel. All are timed round-robin in one process
(`bench_amx_kernel.median_ms`: `time_evaluator`, hot caches), the median of `--repeats` rounds, on `--threads`
threads. `max rel` is max|y_bf16 - y_vnni| / max|y_vnni|: both round the activations (bf16: 8-bit mantissa; VNNI:
int8 per 32-value group), the bf16 kernel the weights as well.

    python scripts/bench_amx_bf16.py --threads 2 --repeats 5
"""

from __future__ import annotations

import os

from ember.core.without_torch import hide_torch_from_tvm

hide_torch_from_tvm()  # before TVM is imported: the kernels are built and timed without the torch it would load

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from bench_amx_kernel import case_parser, cases, median_ms  # noqa: E402

from ember.runtime import amx  # noqa: E402
from ember.schedules import amx_bf16_matmul, amx_matmul, int8_matmul  # noqa: E402
from ember.targets.registry import resolve_target  # noqa: E402


def kernels(fmt, n: int, k: int, target) -> dict[str, tvm.runtime.Module]:
    """The compiled kernels of one weight, by version name."""
    funcs = {"bf16": amx_bf16_matmul.amx_bf16_matmul(fmt, n, k), "amx": amx_matmul.amx_int8_matmul(fmt, n, k),
             "vnni": int8_matmul.int8_dot_matmul(fmt, n, k, target.int8_dot, True, target.vector_bits)}
    return {name: tvm.compile(tvm.IRModule({"main": func}), target=target.target) for name, func in funcs.items()}


def main() -> None:
    """Print one row per (shape, format, rows): each kernel's ms, bf16's time over VNNI's and over int8 AMX's, and
    bf16's max relative difference from VNNI."""
    args = case_parser(__doc__.splitlines()[0]).parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    target = resolve_target(args.target)
    amx.request_amx_permission("bench_amx_bf16")
    print(f"{'n x k':<11} {'format':<7} {'rows':>5} {'bf16 ms':>9} {'amx ms':>9} {'vnni ms':>9} "
          f"{'bf16/vnni':>10} {'bf16/amx':>9} {'max rel':>9}")
    for shape, name, rows, runs in cases(args, lambda fmt, n, k: kernels(fmt, n, k, target)):
        want = runs["vnni"][1][-1].numpy()
        diff = np.abs(runs["bf16"][1][-1].numpy() - want).max() / np.abs(want).max()
        ms = median_ms(runs, args.repeats)
        print(f"{shape:<11} {name:<7} {rows:>5} {ms['bf16']:>9.2f} {ms['amx']:>9.2f} {ms['vnni']:>9.2f} "
              f"{ms['bf16'] / ms['vnni']:>10.2f} {ms['bf16'] / ms['amx']:>9.2f} {diff:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
