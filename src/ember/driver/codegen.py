"""Code generation: a lowered IRModule becomes the artifact's shared library.

`tvm.compile` generates the host code (LLVM) and the device code, and
`export_library` links them into one `.so` that embeds the device modules as a
serialized blob (`__tvm_ffi__library_bin`).

A CPU target of another architecture (`--target raspberry-pi-5`, an aarch64 triple) is
cross-linked by the GNU cross compiler for its triple (Debian's g++-aarch64-linux-gnu):
it brings the target's C runtime and libc to link a shared library against, which
LLVM's linker alone would need a separate sysroot for.

CUDA needs one more step. The pip wheel's TVM compiler is built without the CUDA
runtime, so its codegen keeps each CUDA module as C++ *source*, and a GPU machine
would have to compile that when loading the library, through TVM's Python nvcc/NVRTC
callback: a CUDA toolkit and the full TVM on every device. ember compiles the
source here instead, with nvcc, into a fatbin holding SASS for the target
architecture and its PTX (which newer GPUs JIT-compile), and embeds the fatbin in
place of the source, in the layout TVM's CUDA runtime module reads:
`[format: str][function table][code: bytes]`. The device then needs only TVM's
runtime libraries.

A library built before from an equal module, for the same target, is copied instead (`library_cache`).
Below that, on a CPU, each family of kernels ember takes whole from one writer (the functions of one
`KERNEL_SOURCE_ATTR`: the paged KV cache's attention, rope and copies, the int8 matmuls) is built as an object of
its own and kept in the same cache, and the library links those objects with the rest of the module. A family
depends on the attention's or the projections' shapes only, so another quantization of the same model or a
checkpoint of the same attention shape takes the objects built before: the tiny test llama's two prefill
attention kernels are 2.4 s of its 5 s of code generation.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import struct
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import tvm
from tvm import relax
from tvm.relax import vm_build
from tvm.support import nvcc

from ember.core.errors import TargetError
from ember.driver import library_cache
from ember.ir.attributes import KERNEL_SOURCE_ATTR
from ember.targets.registry import TargetSpec

log = logging.getLogger("ember")

LIBRARY_BIN_SYMBOL = "__tvm_ffi__library_bin"
# TVM's own nvcc callback returns a fatbin and records it as "cubin";
# cuModuleLoadData takes either.
_BINARY_FORMAT = "cubin"
_OCTAL = [f"\\{byte:03o}" for byte in range(256)]


def build_library(mod: tvm.IRModule, target: TargetSpec, path: Path) -> bool:
    """Write the loadable library of `mod` for `target` to `path`: generated, or copied from `library_cache` where
    an equal module was built for the same target before. True when copied."""
    linker = cross_linker(target)
    return library_cache.build_once(mod, _recipe(target, linker), path,
                                    lambda dest: _generate(mod, target, linker, dest))


def _generate(mod: tvm.IRModule, target: TargetSpec, linker: str | None, path: Path) -> None:
    if target.name == "cuda":
        executable = tvm.compile(mod, target.target, relax_pipeline=None)
        executable.export_library(str(path), fpack_imports=functools.partial(_pack_compiled_cuda, target=target))
        return
    with tempfile.TemporaryDirectory(prefix="ember-kernels-") as objects:
        executable = _executable_with_family_objects(mod, target, linker, Path(objects))
        if linker:
            executable.export_library(str(path), cc=linker)
        else:
            executable.export_library(str(path))


def _executable_with_family_objects(mod: tvm.IRModule, target: TargetSpec, linker: str | None,
                                    objects: Path) -> tvm.runtime.Executable:
    """What `tvm.compile(mod, target, relax_pipeline=None)` returns, with each family of kernels built as an object of
    its own in `objects` (or copied from `library_cache`) and linked in as a static library.

    The steps are `relax.build`'s after its pipeline, through its own helpers in `tvm.relax.vm_build` (private, and
    TVM is pinned): the VM's code generation, the kernels split off it, and the link of kernels and VM."""
    builder = relax.ExecBuilder()
    kernels = vm_build._filter_tir(vm_build._vmcodegen(builder, mod, "bytecode"))
    families, rest = defaultdict(dict), {}
    for gv, func in (kernels.functions.items() if kernels is not None else ()):
        source = func.attrs.get(KERNEL_SOURCE_ATTR) if func.attrs else None
        (families[str(source)] if source is not None else rest)[gv] = func
    attrs = dict(mod.attrs) if mod.attrs else {}
    statics = list(attrs.get("external_mods", []))
    recipe = _recipe(target, linker) + "\0object of one family of kernels"
    for number, (_, functions) in enumerate(sorted(families.items())):
        statics.append(_family_object(tvm.IRModule(functions), target, recipe, objects / f"family{number}.o"))
    rest_module = tvm.IRModule(rest, attrs=kernels.attrs) if rest else None
    return vm_build._vmlink(builder, target.target, rest_module, "default", statics,
                            dict(attrs.get("const_name_to_constant", {})))


def _family_object(family: tvm.IRModule, target: TargetSpec, recipe: str, path: Path) -> tvm.runtime.Module:
    """The object of one family's kernels at `path` (built, or copied from `library_cache` under `recipe`), as a
    static library."""
    library_cache.build_once(family, recipe, path,
                             lambda dest: tvm.tirx.build(family, target.target).write_to_file(str(dest)))
    return tvm.runtime.load_static_library(str(path), [gv.name_hint for gv in family.get_global_vars()])


