"""The AMX-BF16 matmul (schedules/amx_bf16_matmul.py): x and the dequantized weight rounded to bfloat16 (round to
nearest even), products summed in float32 tiles, against numpy; the VNNI body of short calls; its knobs; and its tile
instructions."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import call_matmul_kernel

from ember.core.machine import host_cpu_flags
from ember.ir.quant_formats import FORMATS, INTERLEAVED
from ember.runtime import amx
from ember.schedules import amx_bf16_matmul as bf16_module
from ember.schedules import int8_matmul
from ember.schedules.amx_bf16_matmul import amx_bf16_matmul
from ember.targets.registry import resolve_target

AMX_TARGET = resolve_target('{"kind": "llvm", "mcpu": "sapphirerapids"}')
# float32 sums of exact bf16 products, in another order than numpy's float64: far below bf16's 2^-9 per value.
TOLERANCE = 2e-6


@pytest.fixture(scope="module")
def amx_bf16_host():
    """The AMX target on a host with amx_bf16 (and avx512_bf16, which converts to bfloat16), with this process's tile
    permission granted."""
    missing = sorted({"amx_tile", "amx_bf16", "avx512_bf16"} - set(host_cpu_flags() or ()))
    if missing:
        pytest.skip(f"this CPU has no {', '.join(missing)}")
    amx.request_amx_permission("test_amx_bf16_matmul")
    return AMX_TARGET


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 `values` rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def _build(fmt, n, k, target):
    return tvm.compile(tvm.IRModule({"main": amx_bf16_matmul(fmt, n, k)}), target=target.target)


def test_rounding_helper_ties_to_even():
    """The reference's rounding: halfway cases go to the even bfloat16, others to the nearest."""
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8)], np.float32)
    np.testing.assert_array_equal(_bfloat16(values), [1, 1 + 2**-6, 1 + 2**-7, -1])


@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("n,k,batch,seq", [
    (32, 96, 1, 37),  # a whole and a partial 32-row block; 3 groups: K not a multiple of 64
    (64, 160, 2, 16),  # two tasks, two sequences of one 32-row block; 5 groups
    (64, 32, 1, 5),  # one group, 5 rows of a block
])
def test_matches_bfloat16_rounded_numpy(amx_bf16_host, name, n, k, batch, seq):
    """y = bf16(x) . bf16(w dequantized in float32), in float64, to TOLERANCE of max|y|; the rounding is really there
    (the unrounded product is farther off)."""
    fmt = FORMATS[name]
    rows = batch * seq
    rng = np.random.default_rng(n + k + rows)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    weight = fmt.dequantize(parts, k, INTERLEAVED).astype(np.float32)
    expected = _bfloat16(x).astype(np.float64) @ _bfloat16(weight).astype(np.float64).T
    actual = call_matmul_kernel(_build(fmt, n, k, amx_bf16_host), fmt, parts, x, n, batch)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE * scale)
    unrounded = x.astype(np.float64) @ weight.astype(np.float64).T
    assert np.abs(actual - unrounded).max() > 50 * TOLERANCE * scale


@pytest.mark.parametrize("pairs,block_chunks", [(4, 5), (4, 1), (2, 5), (1, 1)])
def test_every_blocking_gives_the_same_sums(amx_bf16_host, pairs, block_chunks):
    """Four column pairs a task or fewer (n = 128), K in one sweep or in five (the C tiles kept in y and, for the
    partial last row block, in a task buffer, between sweeps); 37 rows: the same output as the rule's blocking."""
    fmt, n, k, rows = FORMATS["q4f32"], 128, 160, 37
    rng = np.random.default_rng(pairs * 10 + block_chunks)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    weight = fmt.dequantize(parts, k, INTERLEAVED).astype(np.float32)
    expected = _bfloat16(x).astype(np.float64) @ _bfloat16(weight).astype(np.float64).T
    lib = tvm.compile(tvm.IRModule({"main": amx_bf16_matmul(fmt, n, k, pairs, block_chunks)}),
                      target=amx_bf16_host.target)
    np.testing.assert_allclose(call_matmul_kernel(lib, fmt, parts, x, n), expected, rtol=0,
                               atol=TOLERANCE * np.abs(expected).max())


