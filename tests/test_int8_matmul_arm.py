"""The int8 dot-product matmul on aarch64 (dotprod's sdot, i8mm's usdot) against llama.cpp's arithmetic.

Kernels are cross-compiled here, linked with aarch64-linux-gnu-g++, checked for their
instruction in the disassembly, and run under qemu-aarch64 (`scripts/setup_arm64.sh`'s
emulated Python with TVM's runtime) against the numpy reference of llama.cpp's Q8_0
activation rounding, as `test_int8_matmul.py` does on x86. The weights are the same
interleaved bytes x86 reads.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import tvm
from helpers import q8_0_activations
from tvm.target import Target

from ember.ir.quant_formats import FORMATS, INTERLEAVED
from ember.schedules import int8_matmul
from ember.targets.int8_dot import int8_dot_of

CROSS_CXX = "aarch64-linux-gnu-g++"
# Level -> (CPU, features, the instruction its code must use).
LEVELS = {"dotprod": ("cortex-a76", ["+neon", "+dotprod"], "sdot"),
          "i8mm": ("neoverse-v1", ["+neon", "+dotprod", "+i8mm"], "usdot")}
VECTOR_BITS = 128
# (format, n, k, batch, seq, many_tokens): decode of a batch (a tile of sequences and a tail), an odd
# number of groups, prefill with a partial tile; q4f32_zp (Q4_1: a minimum per group) in decode and prefill.
CASES = [("q8f32", 40, 128, 3, 1, False), ("q4f32", 40, 128, 5, 1, False),
         ("q8f32", 8, 2080, 1, 1, False), ("q4f32", 64, 320, 1, 7, True), ("q8f32", 64, 320, 1, 7, True),
         ("q4f32_zp", 40, 128, 3, 1, False), ("q4f32_zp", 64, 320, 1, 7, True)]
RUNNER = """
import sys, numpy as np, tvm
lib = tvm.runtime.load_module(sys.argv[1])
data = dict(np.load(sys.argv[2]))
out = {}
for symbol in sorted({name.split(":")[0] for name in data}):
    arity = sum(name.startswith(symbol + ":") for name in data)  # x, the weight's parts, y
    args = [tvm.runtime.tensor(data[f"{symbol}:{position}"]) for position in range(arity)]
    lib[symbol](*args)
    out[symbol] = args[-1].numpy()
np.savez(sys.argv[3], **out)
"""


def aarch64_target(level: str) -> Target:
    cpu, features, _instruction = LEVELS[level]
    return Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": cpu, "mattr": features})


def test_levels_follow_the_features():
    """sdot with +dotprod, usdot with +i8mm; a NEON-only target has no int8 path (the float path)."""
    assert int8_dot_of(aarch64_target("dotprod")).level == "dotprod"
    assert int8_dot_of(aarch64_target("i8mm")).level == "i8mm"
    assert int8_dot_of(Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72",
                               "mattr": ["+neon"]})) is None


def test_tiles_count_row_blocks_against_the_register_budget():
    """A tile entry is a row block, two 128-bit multiplies on NEON: prefill tiles hold up to 4 entries
    (tokens x blocks), as on 256-bit x86, where a 512-bit multiply's two blocks are one entry."""
    dot = int8_dot_of(aarch64_target("dotprod"))
    tiles = {(tokens, blocks) for tokens, blocks, _unroll in int8_matmul.knob_space(768, dot, True, 128, 4)}
    assert tiles == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}


@pytest.mark.parametrize("level", LEVELS)
def test_matches_llama_cpp_arithmetic_under_emulation(level, arm64_python, tmp_path):
    target = aarch64_target(level)
    dot = int8_dot_of(target)
    funcs, inputs, expected = {}, {}, {}
    for index, (name, n, k, batch, seq, many_tokens) in enumerate(CASES):
        fmt = FORMATS[name]
        rng = np.random.default_rng(index)
        parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
        x = rng.standard_normal((batch, seq, k)).astype(np.float32)
        symbol = f"case{index}"
        funcs[symbol] = int8_matmul.int8_dot_matmul(fmt, n, k, dot, many_tokens, VECTOR_BITS).with_attr(
            "global_symbol", symbol)
        expected[symbol] = q8_0_activations(x) @ fmt.dequantize(parts, k, INTERLEAVED).astype(np.float64).T
        y = np.zeros(expected[symbol].shape, np.float32)
        for position, value in enumerate([x, *(parts[part] for part in fmt.parts), y]):
            inputs[f"{symbol}:{position}"] = value
    library = tmp_path / f"{level}.so"
    tvm.compile(tvm.IRModule(funcs), target=target).export_library(str(library), cc=CROSS_CXX)
    disassembly = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(library)], capture_output=True,
                                 text=True, check=True).stdout
    instruction = LEVELS[level][2]
    assert f"\t{instruction}\t" in disassembly, f"no {instruction} in the {level} kernels"

    np.savez(tmp_path / "inputs.npz", **inputs)
    (tmp_path / "runner.py").write_text(RUNNER)
    run = subprocess.run([*arm64_python, str(tmp_path / "runner.py"), str(library), str(tmp_path / "inputs.npz"),
                          str(tmp_path / "outputs.npz")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    outputs = np.load(tmp_path / "outputs.npz")
    for symbol, reference in expected.items():
        np.testing.assert_allclose(outputs[symbol], reference, rtol=0, atol=1e-5 * np.abs(reference).max(),
                                   err_msg=f"{level} {CASES[int(symbol[4:])]}")
