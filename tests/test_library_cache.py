"""The library cache (`src/ember/driver/library_cache.py`): a module equal to one built before for the same target gets
that library, copied; any other module, target or a damaged entry is generated. Each test has a cache of its own."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import models
import numpy as np
import pytest
import tvm
from conftest import MAX_BATCH, PREFILL_CHUNK, TinyModel
from helpers import assert_logits_close, prompt_ids
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from ember.driver import codegen, library_cache
from ember.driver.compiler import CompileOptions, compile_model
from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.ir_passes.pipeline import dataflow_lower_passes, finalize_passes
from ember.runtime.artifact import load_library
from ember.targets.registry import resolve_target

HOST = resolve_target("cpu")
HASWELL = resolve_target('{"kind": "llvm", "mcpu": "haswell"}')


def scaled(factor: float, target=HOST) -> tvm.IRModule:
    """A module whose `main` returns x * `factor` for x of 4 floats, lowered (`lowered`)."""
    @I.ir_module
    class Module:
        @T.prim_func
        def scale(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):  # noqa: N805 (TVMScript)
            for i in range(4):
                y[i] = x[i] * T.float32(factor)

        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):  # noqa: N805 (TVMScript)
            cls = Module
            y = R.call_tir(cls.scale, (x,), R.Tensor((4,), "float32"))
            return y

    return lowered(Module, target)


def shifted_and_scaled(shift: float, factor: float) -> tvm.IRModule:
    """A module whose `main` returns (x + `shift`) * `factor`: the kernel `shift` is of a family (its
    KERNEL_SOURCE_ATTR), `scale` of none."""
    @I.ir_module
    class Module:
        @T.prim_func
        def shift(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):  # noqa: N805 (TVMScript)
            T.func_attr({KERNEL_SOURCE_ATTR: "a family"})
            for i in range(4):
                y[i] = x[i] + T.float32(shift)

        @T.prim_func
        def scale(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):  # noqa: N805 (TVMScript)
            for i in range(4):
                y[i] = x[i] * T.float32(factor)

        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):  # noqa: N805 (TVMScript)
            cls = Module
            y = R.call_tir(cls.shift, (x,), R.Tensor((4,), "float32"))
            z = R.call_tir(cls.scale, (y,), R.Tensor((4,), "float32"))
            return z

    return lowered(Module, HOST)


def lowered(mod: tvm.IRModule, target) -> tvm.IRModule:
    """`mod` lowered for `target` to what the Relax VM runs, as the compiler lowers a model."""
    with target.target:
        return tvm.transform.Sequential([*dataflow_lower_passes(target), *finalize_passes(target)])(mod)


def computes(library: Path) -> list[float]:
    vm = relax.VirtualMachine(load_library(library), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(np.arange(4, dtype="float32"))).numpy().tolist()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """This test's cache directory and the libraries generated (not copied) so far, by path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    generated = []
    generate = codegen._generate

    def counted(mod, target, linker, path):
        generated.append(path)
        generate(mod, target, linker, path)

    monkeypatch.setattr(codegen, "_generate", counted)
    return SimpleNamespace(root=tmp_path / "cache" / "ember" / "libraries", generated=generated, dir=tmp_path)


def test_an_equal_module_gets_the_library_built_before(cache):
    """The same module made again is not generated: the first library is copied, byte for byte, and runs."""
    first, second = cache.dir / "first.so", cache.dir / "second.so"
    assert codegen.build_library(scaled(2.0), HOST, first) is False
    assert codegen.build_library(scaled(2.0), HOST, second) is True
    assert cache.generated == [first]
    assert second.read_bytes() == first.read_bytes()
    assert computes(second) == [0.0, 2.0, 4.0, 6.0]


def test_another_module_or_target_is_generated(cache):
    """Another constant in a kernel, or the same module for another CPU, is a library of its own."""
    for name, mod, target in (("two", scaled(2.0), HOST), ("three", scaled(3.0), HOST),
                              ("two-haswell", scaled(2.0, HASWELL), HASWELL)):
        assert codegen.build_library(mod, target, cache.dir / f"{name}.so") is False
    assert len(cache.generated) == 3 and len(list(cache.root.iterdir())) == 3
    assert computes(cache.dir / "three.so") == [0.0, 3.0, 6.0, 9.0]


def test_a_module_of_the_same_hash_is_not_given_another_library(cache, monkeypatch):
    """Two modules whose structural hashes collide (forced here) are told apart by comparing the stored module:
    the second is generated and replaces the entry."""
    monkeypatch.setattr(library_cache.tvm_ffi, "structural_hash", lambda mod: 0)
    codegen.build_library(scaled(2.0), HOST, cache.dir / "two.so")
    assert codegen.build_library(scaled(3.0), HOST, cache.dir / "three.so") is False
    assert computes(cache.dir / "three.so") == [0.0, 3.0, 6.0, 9.0]
    assert codegen.build_library(scaled(3.0), HOST, cache.dir / "three-again.so") is True


@pytest.mark.parametrize("damage", [
    pytest.param(lambda entry: (entry / library_cache.MODULE_FILE).write_text("{"), id="module-not-json"),
    pytest.param(lambda entry: (entry / library_cache.LIBRARY_FILE).write_bytes(b"\x7fELF"), id="library-changed"),
    pytest.param(lambda entry: (entry / library_cache.DIGEST_FILE).unlink(), id="digest-missing"),
])
def test_a_damaged_entry_is_generated_again_and_replaced(cache, damage):
    codegen.build_library(scaled(2.0), HOST, cache.dir / "first.so")
    (entry,) = cache.root.iterdir()
    damage(entry)
    assert codegen.build_library(scaled(2.0), HOST, cache.dir / "again.so") is False
    assert computes(cache.dir / "again.so") == [0.0, 2.0, 4.0, 6.0]
    assert codegen.build_library(scaled(2.0), HOST, cache.dir / "third.so") is True
    assert not [p for p in cache.dir.iterdir() if p.name.startswith(".")]  # no copy left half-way


