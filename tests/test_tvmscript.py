"""`ember.ir.tvmscript`: stacks read from linecache equal inspect's own records, and a kernel builder parses once;
`ember.ir.kernel_store`: a parsed kernel kept between processes loads as the kernel the builder parses."""

import inspect
import subprocess
import sys

import pytest
import tvm_ffi
from tvm import tirx
from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv_cache
from tvm.script import tirx as T
from tvm.target import Target

from ember.ir import kernel_store
from ember.ir.kv_cache import SHARED_KERNEL_BUILDERS
from ember.ir.quant_formats import FORMATS
from ember.ir.tvmscript import parsed_once, stacks_from_linecache
from ember.schedules import int8_matmul
from ember.targets.int8_dot import int8_dot_of


def _nested(depth: int, read):
    return read() if depth == 0 else _nested(depth - 1, read)


def _with_inspects_reads(records: list[inspect.FrameInfo], context: int) -> list[tuple]:
    """Each record beside what `inspect.getframeinfo` (which looks up each frame's module) reads of its frame now:
    called on the line that read the stack, so every frame is still on the line recorded."""
    return [((r.filename, r.lineno, r.function, r.code_context, r.index),
             (i.filename, i.lineno, i.function, i.code_context, i.index))
            for r, i in ((record, inspect.getframeinfo(record.frame, context)) for record in records)]


def _here():
    return inspect.currentframe().f_back


def test_stack_and_outer_frames_read_each_frame_as_inspect_does():
    with stacks_from_linecache():
        assert inspect.stack.__module__ == inspect.getouterframes.__module__ == "ember.ir.tvmscript"
        for context in (0, 1, 3, 6):
            stack = _nested(3, lambda c=context: _with_inspects_reads(inspect.stack(c), c))
            outer = _nested(2, lambda c=context: _with_inspects_reads(inspect.getouterframes(_here(), c), c))
            assert [ours[2] for ours, _ in stack[:5]] == ["<lambda>", *["_nested"] * 4]
            assert [ours[2] for ours, _ in outer[:4]] == ["<lambda>", *["_nested"] * 3]
            for ours, theirs in stack + outer:
                assert ours == theirs
            assert len(stack) > 8 and any(ours[3] for ours, _ in stack) == (context > 0)


def test_a_builder_parses_each_argument_tuple_once():
    parses = []

    @parsed_once
    def add_constant(n: int, constants: tuple[int, ...]):
        parses.append((n, constants))
        total = sum(constants)

        @T.prim_func
        def add(a: T.Buffer((n,), "int32"), b: T.Buffer((n,), "int32")):
            for i in range(n):
                b[i] = a[i] + total

        return add

    first = add_constant(4, [1, 2])
    assert add_constant(4, (1, 2)) is first  # a list argument is keyed as the tuple of its items
    other = add_constant(8, (1, 2))
    assert other is not first and parses == [(4, [1, 2]), (8, (1, 2))]  # the builder gets the arguments as given
    assert "a[i] + 3" in first.script()


def test_arguments_are_compared_by_value_and_ir_nodes_are_refused():
    calls = []

    @parsed_once
    def build(*args, **kwargs):
        calls.append((args, kwargs))
        return len(calls)

    cuda = {"kind": "cuda", "arch": "sm_90a"}
    assert build({"factor": 8.0, "type": "yarn"}, Target(cuda)) == build({"type": "yarn", "factor": 8.0}, Target(cuda))
    assert build({"factor": 8.0}, Target({**cuda, "arch": "sm_80"})) == 2  # another target's configuration
    assert [build(1), build(1.0), build(True), build(1)] == [3, 4, 5, 3]  # equal, but not the same value
    assert build(n=4) == build(n=4) == 6 and len(calls) == 6
    with pytest.raises(TypeError, match="Var is an IR node"):
        build(tirx.Var("n", "int64"))
    with pytest.raises(TypeError, match="unhashable"):
        build({1, 2})
    assert len(calls) == 6


