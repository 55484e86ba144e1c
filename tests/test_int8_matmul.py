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
from helpers import call_matmul_kernel, llama_cpp_matmul_reference, q8_0_activations

from ember.ir.quant_formats import FORMATS, INTERLEAVED
from ember.schedules import int8_matmul
from ember.targets.registry import resolve_target

TARGET = resolve_target("cpu")
needs_int8_dot = pytest.mark.skipif(TARGET.int8_dot is None, reason="this CPU has no int8 dot-product instruction")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


CPU_FLAGS = _cpu_flags()
# One CPU per ISA level (int8_dot's level; None: the float path), and the /proc/cpuinfo
# flags of the extensions its code may use: this host runs a level's code if it has them all.
LEVELS = {
    "avx512vnni": ("cascadelake", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                                   "avx512_vnni"}),
    "avxvnni": ("alderlake", {"avx2", "fma", "avx_vnni", "gfni", "vaes", "vpclmulqdq", "sha_ni"}),
    "avx512": ("skylake-avx512", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}),
    "avx2": ("haswell", {"avx2", "fma", "bmi2", "f16c", "movbe"}),
    None: ("nehalem", {"sse4_2", "popcnt"}),
}


def level_target(level):
    """The target of an ISA level's CPU, or a skip when this host cannot run its code."""
    cpu, flags = LEVELS[level]
    if not flags <= CPU_FLAGS:
        pytest.skip(f"this CPU cannot run {cpu} code (no {', '.join(sorted(flags - CPU_FLAGS))} in /proc/cpuinfo)")
    return resolve_target(f'{{"kind": "llvm", "mcpu": "{cpu}"}}')


INT8_LEVELS = [level for level in LEVELS if level]


def _compile(target, fmt, n, k, many_tokens):
    func = int8_matmul.int8_dot_matmul(fmt, n, k, target.int8_dot, many_tokens, target.vector_bits)
    return tvm.compile(tvm.IRModule({"main": func}), target=target.target)


def _run(target, fmt, parts, x, n, many_tokens, batch=1):
    """y [rows, n] from the kernel compiled for `target`, with x [rows, k] as `batch` sequences."""
    return call_matmul_kernel(_compile(target, fmt, n, x.shape[1], many_tokens), fmt, parts, x, n, batch)


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("n,k,batch,seq,many_tokens", [
    (96, 64, 1, 1, False), (40, 128, 3, 1, False),  # decode: one token per sequence, a batch of them
    (8, 2080, 1, 1, False),  # an odd number of groups (65), one row block
    (64, 320, 1, 7, True),  # prefill: a full and a partial tile of activation rows
    (40, 96, 1, 13, True),  # an odd number of row blocks and of groups: one block per register tile
    (16, 512, 2, 2, True),  # two sequences' rows in one tile
])
def test_matches_llama_cpp_arithmetic(level, name, n, k, batch, seq, many_tokens):
    target = level_target(level)
    assert target.int8_dot.level == level
    fmt = FORMATS[name]
    rows = batch * seq
    rng = np.random.default_rng(n + k + rows)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    parts = fmt.quantize(weight, INTERLEAVED)
    actual = _run(target, fmt, parts, x, n, many_tokens, batch)
    expected, exact = llama_cpp_matmul_reference(fmt, parts, x, k)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert np.abs(actual - exact).max() > 1e-4 * np.abs(exact).max()  # the rounding is really there


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
def test_decode_of_a_batch_matches_llama_cpp_arithmetic(level, name):
    """One decode kernel run with 1 to 17 sequences: whole tiles of sequences, a tail of fewer
    than a tile (by tiles of halving sizes down to 1 row, or past a few rows of an 8-row tile
    one more whole tile over padded activations: `padded_tail_rows`), or both.
    AVX512-VNNI's int4 whole tiles multiply pairs of blocks on 512-bit registers, their halving
    tails each block on 256-bit ones (`wide_decode_tiles`). Each row is the same to the bit as
    that sequence decoded alone: a server's batch never changes a request's tokens."""
    target = level_target(level)
    fmt = FORMATS[name]
    n, k = 48, 160  # 6 row blocks, 5 groups
    rng = np.random.default_rng(k)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    lib = _compile(target, fmt, n, k, many_tokens=False)
    for batch in range(1, 18):
        x = rng.standard_normal((batch, k)).astype(np.float32) * rng.uniform(0.1, 10, (batch, 1)).astype(np.float32)
        expected, _exact = llama_cpp_matmul_reference(fmt, parts, x, k)
        actual = call_matmul_kernel(lib, fmt, parts, x, n, batch)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=f"{batch} sequences")
        alone = np.concatenate([call_matmul_kernel(lib, fmt, parts, x[row:row + 1], n) for row in range(batch)])
        np.testing.assert_array_equal(actual, alone, err_msg=f"{batch} sequences against each alone")


