"""Unit tests of ember's IR passes and schedule check on small hand-built modules."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from ember.ir.quant_formats import FORMATS
from ember.ir.weight_recipes import get_recipes, set_recipes, weight_params
from ember.ir_passes.attach_sequence_bounds import attach_sequence_bounds
from ember.ir_passes.capture_cuda_graphs import capture_cuda_graphs
from ember.ir_passes.fold_split_concat import fold_split_concat
from ember.ir_passes.fuse_parallel_projections import fuse_parallel_projections
from ember.ir_passes.pack_float_panels import pack_float_panels, to_panels
from ember.ir_passes.quantize_weights import quantize_weights
from ember.schedules.check import check_all_scheduled


def _projection_module() -> tvm.IRModule:
    """x[n, 8] projected by three weights sharing x, and one that does not share it."""
    n = tvm.tirx.Var("seq_len", "int64")
    x = relax.Var("x", relax.TensorType([n, 8], "float32"))
    y = relax.Var("y", relax.TensorType([n, 6], "float32"))
    weights = {
        "a.q_proj.weight": [4, 8], "a.k_proj.weight": [2, 8], "a.v_proj.weight": [2, 8], "a.o_proj.weight": [5, 6],
    }
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in weights.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y, *params], attrs={"num_input": 2}):
        with bb.dataflow():
            outs = [bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)))) for w in params[:3]]
            other = bb.emit(relax.op.matmul(y, bb.emit(relax.op.permute_dims(params[3]))))
            result = bb.emit_output(relax.Tuple([*outs, other]))
        bb.emit_func_output(result)
    mod = bb.get()
    return set_recipes(mod, {name: {"op": "load", "name": name} for name in weights})


def _run(mod: tvm.IRModule, inputs: list[np.ndarray]) -> list[np.ndarray]:
    target = tvm.target.Target({"kind": "llvm"})
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    return [o.numpy() for o in out]


def _run_single(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    """`main` of `mod` on one input, one output."""
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def test_fuse_parallel_projections_fuses_shared_input_and_keeps_values() -> None:
    mod = _projection_module()
    fused = fuse_parallel_projections()(mod)

    names = [p.name for p in weight_params(fused["main"])]
    assert names == ["a.q_k_v_proj.weight", "a.o_proj.weight"]
    recipe = get_recipes(fused)["a.q_k_v_proj.weight"]
    assert recipe["op"] == "concat" and [r["name"] for r in recipe["inputs"]] == [
        "a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight"]
    matmuls = []
    relax.analysis.post_order_visit(
        fused["main"].body,
        lambda e: matmuls.append(e) if isinstance(e, relax.Call) and e.op.name == "relax.matmul" else None,
    )
    assert len(matmuls) == 2

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((3, 8), "float32"), rng.standard_normal((3, 6), "float32")
    wq, wk, wv = (rng.standard_normal(s, "float32") for s in ([4, 8], [2, 8], [2, 8]))
    wo = rng.standard_normal((5, 6), "float32")
    expected = _run(mod, [x, y, wq, wk, wv, wo])
    got = _run(fused, [x, y, np.concatenate([wq, wk, wv]), wo])
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def test_fuse_parallel_projections_leaves_single_projections_alone() -> None:
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    w = relax.Var("w", relax.TensorType([3, 4], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    mod = set_recipes(bb.get(), {"w": {"op": "load", "name": "w"}})
    assert fuse_parallel_projections()(mod)["main"].same_as(mod["main"])


def test_fuse_parallel_projections_keeps_weights_of_different_formats_apart() -> None:
    """A GGUF file's v projection in Q6_K (stored 8-bit) beside q and k in Q4_K (4-bit): q and k fuse,
    v stays its own weight, so neither is stored in the other's format."""
    mod = _projection_module()
    q4, q8 = FORMATS["q4f32_zp"], FORMATS["q8f32"]
    formats = {"a.q_proj.weight": q4, "a.k_proj.weight": q4, "a.v_proj.weight": q8}
    fused = fuse_parallel_projections(formats)(mod)
    assert [p.name for p in weight_params(fused["main"])] == ["a.q_k_proj.weight", "a.v_proj.weight",
                                                               "a.o_proj.weight"]
    quantized = quantize_weights(FORMATS["q0f32"], tensor_formats=formats)(fused)
    recipes = get_recipes(quantized)
    assert {name: recipe["format"] for name, recipe in recipes.items() if recipe["op"] == "quantize"} == {
        "a.q_k_proj.weight.packed": "q4f32_zp", "a.q_k_proj.weight.scale": "q4f32_zp",
        "a.q_k_proj.weight.min": "q4f32_zp", "a.v_proj.weight.packed": "q8f32", "a.v_proj.weight.scale": "q8f32"}
    assert recipes["a.o_proj.weight"] == {"op": "load", "name": "a.o_proj.weight"}  # no format: stays float


