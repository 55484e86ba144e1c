"""The int8 dot-product decode GEMV (`schedules/int8_gemv.py`) against llama.cpp's arithmetic.

llama.cpp multiplies Q4_0/Q8_0 weights by activations rounded to Q8_0: per group of
32, d = max|x| / 127 and q = round(x / d). The reference here is that rule in numpy
(float64 sums of the dequantized weight times q * d): the kernel must agree to float
rounding, for every row count the decode batch can have and every unroll depth.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from ember.ir_passes.quant_formats import FORMATS
from ember.schedules import int8_gemv
from ember.targets.registry import resolve_target
from helpers import q8_0_activations

TARGET = resolve_target("cpu")
needs_int8_dot = pytest.mark.skipif(TARGET.int8_dot is None, reason="this CPU has no int8 dot-product instruction")


@needs_int8_dot
@pytest.mark.parametrize("name", ["q8f32", "q4f32"])
@pytest.mark.parametrize("n,k,rows", [(96, 64, 1), (40, 128, 3), (24, 320, 2), (64, 512, 1)])
def test_matches_llama_cpp_arithmetic(name, n, k, rows):
    fmt = FORMATS[name]
    rng = np.random.default_rng(n + k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    parts = fmt.quantize(weight)
    lib = tvm.compile(tvm.IRModule({"main": int8_gemv.int8_dot_gemv(fmt, n, k, TARGET.int8_dot)}),
                      target=TARGET.target)
    y = tvm.runtime.tensor(np.zeros((rows, n), np.float32))
    lib["main"](tvm.runtime.tensor(x), *(tvm.runtime.tensor(parts[p]) for p in fmt.parts), y)
    expected = q8_0_activations(x) @ fmt.dequantize(parts, k).astype(np.float64).T
    np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    exact = x.astype(np.float64) @ fmt.dequantize(parts, k).astype(np.float64).T
    assert np.abs(y.numpy() - exact).max() > 1e-4 * np.abs(exact).max()  # the rounding is really there


def test_formats_and_widths_it_takes():
    assert int8_gemv.supports(FORMATS["q4f32"], 768) and int8_gemv.supports(FORMATS["q8f32"], 2080)
    assert not int8_gemv.supports(FORMATS["q4f32"], 96)  # int4 reads 64 values per step
    for name in ("q0f32", "q4f16", "q8f16", "q4f32_zp"):
        assert not int8_gemv.supports(FORMATS[name], 768)


@pytest.mark.parametrize("spec,has", [('{"kind": "llvm", "mcpu": "skylake-avx512"}', False),
                                      ('{"kind": "llvm", "mcpu": "icelake-server"}', True),
                                      ('{"kind": "llvm", "mcpu": "alderlake"}', True),
                                      ('{"kind": "llvm", "mcpu": "haswell"}', False)])
def test_targets_choose_the_instruction_by_cpu_features(spec, has):
    assert (resolve_target(spec).int8_dot is not None) == has


def test_compiles_for_avx_vnni():
    """Alder Lake's AVX-VNNI form of the instruction (no AVX-512) compiles too."""
    target = resolve_target('{"kind": "llvm", "mcpu": "alderlake"}')
    func = int8_gemv.int8_dot_gemv(FORMATS["q4f32"], 16, 128, target.int8_dot)
    assert "vpdpbusd" in tvm.compile(tvm.IRModule({"main": func}), target=target.target).mod.inspect_source("asm")


def test_decode_projections_use_it_and_prefill_does_not(tiny_models):
    """On a CPU with the instruction, every decode projection of a q4f32 model is this kernel; prefill's stay float."""
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline

    imported = import_hf_model(tiny_models.checkpoint("llama"), TARGET.target, "float32")
    for int8 in (True, False):
        options = pipeline.LowerOptions(FORMATS["q4f32"], 64, 4, int8_activations=int8)
        kernels = pipeline.to_kernels(imported.mod, TARGET, options)
        calls = {name: kernels[name].script().count("int8_dot_gemv") for name in ("decode", "prefill")}
        expected_decode = 4 * 2 + 1 if int8 and TARGET.int8_dot else 0  # qkv, o, gate_up, down per layer; lm_head
        assert calls == {"decode": expected_decode, "prefill": 0}