def _recipe(target: TargetSpec, linker: str | None) -> str:
    """What shapes a library besides its module: the TVM target, the linker, nvcc's version for CUDA, and this
    file's code."""
    parts = [str(target.target), linker or "", Path(__file__).read_text(encoding="utf-8")]
    if target.name == "cuda":
        parts.append(_nvcc_version())
    return "\0".join(parts)


@functools.cache
def _nvcc_version() -> str:
    return subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout


def cross_linker(target: TargetSpec) -> str | None:
    """The cross compiler that links a library for a CPU of another architecture (None: the host's),
    refused with the Debian package to install when it is not on PATH."""
    triple = target.foreign_architecture
    if triple is None:
        return None
    machine = triple.split("-")[0]
    linker = f"{machine}-linux-gnu-g++"
    if shutil.which(linker) is None:
        raise TargetError(f"--target: linking a library for {machine} needs the cross compiler {linker} on PATH; "
                          f"install Debian's g++-{machine}-linux-gnu (apt-get install g++-{machine}-linux-gnu)")
    return linker


def _pack_compiled_cuda(module: tvm.runtime.Module, is_system_lib: bool, symbol_prefix: str, workspace_dir: str,
                        target: TargetSpec) -> str:
    """`export_library`'s `fpack_imports`: TVM's blob of imported modules, CUDA source swapped for a fatbin."""
    assert not is_system_lib and not symbol_prefix, "ember exports dynamic libraries only"
    blob = bytes(tvm.get_global_func("runtime.ModulePackImportsToTensor")(module).numpy())
    sources = [m.inspect_source() for m in _import_tree(module) if m.kind == "cuda"]
    path = os.path.join(workspace_dir, "devc.c")
    _write_c_array(_with_cuda_binaries(blob, sources, target), path)
    return path


def _import_tree(module: tvm.runtime.Module) -> list[tvm.runtime.Module]:
    found = []
    for child in module.imports:
        found += [child, *_import_tree(child)]
    return found


def _with_cuda_binaries(blob: bytes, sources: list[str], target: TargetSpec) -> bytes:
    """Rewrite a library blob (see tvm_ffi's `ProcessLibraryBin`): every CUDA source module compiled."""
    reader = _Reader(blob)
    reader.u64()  # payload size, recomputed below
    indptr, children = reader.u64s(), reader.u64s()
    parts = [_pack_u64s(indptr), _pack_u64s(children)]
    for _ in range(len(indptr) - 1):
        kind = reader.string()
        parts.append(_pack_bytes(kind.encode()))
        if kind == "_lib":  # the host library itself: a placeholder without bytes
            continue
        data = reader.bytes()
        parts.append(_pack_bytes(_compile_cuda_module(data, sources, target) if kind == "cuda" else data))
    payload = b"".join(parts)
    return struct.pack("<Q", len(payload)) + payload


def _compile_cuda_module(data: bytes, sources: list[str], target: TargetSpec) -> bytes:
    """A serialized CUDA module holding source, rewritten to hold the nvcc-compiled fatbin."""
    fmt_field = _pack_bytes(b"cuda")
    for source in sources:
        code_field = _pack_bytes(source.encode())
        if data.startswith(fmt_field) and data.endswith(code_field):
            function_table = data[len(fmt_field): len(data) - len(code_field)]
            fatbin = _nvcc_fatbin(source, target)
            return _pack_bytes(_BINARY_FORMAT.encode()) + function_table + _pack_bytes(fatbin)
    raise RuntimeError("a CUDA module in the library is not the CUDA source TVM generated; cannot compile it")


def _nvcc_fatbin(source: str, target: TargetSpec) -> bytes:
    version = target.arch.removeprefix("sm_")
    log.info("compiling %.1f MB of CUDA kernels for %s with nvcc", len(source) / 1e6, target.arch)
    gencode = ["-gencode", f"arch=compute_{version},code=[sm_{version},compute_{version}]"]
    try:
        with target.target:
            return bytes(nvcc.compile_cuda(source, target_format="fatbin", arch=gencode, compiler="nvcc"))
    except RuntimeError as err:  # the message starts with the whole generated source
        raise RuntimeError(f"nvcc failed for {target.arch}:\n{str(err).split('Compilation error:')[-1]}") from None


def _write_c_array(blob: bytes, path: str) -> None:
    """The blob as the C definition TVM's own packer emits (a string literal compiles fastest)."""
    rows = ('"' + "".join(_OCTAL[b] for b in blob[i: i + 4096]) + '"' for i in range(0, len(blob), 4096))
    with open(path, "w", encoding="ascii") as f:
        f.write('#ifdef __cplusplus\nextern "C" {\n#endif\n')
        f.write(f"extern const unsigned char {LIBRARY_BIN_SYMBOL}[];\n")
        # One byte longer than the blob for the literal's terminating NUL, which C++ requires.
        f.write(f"const unsigned char {LIBRARY_BIN_SYMBOL}[{len(blob) + 1}] =\n")
        f.write("\n".join(rows) or '""')
        f.write(';\n#ifdef __cplusplus\n}\n#endif\n')


class _Reader:
    """Little-endian reader of tvm_ffi's binary serialization (u64 sizes before every sequence)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return value

    def u64s(self) -> list[int]:
        count = self.u64()
        values = list(struct.unpack_from(f"<{count}Q", self.data, self.pos))
        self.pos += 8 * count
        return values

    def bytes(self) -> bytes:
        size = self.u64()
        self.pos += size
        return self.data[self.pos - size: self.pos]

    def string(self) -> str:
        return self.bytes().decode()


def _pack_u64s(values: list[int]) -> bytes:
    return struct.pack(f"<Q{len(values)}Q", len(values), *values)


def _pack_bytes(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data