def test_pack_float_panels_stores_projection_weights_as_panels_and_keeps_values() -> None:
    """Projection-only float weights whose rows a panel divides become [N/P, K, P] (recipe and graph
    together); a weight also gathered (a tied embedding) and one of 5 rows keep their layout."""
    n = tvm.tirx.Var("seq_len", "int64")
    ids = relax.Var("ids", relax.TensorType([n], "int32"))
    x = relax.Var("x", relax.TensorType([n, 8], "float32"))
    shapes = {"tied.weight": [16, 8], "proj.weight": [32, 8], "odd.weight": [5, 8]}
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    tied, proj, odd = params
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, x, *params], attrs={"num_input": 2}):
        with bb.dataflow():
            embedded = bb.emit(relax.op.take(tied, ids, axis=0))
            outs = [bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)))) for w in params]
            result = bb.emit_output(relax.Tuple([embedded, *outs]))
        bb.emit_func_output(result)
    mod = set_recipes(bb.get(), {name: {"op": "load", "name": name} for name in shapes})

    packed = pack_float_panels(vector_bits=64)(mod)  # panels of 4 float32 rows
    recipes = get_recipes(packed)
    assert recipes["proj.weight"] == {"op": "panels", "rows": 4, "input": {"op": "load", "name": "proj.weight"}}
    assert recipes["tied.weight"]["op"] == recipes["odd.weight"]["op"] == "load"
    assert [[int(d) for d in p.ty.shape] for p in weight_params(packed["main"])] == [[16, 8], [8, 8, 4], [5, 8]]

    rng = np.random.default_rng(0)
    inputs = [np.array([3, 0, 15], "int32"), rng.standard_normal((3, 8), "float32")]
    weights = [rng.standard_normal(shape, "float32") for shape in shapes.values()]
    expected = _run(mod, [*inputs, *weights])
    got = _run(packed, [*inputs, weights[0], np.ascontiguousarray(to_panels(weights[1], 4)), weights[2]])
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def _split_concat_module(order: tuple[int, ...]) -> tvm.IRModule:
    """y[n, 1, 20] split into q/k/v (8 + 6 + 6), each viewed as heads of 2, concatenated in `order`."""
    n = tvm.tirx.Var("n", "int64")
    y = relax.Var("y", relax.TensorType([n, 1, 20], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [y]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(y, [8, 14], axis=-1))
            heads = [bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(parts, i)), [n, 1, size // 2, 2]))
                     for i, size in enumerate((8, 6, 6))]
            out = bb.emit_output(relax.op.concat([heads[i] for i in order], axis=2))
        bb.emit_func_output(out)
    return bb.get()


def _ops(func: relax.Function) -> list[str]:
    found = []
    relax.analysis.post_order_visit(
        func.body,
        lambda e: found.append(e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def test_fold_split_concat_turns_split_heads_concat_into_a_reshape() -> None:
    mod = _split_concat_module((0, 1, 2))
    folded = fold_split_concat(mod)
    assert _ops(folded["main"]) == ["relax.reshape"]
    y = np.random.default_rng(0).standard_normal((3, 1, 20), "float32")
    np.testing.assert_array_equal(_run_single(folded, y), _run_single(mod, y))


def test_fold_split_concat_keeps_a_reordering_concat() -> None:
    mod = _split_concat_module((1, 0, 2))
    assert "relax.concat" in _ops(fold_split_concat(mod)["main"])


def test_attach_sequence_bounds_sets_upper_bounds() -> None:
    mod = attach_sequence_bounds(prefill_chunk=64, max_batch=4)(_projection_module())
    bounds = mod["main"].attrs["tir_var_upper_bound"]
    assert int(bounds["seq_len"]) == 64 and "batch_size" not in bounds


def test_check_all_scheduled_rejects_an_unscheduled_kernel() -> None:
    mod = relax.transform.LegalizeOps()(_projection_module())
    with pytest.raises(RuntimeError, match="no ember schedule rule matched"):
        check_all_scheduled(mod)


@pytest.mark.parametrize("reduce", ["mean over a middle axis", "max over the rows", "variance over a small axis"])
def test_every_kernel_a_graph_can_leave_gets_a_correct_cpu_schedule(reduce) -> None:
    """Reductions no specialised rule matches (a lone mean, a max over rows, a variance over 3 values) are scheduled
    by the fallback, and compute what numpy does."""
    from ember.schedules import schedule_passes
    from ember.targets.registry import resolve_target

    x = relax.Var("x", relax.TensorType([6, 3, 5], "float32"))
    ops = {"mean over a middle axis": lambda v: relax.op.mean(v, axis=[1]),
           "max over the rows": lambda v: relax.op.max(v, axis=[0]),
           "variance over a small axis": lambda v: relax.op.variance(relax.op.permute_dims(v, [0, 2, 1]), axis=[2])}
    numpy = {"mean over a middle axis": lambda a: a.mean(axis=1), "max over the rows": lambda a: a.max(axis=0),
             "variance over a small axis": lambda a: a.var(axis=1)}
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(ops[reduce](x))
        bb.emit_func_output(out)
    target = resolve_target("cpu")
    with target.target:
        lowered = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                            relax.transform.FuseOps(), relax.transform.FuseTIR(),
                                            *schedule_passes(target)])(bb.get())
    vm = relax.VirtualMachine(tvm.compile(lowered, target.target), tvm.cpu())
    a = np.random.default_rng(0).standard_normal((6, 3, 5)).astype("float32")
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(a)).numpy(), numpy[reduce](a), rtol=1e-5, atol=1e-6)


