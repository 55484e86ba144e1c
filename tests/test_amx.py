"""The AMX int8 matmul (schedules/amx_matmul.py): the VNNI kernel's numbers on AMX tiles, its instructions; how a
target chooses tiles (bfloat16 ones, `test_amx_bf16_matmul.py`, or int8 ones), a whole model on them, and Linux's
tile permission (runtime/amx.py)."""

from __future__ import annotations

import errno
import re

import numpy as np
import pytest
import tvm
from helpers import call_matmul_kernel, llama_cpp_matmul_reference

from ember.core.errors import ArtifactError
from ember.core.machine import host_cpu_flags
from ember.ir.quant_formats import FORMATS, INTERLEAVED
from ember.runtime import amx
from ember.schedules import amx_matmul, int8_matmul
from ember.targets.registry import resolve_target

AMX_TARGET = resolve_target('{"kind": "llvm", "mcpu": "sapphirerapids"}')
VNNI_TARGET = resolve_target('{"kind": "llvm", "mcpu": "cascadelake"}')
# AMX-INT8 without AMX-BF16: prefill on int8 tiles.
INT8_TILES_TARGET = resolve_target('{"kind": "llvm", "mcpu": "icelake-server", "mattr": ["+amx-tile", "+amx-int8"]}')


def _runnable(target):
    """`target`, or a skip naming the CPU flags its code needs and this host lacks."""
    missing = sorted(set(target.cpu_features) - set(host_cpu_flags()))
    if missing:
        pytest.skip(f"this CPU cannot run {target.tvm_target.get('mcpu')} code (no {', '.join(missing)})")
    return target


@pytest.fixture(scope="module")
def amx_host():
    """The AMX target on a host that runs it, with this process's tile permission granted."""
    target = _runnable(AMX_TARGET)
    amx.request_amx_permission("test_amx")
    return target


def _build(func, target):
    return tvm.compile(tvm.IRModule({"main": func}), target=target.target)


