"""The int8 dot-product matmul (`schedules/int8_matmul.py`) against llama.cpp's arithmetic.

llama.cpp multiplies Q4_0/Q8_0 weights by activations rounded to Q8_0: per group of
32, d = max|x| / 127 and q = round(x / d). The reference here is that rule in numpy
(float64 sums of the dequantized weight times q * d): the kernel must agree to float
rounding, in its decode and prefill variants, for full and partial register tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from ember.ir_passes.quant_formats import FORMATS, INTERLEAVED
from ember.schedules import int8_matmul
from ember.targets.registry import resolve_target
from helpers import q8_0_activations

TARGET = resolve_target("cpu")
needs_int8_dot = pytest.mark.skipif(TARGET.int8_dot is None, reason="this CPU has no int8 dot-product instruction")


@needs_int8_dot
@pytest.mark.parametrize("name", ["q8f32", "q4f32"])
@pytest.mark.parametrize("n,k,batch,seq,many_tokens", [
    (96, 64, 1, 1, False), (40, 128, 3, 1, False),  # decode: one token per sequence, a batch of them
    (64, 320, 1, 7, True),  # prefill: a full and a partial tile of activation rows
    (40, 96, 1, 13, True),  # an odd number of row blocks: one block per register tile
    (16, 512, 2, 2, True),  # two sequences' rows in one tile
])
def test_matches_llama_cpp_arithmetic(name, n, k, batch, seq, many_tokens):
    fmt = FORMATS[name]
    rows = batch * seq
    rng = np.random.default_rng(n + k + rows)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    parts = fmt.quantize(weight, INTERLEAVED)
    func = int8_matmul.int8_dot_matmul(fmt, n, k, TARGET.int8_dot, many_tokens, TARGET.vector_bits)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET.target)
    y = tvm.runtime.tensor(np.zeros((batch, seq, n), np.float32))
    lib["main"](tvm.runtime.tensor(x.reshape(batch, seq, k)), *(tvm.runtime.tensor(parts[p]) for p in fmt.parts), y)
    dequantized = fmt.dequantize(parts, k, INTERLEAVED).astype(np.float64)
    expected = q8_0_activations(x) @ dequantized.T
    actual = y.numpy().reshape(rows, n)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-6 * np.abs(expected).max())
    exact = x.astype(np.float64) @ dequantized.T
    assert np.abs(actual - exact).max() > 1e-4 * np.abs(exact).max()  # the rounding is really there


def test_formats_and_shapes_it_takes():
    assert int8_matmul.supports(FORMATS["q4f32"], 768, 768) and int8_matmul.supports(FORMATS["q8f32"], 8, 2080)
    assert not int8_matmul.supports(FORMATS["q4f32"], 100, 768)  # rows in whole blocks of 8
    assert not int8_matmul.supports(FORMATS["q8f32"], 64, 80)  # K in whole groups of 32
    for name in ("q0f32", "q4f16", "q8f16", "q4f32_zp"):
        assert not int8_matmul.supports(FORMATS[name], 768, 768)


@pytest.mark.parametrize("spec,has", [('{"kind": "llvm", "mcpu": "skylake-avx512"}', False),
                                      ('{"kind": "llvm", "mcpu": "icelake-server"}', True),
                                      ('{"kind": "llvm", "mcpu": "alderlake"}', True),
                                      ('{"kind": "llvm", "mcpu": "haswell"}', False)])
def test_targets_choose_the_instruction_by_cpu_features(spec, has):
    assert (resolve_target(spec).int8_dot is not None) == has


def test_compiles_for_avx_vnni():
    """Alder Lake's AVX-VNNI form of the instruction (no AVX-512, 16 vector registers) compiles too."""
    target = resolve_target('{"kind": "llvm", "mcpu": "alderlake"}')
    assert int8_matmul.register_tile(target.vector_bits, many_tokens=True) == (2, 2)
    func = int8_matmul.int8_dot_matmul(FORMATS["q4f32"], 16, 128, target.int8_dot, True, target.vector_bits)
    assert "vpdpbusd" in tvm.compile(tvm.IRModule({"main": func}), target=target.target).mod.inspect_source("asm")


def test_every_projection_uses_it(tiny_models):
    """On a CPU with the instruction, every projection of a q4f32 model, decode and prefill, is this kernel;
    with float activations none is, and the weights stay row-major."""
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline
    from ember.ir_passes.weight_recipes import get_recipes

    imported = import_hf_model(tiny_models.checkpoint("llama"), TARGET.target, "float32")
    for int8 in (True, False):
        options = pipeline.LowerOptions(FORMATS["q4f32"], 64, 4, int8_activations=int8)
        kernels = pipeline.to_kernels(imported.mod, TARGET, options)
        calls = {name: kernels[name].script().count("int8_dot_matmul") for name in ("decode", "prefill")}
        expected = 4 * 2 + 1 if int8 and TARGET.int8_dot else 0  # qkv, o, gate_up, down per layer; lm_head
        assert calls == {"decode": expected, "prefill": expected}
        layouts = {recipe["layout"] for name, recipe in get_recipes(kernels).items() if name.endswith("_proj.weight.packed")}
        assert layouts == {"interleaved" if expected else "rows"}
