"""ember's attention kernels through a sliding window, against a numpy reference of the window's definition.

A query at position p sees the keys at positions p - W + 1 .. p (transformers' sliding-window
mask, which `specialize_attention` proves each graph's equal to). The cache hands a kernel
either every page of a sequence (every layer windowed) or the pages of its last W cached
tokens (TVM's sliding-window slot, for models whose other layers see the whole context),
and the positions of its queries and of its first handed key; the kernels must mask by those
positions alone, whatever the chunking.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from ember.schedules.decode_attention import paged_decode_attention
from ember.schedules.prefill_attention import paged_prefill_attention
from ember.targets.registry import resolve_target

PAGE = 16
LANES = resolve_target("cpu").vector_bits // 32
START_MAX = -5e4  # a row without keys: output 0, lse -5e4 (what the runtime's state merge expects)


def reference(q, q_pos, keys, values, window, scale):
    """Output [n, qo_heads, d] and base-2 lse [n, qo_heads] of queries at `q_pos` over one sequence's `keys` and
    `values` [length, kv_heads, d], the key at index t at position t, through `window` (0: causal only)."""
    group = q.shape[1] // keys.shape[1]
    k = np.repeat(keys.astype(np.float64), group, axis=1)
    v = np.repeat(values.astype(np.float64), group, axis=1)
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], START_MAX)
    for row, position in enumerate(q_pos):
        low = max(0, position - window + 1) if window else 0
        visible = slice(low, min(position + 1, len(keys)))
        if visible.stop <= visible.start:
            continue
        scores = np.einsum("hd,thd->ht", q[row].astype(np.float64), k[visible]) * scale
        top = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - top)
        out[row] = np.einsum("ht,thd->hd", weights / weights.sum(axis=1, keepdims=True), v[visible])
        lse[row] = (top[:, 0] + np.log(weights.sum(axis=1))) / np.log(2)
    return out, lse


def handed_pages(length: int, window: int, window_pages: bool, first_page: int) -> tuple[list[int], int, int, int]:
    """(page slots, last page length, slots skipped in the first, position of the first handed key) that the
    runtime hands a kernel for a sequence of `length` cached tokens kept in pages first_page, first_page + 1, ..."""
    pages = list(range(first_page, first_page + -(-length // PAGE)))
    last = length - (len(pages) - 1) * PAGE if pages else 0
    if not window_pages or length <= window:
        return pages, last, 0, 0
    first_key = length - window
    return pages[first_key // PAGE:], last, first_key % PAGE, first_key


def run(kernel, q, sequences, q_indptr, q_pos, window_pages, heads, head_dim):
    """The kernel's output and lse for `sequences` [(keys, values)] kept in consecutive pages."""
    kv_heads = heads[1]
    total_pages = sum(-(-len(k) // PAGE) for k, _ in sequences) + 1
    pages = np.zeros((total_pages, 2, kv_heads, PAGE, head_dim), np.float32)
    indptr, table, info, k_pos, first = [0], [], [[], [], []], [], 0
    for keys, values in sequences:
        for t in range(len(keys)):
            pages[first + t // PAGE, 0, :, t % PAGE] = keys[t]
            pages[first + t // PAGE, 1, :, t % PAGE] = values[t]
        handed, last, skipped, first_key = handed_pages(len(keys), kernel.window, window_pages, first)
        table += handed
        indptr.append(len(table))
        for row, value in zip(info, (last, skipped, 0)):
            row.append(value)
        k_pos.append(first_key)
        first += -(-len(keys) // PAGE)
    length_info = np.array(info if window_pages else info[0], np.int32)
    target = resolve_target("cpu").target
    lib = tvm.compile(tvm.IRModule({"main": kernel.func.with_attr("global_symbol", "main")}), target=target)
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float32))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    tables = [np.array(indptr, np.int32), np.array(table or [0], np.int32), length_info]
    positions = [np.array(k_pos, np.int32), np.array(q_pos, np.int32)]
    args = [q] + ([] if q_indptr is None else [np.array(q_indptr, np.int32)]) + [pages, *tables, *positions]
    tail = [0] if q_indptr is None else [0, 0]  # decode: rotary mode; prefill: causal (ignored), rotary mode
    lib["main"](*(tvm.runtime.tensor(a) for a in args), out, lse, *tail, 1.0, 10000.0,
                float(1 / np.sqrt(head_dim)))
    return out.numpy(), lse.numpy()


class Kernel:
    """A kernel PrimFunc and the window it was built for."""

    def __init__(self, func, window: int) -> None:
        self.func, self.window = func, window


CASES = [  # (kv heads, qo heads, head dim, window)
    (2, 4, 16, 5),  # GQA, a window shorter than a page
    (1, 4, 64, 16),  # MQA, a window of one page
    (4, 4, 128, 33),  # MHA, a window across page edges
    (2, 8, 32, 40),
]
LENGTHS = [1, 4, 5, 6, 16, 17, 33, 34, 47, 100]  # shorter than, equal to and past each window


def _sequences(rng, lengths, kv_heads, head_dim):
    return [(rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32),
             rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)) for n in lengths]


@pytest.mark.parametrize("window_pages", [False, True], ids=["every-page", "window-pages"])
@pytest.mark.parametrize("case", CASES, ids=[f"kv{c[0]}-q{c[1]}-d{c[2]}-w{c[3]}" for c in CASES])
def test_decode_attention_sees_exactly_its_window(case, window_pages):
    kv_heads, qo_heads, head_dim, window = case
    rng = np.random.default_rng(window)
    sequences = _sequences(rng, LENGTHS, kv_heads, head_dim)
    q = rng.standard_normal((len(LENGTHS), qo_heads, head_dim)).astype(np.float32)
    q_pos = [n - 1 for n in LENGTHS]  # the new token, appended before decode attends
    kernel = Kernel(paged_decode_attention(kv_heads, qo_heads, head_dim, "float32", PAGE, LANES, "ours",
                                           window=window, window_pages=window_pages), window)
    out, lse = run(kernel, q, sequences, None, q_pos, window_pages, (qo_heads, kv_heads), head_dim)
    for b, (keys, values) in enumerate(sequences):
        expected = reference(q[b:b + 1], q_pos[b:b + 1], keys, values, window, 1 / np.sqrt(head_dim))
        np.testing.assert_allclose(out[b], expected[0][0], rtol=1e-4, atol=1e-5, err_msg=f"sequence {b}")
        np.testing.assert_allclose(lse[b], expected[1][0], rtol=1e-4, atol=1e-4, err_msg=f"sequence {b}")


@pytest.mark.parametrize("window_pages", [False, True], ids=["every-page", "window-pages"])
@pytest.mark.parametrize("case", CASES, ids=[f"kv{c[0]}-q{c[1]}-d{c[2]}-w{c[3]}" for c in CASES])
def test_prefill_attention_over_the_cache_sees_exactly_its_window(case, window_pages):
    """A prompt's later chunk (`new` tokens) against the tokens cached before it: each query sees the cached keys
    within its window, so early rows of a chunk see more of the cache than late ones."""
    kv_heads, qo_heads, head_dim, window = case
    rng = np.random.default_rng(window + 1)
    cached = [0, 3, 16, 17, 40, 70]
    new = [5, 1, window, 35, 2, 40]
    sequences = _sequences(rng, cached, kv_heads, head_dim)
    q = rng.standard_normal((sum(new), qo_heads, head_dim)).astype(np.float32)
    q_indptr = np.concatenate([[0], np.cumsum(new)])
    q_pos = [cached[b] + i for b in range(len(new)) for i in range(new[b])]
    kernel = Kernel(paged_prefill_attention(kv_heads, qo_heads, head_dim, "float32", PAGE, LANES, "ours",
                                            window=window, window_pages=window_pages), window)
    out, lse = run(kernel, q, sequences, q_indptr, q_pos, window_pages, (qo_heads, kv_heads), head_dim)
    for b, (keys, values) in enumerate(sequences):
        rows = slice(q_indptr[b], q_indptr[b + 1])
        expected = reference(q[rows], q_pos[rows], keys, values, window, 1 / np.sqrt(head_dim))
        np.testing.assert_allclose(out[rows], expected[0], rtol=1e-4, atol=1e-5, err_msg=f"sequence {b}")
        np.testing.assert_allclose(lse[rows], expected[1], rtol=1e-4, atol=1e-4, err_msg=f"sequence {b}")