@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("n,k,batch,seq,units", [
    (48, 160, 1, 21, None),  # a whole and a partial 16-row tile; 5 groups: K not a multiple of 64
    (16, 96, 2, 8, None),  # one whole tile of two sequences; 3 groups
    (24, 32, 1, 3, None),  # one group (K = 32), 3 rows of a tile, an odd number of blocks: one block per task
    (32, 224, 1, 17, 1),  # 7 groups, one block per task where they could pair
])
def test_matches_the_vnni_kernel_and_llama_cpp_arithmetic(amx_host, name, n, k, batch, seq, units):
    """Q8_0-rounded activations times the weight (numpy, float64) to 1e-5, and the AVX512-VNNI kernel's output
    on the same inputs to float32 rounding of the same sums."""
    fmt = FORMATS[name]
    rows = batch * seq
    rng = np.random.default_rng(n + k + rows)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    actual = call_matmul_kernel(_build(amx_matmul.amx_int8_matmul(fmt, n, k, units), amx_host), fmt, parts, x, n, batch)
    expected, exact = llama_cpp_matmul_reference(fmt, parts, x, k)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert np.abs(actual - exact).max() > 1e-4 * np.abs(expected).max()  # the rounding is really there
    vnni = _build(int8_matmul.int8_dot_matmul(fmt, n, k, VNNI_TARGET.int8_dot, True, VNNI_TARGET.vector_bits),
                  _runnable(VNNI_TARGET))
    np.testing.assert_allclose(actual, call_matmul_kernel(vnni, fmt, parts, x, n, batch), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("rows", [1, 16, 19])
def test_integer_dot_products_are_exact(amx_host, name, rows):
    """Integer weights (scale 1) and activations whose every group holds a +-127 (scale 1): the output is the
    integer dot products, numpy's to the bit, the extremes of each format's range included."""
    fmt = FORMATS[name]
    n, k = 32, 96
    low, high = (-127, 127) if fmt.bits == 8 else (0, 15) if fmt.zero_point else (-8, 7)
    rng = np.random.default_rng(rows)
    values = rng.integers(low, high + 1, (n, k))
    values[0], values[1] = low, high
    x = rng.integers(-127, 128, (rows, k))
    x[:, ::32] = rng.choice([-127, 127], (rows, k // 32))
    x[0, :] = np.where(np.arange(k) % 2, 127, -127)
    ones = np.ones((n, k // fmt.group_size), np.float32)
    parts = fmt.pack(values, ones, ones * 0 if fmt.zero_point else None, INTERLEAVED)
    kernel = _build(amx_matmul.amx_int8_matmul(fmt, n, k), amx_host)
    actual = call_matmul_kernel(kernel, fmt, parts, x.astype(np.float32), n)
    np.testing.assert_array_equal(actual, x @ values.T)


@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("units,row_tiles", [(4, 2), (4, 1), (2, 2), (1, 2), (1, 1)])
def test_every_tile_blocking_equals_the_vnni_kernel_to_the_bit(amx_host, name, units, row_tiles):
    """Each (units, row_tiles) knob pair: two 16-row column tiles or one (or one block alone), two 16-row A tiles or
    one; 37 rows (a partial row block) and 7 groups (K not a multiple of 64), the VNNI kernel's output to the bit."""
    fmt, n, k, rows = FORMATS[name], 64, 224, 37
    rng = np.random.default_rng(units * 10 + row_tiles)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    tiles = _build(amx_matmul.amx_int8_matmul(fmt, n, k, units, row_tiles=row_tiles), amx_host)
    vnni = _build(int8_matmul.int8_dot_matmul(fmt, n, k, amx_host.int8_dot, True, amx_host.vector_bits), amx_host)
    np.testing.assert_array_equal(call_matmul_kernel(tiles, fmt, parts, x, n),
                                  call_matmul_kernel(vnni, fmt, parts, x, n))


_LONG_K_PARTIAL_TILE = """
import numpy as np, tvm
from ember.ir.quant_formats import FORMATS, INTERLEAVED
from ember.runtime import amx
from ember.schedules import amx_matmul
from ember.targets.registry import resolve_target
amx.request_amx_permission("test")
fmt, n, k, rows = FORMATS["q8f32"], 16, 32768, 17
rng = np.random.default_rng(0)
parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
x = rng.standard_normal((1, rows, k)).astype(np.float32)
lib = tvm.compile(tvm.IRModule({"main": amx_matmul.amx_int8_matmul(fmt, n, k)}),
                  target=resolve_target('{"kind": "llvm", "mcpu": "sapphirerapids"}').target)
y = tvm.runtime.tensor(np.zeros((1, rows, n), np.float32))
lib["main"](tvm.runtime.tensor(x), *(tvm.runtime.tensor(parts[p]) for p in fmt.parts), y)
expected = x[0] @ fmt.dequantize(parts, k, INTERLEAVED).T
print(np.abs(y.numpy()[0] - expected).max() / np.abs(expected).max())
"""


def test_a_partial_row_tile_of_a_long_k_reads_only_its_own_rows(amx_host):
    """17 rows of K = 32768: the last tile's A load spans 16 rows of 32 KiB, past the batch's 17. Run in a child
    process, so that a read past the quantized activations' buffer (a segmentation fault) fails this test alone."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _LONG_K_PARTIAL_TILE], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert float(child.stdout.split()[-1]) < 0.02  # the activations' int8 rounding, nothing more


@pytest.mark.parametrize("name", ["q8f32", "q4f32_zp"])
def test_calls_below_the_row_threshold_run_the_vnni_body(amx_host, name):
    """With the target's dot product, one kernel holds both bodies: calls of fewer than `vnni_below` rows take the
    VNNI one, longer calls the tiles; either equals the VNNI kernel to the bit, on both sides of the threshold."""
    fmt, n, k = FORMATS[name], 48, 160
    rng = np.random.default_rng(3)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    both = _build(amx_matmul.amx_int8_matmul(fmt, n, k, vnni=amx_host.int8_dot, vector_bits=amx_host.vector_bits),
                  amx_host)
    assembly = both.mod.imports[0].inspect_source("s") if both.mod.imports else both.mod.inspect_source("s")
    assert "tdpbssd" in assembly and "vpdpbusd" in assembly
    vnni = _build(int8_matmul.int8_dot_matmul(fmt, n, k, amx_host.int8_dot, True, amx_host.vector_bits), amx_host)
    for rows in (1, amx_matmul.VNNI_BELOW_ROWS - 1, amx_matmul.VNNI_BELOW_ROWS, amx_matmul.VNNI_BELOW_ROWS + 8):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        np.testing.assert_array_equal(call_matmul_kernel(both, fmt, parts, x, n),
                                      call_matmul_kernel(vnni, fmt, parts, x, n), f"{rows} rows")


@pytest.mark.parametrize("name", ["q8f32", "q4f32"])
def test_compiles_to_tile_instructions(name):
    """Compiled, not run (any host): tile config, tile loads, the signed x signed tile dot product, tile stores."""
    fmt = FORMATS[name]
    lib = _build(amx_matmul.amx_int8_matmul(fmt, 32, 160), AMX_TARGET)
    assembly = lib.mod.imports[0].inspect_source("s") if lib.mod.imports else lib.mod.inspect_source("s")
    for instruction in ("ldtilecfg", "tileloadd", "tdpbssd", "tilestored", "tilerelease"):
        assert instruction in assembly, instruction


def test_targets_with_amx_choose_tiles_for_prefill():
    """bfloat16 tiles where the CPU has AMX-BF16 (and AVX512-BF16, which converts to bfloat16), int8 tiles where it
    has AMX-INT8 alone, none without AMX."""
    assert AMX_TARGET.int8_dot.level == "amx" and AMX_TARGET.int8_dot.tiles == "bf16"
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"} <= set(AMX_TARGET.cpu_features)
    assert INT8_TILES_TARGET.int8_dot.level == "amx" and INT8_TILES_TARGET.int8_dot.tiles == "int8"
    assert not VNNI_TARGET.int8_dot.tiles and VNNI_TARGET.int8_dot.level == "avx512vnni"
    assert not resolve_target('{"kind": "llvm", "mcpu": "icelake-server"}').int8_dot.tiles


def test_knobs_outside_the_space_are_refused():
    with pytest.raises(ValueError, match="units 2 are not among"):
        amx_matmul.amx_int8_matmul(FORMATS["q8f32"], 24, 64, units=2)
    with pytest.raises(ValueError, match="units 4 are not among"):
        amx_matmul.amx_int8_matmul(FORMATS["q8f32"], 48, 64, units=4)
    with pytest.raises(ValueError, match="row_tiles 3 are not among"):
        amx_matmul.amx_int8_matmul(FORMATS["q8f32"], 64, 64, row_tiles=3)


def test_tile_config_is_palette_1_with_each_tiles_shape():
    """2 x 2: A tiles 0-1 (16 rows of 32 bytes), B tiles 2-3 (8 rows of 2 blocks' 64 bytes), C tiles 4-7."""
    config = amx_matmul.tile_config(4, 2)
    assert len(config) == 64 and config[0] == 1
    assert config[16:32] == [32, 0, 32, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0, 64, 0] and not any(config[32:48])
    assert config[48:56] == [16, 16, 8, 8, 16, 16, 16, 16] and not any(config[56:])
    one = amx_matmul.tile_config(1, 1)  # one A, one B of one block (32 bytes a row), one C
    assert one[16:26] == [32, 0, 0, 0, 32, 0, 0, 0, 32, 0] and one[48:53] == [16, 0, 8, 0, 16]
    assert not any(one[26:48]) and not any(one[53:])


def test_permission_is_granted_on_an_amx_host(monkeypatch):
    _runnable(AMX_TARGET)
    monkeypatch.setattr(amx, "_granted", False)
    amx.request_amx_permission("model")
    assert amx._granted


def test_a_refused_permission_is_a_one_line_error_naming_the_artifact(monkeypatch):
    monkeypatch.setattr(amx, "_granted", False)
    with pytest.raises(ArtifactError) as refused:
        amx.request_amx_permission("/models/tiny-amx", request=lambda: (-1, errno.EINVAL))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("/models/tiny-amx: ")
    assert "AMX" in message and "Invalid argument" in message and "--target cpu" in message
    assert not amx._granted


def test_only_artifacts_whose_code_may_use_tiles_ask():
    assert amx.needs_amx(list(AMX_TARGET.cpu_features))
    assert not amx.needs_amx(list(VNNI_TARGET.cpu_features))


@pytest.mark.parametrize("target,tile_kernel", [(AMX_TARGET, "amx_bf16_matmul"),
                                                (INT8_TILES_TARGET, "amx_int8_matmul")], ids=["bf16", "int8"])
def test_prefill_projections_are_amx_kernels_and_decode_keeps_vnni(tiny_models, target, tile_kernel):
    """Lowered for an AMX target (any host): every q8f32 projection of prefill is the target's tile kernel (bfloat16
    tiles with AMX-BF16, else int8 ones), every one of decode the VNNI kernel."""
    from ember.frontend.hf import import_hf_model
    from ember.ir_passes import pipeline

    imported = import_hf_model(tiny_models.checkpoint("llama"), target.target, "float32")
    kernels = pipeline.to_kernels(imported.mod, target, pipeline.LowerOptions(FORMATS["q8f32"], 64, 4))
    names = ("amx_bf16_matmul", "amx_int8_matmul", "int8_dot_matmul")
    calls = {stage: {name: kernels[stage].script().count(name) for name in names} for stage in ("decode", "prefill")}
    projections = 4 * 2 + 1  # qkv, o, gate_up, down per layer; lm_head
    assert calls == {"decode": {**dict.fromkeys(names, 0), "int8_dot_matmul": projections},
                     "prefill": {**dict.fromkeys(names, 0), tile_kernel: projections}}


@pytest.mark.parametrize("quantization", ["q8f32", "q4f32"])
def test_model_compiled_for_amx_matches_transformers(tiny_models, tmp_path, monkeypatch, quantization):
    """A tiny q8f32 or q4f32 Llama compiled for an AMX CPU and run here (prefill on bfloat16 tiles, decode on VNNI):
    its logits against transformers on the quantized weights, as every int8 build is checked (`test_quantization`).
    Where Linux refuses the tile state, loading it is a one-line error naming the artifact."""
    import artifact_cache
    from conftest import MAX_BATCH, PREFILL_CHUNK, TinyModel
    from test_quantization import _assert_logits_match_reference

    from ember.core.manifest import read_manifest
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.runtime.artifact import load_artifact

    _runnable(AMX_TARGET)
    model_dir, artifact_dir = tiny_models.checkpoint("llama"), tmp_path / "artifact"
    options = CompileOptions(target='{"kind": "llvm", "mcpu": "sapphirerapids"}', quantization=quantization,
                             prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key(f"tiny-llama-amx-{quantization}", options, [model_dir]),
                         artifact_dir, lambda dest: compile_model(model_dir, dest, options))
    manifest = read_manifest(artifact_dir)
    assert manifest.activations == "int8" and {"amx_tile", "amx_int8"} <= set(manifest.target["cpu_features"])
    _assert_logits_match_reference(TinyModel("llama", model_dir, artifact_dir, quantization=quantization))
    monkeypatch.setattr(amx, "_granted", False)
    monkeypatch.setattr(amx, "_arch_prctl", lambda: (-1, errno.EPERM))
    with pytest.raises(ArtifactError, match=f"^{re.escape(str(artifact_dir))}: Linux refused .*AMX") as refused:
        load_artifact(artifact_dir)
    assert "\n" not in str(refused.value)
