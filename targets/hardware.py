"""What a device can do, as the roofline model sees it: peak operations per second per
data type, memory bandwidth, memory capacity and on-chip memory.

Presets are JSON files in `targets/hardware/`, one per device, each citing where its
numbers come from (a datasheet, a whitepaper, or a derivation from core counts and
clocks when the vendor publishes none). The JSON uses the units spec sheets use
(TFLOP/s, GB/s, GiB, KiB); `Hardware` holds SI base units (op/s, bytes/s, bytes).

`host` is this machine, measured once (for bandwidth the faster of two reads of 512 MiB: multi-threaded
numpy dot products, and a TVM kernel compiled for this CPU that streams it through TVM's own thread pool
with four vector accumulators per thread, as ember's decode kernels stream weights; a float32 matmul for
peak FLOP/s) and cached under `~/.cache/ember/`. A measurement during which
other processes (or the hypervisor: steal time) took more than `BUSY_SHARE` of the CPUs is used
but not cached: cached, it would hold a low roofline for good. One cached on this project's
2-core machine while other work ran held 39 GB/s and 125 GFLOP/s where the quiet machine
measures 44-79 GB/s and 250 GFLOP/s; one busy loop beside the measurement halves the FLOP/s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.core.errors import TargetError
from ember.core.machine import cache_dir, cpu_fingerprint, cpu_model, host_cores

PRESET_DIR = Path(__file__).with_name("hardware")
DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")
# A data type a device lacks runs as the next one that it has: an int4 matmul without
# int4 units unpacks to int8, a bf16 checkpoint runs in fp16 on pre-Ampere GPUs, and
# CPUs without half-precision arithmetic compute in fp32.
_FALLBACK = {"int4": "int8", "int8": "fp16", "bf16": "fp16", "fp16": "fp32"}
_KINDS = ("cpu", "gpu")
_GIB, _KIB = 2**30, 2**10


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A device's roofline: peak compute per data type, memory bandwidth and sizes.

    `peak_flops["fp32"]` is the vector-unit rate (CUDA cores, SIMD lanes), which also
    bounds elementwise work; the other entries are dense matrix-unit rates (tensor
    cores, AMX, dot-product instructions), without structured-sparsity doubling.
    `onchip_memory` is the fast memory one compute unit tiles in (shared memory/L1 of
    one GPU SM, L2 of one CPU core): it sets the tile sizes of fused kernels.
    `arch` is the GPU's code-generation architecture (`sm_90a`, `gfx942`) and
    `compute_units` its SM (NVIDIA) or CU (AMD) count; both are empty where not given.
    `llvm_target` is the TVM target a CPU board's code is compiled for (`--target NAME`), empty for the rest.
    """

    name: str
    description: str
    kind: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_capacity: float
    onchip_memory: int
    source: str
    notes: str = ""
    arch: str = ""
    compute_units: int = 0
    llvm_target: dict[str, Any] = dataclasses.field(default_factory=dict)  # a CPU board's `--target` (TVM JSON)

    def compute_dtype(self, dtype: str) -> str:
        """The data type that `dtype` work runs as here (itself, or its fallback)."""
        while dtype not in self.peak_flops:
            dtype = _FALLBACK[dtype]
        return dtype

    def peak(self, dtype: str) -> float:
        """Peak operations per second for `dtype` work, after fallback."""
        return self.peak_flops[self.compute_dtype(dtype)]

    def ridge_point(self, dtype: str) -> float:
        """Arithmetic intensity (op/byte) above which `dtype` work is compute-bound."""
        return self.peak(dtype) / self.memory_bandwidth

    def to_json(self) -> dict[str, Any]:
        """The preset-file form (spec-sheet units), as read by `load_hardware`."""
        return {
            "name": self.name,
            "description": self.description,
            "kind": self.kind,
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "memory_bandwidth_gbps": self.memory_bandwidth / 1e9,
            "memory_capacity_gib": self.memory_capacity / _GIB,
            "onchip_kib": self.onchip_memory / _KIB,
            "source": self.source,
            "notes": self.notes,
            **({"arch": self.arch, "compute_units": self.compute_units} if self.arch else {}),
            **({"llvm_target": self.llvm_target} if self.llvm_target else {}),
        }