def test_the_kv_caches_tvm_kernels_are_parsed_once_per_process():
    """`TIRPagedKVCache` calls its kernel builders by their names in its module, and a compile's cache hands them
    a fresh rope-scaling dict and target each time: the second cache of a shape gets the first one's kernels."""
    assert all(getattr(tvm_kv_cache, name).__wrapped__ for name in SHARED_KERNEL_BUILDERS)
    cpu = tvm_kv_cache._attention_decode_cpu(2, 4, 16, "float32", False, {})
    assert tvm_kv_cache._attention_decode_cpu(2, 4, 16, "float32", False, {}) is cpu
    assert tvm_kv_cache._attention_decode_cpu(2, 4, 32, "float32", False, {}) is not cpu
    gpu = tvm_kv_cache._attention_prefill(2, 4, 16, "float16", False, {}, Target({"kind": "cuda", "arch": "sm_90a"}))
    assert tvm_kv_cache._attention_prefill(2, 4, 16, "float16", False, {},
                                           Target({"kind": "cuda", "arch": "sm_90a"})) is gpu


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The kernel store in a directory of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("EMBER_KERNEL_CACHE", raising=False)
    kernel_store._source_tree.cache_clear()
    yield tmp_path / "ember" / "kernels"
    kernel_store._source_tree.cache_clear()


def _vnni_matmul():
    dot = int8_dot_of(Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "icelake-server"}))
    return int8_matmul.int8_dot_matmul.__wrapped__, (FORMATS["q4f32"], 64, 96, dot, True, 512)


def _refuse_to_parse():
    raise AssertionError("parsed, not loaded")


def test_a_stored_kernel_loads_equal_to_the_parse_and_a_damaged_one_is_parsed_again(store):
    builder, args = _vnni_matmul()
    parsed = kernel_store.load_or_build(builder, args, lambda: builder(*args))
    (entry,) = store.glob("*/*.json")
    loaded = kernel_store.load_or_build(builder, args, _refuse_to_parse)
    assert loaded is not parsed and tvm_ffi.structural_equal(loaded, parsed) and loaded.script() == parsed.script()

    entry.write_text(entry.read_text()[:1000])  # cut short
    again = kernel_store.load_or_build(builder, args, lambda: builder(*args))
    assert tvm_ffi.structural_equal(again, parsed)
    assert tvm_ffi.structural_equal(kernel_store.load_or_build(builder, args, _refuse_to_parse), parsed)


def test_only_ember_and_tvm_builders_are_stored_and_the_switch_turns_it_off(store, monkeypatch):
    def local_builder():
        return T.prim_func(lambda: None)

    assert kernel_store.load_or_build(local_builder, (), lambda: 7) == 7 and not store.exists()
    builder, args = _vnni_matmul()
    monkeypatch.setenv("EMBER_KERNEL_CACHE", "0")
    kernel_store.load_or_build(builder, args, lambda: builder(*args))
    assert not store.exists()
    monkeypatch.setenv("EMBER_KERNEL_CACHE", "1")
    kernel_store.load_or_build(builder, (object(),), lambda: builder(*args))  # keyed by an address: not kept
    assert not list(store.glob("*/*.json"))


def test_a_cache_directory_that_cannot_be_made_leaves_kernels_parsed(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.delenv("EMBER_KERNEL_CACHE", raising=False)
    kernel_store._source_tree.cache_clear()
    try:
        builder, args = _vnni_matmul()
        kernel = kernel_store.load_or_build(builder, args, lambda: builder(*args))
        assert isinstance(kernel, tirx.PrimFunc) and blocker.read_text() == "not a directory"
    finally:
        kernel_store._source_tree.cache_clear()


@pytest.mark.slow
def test_another_process_loads_the_kernels_of_a_kv_cache_and_old_source_trees_go(store):
    """A second process's `parsed_once` builders (TVM's KV cache kernels, ember's int8 matmul) load every kernel the
    first one parsed, none parsed again, equal to the first's; only the newest source trees are kept."""
    for stale in range(kernel_store.KEPT_SOURCE_TREES + 1):
        (store / f"stale{stale}").mkdir(parents=True)
    code = """if True:
        import hashlib, tvm
        from ember.ir import kernel_store
        from ember.ir.kv_cache import CacheShape, cache_functions
        from ember.ir.quant_formats import FORMATS
        from ember.schedules.int8_matmul import int8_dot_matmul
        from ember.targets.int8_dot import int8_dot_of
        parsed, load = [], kernel_store.load_or_build
        kernel_store.load_or_build = lambda b, k, build: load(b, k, lambda: parsed.append(b) or build())
        target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "icelake-server"})
        mod = cache_functions(CacheShape(2, 4, 2, 16, 64), "float32", target)
        mod["matmul"] = int8_dot_matmul(FORMATS["q4f32"], 64, 96, int8_dot_of(target), True, 512)
        print(len(parsed), hashlib.sha256(mod.script().encode()).hexdigest())
    """
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    (first, first_module), (second, second_module) = (run.stdout.split()[-2:] for run in runs)
    assert int(first) >= 10 and int(second) == 0 and first_module == second_module
    assert len([p for p in store.iterdir() if p.is_dir()]) == kernel_store.KEPT_SOURCE_TREES