def test_capture_cuda_graphs_lifts_decode_kernels_between_unstable_inputs() -> None:
    """decode(x, w1, w2) = relu(x @ w1) @ w2 after static planning: the kernel reading only planned
    storage (relu) is captured per batch size; the ones reading the per-call input x or writing the
    returned tensor run outside the graph; the storages move into `cuda_graph_alloc`."""
    batch = tvm.tirx.Var("batch_size", "int64")
    x = relax.Var("x", relax.TensorType([batch, 8], "float16"))
    w1, w2 = (relax.Var(name, relax.TensorType([8, 8], "float16")) for name in ("w1", "w2"))
    bb = relax.BlockBuilder()
    with bb.function("decode", [x, w1, w2], attrs={"num_input": 1, "tir_var_upper_bound": {"batch_size": 4}}):
        with bb.dataflow():
            hidden = bb.emit(relax.op.nn.relu(bb.emit(relax.op.matmul(x, w1))))
            out = bb.emit_output(relax.op.matmul(hidden, w2))
        bb.emit_func_output(out)
    planned = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory(),
    ])(bb.get())

    mod = capture_cuda_graphs(planned)
    functions = {gv.name_hint for gv, func in mod.functions_items() if isinstance(func, relax.Function)}
    assert functions == {"decode", "cuda_graph_alloc", "decode_cuda_graph_capture"}
    assert list(mod["decode"].attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"]) == ["batch_size"]
    decode = mod["decode"].script()
    assert decode.count("vm.builtin.cuda_graph.run_or_capture") == 1 and decode.count("matmul(") == 2
    assert "relu" in mod["decode_cuda_graph_capture"].script()


def test_polynomial_exp_vectorizes_exp_and_sigmoid_within_float_rounding() -> None:
    """SiLU and exp become polynomials (no libm call left) that agree with float64 numpy within the documented
    bound over |x| <= 80, and saturate at the ends of float32's normal range."""
    from tvm import s_tir, te

    from ember.ir.attributes import KERNEL_SOURCE_ATTR
    from ember.ir_passes.polynomial_exp import polynomial_exp
    from ember.targets.registry import resolve_target

    n = 4096
    x = te.placeholder((n,), "float32", name="x")
    silu = te.compute((n,), lambda i: x[i] * te.sigmoid(x[i]), name="silu")
    exp = te.compute((n,), lambda i: te.exp(x[i]), name="exp")
    tagged = te.create_prim_func([x, exp]).with_attr(KERNEL_SOURCE_ATTR, "a hand-written kernel")
    mod = polynomial_exp(tvm.IRModule({"silu": te.create_prim_func([x, silu]), "exp": te.create_prim_func([x, exp]),
                                       "tagged": tagged}))
    assert "T.sigmoid" not in mod["silu"].script() and "T.exp" not in mod["exp"].script()
    assert "T.exp" in mod["tagged"].script()

    target = resolve_target("cpu")
    values = np.concatenate([np.linspace(-80, 80, n // 2 - 2), np.random.default_rng(0).standard_normal(n // 2) * 8,
                             [-100, 100]]).astype(np.float32)
    exact = values.astype(np.float64)
    for name, expected in (("silu", exact / (1 + np.exp(-exact))), ("exp", np.exp(exact))):
        sch = s_tir.Schedule(mod[name])
        sch.vectorize(sch.split(sch.get_loops(sch.get_sblock(name))[0], [None, 16])[1])
        out = tvm.runtime.tensor(np.zeros(n, np.float32))
        tvm.compile(sch.mod, target=target.target)["main"](tvm.runtime.tensor(values), out)
        # The polynomial's 2e-7, float rounding of the result, and x * log2(e)'s rounding (|x| * 6e-8).
        bound = (1e-6 + 6e-8 * np.abs(exact[:-2])) * np.abs(expected[:-2])
        assert (np.abs(out.numpy()[:-2] - expected[:-2]) <= bound).all(), name
        low, high = out.numpy()[-2:]
        if name == "silu":
            assert abs(low) < 1e-35 and high == np.float32(100)
        else:
            assert low <= 2e-38 and np.isfinite(high) and high > 1e38


def test_noalias_kernels_keeps_the_matmul_register_tile_beside_a_kernel_without_noalias() -> None:
    """TVM 0.27 compiles every kernel of a module with the `tirx.noalias` of the one whose name sorts
    last. Beside a copy kernel without it, ember's matmul loses its `noalias` compute function (and
    stores its accumulators after every FMA); after `noalias_kernels` it keeps it."""
    import re

    from tvm import te

    from ember.ir_passes.noalias_kernels import noalias_kernels
    from ember.schedules.matmul import NTMatmul
    from ember.targets.registry import resolve_target

    target = resolve_target("cpu")
    a, w = te.placeholder((64, 256), name="A"), te.placeholder((64, 256), name="W")
    r = te.reduce_axis((0, 256), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, r] * w[j, r], axis=r), name="NT_matmul")
    matmul = NTMatmul(target.vector_bits).apply(te.create_prim_func([a, w, c]), target.target, False).mod["main"]
    pages = te.placeholder((4, 256), name="pages")
    copy = te.create_prim_func([pages, te.compute((4, 256), lambda i, j: pages[i, j], name="copy")])
    mod = tvm.IRModule({"matmul": matmul.with_attr("global_symbol", "matmul"),
                        "zz_copy": copy.with_attr("global_symbol", "zz_copy").without_attr("tirx.noalias")})

    def compute_function(module: tvm.IRModule) -> str | None:
        llvm_ir = tvm.compile(module, target=target.target).mod.inspect_source("ll")
        found = re.search(r"define [^\n]*@matmul_compute_\([^\n]*", llvm_ir)
        return found.group(0) if found else None

    assert compute_function(mod) is None, "TVM no longer drops noalias module-wide: noalias_kernels can go"
    marked = noalias_kernels(mod)
    assert all(bool(func.attrs["tirx.noalias"]) for _, func in marked.functions_items())
    assert "ptr noalias" in compute_function(marked)


