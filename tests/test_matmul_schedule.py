"""The float matmul rule (`schedules/matmul.py`) against numpy, on each of its paths.

Prefill shapes take the GEMM tile (full and partial m tiles, an epilogue, a prologue
that computes the weight, a weight whose rows no 8- or 4-row tile divides); decode
shapes the GEMV, with a symbolic batch of 1 to FEW_ROWS rows. Weights stored as
panels (`ir_passes/pack_float_panels.py`) take the outer-product tiles, on both paths,
with each tile size tuning may choose.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from ember.ir_passes.pack_float_panels import panel_rows, to_panels
from ember.schedules.matmul import FEW_ROWS, NTMatmul
from ember.targets.registry import resolve_target

TARGET = resolve_target("cpu")


def _i64(*values: int) -> list[tirx.IntImm]:
    return [tirx.IntImm("int64", value) for value in values]


def _build(n: int, k: int, prefill: bool, residual: bool, scaled: bool, panels: int = 0, knobs=None):
    """C = A @ W^T (+ R), W optionally computed as int8 rows times a scale or read from panels of
    `panels` rows; the symbolic rows bounded; `knobs` replace the rule's own."""
    size = tirx.Var("seq_len" if prefill else "batch_size", "int64")
    one, n_, k_ = _i64(1, n, k)
    shape = (one, size, k_) if prefill else (size, one, k_)
    a = te.placeholder(shape, name="A")
    inputs = [a]
    if scaled:
        quantized, scale = te.placeholder((n_, k_), "int8", name="Q"), te.placeholder((n_,), name="S")
        w = te.compute((n_, k_), lambda j, r: quantized[j, r].astype("float32") * scale[j], name="dequantize")
        inputs += [quantized, scale]
    elif panels:
        stored = te.placeholder(_i64(n // panels, k, panels), name="W")
        w = lambda j, r: stored[j // panels, r, j % panels]  # noqa: E731 (read in place, as the pass writes it)
        inputs.append(stored)
    else:
        w = te.placeholder((n_, k_), name="W")
        inputs.append(w)
    r = te.reduce_axis((0, k_), name="k")
    if panels:
        c = te.compute((*shape[:2], n_), lambda b, i, j: te.sum(a[b, i, r] * w(j, r), axis=r), name="matmul")
    else:
        c = te.compute((*shape[:2], n_), lambda b, i, j: te.sum(a[b, i, r] * w[j, r], axis=r), name="NT_matmul")
    if residual:
        res = te.placeholder((*shape[:2], n_), name="R")
        c = te.compute(c.shape, lambda b, i, j: c[b, i, j] + res[b, i, j], name="add")
        inputs.append(res)
    func = te.create_prim_func([*inputs, c]).with_attr("tir_var_upper_bound", {size.name: 64 if prefill else FEW_ROWS})
    values = iter(knobs or [])
    choose = (lambda _name, candidates, _default: next(values)) if knobs else (lambda _n, _c, default: default)
    sch = NTMatmul(TARGET.vector_bits, choose=choose).apply(func, TARGET.target, False)
    assert sch is not None
    return tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=TARGET.target)


@pytest.mark.parametrize("n,k,prefill,residual,scaled,row_counts", [
    (48, 64, True, False, False, [1, 7, 13, 64]),  # GEMM: one partial m tile, full and partial ones
    (40, 96, True, True, True, [9]),  # GEMM with a computed weight and a residual add
    (37, 32, True, False, False, [5, 12]),  # an odd number of weight rows: one-row tiles
    (64, 96, False, True, False, [1, 3, FEW_ROWS]),  # GEMV, a decode batch
])
def test_matches_numpy(n, k, prefill, residual, scaled, row_counts):
    _check(_build(n, k, prefill, residual, scaled)["main"], n, k, prefill, residual, scaled, row_counts)


PANEL = panel_rows(TARGET.vector_bits, "float32")


@pytest.mark.parametrize("n,k,prefill,residual,row_counts,knobs", [
    (3 * PANEL, 64, True, False, [1, 5, 6, 13, 64], None),  # GEMM: a partial tile alone, full and partial
    (2 * PANEL, 96, True, True, [37], None),  # GEMM with a residual add
    (2 * PANEL, 96, True, False, [9], [2 * PANEL, 1, 3]),  # GEMM, two panels by three rows
    (4 * PANEL, 96, False, True, [1, 3, FEW_ROWS], None),  # GEMV, a decode batch
    (2 * PANEL, 96, False, False, [2], [PANEL, 4, 1]),  # GEMV, one panel a tile, four k accumulators
    (4 * PANEL, 96, False, False, [1], [4 * PANEL, 1, 1]),  # GEMV, four panels a tile, one k accumulator
])
def test_panels_match_numpy(n, k, prefill, residual, row_counts, knobs):
    kernel = _build(n, k, prefill, residual, False, panels=PANEL, knobs=knobs)
    _check(kernel["main"], n, k, prefill, residual, False, row_counts, panels=PANEL)


def test_panel_rule_takes_the_outer_product_tile() -> None:
    """The GEMM over panels accumulates whole vectors of outputs: FMAs with a broadcast activation,
    no horizontal sums (shuffles) in its loop."""
    assembly = _build(4 * PANEL, 256, True, False, False, panels=PANEL).mod.inspect_source("asm")
    assert "vfmadd" in assembly and "vbroadcastss" in assembly
    assert "vhaddps" not in assembly and "vpermilps" not in assembly


def _check(kernel, n, k, prefill, residual, scaled, row_counts, panels=0):
    rng = np.random.default_rng(n * k)
    if scaled:
        quantized = rng.integers(-127, 128, (n, k), dtype=np.int8)
        scale = rng.random(n, dtype=np.float32)
        weights, weight = [quantized, scale], quantized.astype(np.float32) * scale[:, None]
    else:
        weight = rng.standard_normal((n, k), dtype=np.float32)
        weights = [np.ascontiguousarray(to_panels(weight, panels)) if panels else weight]
    for rows in row_counts:
        shape = (1, rows) if prefill else (rows, 1)
        a = rng.standard_normal((*shape, k), dtype=np.float32)
        expected = a.astype(np.float64) @ weight.T.astype(np.float64)
        extra = []
        if residual:
            extra = [rng.standard_normal((*shape, n), dtype=np.float32)]
            expected += extra[0]
        out = tvm.runtime.tensor(np.zeros((*shape, n), np.float32))
        kernel(*(tvm.runtime.tensor(x) for x in (a, *weights, *extra)), out)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(weight).max() * np.sqrt(k),
                                   err_msg=f"{rows} rows")


@pytest.mark.parametrize("gate_first", [True, False])  # the sigmoid's block before the matmul's, or after
@pytest.mark.parametrize("panels, prefill, rows", [(0, True, 37), (PANEL, True, 37), (0, False, 5), (PANEL, False, 5)])
def test_an_epilogue_scaled_by_a_per_row_input_matches_numpy(panels, prefill, rows, gate_first):
    """C = sigmoid(G) * (A @ W^T) + R with G [.., 1] per activation row (Qwen2-MoE's gated shared expert): the
    sigmoid of G is its own block, computed from an input alone, and must not be placed over every row inside one
    tile's loop (each tile then wrote all rows from other tiles' unfinished sums)."""
    n, k = 2 * PANEL, 64
    size = tirx.Var("seq_len" if prefill else "batch_size", "int64")
    one, n_, k_ = _i64(1, n, k)
    shape = (one, size, k_) if prefill else (size, one, k_)
    a = te.placeholder(shape, name="A")
    gate = te.placeholder((*shape[:2], one), name="G")
    residual = te.placeholder((*shape[:2], n_), name="R")
    r = te.reduce_axis((0, k_), name="k")
    if panels:
        weight = te.placeholder(_i64(n // panels, k, panels), name="W")
        c = te.compute((*shape[:2], n_), lambda b, i, j: te.sum(a[b, i, r] * weight[j // panels, r, j % panels],
                                                                axis=r), name="matmul")
    else:
        weight = te.placeholder((n_, k_), name="W")
        c = te.compute((*shape[:2], n_), lambda b, i, j: te.sum(a[b, i, r] * weight[j, r], axis=r), name="NT_matmul")
    scale = te.compute(gate.shape, lambda b, i, j: te.sigmoid(gate[b, i, j]), name="sigmoid")
    out = te.compute(c.shape, lambda b, i, j: (scale[b, i, 0] * c[b, i, j] if gate_first else c[b, i, j] * scale[
        b, i, 0]) + residual[b, i, j], name="gated")
    func = te.create_prim_func([a, weight, gate, residual, out]).with_attr(
        "tir_var_upper_bound", {size.name: 64 if prefill else FEW_ROWS})
    sch = NTMatmul(TARGET.vector_bits).apply(func, TARGET.target, False)
    assert sch is not None
    kernel = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=TARGET.target)["main"]
    rng = np.random.default_rng(rows)
    lead = (1, rows) if prefill else (rows, 1)
    x, g, res = (rng.standard_normal(s, dtype=np.float32) for s in ((*lead, k), (*lead, 1), (*lead, n)))
    w = rng.standard_normal((n, k), dtype=np.float32)
    expected = 1 / (1 + np.exp(-g.astype(np.float64))) * (x.astype(np.float64) @ w.T) + res
    stored = np.ascontiguousarray(to_panels(w, panels)) if panels else w
    y = tvm.runtime.tensor(np.zeros((*lead, n), np.float32))
    kernel(*(tvm.runtime.tensor(v) for v in (x, stored, g, res)), y)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-4 * np.sqrt(k) * np.abs(w).max())