def hardware_presets() -> list[str]:
    """Names of the shipped hardware presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def board_presets() -> dict[str, Hardware]:
    """The CPU presets `--target` compiles for (those with an `llvm_target`), by name."""
    boards = (_read_preset(PRESET_DIR / f"{name}.json") for name in hardware_presets())
    return {hw.name: hw for hw in boards if hw.llvm_target}


def board_preset(name: str) -> Hardware | None:
    """The board preset called `name`, with or without its vendor prefix (`rk3588`), if any."""
    boards = board_presets()
    matches = [hw for preset, hw in boards.items() if name in (preset, preset.split("-", 1)[-1])]
    return matches[0] if len(matches) == 1 else None


def load_hardware(name: str) -> Hardware:
    """A preset by name (exact, without its vendor prefix, or a unique part of it), `host`, or a
    path to a preset-style JSON file."""
    if name == "host":
        return load_host()
    if name.endswith(".json"):
        return _read_preset(Path(name))
    presets = hardware_presets()
    query = name.lower()
    matches = ([p for p in presets if p == query] or [p for p in presets if p.split("-", 1)[-1] == query]
               or [p for p in presets if query in p])
    if len(matches) == 1:
        return _read_preset(PRESET_DIR / f"{matches[0]}.json")
    if matches:
        raise TargetError(f"--hardware {name!r} is ambiguous: it matches {', '.join(matches)}")
    raise TargetError(
        f"--hardware {name!r} is not a known device; presets: {', '.join(presets)}; "
        "or 'host' (this machine, measured), or a path to a JSON file shaped like "
        f"{PRESET_DIR / 'nvidia-rtx-a6000.json'}"
    )


def _read_preset(path: Path) -> Hardware:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetError(f"hardware file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TargetError(f"{path}: malformed JSON: {err}") from None
    return _from_json(data, str(path))


def _from_json(data: Any, origin: str) -> Hardware:
    if not isinstance(data, dict):
        raise TargetError(f"{origin}: expected a JSON object")

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise TargetError(f"{origin}: {key!r} must be a positive number, got {value!r}")
        return float(value)

    missing = [k for k in ("name", "kind", "peak_tflops", "memory_bandwidth_gbps",
                           "memory_capacity_gib", "onchip_kib", "source") if k not in data]
    if missing:
        raise TargetError(f"{origin}: missing {', '.join(missing)}")
    if data["kind"] not in _KINDS:
        raise TargetError(f"{origin}: 'kind' must be one of {', '.join(_KINDS)}, got {data['kind']!r}")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or "fp32" not in peaks:
        raise TargetError(f"{origin}: 'peak_tflops' must be an object with at least 'fp32'")
    unknown = sorted(set(peaks) - set(DTYPES))
    if unknown:
        raise TargetError(f"{origin}: unknown data types {', '.join(unknown)} in 'peak_tflops' "
                          f"(known: {', '.join(DTYPES)})")
    return Hardware(
        name=str(data["name"]),
        description=str(data.get("description", data["name"])),
        kind=data["kind"],
        peak_flops={k: number(f"peak_tflops.{k}", v) * 1e12 for k, v in peaks.items()},
        memory_bandwidth=number("memory_bandwidth_gbps", data["memory_bandwidth_gbps"]) * 1e9,
        memory_capacity=number("memory_capacity_gib", data["memory_capacity_gib"]) * _GIB,
        onchip_memory=int(number("onchip_kib", data["onchip_kib"]) * _KIB),
        source=str(data["source"]),
        notes=str(data.get("notes", "")),
        arch=str(data.get("arch", "")),
        compute_units=int(number("compute_units", data["compute_units"])) if "compute_units" in data else 0,
        llvm_target=_llvm_target(data, origin),
    )


def _llvm_target(data: dict[str, Any], origin: str) -> dict[str, Any]:
    target = data.get("llvm_target", {})
    if not isinstance(target, dict) or (target and (data["kind"] != "cpu" or target.get("kind") != "llvm")):
        raise TargetError(f"{origin}: 'llvm_target' must be a TVM target object of kind 'llvm' on a 'cpu' preset")
    return target


BANDWIDTH_METHOD = ("the faster of a threaded numpy dot of two 256 MiB float32 streams and a TVM parallel "
                    "max-reduction of 512 MiB")
# Part of the cache's fingerprint: caches from before measurements were checked for other work
# (which may hold a busy machine's figures) are measured again.
MEASUREMENT_CHECK = "other processes' share of the CPUs (/proc/stat) <= 0.2"
# The largest share of the CPUs other work may take during a measurement that is cached.
BUSY_SHARE = 0.2


@dataclasses.dataclass(frozen=True)
class HostMeasurement:
    """This machine's roofline as measured, and how much of the CPUs other work took meanwhile."""

    hardware: Hardware
    others_share: float | None  # CPU time of other processes and steal over wall time x CPUs; None: unknown

    @property
    def quiet(self) -> bool:
        """Whether the figures are this machine's own (unknown counts as quiet: nothing to check with)."""
        return self.others_share is None or self.others_share <= BUSY_SHARE