def test_fold_permute_chains_composes_and_drops_identities() -> None:
    """[1, n, h, d] -> [1, h, n, d] -> [n, 1, h, d] -> [1, n, h, d] cancels out; a chain that does not cancel
    becomes one permutation; the values stay."""
    from ember.ir_passes.fold_permute_chains import fold_permute_chains

    x = relax.Var("x", relax.TensorType([1, 3, 2, 4], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
            b = bb.emit(relax.op.permute_dims(a, [2, 0, 1, 3]))
            back = bb.emit(relax.op.permute_dims(b, [1, 0, 2, 3]))
            other = bb.emit(relax.op.permute_dims(a, [0, 1, 3, 2]))
            out = bb.emit_output(relax.Tuple([relax.op.add(back, back), other]))
        bb.emit_func_output(out)
    mod = bb.get()
    folded = fold_permute_chains(mod)
    assert _ops(folded["main"]).count("relax.permute_dims") == 1  # `other` composed into one; the identity chain gone
    values = np.random.default_rng(0).standard_normal((1, 3, 2, 4)).astype("float32")
    for expected, actual in zip(_run(mod, [values]), _run(folded, [values])):
        np.testing.assert_array_equal(actual, expected)


def test_tidy_traced_graph_unflattens_projections_and_drops_empty_operands() -> None:
    """reshape(matmul(reshape(x, [n, k]), W) + b, [1, n, o]) (an addmm) becomes matmul(x, W) + b on the 3-D x;
    a concat's empty operand (a zero-width rest of a partial rotary) goes; 1/sqrt(x) becomes rsqrt(x); x**3
    multiplications."""
    from ember.ir.attributes import FORWARD
    from ember.ir_passes.tidy_traced_graph import tidy_traced_graph

    n = tvm.tirx.Var("seq", "int64")
    x = relax.Var("x", relax.TensorType([1, n, 8], "float32"))
    w = relax.Var("w", relax.TensorType([8, 6], "float32"))
    b = relax.Var("b", relax.TensorType([6], "float32"))
    bb = relax.BlockBuilder()
    with bb.function(FORWARD, [x, w, b], {"num_input": 1}):
        with bb.dataflow():
            rows = bb.emit(relax.op.reshape(x, [n, 8]))
            biased = bb.emit(relax.op.add(b, bb.emit(relax.op.matmul(rows, w))))
            product = bb.emit(relax.op.reshape(biased, [1, n, 6]))
            empty = bb.emit(relax.op.strided_slice(product, [2], [6], [6]))
            whole = bb.emit(relax.op.concat([product, empty], axis=2))
            scale = bb.emit(relax.op.divide(relax.const(1.0, "float32"), bb.emit(relax.op.sqrt(whole))))
            cube = bb.emit(relax.op.power(scale, relax.const(3.0, "float32")))
            out = bb.emit_output(cube)
        bb.emit_func_output(out)
    mod = bb.get()
    tidied = tidy_traced_graph(mod)
    assert _ops(tidied[FORWARD]) == ["relax.matmul", "relax.add", "relax.rsqrt", "relax.multiply", "relax.multiply"]
    inputs = [np.random.default_rng(1).uniform(0.5, 1.0, (1, 5, 8)).astype("float32"),
              np.random.default_rng(2).uniform(0.5, 1.0, (8, 6)).astype("float32"),
              np.random.default_rng(3).uniform(0.5, 1.0, (6,)).astype("float32")]

    def run(module: tvm.IRModule) -> np.ndarray:
        func = module[FORWARD].bind_symbolic_vars({n: 5}).with_attr("global_symbol", "main")
        vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"main": func}), tvm.target.Target("llvm")), tvm.cpu())
        return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()

    np.testing.assert_allclose(run(tidied), run(mod), rtol=1e-6)