def test_switched_off_or_without_a_directory_every_library_is_generated(cache, monkeypatch):
    monkeypatch.setenv("EMBER_LIBRARY_CACHE", "0")
    for name in ("first", "second"):
        codegen.build_library(scaled(2.0), HOST, cache.dir / f"{name}.so")
    assert len(cache.generated) == 2 and not cache.root.exists()
    monkeypatch.delenv("EMBER_LIBRARY_CACHE")
    blocker = cache.dir / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    for name in ("third", "fourth"):
        assert codegen.build_library(scaled(2.0), HOST, cache.dir / f"{name}.so") is False
    assert computes(cache.dir / "fourth.so") == [0.0, 2.0, 4.0, 6.0]


def test_the_least_recently_used_go_beyond_the_size_kept(cache, monkeypatch):
    """With room for one entry and a half, storing a second removes the first."""
    codegen.build_library(scaled(2.0), HOST, cache.dir / "two.so")
    (first,) = cache.root.iterdir()
    size = sum(f.stat().st_size for f in first.iterdir())
    monkeypatch.setattr(library_cache, "KEPT_BYTES", size * 3 // 2)
    codegen.build_library(scaled(3.0), HOST, cache.dir / "three.so")
    (kept,) = cache.root.iterdir()
    assert kept != first
    assert codegen.build_library(scaled(3.0), HOST, cache.dir / "three-again.so") is True


def test_a_family_of_kernels_is_built_once_and_linked_from_its_object(cache, monkeypatch):
    """The kernels of one family are built as an object of their own and kept: a module that has the same family
    and other kernels besides builds only the others and links the family's object copied from the cache; another
    family is built. Each library computes its own module."""
    built, build = [], tvm.tirx.build

    def recorded(mod, *args, **kwargs):
        built.append(sorted(gv.name_hint for gv in mod.get_global_vars()))
        return build(mod, *args, **kwargs)

    monkeypatch.setattr(tvm.tirx, "build", recorded)
    for name, shift, factor in (("first", 1.0, 2.0), ("second", 1.0, 3.0), ("third", 2.0, 3.0)):
        assert codegen.build_library(shifted_and_scaled(shift, factor), HOST, cache.dir / f"{name}.so") is False
    assert built == [["shift"], ["scale"], ["scale"], ["shift"], ["scale"]]
    assert computes(cache.dir / "first.so") == [2.0, 4.0, 6.0, 8.0]
    assert computes(cache.dir / "second.so") == [3.0, 6.0, 9.0, 12.0]
    assert computes(cache.dir / "third.so") == [6.0, 9.0, 12.0, 15.0]


@pytest.mark.slow
def test_a_checkpoint_of_the_same_architecture_reuses_the_library_and_matches_transformers(cache, tmp_path, capsys,
                                                                                           monkeypatch):
    """Two tiny llamas of the same config and other weights: the second compile copies the first's library, says
    so under its "generating code" stage, and its artifact computes the second checkpoint's logits as transformers
    does. The second compiled again in q4f32 generates a library of its own, which links the attention kernels'
    object copied from the cache, and computes the quantized weights' logits as transformers does."""
    options = CompileOptions(prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH, show_progress=True)
    artifacts, shown = [], []
    for seed in (1, 2):
        checkpoint, artifact = tmp_path / f"llama-{seed}", tmp_path / f"artifact-{seed}"
        models.write_checkpoint("llama", checkpoint, seed=seed)
        compile_model(checkpoint, artifact, options)
        artifacts.append(TinyModel("llama", checkpoint, artifact))
        shown.append(capsys.readouterr().err)
    assert len(cache.generated) == 1
    copied = "\n          copied the library built before from an equal module"
    assert copied not in shown[0] and copied in shown[1], shown[1]
    second = artifacts[1]
    assert (second.artifact_dir / "model.so").read_bytes() == (artifacts[0].artifact_dir / "model.so").read_bytes()
    ids = prompt_ids(24, seed=5)
    engine = second.engine()
    logits = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    assert_logits_close(logits, second.reference_logits(ids), "llama with a reused library")

    copied, build_once = [], library_cache.build_once

    def recorded(mod, *args):
        copied.append((sorted(gv.name_hint for gv in mod.get_global_vars()), build_once(mod, *args)))
        return copied[-1][1]

    monkeypatch.setattr(library_cache, "build_once", recorded)
    quantized = TinyModel("llama", second.model_dir, tmp_path / "artifact-q4f32", quantization="q4f32")
    compile_model(quantized.model_dir, quantized.artifact_dir,
                  dataclasses.replace(options, quantization="q4f32", float_activations=True, show_progress=False))
    *families, (_, library_copied) = copied  # the library's call returns after its families'
    assert len(cache.generated) == 2 and not library_copied
    assert [was_copied for names, was_copied in families if "batch_prefill_paged_kv_cpu" in names] == [True]
    engine = quantized.engine()
    logits = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    assert_logits_close(logits, quantized.reference_logits(ids), "q4f32 llama with the attention kernels reused")
    shutil.rmtree(cache.root)