def _integer_weight(fmt, values):
    """Interleaved parts storing the integers `values` [n, k] with scale 1 (any value of the format's range) and,
    with a zero point, minimum 0."""
    n, k = values.shape
    groups = np.ones((n, k // fmt.group_size), np.float32)
    return fmt.pack(values, groups, groups * 0 if fmt.zero_point else None, INTERLEAVED)


def _integer_range(fmt) -> tuple[int, int]:
    return (-127, 127) if fmt.bits == 8 else (0, 15) if fmt.zero_point else (-8, 7)


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("rows,many_tokens", [(1, False), (5, False), (5, True)])
def test_integer_dot_products_are_exact(level, name, rows, many_tokens):
    """Integer weights (scale 1) and activations whose every group holds a +-127 (scale 1): the
    kernel's output is its integer dot products, equal to numpy's bit for bit (decode: one
    sequence, and 5 in tiles and a tail)."""
    target = level_target(level)
    fmt = FORMATS[name]
    n, k = 24, 160
    low, high = _integer_range(fmt)
    rng = np.random.default_rng(rows)
    values = rng.integers(low, high + 1, (n, k))
    x = rng.integers(-127, 128, (rows, k))
    x[:, ::32] = rng.choice([-127, 127], (rows, k // 32))
    actual = _run(target, fmt, _integer_weight(fmt, values), x.astype(np.float32), n, many_tokens,
                  batch=1 if many_tokens else rows)
    np.testing.assert_array_equal(actual, x @ values.T)


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
def test_extreme_values_do_not_saturate(level, name):
    """Every weight at the format's minimum or maximum times activations all +127 or all -127, and
    alternating signs: the largest sums each step and group can reach (vpmaddubsw's int16 pairs
    saturate at 32767; see the kernel's docstring for the bounds), computed exactly."""
    target = level_target(level)
    fmt = FORMATS[name]
    low, high = _integer_range(fmt)
    k = 64
    alternating = np.where(np.arange(k) % 2, low, high)
    values = np.stack([np.full(k, high)] * 4 + [np.full(k, low)] * 3 + [alternating])  # one row block
    x = np.stack([np.full(k, 127), np.full(k, -127), np.where(np.arange(k) % 2, -127, 127)])
    actual = _run(target, fmt, _integer_weight(fmt, values), x.astype(np.float32), 8, many_tokens=True)
    np.testing.assert_array_equal(actual, x @ values.T)
    assert np.abs(actual).max() == k * 127 * max(-low, high)


def test_formats_and_shapes_it_takes():
    assert int8_matmul.supports(FORMATS["q4f32"], 768, 768) and int8_matmul.supports(FORMATS["q8f32"], 8, 2080)
    assert not int8_matmul.supports(FORMATS["q4f32"], 100, 768)  # rows in whole blocks of 8
    assert not int8_matmul.supports(FORMATS["q8f32"], 64, 80)  # K in whole groups of 32
    assert int8_matmul.supports(FORMATS["q4f32_zp"], 768, 768)  # Q4_1: the minimum times the activations' sum
    for name in ("q0f32", "q4f16", "q8f16", "q4f16_zp"):
        assert not int8_matmul.supports(FORMATS[name], 768, 768)


@pytest.mark.parametrize("cpu,level", [("icelake-server", "avx512vnni"), ("cascadelake", "avx512vnni"),
                                       ("alderlake", "avxvnni"), ("skylake-avx512", "avx512"),
                                       ("haswell", "avx2"), ("znver3", "avx2"), ("nehalem", None), ("x86-64", None)])
def test_targets_choose_the_level_by_cpu_features(cpu, level):
    dot = resolve_target(f'{{"kind": "llvm", "mcpu": "{cpu}"}}').int8_dot
    assert (dot and dot.level) == level
    if dot:
        assert dot.accumulates == level.endswith("vnni")


# Instructions each level's kernel must use, and must not.
INSTRUCTIONS = {"avx512vnni": ({"vpdpbusd"}, {"vpmaddubsw"}), "avxvnni": ({"vpdpbusd"}, {"vpmaddubsw"}),
                "avx512": ({"vpmaddubsw", "vpmaddwd"}, {"vpdpbusd"}),
                "avx2": ({"vpmaddubsw", "vpmaddwd"}, {"vpdpbusd"})}


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("name", ["q8f32", "q4f32"])
def test_each_level_compiles_to_its_instructions(level, name):
    """Compiled, not run (any host): the assembly has the level's dot product; without VNNI, int8
    weights take the sign trick (vpsignb) and int4 groups widen once (a vpmaddwd per 8 vpmaddubsw).
    Decode's tile of sequences transforms each weight word once for all of them: fewer nibble
    shifts (int4) and |v| (the sign trick) than the dot products and signed activations they feed,
    which a 1-sequence tile (the batch's last row) has one for one. Decode prefetches the weight stream
    ahead of its loads (`prefetch_distance`)."""
    target = resolve_target(f'{{"kind": "llvm", "mcpu": "{LEVELS[level][0]}"}}')
    bits = FORMATS[name].bits
    assert int8_matmul.register_tile(target.vector_bits, True, target.int8_dot, bits) == (
        (4, 4) if level == "avx512vnni" else (4, 2) if level == "avx512" else (2, 2) if level == "avxvnni"
        else (2, 1) if bits == 8 else (1, 4))
    # Decode: as many sequences as AVX-512's (8) or AVX-VNNI's (4) register budget; AVX2 in pairs.
    assert int8_matmul.register_tile(target.vector_bits, False, target.int8_dot, bits) == (
        {"avx512vnni": 8, "avx512": 8, "avxvnni": 4}.get(level, 2), 1)
    func = int8_matmul.int8_dot_matmul(FORMATS[name], 8, 128, target.int8_dot, False, target.vector_bits)
    asm = tvm.compile(tvm.IRModule({"main": func}), target=target.target).mod.inspect_source("asm")
    used, unused = INSTRUCTIONS[level]
    # A one-block weight's decode multiplies on 256-bit registers at every level (see kernel_dot)
    assert not [line for line in asm.splitlines() if multiply_of(used) in line and "zmm" in line]
    mnemonics = set(asm.split())
    assert used <= mnemonics and not unused & mnemonics
    assert "prefetcht0" in mnemonics
    multiply = multiply_of(used)
    if "vpmaddubsw" in used:
        assert ("vpsignb" in mnemonics) == (name == "q8f32")
        assert asm.count("vpmaddubsw") == asm.count("vpmaddwd") * (1 if name == "q8f32" else 8)
    if name == "q4f32":  # a shift per word (its high nibbles), two dot products per word and sequence
        assert 0 < asm.count("vpsrld") < asm.count(multiply) / 2
    elif multiply == "vpmaddubsw":
        assert 0 < asm.count("vpabsb") < asm.count("vpsignb")


def multiply_of(used: set[str]) -> str:
    return "vpmaddubsw" if "vpmaddubsw" in used else "vpdpbusd"


@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
def test_avx512_vnni_prefill_multiplies_16_rows(name):
    """Compiled, not run: AVX512-VNNI prefill multiplies two interleaved blocks (16 rows) per 512-bit
    vpdpbusd, their words joined from two 256-bit loads; a weight of one block (8 rows) and decode's
    single sequences keep the 256-bit multiply. Prefill, which reads its weights from cache, prefetches nothing."""
    target = resolve_target('{"kind": "llvm", "mcpu": "icelake-server"}')
    dot = target.int8_dot
    assert dot.lanes == 16 and dot.for_rows(24).lanes == 8 and dot.for_rows(32).lanes == 16
    assert int8_matmul.kernel_dot(dot, 32, many_tokens=False).lanes == 8

    def multiplies(n: int) -> set[str]:
        func = int8_matmul.int8_dot_matmul(FORMATS[name], n, 128, dot, True, target.vector_bits)
        asm = tvm.compile(tvm.IRModule({"main": func}), target=target.target).mod.inspect_source("asm")
        lines = [line for line in asm.splitlines() if "vpdpbusd" in line]
        assert lines and "prefetch" not in asm
        return {register for line in lines for register in ("ymm", "zmm") if register in line}

    assert multiplies(32) == {"zmm"}
    assert multiplies(8) == {"ymm"}
    assert int8_matmul.knob_space(32, dot, True, 512, FORMATS[name].bits)[0] == [4, 4, 1]
    assert all(knobs[1] % 2 == 0 for knobs in int8_matmul.knob_space(32, dot, True, 512, FORMATS[name].bits))


@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
def test_avx512_vnni_int4_decode_multiplies_16_rows_for_whole_tiles_of_sequences(name):
    """Compiled, not run: AVX512-VNNI int4 decode's whole tiles of 8 sequences multiply two blocks per
    512-bit vpdpbusd and the rows past them one block per 256-bit one, each tile prefetching its stream;
    int8 decode and a weight of an odd number of blocks stay on 256-bit multiplies (`wide_decode_tiles`)."""
    target = resolve_target('{"kind": "llvm", "mcpu": "icelake-server"}')
    bits = FORMATS[name].bits

    def multiplies(n: int) -> set[str]:
        func = int8_matmul.int8_dot_matmul(FORMATS[name], n, 128, target.int8_dot, False, target.vector_bits)
        asm = tvm.compile(tvm.IRModule({"main": func}), target=target.target).mod.inspect_source("asm")
        assert "prefetcht0" in asm
        lines = [line for line in asm.splitlines() if "vpdpbusd" in line]
        return {register for line in lines for register in ("ymm", "zmm") if register in line}

    assert multiplies(32) == ({"ymm", "zmm"} if bits == 4 else {"ymm"})
    assert multiplies(24) == {"ymm"}
    assert int8_matmul.rule_knobs(32, target.int8_dot, False, 512, bits) == ([8, 2, 1] if bits == 4 else [8, 1, 1])


@pytest.mark.parametrize("cpu", [None, "haswell", "nehalem"])
def test_every_projection_uses_it(tiny_models, cpu):
    """On a CPU with an int8 dot product (this one; AVX2), every projection of a q4f32 model, decode and
    prefill, is this kernel (prefill's, on a CPU with AMX, the tile kernel holding it); with float activations, or
    without AVX2, none is, and the weights stay row-major."""
    from ember.frontend.hf import import_hf_model
    from ember.ir.weight_recipes import get_recipes
    from ember.ir_passes import pipeline

    target = TARGET if cpu is None else resolve_target(f'{{"kind": "llvm", "mcpu": "{cpu}"}}')
    imported = import_hf_model(tiny_models.checkpoint("llama"), target.target, "float32")
    for int8 in (True, False):
        options = pipeline.LowerOptions(FORMATS["q4f32"], 64, 4, int8_activations=int8)
        kernels = pipeline.to_kernels(imported.mod, target, options)
        tiles = target.int8_dot is not None and target.int8_dot.tiles
        kernels_of = {"decode": ("int8_dot_matmul",),
                      "prefill": ("amx_bf16_matmul", "amx_int8_matmul") if tiles else ("int8_dot_matmul",)}
        calls = {stage: sum(kernels[stage].script().count(name) for name in names)
                 for stage, names in kernels_of.items()}
        expected = 4 * 2 + 1 if int8 and target.int8_dot else 0  # qkv, o, gate_up, down per layer; lm_head
        assert calls == {"decode": expected, "prefill": expected}
        assert cpu != "haswell" or not int8 or expected  # the AVX2 path is taken
        layouts = {recipe["layout"] for name, recipe in get_recipes(kernels).items()
                   if name.endswith("_proj.weight.packed")}
        assert layouts == {"interleaved" if expected else "rows"}


@pytest.mark.parametrize("level", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("name", ["q8f32", "q4f32"])
@pytest.mark.parametrize("n,k", [(16, 96), (12, 64), (16, 80), (16, 33)])
@pytest.mark.parametrize("seq", [1, 5])
def test_shapes_it_does_not_take_fall_back_to_the_float_path(level, name, n, k, seq):
    """The quantization pass gives a projection the int8 kernel only where `supports` says so (rows in
    blocks of 8, K in whole groups: not 12 rows, K = 80 or an odd 33); the rest run the float path,
    compiled for the level, equal to the float reference (the int8 kernel to the int8-rounded one)."""
    from tvm import relax

    from ember.ir.weight_recipes import get_recipes, set_recipes
    from ember.ir_passes.quantize_weights import quantize_weights

    target = level_target(level)
    fmt = FORMATS[name]
    builder = relax.BlockBuilder()
    x_var = relax.Var("x", relax.TensorType((1, seq, k), "float32"))
    w_var = relax.Var("w", relax.TensorType((n, k), "float32"))
    with builder.function("main", [x_var, w_var], attrs={"num_input": 1}):
        with builder.dataflow():
            y_var = builder.emit_output(relax.op.matmul(x_var, relax.op.permute_dims(w_var)))
        builder.emit_func_output(y_var)
    mod = set_recipes(builder.get(), {"w": {"op": "load", "name": "w"}})
    with target.target:
        mod = quantize_weights(fmt, int8_dot=target.int8_dot, vector_bits=target.vector_bits)(mod)
    layout = get_recipes(mod)["w.packed"]["layout"]
    assert (layout == INTERLEAVED) == int8_matmul.supports(fmt, n, k)
    assert ("int8_dot_matmul" in mod["main"].script()) == (layout == INTERLEAVED)

    rng = np.random.default_rng(n + k + seq)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((1, seq, k)).astype(np.float32)
    parts = fmt.quantize(weight, layout)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target.target), tvm.cpu())
    actual = vm["main"](tvm.runtime.tensor(x), *(tvm.runtime.tensor(parts[p]) for p in fmt.parts)).numpy()
    dequantized = fmt.dequantize(parts, k, layout).astype(np.float64)
    expected = (q8_0_activations(x) if layout == INTERLEAVED else x.astype(np.float64)) @ dequantized.T
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("level", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("name", ["q8f32", "q4f32"])
@pytest.mark.slow
def test_every_tuning_knob_tuple_matches_llama_cpp_arithmetic(level, name):
    """Each knob tuple `ember tune` may choose (register tile, row blocks, word loop unrolled or not),
    prefill at 7 tokens (partial tiles) and decode at 11 sequences (tiles and a tail), equals the numpy reference."""
    target = level_target(level)
    fmt = FORMATS[name]
    n, k = 32, 96  # 4 row blocks, 3 groups
    rng = np.random.default_rng(7)
    parts = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32), INTERLEAVED)
    expected = {}
    kernels = {}
    for many_tokens, (batch, seq) in ((True, (1, 7)), (False, (11, 1))):
        x = rng.standard_normal((batch, seq, k)).astype(np.float32)
        expected[many_tokens] = (x, q8_0_activations(x) @ fmt.dequantize(parts, k, INTERLEAVED).astype(np.float64).T)
        space = int8_matmul.knob_space(n, target.int8_dot, many_tokens, target.vector_bits, fmt.bits)
        assert space[0] == int8_matmul.rule_knobs(n, target.int8_dot, many_tokens, target.vector_bits, fmt.bits)
        assert len(space) == len({tuple(knobs) for knobs in space}) >= (12 if many_tokens else 6)
        for knobs in space:
            func = int8_matmul.int8_dot_matmul(fmt, n, k, target.int8_dot, many_tokens, target.vector_bits, knobs)
            kernels[f"k{len(kernels)}"] = (many_tokens, knobs, func.with_attr("global_symbol", f"k{len(kernels)}"))
    # One module: one LLVM run for every variant.
    lib = tvm.compile(tvm.IRModule({symbol: func for symbol, (_m, _k, func) in kernels.items()}), target=target.target)
    for symbol, (many_tokens, knobs, _func) in kernels.items():
        x, reference = expected[many_tokens]
        y = tvm.runtime.tensor(np.zeros((*x.shape[:2], n), np.float32))
        lib[symbol](tvm.runtime.tensor(x), *(tvm.runtime.tensor(parts[p]) for p in fmt.parts), y)
        np.testing.assert_allclose(y.numpy(), reference, rtol=0, atol=1e-5 * np.abs(reference).max(),
                                   err_msg=f"knobs {knobs}, many_tokens={many_tokens}")


def test_knobs_outside_the_space_are_refused():
    """A tile over the register budget, or row blocks that do not divide the weight's, is no kernel; nor is
    a decode tile of other than the rule's sequences (decode is tuned with one sequence, which never sees it)."""
    target = resolve_target('{"kind": "llvm", "mcpu": "haswell"}')
    fmt = FORMATS["q4f32"]
    decode = [int8_matmul.DECODE_TOKENS * 2, 1, 0]
    for knobs in ([4, 4, 0], [4, 2, 1], [1, 4, 0], decode):  # over 4 tile entries; 4 blocks of 6; decode: 4 rows
        with pytest.raises(ValueError, match="not among"):
            int8_matmul.int8_dot_matmul(fmt, 48, 64, target.int8_dot, knobs != decode, target.vector_bits, knobs)


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("name", ["q8f32", "q4f32", "q4f32_zp"])
@pytest.mark.parametrize("many_tokens", [False, True])
def test_expert_projection_is_the_dense_kernel_on_each_experts_pairs(level, name, many_tokens):
    """`moe_matmul` with the int8 dot product (`int8_matmul.int8_dot_experts`): each pair's row equals, to the bit,
    the dense kernel's on that expert's weight, and llama.cpp's arithmetic. The pairs come in any order and the
    experts get 0, 1, 3, 5, 7, 8, 9 and 17 of them (whole register tiles, halving and padded tails: 5 and 7 are
    where decode's padded tiles start), so a tile reading past its expert's rows is seen."""
    from ember.schedules.moe import moe_matmul

    target = level_target(level)
    fmt = FORMATS[name]
    counts = [3, 0, 1, 9, 5, 17, 7, 8]
    experts, n, k = len(counts), 48, 96
    rng = np.random.default_rng(len(name) + many_tokens)
    pair_experts = rng.permutation(np.repeat(np.arange(experts), counts))
    order = np.argsort(pair_experts, kind="stable").astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = rng.standard_normal((pair_experts.size, k)).astype(np.float32) * rng.uniform(
        0.1, 10, (pair_experts.size, 1)).astype(np.float32)
    parts = fmt.quantize(rng.standard_normal((experts * n, k)).astype(np.float32), INTERLEAVED)
    kernel = moe_matmul(fmt, experts, n, k, target.vector_bits, target.int8_dot, many_tokens)
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target.target)
    y = tvm.runtime.tensor(np.zeros((pair_experts.size, n), np.float32))
    lib["main"](tvm.runtime.tensor(x), *(tvm.runtime.tensor(parts[p]) for p in fmt.parts), tvm.runtime.tensor(order),
                tvm.runtime.tensor(offsets), y)
    actual = y.numpy()
    dense = _compile(target, fmt, n, k, many_tokens)
    blocks = n // 8
    for expert in range(experts):
        pairs = np.flatnonzero(pair_experts == expert)
        if not pairs.size:
            continue
        own = {part: value[expert * blocks:(expert + 1) * blocks] for part, value in parts.items()}
        rows = x[pairs]
        np.testing.assert_array_equal(actual[pairs], call_matmul_kernel(dense, fmt, own, rows, n, rows.shape[0]),
                                      err_msg=f"expert {expert}")
        expected, _exact = llama_cpp_matmul_reference(fmt, own, rows, k)
        np.testing.assert_allclose(actual[pairs], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