# Window slots are kept only where some layers are windowed and others not; every layer windowed uses the plain ones.
@pytest.mark.parametrize("layer_windows, sliding_window", [((), False), ((8, 0), True), ((8, 8), False)],
                         ids=["no-window", "some-layers", "every-layer"])
def test_drop_unused_kv_kernels_empties_the_caches_unused_slots_and_the_runtime_takes_it(layer_windows,
                                                                                          sliding_window) -> None:
    from ember.ir.kv_cache import CREATE_FUNCTION, CacheShape, CreateArg, cache_functions, with_cache_shape
    from ember.ir.module_utils import bindings, calls_packed
    from ember.ir_passes.drop_unreachable_functions import drop_unreachable_functions
    from ember.ir_passes.drop_unused_kv_kernels import drop_unused_kv_kernels

    target = tvm.target.Target({"kind": "llvm"})
    shape = CacheShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, context_window=64,
                       layer_windows=layer_windows)
    mod = with_cache_shape(cache_functions(shape, "float32", target), shape)

    def create_args(module: tvm.IRModule) -> list[relax.Expr]:
        calls = [b.value for b in bindings(module["create_paged_kv_cache"]) if calls_packed(b.value, CREATE_FUNCTION)]
        assert len(calls) == 1
        return list(calls[0].args[1:])

    before = create_args(mod)
    windowed = (CreateArg.PREFILL_SLIDING_WINDOW, CreateArg.DECODE_SLIDING_WINDOW)
    emptied = (CreateArg.TREE_PREFILL_PAGED, CreateArg.TREE_PREFILL, *(() if sliding_window else windowed))
    kept = [slot for slot in (CreateArg.RAGGED, CreateArg.PREFILL, CreateArg.DECODE, *windowed) if slot not in emptied]
    gone = {before[slot].fields[1].name_hint for slot in emptied} | {before[CreateArg.APPEND_MLA].name_hint}
    assert len(gone) == len(emptied) + 1

    pruned = tvm.transform.Sequential([drop_unused_kv_kernels, drop_unreachable_functions])(mod)
    after = create_args(pruned)
    assert all(isinstance(after[slot], relax.Tuple) and not after[slot].fields for slot in emptied)
    assert [after[slot].fields[1].name_hint for slot in kept] == [before[slot].fields[1].name_hint for slot in kept]
    names = {gv.name_hint for gv, _ in mod.functions_items()}
    assert {gv.name_hint for gv, _ in pruned.functions_items()} == names - gone

    # TVM's cache runtime takes the emptied slots (a cache for 2 sequences of 64 tokens is created).
    vm = relax.VirtualMachine(tvm.compile(pruned, target), tvm.cpu())
    shape_tuple = tvm.runtime.ShapeTuple
    cache = vm["create_paged_kv_cache"](shape_tuple([2]), shape_tuple([128]), shape_tuple([32]), shape_tuple([16]),
                                        shape_tuple([0]))
    assert cache is not None