def host_cache_path() -> Path:
    """Where the measured `host` description is cached."""
    return cache_dir() / "host-hardware.json"


def load_host() -> Hardware:
    """This machine: read from the cache if it was measured here, else measured and cached."""
    path = host_cache_path()
    fingerprint = _host_fingerprint()
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(cached, dict) and cached.get("fingerprint") == fingerprint:
            return _from_json(cached, str(path))
    except (OSError, ValueError, TargetError):
        pass  # absent or damaged: measure again (as when it was measured on another machine)
    print(f"measuring this machine's memory bandwidth and peak FLOP/s (cached in {path}) ...",
          file=sys.stderr)
    measurement = measure_host()
    if not measurement.quiet:
        print(f"ember: warning: other work took {measurement.others_share:.0%} of the CPUs while this machine was "
              "measured, so its roofline may be low; not cached (measured again next time)", file=sys.stderr)
        return measurement.hardware
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**measurement.hardware.to_json(), "fingerprint": fingerprint}, indent=2))
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return measurement.hardware


def measure_host(read_bytes: int = 512 * 2**20, matmul_size: int = 2048, repeats: int = 3) -> HostMeasurement:
    """Measure read bandwidth (threaded dot products) and fp32 peak (numpy matmul) on this machine, and the
    share of the CPUs other work took meanwhile."""
    import numpy as np

    others = _OtherWork()
    threads = host_cores()
    # Two streams far larger than the caches, read in one chunk per core. Read
    # bandwidth is what weight-streaming kernels (decode GEMVs) can reach; a copy
    # also pays for writes and reports less.
    x = np.ones(read_bytes // 8, dtype=np.float32)
    y = np.ones_like(x)
    step = -(-x.size // threads)
    bounds = [(start, min(start + step, x.size)) for start in range(0, x.size, step)]

    def read_chunk(bound: tuple[int, int]) -> None:
        np.dot(x[bound[0]:bound[1]], y[bound[0]:bound[1]])

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        # numpy releases the GIL in dot, so the threads load every memory channel.
        read_s = _best_time(lambda: list(pool.map(read_chunk, bounds)), repeats)
    bandwidth = max(read_bytes / read_s, compiled_read_bandwidth(read_bytes, repeats))

    a = np.ones((matmul_size, matmul_size), dtype=np.float32)
    b = np.ones_like(a)
    matmul_s = _best_time(lambda: a @ b, repeats)
    fp32 = 2 * matmul_size**3 / matmul_s

    l2 = _sysconf("SC_LEVEL2_CACHE_SIZE") or _KIB * _KIB
    hardware = Hardware(
        name="host",
        description=f"this machine ({cpu_model()}, {threads} cores)",
        kind="cpu",
        peak_flops={"fp32": fp32},
        memory_bandwidth=bandwidth,
        memory_capacity=float(host_memory_bytes()),
        onchip_memory=l2,
        source=f"measured by ember: {BANDWIDTH_METHOD} (bandwidth), numpy float32 matmul (peak)",
        notes=f"measured on {time.strftime('%Y-%m-%d')}; numpy's BLAS may reach less than the "
              "vector units' peak, so this is an attainable rather than a theoretical roofline",
    )
    return HostMeasurement(hardware, others.share())


def compiled_read_bandwidth(read_bytes: int = 512 * 2**20, repeats: int = 3) -> float:
    """Bytes/s a TVM kernel compiled for this CPU reads `read_bytes` at: a max-reduction over 64 chunks in
    parallel on TVM's thread pool (the one ember's kernels run on), each with four vector accumulators so that
    no chain of dependent instructions bounds it below the memory. 0.0 where TVM cannot compile here (a
    runtime-only install)."""
    try:
        import numpy as np
        import tvm

        steps = read_bytes // 4 // (_READ_CHUNKS * _READ_LANES * _READ_ACCUMULATORS)
        kernel = _read_kernel(steps)
        device = tvm.cpu()
        data = tvm.runtime.tensor(np.ones((_READ_CHUNKS, steps, _READ_ACCUMULATORS, _READ_LANES), np.float32),
                                  device)
        out = tvm.runtime.empty((_READ_CHUNKS, _READ_LANES), "float32", device)
    except Exception:  # noqa: BLE001 (no compiler, no LLVM: the numpy probe alone)
        return 0.0
    return _READ_CHUNKS * steps * _READ_ACCUMULATORS * _READ_LANES * 4 / _best_time(lambda: kernel(data, out),
                                                                                   repeats)


_READ_LANES, _READ_ACCUMULATORS, _READ_CHUNKS = 16, 4, 64


@functools.cache
def _read_kernel(steps: int):
    """`compiled_read_bandwidth`'s kernel for chunks of `steps` x accumulators x lanes floats, built once."""
    import tvm
    from tvm.script import tirx as T

    from ember.targets.registry import resolve_target

    chunks, accumulators, lanes = _READ_CHUNKS, _READ_ACCUMULATORS, _READ_LANES

    @T.prim_func(s_tir=True)
    def read(data_handle: T.handle, out_handle: T.handle):
        T.func_attr({"global_symbol": "read", "tirx.noalias": True})
        data = T.match_buffer(data_handle, (chunks, steps, accumulators, lanes), "float32")
        out = T.match_buffer(out_handle, (chunks, lanes), "float32")
        for c in T.parallel(chunks):
            with T.sblock("read"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((accumulators, lanes), "float32")
                for j in T.unroll(accumulators):
                    for v in T.vectorized(lanes):
                        acc[j, v] = data[c, 0, j, v]
                for i in T.serial(steps):
                    for j in T.unroll(accumulators):
                        for v in T.vectorized(lanes):
                            acc[j, v] = T.max(acc[j, v], data[c, i, j, v])
                for v in T.vectorized(lanes):
                    out[c, v] = T.max(T.max(acc[0, v], acc[1, v]), T.max(acc[2, v], acc[3, v]))

    return tvm.compile(tvm.IRModule({"read": read}), target=resolve_target("cpu").target)["read"]


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, thread start-up, BLAS initialisation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# /proc/stat counts in clock ticks (10 ms): a shorter span than this tells nothing.
_SHORTEST_SPAN_S = 0.25


class _OtherWork:
    """From its creation to `share()`: the CPU time every process ran (and the hypervisor stole), less this
    process's own, over wall time x CPUs. Linux's /proc/stat; unknown (None) elsewhere and over spans too
    short for its clock ticks (a measurement of a few MiB)."""

    def __init__(self) -> None:
        self._start = (_system_busy_seconds(), time.process_time(), time.perf_counter())

    def share(self) -> float | None:
        busy, own, wall = _system_busy_seconds(), time.process_time(), time.perf_counter()
        if busy is None or self._start[0] is None or wall - self._start[2] < _SHORTEST_SPAN_S:
            return None
        others = (busy - self._start[0]) - (own - self._start[1])
        return max(others, 0.0) / ((wall - self._start[2]) * (os.cpu_count() or 1))


def _system_busy_seconds() -> float | None:
    """CPU seconds all CPUs have spent on work (user, nice, system, irq, softirq) or lost to the hypervisor (steal)."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()  # "cpu user nice system idle iowait irq softirq steal ..."
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _host_fingerprint() -> dict[str, Any]:
    return {**cpu_fingerprint(), "memory": host_memory_bytes(),
            "method": BANDWIDTH_METHOD, "check": MEASUREMENT_CHECK}


def host_memory_bytes() -> int:
    """This machine's physical memory (0: unknown)."""
    return _sysconf("SC_PHYS_PAGES") * _sysconf("SC_PAGE_SIZE")


def _sysconf(name: str) -> int:
    try:
        return max(int(os.sysconf(name)), 0)
    except (ValueError, OSError, AttributeError):
        return 0