def test_refuses_weights_of_partial_tasks():
    """A weight whose rows are not whole 32-row tasks (two B tiles) is refused, not computed in part."""
    with pytest.raises(ValueError, match="does not compute"):
        amx_bf16_matmul(FORMATS["q8f32"], 48, 64)
    with pytest.raises(ValueError, match="does not divide"):
        amx_bf16_matmul(FORMATS["q8f32"], 64, 96, 1, 2)


def test_assembly_holds_the_bf16_tile_instructions():
    """Compiled, not run (any host): the kernel configures tiles, loads them, multiplies bfloat16 pairs (tdpbf16ps),
    stores and releases them."""
    lib = _build(FORMATS["q4f32"], 32, 64, AMX_TARGET)
    assembly = lib.mod.imports[0].inspect_source("s") if lib.mod.imports else lib.mod.inspect_source("s")
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"):
        assert instruction in assembly, instruction
    assert "tdpbssd" not in assembly


@pytest.mark.parametrize("name", ["q8f32", "q4f32_zp"])
def test_calls_below_the_row_threshold_run_the_vnni_body(amx_bf16_host, name):
    """With the target's dot product, one kernel holds both bodies: calls of fewer than `vnni_below` rows equal the
    VNNI kernel to the bit, longer ones are the bfloat16 tiles' products."""
    fmt, n, k = FORMATS[name], 64, 96
    rng = np.random.default_rng(5)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    weight = _bfloat16(fmt.dequantize(parts, k, INTERLEAVED).astype(np.float32)).astype(np.float64)
    both = tvm.compile(tvm.IRModule({"main": amx_bf16_matmul(fmt, n, k, vnni=amx_bf16_host.int8_dot,
                                                             vector_bits=amx_bf16_host.vector_bits)}),
                       target=amx_bf16_host.target)
    vnni = tvm.compile(tvm.IRModule({"main": int8_matmul.int8_dot_matmul(fmt, n, k, amx_bf16_host.int8_dot, True,
                                                                         amx_bf16_host.vector_bits)}),
                       target=amx_bf16_host.target)
    below = bf16_module.VNNI_BELOW_ROWS
    for rows in (1, below - 1):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        np.testing.assert_array_equal(call_matmul_kernel(both, fmt, parts, x, n),
                                      call_matmul_kernel(vnni, fmt, parts, x, n), f"{rows} rows")
    for rows in (below, below + 7):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        expected = _bfloat16(x).astype(np.float64) @ weight.T
        np.testing.assert_allclose(call_matmul_kernel(both, fmt, parts, x, n), expected, rtol=0,
                                   atol=TOLERANCE * np.abs(expected).max(), err_msg=f"{rows} rows")


def test_knob_space_starts_with_the_rule_and_rebuilds_keep_the_attributes():
    """`ember tune`'s space: the rule's (pairs, block_chunks, vnni_below) first, each tuple once, every one built;
    a rebuild with other knobs records them and keeps the kernel's other attributes."""
    vnni = AMX_TARGET.int8_dot
    space = bf16_module.knob_space(256, 2048)
    assert space[0] == [4, 64, bf16_module.VNNI_BELOW_ROWS] and len(space) == len({tuple(k) for k in space}) == 18
    assert {tuple(k[:2]) for k in space} == {(4, 64), (4, 32), (2, 64), (2, 32), (1, 64), (1, 32)}
    assert bf16_module.knob_space(96, 96)[0] == [3, 3, bf16_module.VNNI_BELOW_ROWS]  # 3 pairs, 3 chunks: no halves
    assert {tuple(k[:2]) for k in bf16_module.knob_space(96, 96)} == {(3, 3), (1, 3)}
    kernel = amx_bf16_matmul(FORMATS["q4f32"], 128, 128, vnni=vnni).with_attr("ember.kernel_source", "x")
    assert bf16_module.kernel_knob_space(kernel) == bf16_module.knob_space(128, 128)
    assert bf16_module.kernel_knob_space(amx_bf16_matmul(FORMATS["q4f32"], 128, 128)) is None  # no VNNI body
    rebuilt = bf16_module.rebuild(kernel, vnni, 512, [2, 2, 16])
    assert bf16_module.built_as(rebuilt) == {"format": "q4f32", "n": 128, "k": 128, "pairs": 2, "block_chunks": 2,
                                             "vnni_below": 16}
    assert rebuilt.attrs["ember.kernel_source"] == "x"