def test_merge_equal_kernels_keeps_one_of_kernels_equal_but_for_bounds_with_the_larger_bounds() -> None:
    from tvm.script import tirx as T

    from ember.ir.module_utils import upper_bounds
    from ember.ir_passes.merge_equal_kernels import merge_equal_kernels

    def scaled(factor: float, bound: int) -> tvm.tirx.PrimFunc:
        @T.prim_func(s_tir=True)
        def kernel(a: T.handle, b: T.handle):
            n = T.int64()
            x = T.match_buffer(a, (n, 4), "float32")
            y = T.match_buffer(b, (n, 4), "float32")
            for i, j in T.grid(n, 4):
                with T.sblock("scale"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = x[vi, vj] * T.float32(factor)

        return kernel.with_attr("tir_var_upper_bound", {"n": bound})

    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4], "float32"))
    bb = relax.BlockBuilder()
    kernels = {"small": scaled(2.0, 256), "large": scaled(2.0, 8), "other": scaled(3.0, 8)}
    gvs = {name: bb.add_func(func.without_attr("global_symbol"), name) for name, func in kernels.items()}
    with bb.function("main", [x], attrs={"global_symbol": "main"}):
        with bb.dataflow():
            out = x
            for name in ("small", "large", "other"):
                out = bb.emit(relax.call_tir(gvs[name], [out], relax.TensorType([n, 4], "float32")))
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    mod = bb.get()

    merged = merge_equal_kernels(mod)
    kernels_left = {gv.name_hint: func for gv, func in merged.functions_items() if isinstance(func, tvm.tirx.PrimFunc)}
    assert set(kernels_left) == {"large", "other"}  # the first by name
    assert upper_bounds(kernels_left["large"]) == {"n": 256} and upper_bounds(kernels_left["other"]) == {"n": 8}
    data = np.random.default_rng(0).standard_normal((5, 4)).astype("float32")
    np.testing.assert_array_equal(_run_single(merged, data), data * 12)
    np.testing.assert_array_equal(_run_single(merged, data), _run_single(mod, data))
