"""Decode attention through a sliding window: one layer's decode step against the context it has cached.

A windowed layer (Gemma 3's local layers: window 512) reads only its last `window` keys, so its
decode cost must stay flat once the context passes the window, while a layer over the whole
context grows with it. This times ember's decode kernel (`schedules/decode_attention.py`) for one
layer of the Gemma-3-1B attention shape (4 query heads sharing 1 KV head, head dim 256, float32
pages of 16 tokens), a batch of one, at each context length, three ways:

    whole context      the kernel without a window (a global layer)
    window, all pages  the window applied by position over every page (a model windowed in every layer)
    window pages       the runtime hands only the window's pages (a local layer among global ones)

round-robin in one process (`time_evaluator`, hot caches), median of `--repeats` rounds. The
windowed outputs are checked against the whole-context kernel's at a context inside the window.

    python scripts/bench_window.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ember.core.without_torch import hide_torch_from_tvm

hide_torch_from_tvm()  # before TVM is imported: the kernels are built and timed without the torch it would load

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from ember.schedules.decode_attention import paged_decode_attention  # noqa: E402
from ember.targets.registry import resolve_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402
from bench_matmul import median_times  # noqa: E402

KV_HEADS, QO_HEADS, HEAD_DIM, PAGE, WINDOW = 1, 4, 256, 16, 512
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
KINDS = {"whole context": (0, False), "window, all pages": (WINDOW, False), "window pages": (WINDOW, True)}


def arguments(context: int, window: int, window_pages: bool, rng: np.random.Generator) -> list[np.ndarray]:
    """The decode kernel's inputs before its outputs for one sequence of `context` cached tokens (the new one
    included, at position context - 1): q, pages, page table, length info, key and query positions."""
    pages_used = -(-context // PAGE)
    pages = rng.standard_normal((pages_used + 2, 2, KV_HEADS, PAGE, HEAD_DIM), dtype=np.float32)
    table = rng.permutation(pages_used + 2)[:pages_used].astype(np.int32)  # scattered, as a cache's are
    last = context - (pages_used - 1) * PAGE
    first_key = max(0, context - window) if window_pages else 0
    handed = table[first_key // PAGE:]
    length_info = np.array([[last], [first_key % PAGE], [0]] if window_pages else [last], np.int32)
    q = rng.standard_normal((1, QO_HEADS, HEAD_DIM), dtype=np.float32)
    return [q, pages, np.array([0, len(handed)], np.int32), handed, length_info, np.array([first_key], np.int32),
            np.array([context - 1], np.int32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error(f"--threads {args.threads} --repeats {args.repeats}: each must be at least 1")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # unset, TVM's pool takes half the cores
    target = resolve_target("cpu")
    lanes = target.vector_bits // 32
    libs = {kind: tvm.compile(tvm.IRModule({"main": paged_decode_attention(
        KV_HEADS, QO_HEADS, HEAD_DIM, "float32", PAGE, lanes, "main", window=window, window_pages=pages)}),
        target=target.target) for kind, (window, pages) in KINDS.items()}
    print(bench_cpu.host_line())
    print(f"target {target.describe()}, {args.threads} threads, median of {args.repeats} rounds; one layer, "
          f"{QO_HEADS} query heads / {KV_HEADS} KV head, head dim {HEAD_DIM}, window {WINDOW}")
    print(f"{'context':>8} " + " ".join(f"{kind + ' us':>20}" for kind in KINDS))
    for context in CONTEXTS:
        runs = {}
        for kind, (window, pages) in KINDS.items():
            call = [tvm.runtime.tensor(a) for a in arguments(context, window, pages, np.random.default_rng(0))]
            call += [tvm.runtime.tensor(np.zeros((1, QO_HEADS, HEAD_DIM), np.float32)),
                     tvm.runtime.tensor(np.zeros((1, QO_HEADS), np.float32)), 0, 1.0, 10000.0, HEAD_DIM ** -0.5]
            libs[kind]["main"](*call)
            runs[kind] = (libs[kind], call)
        if context <= WINDOW:  # the window drops nothing yet: every kind computes the same
            outputs = [call[7].numpy() for _lib, call in runs.values()]
            for other in outputs[1:]:
                np.testing.assert_allclose(other, outputs[0], rtol=1e-4, atol=1e-5)
        times = median_times(runs, args.repeats)
        print(f"{context:>8} " + " ".join(f"{times[kind] * 1e6:>20.1f}" for kind in KINDS))


if __name__ == "__main__":
    main()
